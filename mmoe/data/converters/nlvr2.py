"""NLVR2 (Suhr et al., 2019) JSON lines -> shards, one sample per line.

Each line holds ``identifier`` (``split-set-pair-sentence``), ``sentence`` and ``label`` (``"True"`` / ``"False"``).
Its two images are found anywhere under DIR by the official naming rule:
``'-'.join(identifier.split('-')[:3]) + '-img0.png'`` (left) and ``'-img1.png'`` (right). Each sample holds
``left.png``, ``right.png`` (the files' bytes), ``txt`` = the sentence and ``json`` = ``identifier``, ``sentence``,
``label`` (true / false / null), ``left``, ``right`` (file names).

Labels are the official ``"True"`` / ``"False"`` strings (any case) or JSON booleans; anything else is an error. A
split is labelled throughout or not at all: a record without a label in a labelled file is an error naming its line
and identifier, and a file in which no record has a label (a hidden test split) converts as an unlabelled split, with
``"labelled": false`` in its manifest (``true`` otherwise) and ``label`` null in every sample.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmoe.data.converters.common import (
    ConversionError,
    Skip,
    field,
    image_or_skip,
    images_folder,
    iter_json_lines,
    write_split,
)
from mmoe.data.converters.provenance import provenance
from mmoe.data.shards import Manifest


def image_names(identifier: str) -> tuple[str, str]:
    """The left and right image file names of an NLVR2 identifier (the official rule)."""
    stem = "-".join(identifier.split("-")[:3])
    return f"{stem}-img0.png", f"{stem}-img1.png"


def index_images(root: Path) -> dict[str, Path]:
    """File name -> path of every .png under ``root`` (sorted walk; a repeated name keeps the first, with a
    warning)."""
    found: dict[str, Path] = {}
    repeated = 0
    for folder, subfolders, files in os.walk(root):
        subfolders.sort()
        for name in sorted(files):
            if not name.lower().endswith(".png"):
                continue
            if name in found:
                repeated += 1
                continue
            found[name] = Path(folder) / name
    if repeated:
        print(
            f"{root}: {repeated} image names appear more than once; the first in sorted order is used", file=sys.stderr
        )
    return found


@dataclass
class Record:
    """One line of an NLVR2 file."""

    line: int
    identifier: str
    sentence: str
    label: bool | None


def parse_label(value: Any, where: str, identifier: str = "") -> bool | None:
    """``"True"`` / ``"False"`` (any case) or a boolean; None for a missing (null) label."""
    if value is None:
        return None
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    of = f" of {identifier!r}" if identifier else ""
    raise ConversionError(f'{where}: field \'label\'{of} must be "True" or "False", got {value!r}')


def read_records(data: Path) -> list[Record]:
    """The validated records of an NLVR2 file: identifiers well-formed and unique, labels all present or all absent."""
    records: list[Record] = []
    seen: set[str] = set()
    for number, record in iter_json_lines(data):
        where = f"{data}:{number}"
        identifier = field(record, "identifier", str, where)
        if len(identifier.split("-")) < 4 or "." in identifier or "/" in identifier:
            raise ConversionError(f"{where}: field 'identifier' must read split-set-pair-sentence, got {identifier!r}")
        if identifier in seen:
            raise ConversionError(f"{where}: field 'identifier' = {identifier!r} appears twice")
        seen.add(identifier)
        sentence = field(record, "sentence", str, where)
        label = parse_label(record.get("label"), where, identifier)
        records.append(Record(number, identifier, sentence, label))
    if not records:
        raise ConversionError(f"{data}: no records to convert")
    check_labels(data, records)
    return records


def check_labels(data: Path, records: list[Record]) -> None:
    """A record without a label in a file where others have one is an error naming both."""
    labelled = next((record for record in records if record.label is not None), None)
    unlabelled = next((record for record in records if record.label is None), None)
    if labelled is not None and unlabelled is not None:
        raise ConversionError(
            f"{data}:{unlabelled.line}: record {unlabelled.identifier!r} has no field 'label', but line "
            f"{labelled.line} ({labelled.identifier!r}) has one; a split is labelled throughout or not at all"
        )
    if labelled is None:
        print(
            f"{data}: no record has a 'label': converted as an unlabelled split (for predictions; training and "
            "evaluation need labels)",
            file=sys.stderr,
        )


def convert_nlvr2(
    data: str | os.PathLike,
    images: str | os.PathLike,
    out: str | os.PathLike,
    shard_size: int = 1000,
    name: str | None = None,
) -> Manifest:
    """Converts one NLVR2 split file (``train.json``, ``dev.json``, ``test1.json``).

    Args:
        data: the JSON lines file.
        images: folder searched recursively for the images.
        out: output folder for this split.
        shard_size: samples per shard.
        name: shard name; default ``nlvr2-<file stem>`` (e.g. ``nlvr2-dev``).
    """
    data, images = Path(data), images_folder(images)
    records = read_records(data)
    found = index_images(images)

    def samples() -> Iterator[dict[str, Any] | Skip]:
        for record in records:
            identifier, sentence, label = record.identifier, record.sentence, record.label
            left, right = image_names(identifier)
            sample: dict[str, Any] = {"__key__": identifier, "txt": sentence}
            for entry, file_name in (("left.png", left), ("right.png", right)):
                image = image_or_skip(found.get(file_name, images / file_name))
                if isinstance(image, Skip):
                    yield image
                    break
                sample[entry] = image[0]
            else:
                sample["json"] = {
                    "identifier": identifier,
                    "sentence": sentence,
                    "label": label,
                    "left": left,
                    "right": right,
                }
                yield sample

    extra = {"source": {"data": str(data)}, "labelled": records[0].label is not None}
    extra.update(provenance([data], "every line of the file"))
    return write_split(out, name or f"nlvr2-{data.stem}", samples(), shard_size, extra)
