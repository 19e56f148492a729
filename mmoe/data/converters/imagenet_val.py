"""The labels of ImageNet's flat validation folder (``val/ILSVRC2012_val_00000001.JPEG`` ...), read from the
devkit or from Kaggle's ``LOC_val_solution.csv``, as :class:`~mmoe.data.converters.imagenet.Labels` of the folder.

The devkit's ``data/ILSVRC2012_validation_ground_truth.txt`` holds one ILSVRC2012_ID per line, line ``n`` labelling
``ILSVRC2012_val_<n:08d>.JPEG``. Which WNID an ILSVRC2012_ID is, the devkit says in ``data/meta.mat``, a MATLAB file
that mmoe does not read (SciPy, its reader, is not a dependency of mmoe): a text file gives it instead, line ``i``
beginning with the WNID of ILSVRC2012_ID ``i`` (``--devkit-synsets``; ``data/README.md`` shows how to write it once
from ``meta.mat``). ``LOC_val_solution.csv`` (``ImageId,PredictionString``) names each image's WNID as the first
token of its boxes. :func:`convert_imagenet` converts a folder of either kind as its options say (``mmoe data convert
imagenet``).
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

from mmoe.data.converters.class_index import ClassIndex, class_index_option, classes_file
from mmoe.data.converters.common import ConversionError, first_existing, images_folder, path_under, read_lines
from mmoe.data.converters.imagenet import (
    LabelledImage,
    Labels,
    convert_classification,
    labelled_folder_check,
    missing_synset,
)
from mmoe.data.shards import Manifest

#: Where the devkit keeps the validation labels.
GROUND_TRUTH = Path("data") / "ILSVRC2012_validation_ground_truth.txt"
#: ImageNet's validation image of the label on line ``n`` of the ground truth.
VAL_IMAGE = "ILSVRC2012_val_{:08d}.JPEG"
_SOLUTION_COLUMNS = ("ImageId", "PredictionString")


def _non_empty_lines(path: Path) -> list[str]:
    lines = read_lines(path)
    while lines and not lines[-1].strip():
        lines.pop()
    return lines


def devkit_synsets(path: Path) -> list[str]:
    """The WNIDs by ILSVRC2012_ID (entry ``i - 1`` is ID ``i``'s): the first word of each line of ``path``."""
    wnids = [line.split()[0] if line.strip() else "" for line in _non_empty_lines(path)]
    if "" in wnids or not wnids:
        number = wnids.index("") + 1 if "" in wnids else 1
        raise ConversionError(f"{path}:{number}: expected a WNID at the start of every line (line i: ILSVRC2012_ID i)")
    return wnids


def devkit_labels(root: Path, devkit: Path, synsets: Path, classes: ClassIndex, classes_from: str) -> Labels:
    """The labels of the flat folder ``root`` from the devkit folder (or its ground-truth file) ``devkit`` and the
    ILSVRC2012_ID -> WNID list ``synsets``; a label outside that list or of a class ``classes`` lacks is a
    ConversionError naming the line."""
    truth = devkit if devkit.is_file() else devkit / GROUND_TRUTH
    if not truth.is_file():
        raise ConversionError(f"--devkit {devkit}: no {GROUND_TRUTH} in it (the ILSVRC2012 devkit's layout)")
    wnid_of = devkit_synsets(synsets)
    index = classes.index_of()
    images = []
    for number, line in enumerate(_non_empty_lines(truth), start=1):
        where = f"{truth}:{number}"
        text = line.strip()
        if not text.isdigit():
            raise ConversionError(f"{where}: expected an ILSVRC2012_ID (a whole number), got {text!r}")
        label = int(text)
        if not 1 <= label <= len(wnid_of):
            raise ConversionError(
                f"{where}: label {label} is out of range: {synsets} lists ILSVRC2012_IDs 1 to {len(wnid_of)}"
            )
        wnid = wnid_of[label - 1]
        if wnid not in index:
            raise missing_synset(wnid, f"{where} (ILSVRC2012_ID {label})", classes_from, classes)
        images.append(LabelledImage(VAL_IMAGE.format(number), wnid, where))
    if not images:
        raise ConversionError(f"{truth}: no labels")
    rule = f"every line of {truth.name}, line n labelling {VAL_IMAGE.format(0).replace('00000000', '<n>')}"
    labels = Labels(
        images, {"images": str(root), "devkit": str(truth), "devkit_synsets": str(synsets)}, rule, [truth, synsets]
    )
    labelled_folder_check(root, labels, truth)
    return labels


def solution_labels(root: Path, solution: Path, classes: ClassIndex, classes_from: str) -> Labels:
    """The labels of the flat folder ``root`` from Kaggle's ``LOC_val_solution.csv``, sorted by image; a row without
    a WNID, with boxes of two classes, repeating an image or of a class ``classes`` lacks is a ConversionError naming
    the row."""
    lines = _non_empty_lines(solution)
    rows = list(csv.reader(lines))
    if not rows or tuple(rows[0][:2]) != _SOLUTION_COLUMNS:
        raise ConversionError(f"{solution}:1: expected the header {','.join(_SOLUTION_COLUMNS)}")
    index = classes.index_of()
    found: dict[str, LabelledImage] = {}
    for number, row in enumerate(rows[1:], start=2):
        where = f"{solution}:{number}"
        if not row:
            continue
        tokens = row[1].split() if len(row) >= 2 else []
        if not row[0] or not tokens:
            raise ConversionError(f"{where}: expected 'ImageId,<WNID> <box> ...', got {lines[number - 1][:80]!r}")
        image_id, wnid = row[0], tokens[0]
        if image_id in found:
            raise ConversionError(f"{where}: image {image_id} is labelled twice (first at {found[image_id].where})")
        if len(set(tokens[0::5])) > 1:
            raise ConversionError(f"{where}: boxes of two classes ({', '.join(sorted(set(tokens[0::5])))})")
        if wnid not in index:
            raise missing_synset(wnid, where, classes_from, classes)
        path = first_existing(
            path_under(root, image_id + suffix, where) for suffix in (".JPEG", ".jpg", ".jpeg", ".png")
        )
        found[image_id] = LabelledImage(path.name, wnid, where)
    if not found:
        raise ConversionError(f"{solution}: no labelled rows")
    images = [found[image_id] for image_id in sorted(found)]
    rule = "every row of the solution file, sorted by ImageId; the first token of PredictionString is the class"
    labels = Labels(images, {"images": str(root), "val_solution": str(solution)}, rule, [solution])
    labelled_folder_check(root, labels, solution)
    return labels


def convert_imagenet(
    images: str | os.PathLike,
    out: str | os.PathLike,
    classes: str | os.PathLike | None = None,
    synsets: str | os.PathLike | None = None,
    val_solution: str | os.PathLike | None = None,
    devkit: str | os.PathLike | None = None,
    devkit_synsets: str | os.PathLike | None = None,
    seed: int = 0,
    shard_size: int = 1000,
    name: str | None = None,
) -> Manifest:
    """Converts ImageNet's train folder (or any ImageFolder tree) or, labelled by ``val_solution`` or ``devkit``, its
    flat val folder (:func:`mmoe.data.converters.imagenet.convert_classification`).

    Args:
        images: the class folders, or the flat val folder.
        out: output folder for this split.
        classes: a ``classes.json`` (or a split folder holding one): the class index, the training split's.
        synsets: Kaggle's ``LOC_synset_mapping.txt``: the class index, with names (not with ``classes``).
        val_solution: Kaggle's ``LOC_val_solution.csv`` labelling the flat folder.
        devkit: the ILSVRC2012 devkit folder (or its validation ground-truth file) labelling the flat folder.
        devkit_synsets: with ``devkit``, the WNID of ILSVRC2012_ID ``i`` on line ``i``.
        seed: seeds the order class folders' images are written in.
        shard_size: samples per shard.
        name: shard name; default ``imagenet-<folder name>``.
    """
    index = class_index_option(classes, synsets)
    classes_from = str(classes_file(classes)) if classes else str(synsets or "")
    root = images_folder(images)
    if devkit_synsets and not devkit:
        raise ConversionError("--devkit-synsets applies to --devkit only")
    if val_solution and devkit:
        raise ConversionError("give --val-solution or --devkit, not both (each labels the whole folder)")
    labels = None
    if devkit or val_solution:
        if index is None:
            raise ConversionError("a flat folder's labels need the training split's --classes (or --synsets)")
        if devkit and not devkit_synsets:
            raise ConversionError(
                "--devkit needs --devkit-synsets FILE: the WNID of each ILSVRC2012_ID, which the devkit keeps in "
                "data/meta.mat, a MATLAB file mmoe does not read (data/README.md shows how to write the file)"
            )
        if devkit:
            labels = devkit_labels(root, Path(devkit), Path(devkit_synsets), index, classes_from)
        else:
            labels = solution_labels(root, Path(val_solution), index, classes_from)
    label_files = [classes_from] if classes_from else []
    seed = None if labels else seed
    return convert_classification(root, out, labels, index, classes_from, seed, shard_size, name, label_files)
