"""ImageNet-1K (and any ImageFolder tree) -> classification shards: each sample the image, ``cls`` = its class index
and ``json`` = ``path`` (under ``--images``) and ``wnid``; ``classes.json`` (:mod:`.class_index`) beside the shards.

The inputs are read in ImageNet's own layouts:

* a folder of class folders: ImageNet's ``train/n01440764/n01440764_10026.JPEG``, or any ImageFolder tree. Classes
  are the folder names sorted (torchvision's ``ImageFolder`` numbering) unless a class index is given, and the images
  those torchvision finds (its file suffixes, each class folder walked recursively, sorted). The samples are written
  in a seeded random order (``seed``), so that each shard holds many classes;
* the flat ``val/ILSVRC2012_val_00000001.JPEG`` folder labelled by the devkit (:func:`devkit_labels`) or by Kaggle's
  ``LOC_val_solution.csv`` (:func:`solution_labels`), in the training split's class index, in image order.

A class the index does not hold ("missing synset"), a devkit label outside its synset list and a labelled folder's
image without a label stop the conversion with one line naming the file and value. An image that is missing or
cannot be decoded skips its sample, counted in the manifest, as in every converter
(:mod:`mmoe.data.converters.common`).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmoe.data.converters.class_index import CLASSES_FILE, ClassIndex
from mmoe.data.converters.common import ConversionError, Skip, images_folder, write_split
from mmoe.data.converters.provenance import provenance
from mmoe.data.converters.records import ImageFile, with_image
from mmoe.data.shards import Manifest, check_shard_name

#: The file suffixes torchvision's ImageFolder takes as images (``torchvision.datasets.folder.IMG_EXTENSIONS``).
FOLDER_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


@dataclass(frozen=True, slots=True)
class LabelledImage:
    """One image and its class: ``relative`` is its path under the image folder, ``where`` names its label (a label
    file's line) in errors; empty for an image labelled by its class folder, which its path names."""

    relative: str
    wnid: str
    where: str = ""


@dataclass(frozen=True)
class Labels:
    """The labelled images of a split, and what the manifest says of how they were found."""

    images: list[LabelledImage]
    source: dict[str, str]
    rule: str
    label_files: list[Path]
    other_files: int = 0
    folders: tuple[str, ...] = ()  # an ImageFolder tree's class folders, empty ones included


def _is_image(name: str) -> bool:
    return name.lower().endswith(FOLDER_IMAGE_SUFFIXES)


def missing_synset(wnid: str, where: str, classes_from: str, classes: ClassIndex) -> ConversionError:
    """The error of a class the index does not hold."""
    return ConversionError(
        f"{where}: class {wnid!r} is not in the class index {classes_from} ({len(classes)} classes, "
        f"{classes.wnids[0]} .. {classes.wnids[-1]}); label with the training split's classes.json"
    )


def folder_labels(root: Path) -> Labels:
    """The images of an ImageFolder tree under ``root``, each labelled by its class folder."""
    entries = sorted(os.scandir(root), key=lambda entry: entry.name)
    folders = [entry.name for entry in entries if entry.is_dir()]
    if not folders:
        raise ConversionError(
            f"--images {root}: no class folders in it (a flat folder such as ImageNet's val needs --devkit or "
            "--val-solution)"
        )
    images: list[LabelledImage] = []
    other = sum(1 for entry in entries if not entry.is_dir())
    for wnid in folders:
        for folder, subfolders, files in os.walk(root / wnid, followlinks=True):
            subfolders.sort()
            for name in sorted(files):
                if _is_image(name):
                    images.append(LabelledImage(Path(folder, name).relative_to(root).as_posix(), wnid))
                else:
                    other += 1
    rule = "every image under each class folder (ImageFolder's suffixes), in a seeded random order"
    return Labels(images, {"images": str(root)}, rule, [], other, tuple(folders))


def labelled_folder_check(root: Path, labels: Labels, label_file: Path) -> None:
    """Every image directly in a flat labelled folder has a label in ``label_file``."""
    labelled = {image.relative for image in labels.images}
    unlabelled = sorted(name for name in os.listdir(root) if _is_image(name) and name not in labelled)
    if unlabelled:
        raise ConversionError(
            f"--images {root}: {unlabelled[0]} has no label in {label_file} ({len(unlabelled)} of the folder's "
            "images have none); convert a folder that holds the labelled images only"
        )


def default_name(root: Path) -> str:
    """The split's default shard name: ``imagenet-<folder name>`` (``imagenet`` where that is not a valid name)."""
    name = f"imagenet-{root.resolve().name}"
    try:
        return check_shard_name(name)
    except ValueError:
        return "imagenet"


def _checked_classes(labels: Labels, classes: ClassIndex | None, classes_from: str) -> ClassIndex:
    """``classes``, holding every class ``labels`` name; None: the labels' class folders (as ImageFolder numbers them,
    empty ones included)."""
    if classes is None:
        return ClassIndex.of_folders(labels.folders)
    index = classes.index_of()
    for folder in labels.folders:
        if folder not in index:
            raise missing_synset(folder, f"--images {labels.source['images']}: {folder}/", classes_from, classes)
    for image in labels.images:
        if image.wnid not in index:
            where = image.where or f"--images {labels.source['images']}: {image.relative}"
            raise missing_synset(image.wnid, where, classes_from, classes)
    return classes


def convert_classification(
    images: str | os.PathLike,
    out: str | os.PathLike,
    labels: Labels | None = None,
    classes: ClassIndex | None = None,
    classes_from: str = "",
    seed: int | None = 0,
    shard_size: int = 1000,
    name: str | None = None,
    label_files: list[str | os.PathLike] | None = None,
) -> Manifest:
    """Converts a classification split.

    Args:
        images: the image folder (class folders, or the flat folder ``labels`` describes).
        out: output folder for this split.
        labels: the flat folder's labels (:func:`devkit_labels`, :func:`solution_labels`); None reads ``images`` as
            an ImageFolder tree.
        classes: the class index (the training split's); None: the tree's folder names sorted. Needed with
            ``labels``.
        classes_from: the file ``classes`` was read from, named in errors and the manifest.
        seed: seeds the order the samples are written in; None keeps the labels' order.
        shard_size: samples per shard.
        name: shard name; default ``imagenet-<folder name>``.
        label_files: files whose digests the manifest records beside the label files (the class index).
    """
    root = images_folder(images)
    labels = labels or folder_labels(root)
    if classes is None and labels.label_files:
        raise ConversionError("a flat folder's labels need the training split's class index (--classes or --synsets)")
    classes = _checked_classes(labels, classes, classes_from or "of the class folders")
    index = classes.index_of()
    order = (
        np.arange(len(labels.images)) if seed is None else np.random.default_rng(seed).permutation(len(labels.images))
    )

    def samples() -> Iterator[dict[str, Any] | Skip]:
        for position in order:
            image = labels.images[position]
            meta = {"path": image.relative, "wnid": image.wnid}
            sample = {"__key__": f"{position:09d}", "cls": str(index[image.wnid]), "json": meta}
            yield with_image(sample, ImageFile(root / image.relative))

    counts = Counter(image.wnid for image in labels.images)
    extra = {"source": {**labels.source, **({"classes": classes_from} if classes_from else {})}}
    extra.update(provenance([*labels.label_files, *(label_files or [])], labels.rule))
    extra.update(
        classes=len(classes),
        labelled_images=len(labels.images),
        images_per_class=[counts[wnid] for wnid in classes.wnids],
        other_files=labels.other_files,
    )
    files = {CLASSES_FILE: classes.text()}
    return write_split(out, name or default_name(root), samples(), shard_size, extra, files)
