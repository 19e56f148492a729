"""Images shared by two splits, by id and by digest: ``mmoe data check-overlap TRAIN EVAL`` and the warning a
fine-tuning DataModule gives when its train and eval splits share images.

A split's images are read from its ``image_digests.json`` (every conversion writes it:
:mod:`mmoe.data.converters.image_digests`) or, for a folder without one, from its shards' image entries, with the
same id rule. Two images are shared *by id* when their ids (file names as their dataset names them) are equal and
*by digest* when the SHA-256 of their stored bytes are equal: the same file under another name or in another dataset.
A benchmark's file name names its image wherever it is stored, so an id match counts whatever the digests (the same
COCO image re-encoded by another converter is shared). A user's own file names mean something only inside their image
folder, so their ids carry the folder (:func:`mmoe.data.converters.image_digests.folder_image_id`): ``000000.jpg`` of
two folders is not shared unless its bytes are. A folder read from its shards names an own image by its file name
alone (only ``image_digests.json`` holds the folder). A re-encoded or resized copy under another name has other bytes
and is not found (decoded pixels are not compared: that needs a full decode of every image, and a lossy re-encoding
changes the pixels anyway).
"""

from __future__ import annotations

import hashlib
import os
import sys
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmoe.data.converters.image_digests import (
    DIGESTS_FORMAT,
    IMAGE_DIGESTS_FILE,
    image_entries,
    image_id,
    sample_meta,
)
from mmoe.data.shards import MANIFEST, read_manifest, resolve_shards
from mmoe.io import read_json

#: Shared images named in a report (all are counted).
SHOWN_EXAMPLES = 10
#: The largest tar member read when a folder has no ``image_digests.json`` (larger ones are passed over).
MAX_MEMBER_BYTES = 256 << 20


class OverlapInputError(ValueError):
    """A split that cannot be read: the message names the folder or file."""


@dataclass
class SplitImages:
    """A split's distinct (image id, SHA-256) pairs and where they were read from."""

    folder: str
    pairs: list[tuple[str | None, str]]
    read_from: str

    def summary(self) -> dict[str, Any]:
        return {"folder": self.folder, "images": len(self.pairs), "read_from": self.read_from}


def read_digests_file(folder: str | os.PathLike) -> SplitImages | None:
    """The split's ``image_digests.json``, checked (one listing no images of a split with samples is refused); None
    when the folder has none."""
    path = Path(folder) / IMAGE_DIGESTS_FILE
    if not path.is_file():
        return None
    value = read_json(path, "image digests", OverlapInputError)
    images = value.get("images") if isinstance(value, dict) and value.get("format") == DIGESTS_FORMAT else None
    if not isinstance(images, list) or not all(_is_pair(pair) for pair in images):
        raise OverlapInputError(f"{path}: not an {DIGESTS_FORMAT} file (a list 'images' of [id, sha256] pairs)")
    found = SplitImages(str(folder), [(pair[0], pair[1]) for pair in images], IMAGE_DIGESTS_FILE)
    _check_lists_images(folder, found)
    return found


def _is_pair(pair: Any) -> bool:
    return (
        isinstance(pair, list)
        and len(pair) == 2
        and (pair[0] is None or isinstance(pair[0], str))
        and isinstance(pair[1], str)
        and len(pair[1]) == 64
    )


def split_images(folder: str | os.PathLike) -> SplitImages:
    """A split folder's images: its ``image_digests.json``, else its shards read (every image entry hashed)."""
    if not Path(folder).is_dir():
        raise OverlapInputError(f"{folder}: not a folder")
    found = read_digests_file(folder)
    if found is not None:
        return found
    try:
        shards = resolve_shards(os.fspath(folder))
    except (FileNotFoundError, ValueError) as error:
        raise OverlapInputError(str(error)) from None
    pairs: dict[tuple[str | None, str], None] = {}
    for shard in shards:
        for sample in _tar_samples(shard):
            meta = sample_meta(sample)
            for entry, data in image_entries(sample):
                pairs.setdefault((image_id(sample, entry, meta), hashlib.sha256(data).hexdigest()))
    return SplitImages(str(folder), list(pairs), "shards")


def _check_lists_images(folder: str | os.PathLike, found: SplitImages) -> None:
    """A conversion writes ``image_digests.json`` only for a split with images: one listing none beside a manifest
    that counts samples was emptied or cut short since, and would pass every overlap check; it is refused."""
    if found.pairs or not (Path(folder) / MANIFEST).is_file():
        return
    try:
        samples = read_manifest(folder)["samples"]
    except (OSError, ValueError) as error:
        raise OverlapInputError(str(error)) from None
    if samples:
        counted = f"{samples} sample{'s' * (samples != 1)}"
        raise OverlapInputError(
            f"{Path(folder) / IMAGE_DIGESTS_FILE}: lists no images, but {MANIFEST} counts {counted}; convert the split "
            "again, or remove the file to have the shards read"
        )


