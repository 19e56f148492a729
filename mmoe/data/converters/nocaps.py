"""NoCaps (Agrawal et al., 2019): the reader of its own files, whose
:class:`~mmoe.data.converters.records.CaptionedImage` records :mod:`.build_captions` writes as a captioning evaluation
split, one sample per image, the image's domain beside its captions.

Two files, both in COCO's captions format (nocaps.org/download; :mod:`mmoe.metrics.nocaps`):
``nocaps_val_4500_captions.json`` (``images`` with ``id``, ``file_name`` and ``domain``, ``annotations`` with
``image_id`` and ``caption``: 4,500 images, 10 captions each) and ``nocaps_test_image_info.json`` (10,600 ``images``,
no captions). Images at DIR/<file_name> or DIR/<split>/<file_name> (BEiT-3's layout: ``val/``, ``test/``; the split
is the one the file name says, ``nocaps_val_...`` or ``nocaps_test_...``, else ``val`` for a file with annotations).
Each sample: the image, ``txt`` = the first caption, ``json`` = ``image_id``, ``captions`` (empty for test),
``file_name``, ``domain``; ``caption_tokens.json`` beside the shards; the manifest counts the images per domain.

The evaluation server scores a caption for every image, so unlike COCO's converter nothing is skipped: a missing or
unreadable image, an image without a caption in a file with annotations, a missing or unknown domain are refused
(one line naming the file, the image and the field), and nothing is written.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmoe.data.converters.build_captions import CaptionSet, write_caption_split
from mmoe.data.converters.coco import ImageFiles
from mmoe.data.converters.common import (
    ConversionError,
    Skip,
    field,
    first_existing,
    images_folder,
    load_json,
    path_under,
)
from mmoe.data.converters.provenance import provenance
from mmoe.data.converters.records import CaptionedImage, ImageFile
from mmoe.data.shards import Manifest
from mmoe.data.tokenizer import TextTokenizer
from mmoe.metrics.nocaps import DOMAINS, checked_domains, image_domain

_SPLIT_IN_NAME = re.compile(r"^nocaps_(val|test)_")


def convert_nocaps(
    annotations: str | os.PathLike,
    images: str | os.PathLike,
    out: str | os.PathLike,
    *,
    tokenizer: TextTokenizer | None = None,
    name: str | None = None,
    shard_size: int = 1000,
) -> Manifest:
    """Converts ``nocaps_val_4500_captions.json`` or ``nocaps_test_image_info.json`` with its images.

    Args:
        annotations: the NoCaps file; without ``annotations`` (test image info) the samples have no captions.
        images: the folder holding the images (or their ``val/`` / ``test/`` folder).
        out: the split's folder.
        tokenizer: the tokenizer whose ids ``caption_tokens.json`` lists; None = open_clip's BPE.
        name: shard name; default ``nocaps-<split>`` (``nocaps-val``, ``nocaps-test``).
        shard_size: samples in each shard.
    """
    annotations, images = Path(annotations), images_folder(images)
    data = load_json(annotations)
    if not isinstance(data, dict):
        raise ConversionError(f"{annotations}: expected a JSON object with 'images' (NoCaps' COCO-style file)")
    has_captions = bool(data.get("annotations"))
    split = nocaps_split(annotations, has_captions)
    chosen = nocaps_images(data, annotations, images, split, has_captions)
    captions = nocaps_captions(data, annotations, chosen)

    def records() -> Iterator[tuple[CaptionedImage, RequiredImage]]:
        for image in chosen:
            record = CaptionedImage(
                image.image_id, captions.by_image[image.image_id], image.file_name, None, image.domain
            )
            yield record, RequiredImage(image.path, entry=image.entry)

    counts = {domain: sum(image.domain == domain for image in chosen) for domain in DOMAINS}
    extra: dict[str, Any] = {"source": {"annotations": str(annotations)}, "split": split}
    extra["domains"] = counts if chosen[0].domain is not None else None
    extra.update(provenance([annotations], "every image of the NoCaps file"))
    return write_caption_split(
        out, name or f"nocaps-{split}", records(), captions, annotations, shard_size, extra, tokenizer
    )


@dataclass(frozen=True)
class RequiredImage(ImageFile):
    """An image every sample of the split must have: one that cannot be read stops the conversion (a ConversionError
    naming ``entry``, the record that names it) instead of skipping its sample."""

    entry: str = ""

    def load(self) -> tuple[bytes, str] | Skip:
        image = super().load()
        if isinstance(image, Skip):
            raise ConversionError(f"{self.entry}: image {image.path}: {image.reason}; every NoCaps image is scored")
        return image


@dataclass(frozen=True)
class NocapsImage:
    """One image of a NoCaps file: where it is named (``nocaps_val_4500_captions.json: images[2] (id 2)``), its file,
    and the fields its sample keeps."""

    entry: str
    path: Path
    image_id: int
    domain: str | None
    file_name: str


def nocaps_split(annotations: Path, has_captions: bool) -> str:
    """``val`` or ``test``: what the file's name says, else ``val`` for a file with captions."""
    match = _SPLIT_IN_NAME.match(annotations.name)
    return match.group(1) if match else "val" if has_captions else "test"


