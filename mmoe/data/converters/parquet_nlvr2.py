"""NLVR2 (Suhr et al., 2019) from HF parquet -> the shards :func:`convert_nlvr2` writes from the official JSON lines
and image files: one sample per row, byte for byte the same when the rows hold the same records and images.

Columns read: ``identifier`` (``split-set-pair-sentence``), ``sentence``, ``label`` (``"True"`` / ``"False"`` in any
case, or a boolean; null in an unlabelled split) and the pair's images ``left_image`` and ``right_image`` (image
structs ``{bytes, path}``). Each sample holds ``left.png`` and ``right.png`` (the image bytes, as the official
converter stores the files' bytes), ``txt`` = the sentence and ``json`` = ``identifier``, ``sentence``, ``label``,
``left``, ``right`` (the official file names of the pair, :func:`image_names`). Identifiers must be well formed and
unique, and a split is labelled throughout or not at all, as in the official files. The default shard name is
``nlvr2-<split>`` with the split named by the first identifier (``dev``, ``test1``, ...), as the official file names
it. ``lmms-lab/NLVR2`` holds only development and test splits: converting one prints a note that its rows are for
evaluation.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from mmoe.data.converters.common import ConversionError, Skip, write_split
from mmoe.data.converters.nlvr2 import Record, image_names, parse_label
from mmoe.data.converters.parquet import (
    BOOLEAN,
    TEXT,
    ParquetRows,
    either,
    evaluation_note,
    image_or_skip,
    required,
)
from mmoe.data.shards import Manifest

LABEL = either(BOOLEAN, TEXT)
COLUMNS = {"identifier": TEXT, "sentence": TEXT, "label": LABEL}
IMAGE_ENTRIES = {"left_image": "left.png", "right_image": "right.png"}


def read_pair_rows(rows: ParquetRows) -> list[tuple[str, Record]]:
    """(``FILE: row N``, record) for every row: identifiers well formed and unique, labels all present or all null."""
    records: list[tuple[str, Record]] = []
    first_at: dict[str, str] = {}
    for where, row in rows.rows():
        identifier = required(row, "identifier", where)
        if len(identifier.split("-")) < 4 or "." in identifier or "/" in identifier:
            raise ConversionError(f"{where}: field 'identifier' must read split-set-pair-sentence, got {identifier!r}")
        if identifier in first_at:
            first = first_at[identifier]
            raise ConversionError(f"{where}: field 'identifier' = {identifier!r} appears twice (first at {first})")
        first_at[identifier] = where
        label = parse_label(row.get("label"), where, identifier)
        records.append((where, Record(len(records), identifier, required(row, "sentence", where), label)))
    if not records:
        raise ConversionError(f"{rows}: no rows to convert")
    _check_labels(rows, records)
    return records


def _check_labels(rows: ParquetRows, records: list[tuple[str, Record]]) -> None:
    """A row without a label among labelled rows is an error naming both; a split without labels is said so."""
    labelled = next(((where, r) for where, r in records if r.label is not None), None)
    unlabelled = next(((where, r) for where, r in records if r.label is None), None)
    if labelled is not None and unlabelled is not None:
        raise ConversionError(
            f"{unlabelled[0]}: field 'label' of {unlabelled[1].identifier!r} is null, but {labelled[0]} "
            f"({labelled[1].identifier!r}) has one; a split is labelled throughout or not at all"
        )
    if labelled is None:
        print(
            f"{rows}: no row has a 'label': converted as an unlabelled split (for predictions; training and "
            "evaluation need labels)",
            file=sys.stderr,
        )


def pair_sample(record: Record, cells: dict[str, Any], where: str) -> dict[str, Any] | Skip:
    """The sample of one row, as :func:`convert_nlvr2` writes it, or a :class:`Skip` for an unusable image."""
    left, right = image_names(record.identifier)
    sample: dict[str, Any] = {"__key__": record.identifier, "txt": record.sentence}
    for column, entry in IMAGE_ENTRIES.items():
        image = image_or_skip(cells[column], column, where)
        if isinstance(image, Skip):
            return image
        sample[entry] = image[0]
    meta = {"identifier": record.identifier, "sentence": record.sentence, "label": record.label}
    sample["json"] = {**meta, "left": left, "right": right}
    return sample


def convert_nlvr2_parquet(
    parquet: Sequence[str | os.PathLike], out: str | os.PathLike, shard_size: int = 1000, name: str | None = None
) -> Manifest:
    """Converts one NLVR2 split held in HF parquet files.

    Args:
        parquet: the split's parquet files, read in this order.
        out: output folder for this split.
        shard_size: samples per shard.
        name: shard name; default ``nlvr2-<split>``, the split named by the first identifier (e.g. ``nlvr2-dev``).
    """
    rows = ParquetRows(parquet, COLUMNS, images=list(IMAGE_ENTRIES))
    records = read_pair_rows(rows)
    split = records[0][1].identifier.split("-")[0]
    if split != "train":
        evaluation_note(rows, "NLVR2", split, "the official train.json and its images")

    def samples() -> Iterator[dict[str, Any] | Skip]:
        for (where, record), (_, cells) in zip(records, rows.images(), strict=True):
            yield pair_sample(record, cells, f"{where} ({record.identifier})")

    extra = rows.provenance(f"every row: the files hold NLVR2 {split} (named by the first identifier)")
    extra["labelled"] = records[0][1].label is not None
    return write_split(out, name or f"nlvr2-{split}", samples(), shard_size, extra)
