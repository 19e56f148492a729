"""A split's images by id and digest: ``image_digests.json``, written beside the shards of every split with images.

It lists each distinct (image id, SHA-256 of the stored image bytes) pair of the split once, in the order first
written, so that two splits can be checked for shared images without reading their shards (``mmoe data
check-overlap``, and the warning a fine-tuning DataModule gives when its train and eval splits share images:
:mod:`mmoe.data.overlap`). An image's id is the name of its file as its dataset names it (:func:`image_id`):
COCO's ``COCO_val2014_000000000042.jpg`` (VQAv2 samples, COCO and Flickr30K caption samples: the base name of
``file_name``), NLVR2's ``dev-850-0-img0.png``, the path under ``--images`` of a pre-training pair. File names,
unlike numeric ids, do not collide across datasets (COCO image 42 and Flickr30K image 42 differ). A user's own rows
name files only within their image folder (two folders may both hold ``000000.jpg``), so their id is the folder's
resolved path joined with the path under it (:func:`folder_image_id`): tables over one folder share ids, tables over
two folders do not (a file copied from one to the other is still found by its digest).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from mmoe.io import parse_json

IMAGE_DIGESTS_FILE = "image_digests.json"
DIGESTS_FORMAT = "mmoe-image-digests"
#: A sample entry the shard writer leaves out: the image id when the sample's ``json`` does not say it.
IMAGE_ID_KEY = "__image_id__"
#: A sample entry the shard writer leaves out: where each image entry was read (entry -> a file or a parquet row).
IMAGE_SOURCES_KEY = "__image_sources__"
_IMAGE_EXTENSIONS = {"jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff"}
_NLVR2_SIDES = {"left.png": "left", "right.png": "right"}


def is_image_entry(entry: str) -> bool:
    """Whether a sample entry (``jpg``, ``left.png``, ...) holds an image, by its extension."""
    return not entry.startswith("__") and entry.rsplit(".", 1)[-1].lower() in _IMAGE_EXTENSIONS


def image_entries(sample: Mapping[str, Any]) -> Iterator[tuple[str, bytes]]:
    """(entry, bytes) of every image of a sample (``jpg``, ``png``, ``left.png``, ...)."""
    for entry, value in sample.items():
        if is_image_entry(entry):
            if isinstance(value, bytes):
                yield entry, value


def sample_meta(sample: Mapping[str, Any]) -> dict[str, Any]:
    """The sample's ``json`` entry as a dict (empty when absent or not an object)."""
    meta = sample.get("json")
    if isinstance(meta, bytes):
        try:
            meta = parse_json(meta)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return {}
    return meta if isinstance(meta, dict) else {}


def image_id(sample: Mapping[str, Any], entry: str, meta: Mapping[str, Any]) -> str | None:
    """The id of the image in ``entry`` (see the module docstring); None when the sample does not say."""
    if IMAGE_ID_KEY in sample:
        return str(sample[IMAGE_ID_KEY])
    if entry in _NLVR2_SIDES and isinstance(meta.get(_NLVR2_SIDES[entry]), str):
        return meta[_NLVR2_SIDES[entry]]
    if isinstance(meta.get("file_name"), str):
        return posixpath.basename(meta["file_name"])
    if {"question_id", "image_id", "data_subtype"} <= meta.keys() and isinstance(meta["image_id"], int):
        subtype = "test2015" if meta["data_subtype"] == "test-dev2015" else meta["data_subtype"]
        return f"COCO_{subtype}_{meta['image_id']:012d}.jpg"
    return meta["path"] if isinstance(meta.get("path"), str) else None


def folder_image_id(folder: Path, relative: str) -> str:
    """The id of a user's own image ``relative`` (a path checked to lie under ``folder``): unique across folders."""
    return f"{folder.resolve().as_posix()}/{posixpath.normpath(relative)}"


class ImageDigests:
    """The distinct (image id, digest) pairs of the samples added, in the order first seen. An id given to two
    different images (a merged or corrupted input) is a ValueError naming the id and where each image was read."""

    def __init__(self) -> None:
        self._pairs: dict[tuple[str | None, str], None] = {}
        self._first: dict[str, tuple[str, str]] = {}

    def add(self, sample: Mapping[str, Any]) -> None:
        meta = None
        for entry, data in image_entries(sample):
            meta = sample_meta(sample) if meta is None else meta
            identifier, digest = image_id(sample, entry, meta), hashlib.sha256(data).hexdigest()
            where = sample.get(IMAGE_SOURCES_KEY, {}).get(entry) or f"sample {sample.get('__key__')}"
            first = self._first.setdefault(identifier, (digest, where)) if identifier else (digest, where)
            if first[0] != digest:
                raise ValueError(f"{where}: image id {identifier!r} is another image than at {first[1]}")
            self._pairs.setdefault((identifier, digest))

    def __len__(self) -> int:
        return len(self._pairs)

    def pairs(self) -> list[tuple[str | None, str]]:
        return list(self._pairs)

    def text(self) -> str:
        """The text of ``image_digests.json``."""
        images = [[identifier, digest] for identifier, digest in self._pairs]
        return json.dumps({"format": DIGESTS_FORMAT, "version": 1, "images": images}, ensure_ascii=False) + "\n"
