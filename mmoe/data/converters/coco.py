"""COCO captions -> shards, one sample per image with all its captions.

Two inputs: the official ``captions_<subtype>.json`` (``images`` with ``id`` / ``file_name``, ``annotations`` with
``image_id`` / ``caption``; images at DIR/<file_name> or DIR/<subtype>/<file_name>), or Karpathy's
``dataset_coco.json`` with a split (``images`` with ``filepath``, ``filename``, ``cocoid``, ``split``, ``sentences``;
images at DIR/<filepath>/<filename>). Each sample: the image, ``txt`` = the first caption, ``json`` = ``image_id``
(COCO id; Karpathy ``cocoid``), ``captions``, ``file_name``. Next to the shards, ``caption_tokens.json`` lists the
tokenizer ids the split's captions use (:func:`mmoe.data.tokenizer.token_ids_of`): the output vocabulary a captioning
head can be restricted to (``CaptioningFineTuning(output_vocab=...)``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from mmoe.atomic import write_json_atomic
from mmoe.data.converters.common import (
    ConversionError,
    Skip,
    field,
    first_existing,
    list_field,
    load_json,
    with_image,
    write_split,
)
from mmoe.data.shards import Manifest
from mmoe.data.tokenizer import token_ids_of

KARPATHY_SPLITS = ("train", "restval", "val", "test")
_SUBTYPE_IN_FILE = re.compile(r"^COCO_([a-z]+\d+)_")
#: Written next to a caption split's shards: the sorted tokenizer ids of its captions, end-of-text included.
CAPTION_TOKENS_FILE = "caption_tokens.json"


def write_caption_tokens(out: str | os.PathLike, captions: Iterable[str]) -> None:
    """``out/caption_tokens.json``: the ids :func:`mmoe.data.tokenizer.token_ids_of` finds in ``captions``."""
    write_json_atomic(Path(out) / CAPTION_TOKENS_FILE, token_ids_of(captions), indent=None)


def _sample(image_id: int, captions: list[str], file_name: str, path: Path, **extra: Any) -> dict[str, Any] | Skip:
    meta = {"image_id": image_id, "captions": captions, "file_name": file_name, **extra}
    sample = {"__key__": str(image_id), "txt": captions[0] if captions else "", "json": meta}
    return with_image(sample, path)


def convert_coco_captions(
    annotations: str | os.PathLike,
    images: str | os.PathLike,
    out: str | os.PathLike,
    shard_size: int = 1000,
    name: str | None = None,
) -> Manifest:
    """Converts an official COCO captions file (``captions_train2014.json``, ``captions_val2014.json``, ...).

    Args:
        annotations: the captions JSON; a file without ``annotations`` (test image info) gives samples without
            captions.
        images: COCO image folder.
        out: output folder for this split.
        shard_size: samples per shard.
        name: shard name; default ``coco-captions-<subtype>`` (from the file name ``captions_<subtype>.json``).
    """
    annotations, images = Path(annotations), Path(images)
    data = load_json(annotations)
    image_list = list_field(data, "images", f"{annotations}")
    captions: dict[int, list[str]] = {}
    for index, image in enumerate(image_list):
        where = f"{annotations}: images[{index}]"
        image_id = field(image, "id", int, where)
        field(image, "file_name", str, where)
        if image_id in captions:
            raise ConversionError(f"{where}: image id {image_id} appears twice")
        captions[image_id] = []
    for index, annotation in enumerate(data.get("annotations") or []):
        where = f"{annotations}: annotations[{index}]"
        image_id = field(annotation, "image_id", int, where)
        caption = field(annotation, "caption", str, where)
        if image_id not in captions:
            raise ConversionError(f"{where}: field 'image_id' = {image_id} is not in 'images'")
        captions[image_id].append(caption.strip())
    subtype = annotations.stem.removeprefix("captions_")

    def samples() -> Iterator[dict[str, Any] | Skip]:
        for image in image_list:
            file_name = image["file_name"]
            match = _SUBTYPE_IN_FILE.match(file_name)
            candidates = [images / file_name] + ([images / match.group(1) / file_name] if match else [])
            yield _sample(image["id"], captions[image["id"]], file_name, first_existing(candidates))

    extra = {"source": {"annotations": str(annotations)}}
    manifest = write_split(out, name or f"coco-captions-{subtype}", samples(), shard_size, extra)
    write_caption_tokens(out, (caption for texts in captions.values() for caption in texts))
    return manifest


def convert_karpathy(
    karpathy: str | os.PathLike,
    split: str | Sequence[str],
    images: str | os.PathLike,
    out: str | os.PathLike,
    shard_size: int = 1000,
    name: str | None = None,
) -> Manifest:
    """Converts one split of Karpathy's ``dataset_coco.json``.

    Args:
        karpathy: ``dataset_coco.json``.
        split: ``train``, ``restval``, ``val`` or ``test``, or several (``"train,restval"``: BEiT-3's training set).
        images: COCO image folder (holding ``train2014/`` and ``val2014/``).
        out: output folder for this split.
        shard_size: samples per shard.
        name: shard name; default ``coco-karpathy-<split>`` (splits joined by ``-``).
    """
    karpathy, images = Path(karpathy), Path(images)
    splits = [s.strip() for s in split.split(",")] if isinstance(split, str) else list(split)
    unknown = [s for s in splits if s not in KARPATHY_SPLITS]
    if unknown or not splits:
        raise ConversionError(f"--split {split!r}: expected one or more of {', '.join(KARPATHY_SPLITS)}")
    data = load_json(karpathy)
    chosen = []
    for index, image in enumerate(list_field(data, "images", f"{karpathy}")):
        where = f"{karpathy}: images[{index}]"
        if field(image, "split", str, where) not in splits:
            continue
        field(image, "cocoid", int, where)
        field(image, "filepath", str, where)
        field(image, "filename", str, where)
        sentences = list_field(image, "sentences", where)
        raw = [field(s, "raw", str, f"{where}: sentences[{i}]").strip() for i, s in enumerate(sentences)]
        chosen.append((image, raw))

    def samples() -> Iterator[dict[str, Any] | Skip]:
        for image, raw in chosen:
            file_name = f"{image['filepath']}/{image['filename']}"
            path = images / image["filepath"] / image["filename"]
            yield _sample(image["cocoid"], raw, file_name, path, split=image["split"])

    extra = {"source": {"karpathy": str(karpathy), "split": splits}}
    manifest = write_split(out, name or f"coco-karpathy-{'-'.join(splits)}", samples(), shard_size, extra)
    write_caption_tokens(out, (caption for _, raw in chosen for caption in raw))
    return manifest
