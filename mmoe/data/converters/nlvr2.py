"""NLVR2 (Suhr et al., 2019): the reader of the official JSON lines, whose
:class:`~mmoe.data.converters.records.NLVR2Pair` records :mod:`.build_nlvr2` writes, one sample per line.

Each line holds ``identifier`` (``split-set-pair-sentence``), ``sentence`` and ``label`` (``"True"`` / ``"False"``).
Its two images are found anywhere under DIR by the official naming rule (:func:`.build_nlvr2.image_names`):
``'-'.join(identifier.split('-')[:3]) + '-img0.png'`` (left) and ``'-img1.png'`` (right); the samples hold the
files' bytes.

Labels are the official ``"True"`` / ``"False"`` strings (any case) or JSON booleans; anything else is an error. A
split is labelled throughout or not at all: a record without a label in a labelled file is an error naming its line
and identifier, and a file in which no record has a label (a hidden test split) converts as an unlabelled split, with
``"labelled": false`` in its manifest (``true`` otherwise) and ``label`` null in every sample.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

from mmoe.data.converters.build_nlvr2 import (
    check_identifier,
    check_labels,
    image_names,
    parse_label,
    write_nlvr2_split,
)
from mmoe.data.converters.common import ConversionError, bounded_text, field, images_folder, iter_json_lines
from mmoe.data.converters.provenance import provenance
from mmoe.data.converters.records import ImageFile, NLVR2Pair
from mmoe.data.shards import Manifest


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


def read_records(data: Path) -> list[NLVR2Pair]:
    """The validated records of an NLVR2 file: identifiers well-formed and unique, labels all present or all absent."""
    records: list[NLVR2Pair] = []
    first_at: dict[str, str] = {}
    for number, record in iter_json_lines(data):
        where = f"{data}:{number}"
        identifier = check_identifier(field(record, "identifier", str, where), where, first_at)
        sentence = bounded_text(field(record, "sentence", str, where), where, "field 'sentence'")
        label = parse_label(record.get("label"), where, identifier)
        records.append(NLVR2Pair(identifier, sentence, label, where, f"line {number}"))
    if not records:
        raise ConversionError(f"{data}: no records to convert")
    check_labels(
        records, str(data), "record", lambda pair: f"{pair.where}: record {pair.identifier!r} has no field 'label'"
    )
    return records


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

    def pairs() -> Iterator[tuple[NLVR2Pair, ImageFile, ImageFile]]:
        for record in records:
            left, right = (ImageFile(found.get(name, images / name)) for name in image_names(record.identifier))
            yield record, left, right

    extra = {"source": {"data": str(data)}, **provenance([data], "every line of the file")}
    labelled = records[0].label is not None
    return write_nlvr2_split(out, name or f"nlvr2-{data.stem}", pairs(), labelled, shard_size, extra)