def _tar_samples(shard: str) -> Iterator[dict[str, Any]]:
    """The samples of one tar shard as webdataset groups them (members ``<key>.<entry>``, adjacent)."""
    sample: dict[str, Any] = {}
    try:
        with tarfile.open(shard, "r|*") as tar:
            for member in tar:
                if not member.isfile() or member.size > MAX_MEMBER_BYTES:
                    continue
                key, _, entry = os.path.basename(member.name).partition(".")
                if sample and sample["__key__"] != key:
                    yield sample
                    sample = {}
                file = tar.extractfile(member)
                sample.setdefault("__key__", key)
                sample[entry] = file.read() if file is not None else b""
    except (OSError, tarfile.TarError) as error:
        raise OverlapInputError(f"{shard}: not a readable tar shard ({error})") from None
    if sample:
        yield sample


def overlap_report(train: SplitImages, evaluation: SplitImages) -> dict[str, Any]:
    """What ``evaluation`` shares with ``train``: counts by id and by digest, the eval images shared either way, and
    a few examples of each."""
    train_ids = {identifier for identifier, _ in train.pairs if identifier is not None}
    train_by_digest: dict[str, str | None] = {}
    for identifier, digest in train.pairs:
        train_by_digest.setdefault(digest, identifier)
    by_id = [(i, d) for i, d in evaluation.pairs if i is not None and i in train_ids]
    by_digest = [(i, d) for i, d in evaluation.pairs if d in train_by_digest]
    shared = set(by_id) | set(by_digest)
    return {
        "train": train.summary(),
        "eval": evaluation.summary(),
        "shared_images": len(shared),
        "by_id": {"count": len(by_id), "examples": [i for i, _ in by_id[:SHOWN_EXAMPLES]]},
        "by_digest": {
            "count": len(by_digest),
            "examples": [
                {"eval_id": i, "train_id": train_by_digest[d], "sha256": d} for i, d in by_digest[:SHOWN_EXAMPLES]
            ],
        },
    }


def summary_line(report: dict[str, Any]) -> str:
    """One line saying what the eval split shares with the train split."""
    evaluation, train = report["eval"], report["train"]
    if not report["shared_images"]:
        return f"{evaluation['folder']} shares none of its {evaluation['images']} images with {train['folder']}"
    return (
        f"{evaluation['folder']} shares {report['shared_images']} of its {evaluation['images']} images with "
        f"{train['folder']} ({report['by_id']['count']} by id, {report['by_digest']['count']} by digest)"
    )


def _digest_folders(spec: str | os.PathLike | list[str] | None) -> list[str] | None:
    """The split folders of a shard argument when each has an ``image_digests.json``, else None."""
    specs = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec or [])
    folders = [os.fspath(item) for item in specs]
    if not folders or not all((Path(folder) / IMAGE_DIGESTS_FILE).is_file() for folder in folders):
        return None
    return folders


def _merged(folders: list[str]) -> SplitImages:
    pairs: dict[tuple[str | None, str], None] = {}
    for folder in folders:
        pairs.update(dict.fromkeys(read_digests_file(folder).pairs))
    return SplitImages(" + ".join(folders), list(pairs), IMAGE_DIGESTS_FILE)


def warn_shared_images(train: str | list[str] | None, evaluations: dict[str, str | list[str] | None]) -> list[str]:
    """One stderr warning per eval split (``{"val": spec, "test": spec}``) that shares images with ``train``, from
    the folders' ``image_digests.json`` (splits without one are not checked); returns the lines printed."""
    train_folders = _digest_folders(train)
    if train_folders is None:
        return []
    lines, train_images = [], None
    for split, spec in evaluations.items():
        folders = _digest_folders(spec)
        if folders is None:
            continue
        train_images = train_images or _merged(train_folders)
        report = overlap_report(train_images, _merged(folders))
        if report["shared_images"]:
            example = (report["by_id"]["examples"] or [e["eval_id"] for e in report["by_digest"]["examples"]])[0]
            lines.append(
                f"mmoe: warning: data.{split}_shards shares {report['shared_images']} of its {report['eval']['images']}"
                f" images with data.train_shards ({report['by_id']['count']} by id, {report['by_digest']['count']} "
                f"by digest; e.g. {example}): its scores are not clean; see mmoe data check-overlap"
            )
    for line in lines:
        print(line, file=sys.stderr)
    return lines