def nocaps_images(data: Any, annotations: Path, images: Path, split: str, has_captions: bool) -> list[NocapsImage]:
    """The file's images, each with its domain and its file found under ``images``; a record without ``id``,
    ``file_name`` or a known domain, an id twice, one file under two ids and a missing file are ConversionErrors."""
    files, chosen, seen = ImageFiles(), [], set()
    for index, image in enumerate(field(data, "images", list, f"{annotations}")):
        where = f"{annotations}: images[{index}]"
        image_id = field(image, "id", int, where)
        if image_id in seen:
            raise ConversionError(f"{where}: image id {image_id} appears twice")
        seen.add(image_id)
        entry = f"images[{index}] (id {image_id})"
        domain = image_domain(image, f"{annotations}: {entry}", has_captions, ConversionError)
        file_name = field(image, "file_name", str, f"{annotations}: {entry}")
        path = path_under(images, file_name, f"{annotations}: {entry}")
        path = first_existing([path, images / split / path.relative_to(images)])
        if not path.is_file():
            raise ConversionError(
                f"{annotations}: {entry}: image file {file_name!r} is in neither --images {images} nor "
                f"{images / split}; every NoCaps image is scored"
            )
        files.add(path, file_name, annotations, entry)
        chosen.append(NocapsImage(f"{annotations}: {entry}", path, image_id, domain, file_name))
    if not chosen:
        raise ConversionError(f"{annotations}: field 'images' is empty: no images to convert")
    checked_domains([image.domain for image in chosen], str(annotations), ConversionError)
    return chosen


def nocaps_captions(data: Any, annotations: Path, chosen: list[NocapsImage]) -> CaptionSet:
    """The captions of the file's ``annotations``; one naming an unknown image, or an image without any, is a
    ConversionError."""
    captions = CaptionSet()
    for image in chosen:
        captions.by_image[image.image_id] = []
    listed = field(data, "annotations", list, f"{annotations}") if data.get("annotations") is not None else []
    for index, annotation in enumerate(listed):
        where = f"{annotations}: annotations[{index}]"
        image_id = field(annotation, "image_id", int, where)
        if image_id not in captions.by_image:
            raise ConversionError(f"{where}: field 'image_id' = {image_id} is not in 'images'")
        captions.add(image_id, field(annotation, "caption", str, where), f"{where}, image_id {image_id}")
    if listed:
        for image in chosen:
            if not captions.by_image[image.image_id]:
                raise ConversionError(f"{image.entry}: no caption in 'annotations'; expected its reference captions")
    return captions
