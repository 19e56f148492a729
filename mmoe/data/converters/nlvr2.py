"""NLVR2 (Suhr et al., 2019) JSON lines -> shards, one sample per line.

Each line holds ``identifier`` (``split-set-pair-sentence``), ``sentence`` and ``label`` (``"True"`` / ``"False"``).
Its two images are found anywhere under DIR by the official naming rule:
``'-'.join(identifier.split('-')[:3]) + '-img0.png'`` (left) and ``'-img1.png'`` (right). Each sample holds
``left.png``, ``right.png`` (the files' bytes), ``txt`` = the sentence and ``json`` = ``identifier``, ``sentence``,
``label`` (true / false / null), ``left``, ``right`` (file names).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mmoe.data.converters.common import ConversionError, Skip, field, image_or_skip, iter_json_lines, write_split
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


def parse_label(value: Any, where: str) -> bool | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ConversionError(f'{where}: field \'label\' must be "True" or "False", got {value!r}')


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
    data, images = Path(data), Path(images)
    records = []
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
        records.append((identifier, sentence, parse_label(record.get("label"), where)))
    found = index_images(images)

    def samples() -> Iterator[dict[str, Any] | Skip]:
        for identifier, sentence, label in records:
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

    extra = {"source": {"data": str(data)}}
    return write_split(out, name or f"nlvr2-{data.stem}", samples(), shard_size, extra)
