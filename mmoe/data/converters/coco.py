"""COCO captions (and Flickr30K's): the readers of the official captions files and of Karpathy's split files, whose
:class:`~mmoe.data.converters.records.CaptionedImage` records :mod:`.build_captions` writes, one sample per image with
all its captions: the captioning and the retrieval tasks' shards.

Two inputs: the official ``captions_<subtype>.json`` (``images`` with ``id`` / ``file_name``, ``annotations`` with
``image_id`` / ``caption``; images at DIR/<file_name> or DIR/<subtype>/<file_name>), or one of Karpathy's split files
with a split: ``dataset_coco.json`` (``images`` with ``filepath``, ``filename``, ``cocoid``, ``split``,
``sentences``; images at DIR/<filepath>/<filename>) or ``dataset_flickr30k.json`` (``"dataset": "flickr30k"``; no
``filepath`` and no ``cocoid``: images at DIR/<filename>, image id ``imgid``). Each sample: the image, ``txt`` = the
first caption, ``json`` = ``image_id`` (COCO id; Karpathy ``cocoid``, Flickr30K ``imgid``), ``captions``,
``file_name``, and next to the shards ``caption_tokens.json`` (:mod:`.build_captions`).

An image id or annotation id that appears twice is an error, and so is one image file under two image ids (the same
picture would be two images of a retrieval test set). The same caption twice for one image (after stripping spaces) is
kept once: the converter prints how many it dropped and the manifest stores it as ``duplicate_captions``. An image
without a caption (Karpathy's ``"sentences": []``, or no annotation in a captions file that has annotations) is
skipped and counted like a missing image file (``skipped`` in the manifest): retrieval has no positive for it (its
reader would drop it as corrupt at every pass) and captioning no reference. A captions file without annotations (test
image info) keeps its images, without captions, for predictions. Image paths must lie inside the image folder.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmoe.data.converters.build_captions import CaptionSet, write_caption_split
from mmoe.data.converters.common import (
    ConversionError,
    Skip,
    field,
    first_existing,
    images_folder,
    list_field,
    load_json,
    path_under,
)
from mmoe.data.converters.provenance import provenance
from mmoe.data.converters.records import CaptionedImage, ImageFile
from mmoe.data.shards import Manifest
from mmoe.data.tokenizer import TextTokenizer

KARPATHY_SPLITS = ("train", "restval", "val", "test")
#: Karpathy's split files by their ``dataset`` field (a file without one is COCO's): the image field holding the id.
KARPATHY_IMAGE_ID = {"coco": "cocoid", "flickr30k": "imgid"}
#: Said of a COCO field missing from a file read as COCO's only because it has no ``dataset`` field.
_READ_AS_COCO = (
    "the file has no 'dataset' field, so it was read as COCO's Karpathy split; "
    'Flickr30K\'s says "dataset": "flickr30k"'
)
_SUBTYPE_IN_FILE = re.compile(r"^COCO_([a-z]+\d+)_")
_SUBTYPE_IN_FILE = re.compile(r"^COCO_([a-z]+\d+)_")
#: Written next to a caption split's shards: the sorted tokenizer ids of its captions, end-of-text included.
CAPTION_TOKENS_FILE = "caption_tokens.json"


class ImageFiles:
    """The image files of the records read so far: one file under two image ids is a ConversionError naming both
    records (``entry``: ``images[2] (imgid 3)``) and the file."""

    def __init__(self) -> None:
        self._first_entry: dict[Path, str] = {}

    def add(self, path: Path, file_name: str, source: Path, entry: str) -> Path:
        first = self._first_entry.setdefault(path, entry)
        if first != entry:
            raise ConversionError(f"{source}: {entry}: file {file_name!r} is also {first}")
        return path


def convert_coco_captions(
    annotations: str | os.PathLike,
    images: str | os.PathLike,
    out: str | os.PathLike,
    shard_size: int = 1000,
    name: str | None = None,
    tokenizer: TextTokenizer | None = None,
) -> Manifest:
    """Converts an official COCO captions file (``captions_train2014.json``, ``captions_val2014.json``, ...).

    Args:
        annotations: the captions JSON; a file without ``annotations`` (test image info) gives samples without
            captions.
        images: COCO image folder.
        out: output folder for this split.
        shard_size: samples per shard.
        name: shard name; default ``coco-captions-<subtype>`` (from the file name ``captions_<subtype>.json``).
        tokenizer: the tokenizer whose ids ``caption_tokens.json`` lists (BEiT-3's ``beit3.spm``); None = open_clip's
            BPE.
    """
    annotations, images = Path(annotations), images_folder(images)
    data = load_json(annotations)
    image_list = list_field(data, "images", f"{annotations}")
    if not image_list:
        raise ConversionError(f"{annotations}: field 'images' is empty: no images to convert")
    paths: dict[int, Path] = {}
    files = ImageFiles()
    captions = CaptionSet()
    for index, image in enumerate(image_list):
        where = f"{annotations}: images[{index}]"
        image_id = field(image, "id", int, where)
        if image_id in paths:
            raise ConversionError(f"{where}: image id {image_id} appears twice")
        entry, file_name = f"images[{index}] (id {image_id})", field(image, "file_name", str, where)
        path = image_path(images, file_name, f"{annotations}: {entry}")
        paths[image_id] = files.add(path, file_name, annotations, entry)
        captions.by_image[image_id] = []
    captioned = _read_annotations(data, annotations, captions)
    subtype = annotations.stem.removeprefix("captions_")

    def images() -> Iterator[tuple[CaptionedImage, ImageFile] | Skip]:
        for index, image in enumerate(image_list):
            image_id = image["id"]
            if captioned and not captions.by_image[image_id]:
                yield Skip(str(paths[image_id]), f"no caption (images[{index}] (id {image_id}) has no annotation)")
                continue
            yield CaptionedImage(image_id, captions.by_image[image_id], image["file_name"]), ImageFile(paths[image_id])

    extra = {"source": {"annotations": str(annotations)}}
    extra.update(provenance([annotations], "every image of the captions file (one without a caption skipped)"))
    name = name or f"coco-captions-{subtype}"
    return write_caption_split(out, name, images(), captions, annotations, shard_size, extra, tokenizer)


def _read_annotations(data: dict[str, Any], annotations: Path, captions: CaptionSet) -> bool:
    """Adds the captions of a COCO captions file's ``annotations`` to ``captions`` (whose ``by_image`` holds the
    file's images); whether the file has annotations (test image info has none)."""
    annotation_at: dict[int, int] = {}
    for index, annotation in enumerate(data.get("annotations") or []):
        where = f"{annotations}: annotations[{index}]"
        image_id = field(annotation, "image_id", int, where)
        caption = field(annotation, "caption", str, where)
        if "id" in annotation:
            annotation_id = field(annotation, "id", int, where)
            if annotation_id in annotation_at:
                first = annotation_at[annotation_id]
                raise ConversionError(f"{where}: annotation id {annotation_id} appears twice (first at [{first}])")
            annotation_at[annotation_id] = index
        if image_id not in captions.by_image:
            raise ConversionError(f"{where}: field 'image_id' = {image_id} is not in 'images'")
        captions.add(image_id, caption, f"{where}, image_id {image_id}")
    return bool(data.get("annotations"))


def image_path(images: Path, file_name: str, where: str) -> Path:
    """Where a COCO ``file_name`` is: in ``images`` or in its ``<subtype>/`` folder (``COCO_val2014_...`` files in
    ``val2014/``)."""
    path = path_under(images, file_name, where)
    match = _SUBTYPE_IN_FILE.match(file_name)
    return first_existing([path] + ([images / match.group(1) / file_name] if match else []))


def karpathy_splits(split: str | Sequence[str]) -> list[str]:
    """The Karpathy splits ``split`` names (``"train,restval"`` or a sequence), each one of :data:`KARPATHY_SPLITS`."""
    splits = [s.strip() for s in split.split(",")] if isinstance(split, str) else list(split)
    unknown = [s for s in splits if s not in KARPATHY_SPLITS]
    if unknown or not splits:
        raise ConversionError(f"--split {split!r}: expected one or more of {', '.join(KARPATHY_SPLITS)}")
    return splits


def karpathy_dataset(data: Any, karpathy: Path) -> str:
    """Which split file ``data`` is (a key of :data:`KARPATHY_IMAGE_ID`): its ``dataset`` field, COCO without one."""
    dataset = field(data, "dataset", str, f"{karpathy}") if isinstance(data, dict) and "dataset" in data else "coco"
    if dataset not in KARPATHY_IMAGE_ID:
        known = ", ".join(KARPATHY_IMAGE_ID)
        raise ConversionError(f"{karpathy}: field 'dataset' = {dataset!r}: expected one of {known}")
    return dataset


@dataclass(frozen=True)
class KarpathyImage:
    """One image of the chosen split(s) of a Karpathy split file."""

    image_id: int
    file_name: str
    split: str
    path: Path
    entry: str  # ``images[2] (imgid 3)``


def karpathy_images(
    data: Any, karpathy: Path, dataset: str, splits: list[str], images: Path, captions: CaptionSet
) -> list[KarpathyImage]:
    """The images of ``splits`` in the split file's ``data`` (of ``dataset``), their captions added to ``captions``;
    bad records, repeated image ids and one file under two ids are ConversionErrors."""
    id_field = KARPATHY_IMAGE_ID[dataset]
    read_as_coco = not (isinstance(data, dict) and "dataset" in data)
    files = ImageFiles()
    chosen: list[KarpathyImage] = []
    for index, image in enumerate(list_field(data, "images", f"{karpathy}")):
        where = f"{karpathy}: images[{index}]"
        image_split = field(image, "split", str, where)
        if image_split not in splits:
            continue
        image_id = _karpathy_field(image, id_field, int, where, read_as_coco)
        entry = f"images[{index}] ({id_field} {image_id})"
        where = f"{karpathy}: {entry}"
        if image_id in captions.by_image:
            raise ConversionError(f"{where}: {id_field} {image_id} appears twice in the chosen split(s)")
        file_name = field(image, "filename", str, where)
        if dataset == "coco":
            file_name = f"{_karpathy_field(image, 'filepath', str, where, read_as_coco)}/{file_name}"
        path = files.add(path_under(images, file_name, where), file_name, karpathy, entry)
        chosen.append(KarpathyImage(image_id, file_name, image_split, path, entry))
        captions.by_image[image_id] = []
        for position, sentence in enumerate(list_field(image, "sentences", where)):
            sentence_where = f"{where}: sentences[{position}]"
            captions.add(image_id, field(sentence, "raw", str, sentence_where), sentence_where)
    if not chosen:
        raise ConversionError(f"{karpathy}: no images in split {', '.join(splits)}")
    return chosen


def karpathy_record(image: KarpathyImage, captions: CaptionSet) -> CaptionedImage:
    """The record of a chosen image of a Karpathy split file."""
    return CaptionedImage(image.image_id, captions.by_image[image.image_id], image.file_name, image.split)


def _karpathy_field(image: Any, name: str, kind: type, where: str, read_as_coco: bool) -> Any:
    """:func:`field` for a field of COCO's split file; missing from a file read as COCO's for want of a ``dataset``
    field, the error says so."""
    if read_as_coco and isinstance(image, dict) and name not in image:
        raise ConversionError(f"{where}: missing field {name!r} ({_READ_AS_COCO})")
    return field(image, name, kind, where)


def convert_karpathy(
    karpathy: str | os.PathLike,
    split: str | Sequence[str],
    images: str | os.PathLike,
    out: str | os.PathLike,
    shard_size: int = 1000,
    name: str | None = None,
    tokenizer: TextTokenizer | None = None,
) -> Manifest:
    """Converts one split of a Karpathy split file: ``dataset_coco.json`` or ``dataset_flickr30k.json``.

    Args:
        karpathy: the split file; its ``dataset`` field (:data:`KARPATHY_IMAGE_ID`) says which.
        split: ``train``, ``restval`` (COCO), ``val`` or ``test``, or several (``"train,restval"``: BEiT-3's COCO
            training set).
        images: the image folder (COCO: holding ``train2014/`` and ``val2014/``; Flickr30K: the images themselves).
        out: output folder for this split.
        shard_size: samples per shard.
        name: shard name; default ``<dataset>-karpathy-<split>`` (splits joined by ``-``).
        tokenizer: the tokenizer whose ids ``caption_tokens.json`` lists (BEiT-3's ``beit3.spm``); None = open_clip's
            BPE.
    """
    karpathy, images = Path(karpathy), images_folder(images)
    splits = karpathy_splits(split)
    data = load_json(karpathy)
    dataset = karpathy_dataset(data, karpathy)
    captions = CaptionSet()
    chosen = karpathy_images(data, karpathy, dataset, splits, images, captions)

    def images() -> Iterator[tuple[CaptionedImage, ImageFile] | Skip]:
        for image in chosen:
            if not captions.by_image[image.image_id]:
                yield Skip(str(image.path), f"no caption ({image.entry} has no sentences)")
                continue
            yield karpathy_record(image, captions), ImageFile(image.path)

    extra = {"source": {"karpathy": str(karpathy), "split": splits}}
    extra.update(provenance([karpathy], f"images whose 'split' is {' or '.join(splits)}"))
    name = name or f"{dataset}-karpathy-{'-'.join(splits)}"
    return write_caption_split(out, name, images(), captions, karpathy, shard_size, extra, tokenizer)
