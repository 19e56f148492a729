"""NLVR2 (Suhr et al., 2019) from HF parquet: the reader of its rows, whose
:class:`~mmoe.data.converters.records.NLVR2Pair` records :mod:`.build_nlvr2` writes as the shards
:func:`convert_nlvr2` writes from the official JSON lines and image files: one sample per row, byte for byte the same
when the rows hold the same records and images.

Columns read: ``identifier`` (``split-set-pair-sentence``), ``sentence``, ``label`` (``"True"`` / ``"False"`` in any
case, or a boolean; null in an unlabelled split) and the pair's images ``left_image`` and ``right_image`` (image
structs ``{bytes, path}``), stored as the official reader's files are. Identifiers must be well formed and
unique, and a split is labelled throughout or not at all, as in the official files. The default shard name is
``nlvr2-<split>`` with the split named by the first identifier (``dev``, ``test1``, ...), as the official file names
it. ``lmms-lab/NLVR2`` holds only development and test splits: converting one prints a note that its rows are for
evaluation.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

from mmoe.data.converters.build_nlvr2 import check_identifier, check_labels, parse_label, write_nlvr2_split
from mmoe.data.converters.common import ConversionError, bounded_text
from mmoe.data.converters.parquet import BOOLEAN, TEXT, ImageCell, ParquetRows, either, evaluation_note, required
from mmoe.data.converters.records import NLVR2Pair
from mmoe.data.shards import Manifest

LABEL = either(BOOLEAN, TEXT)
COLUMNS = {"identifier": TEXT, "sentence": TEXT, "label": LABEL}
#: The image columns of a pair, left then right.
IMAGE_COLUMNS = ("left_image", "right_image")


def read_pair_rows(rows: ParquetRows) -> list[NLVR2Pair]:
    """The record of every row: identifiers well formed and unique, labels all present or all null."""
    records: list[NLVR2Pair] = []
    first_at: dict[str, str] = {}
    for where, row in rows.rows():
        identifier = check_identifier(required(row, "identifier", where), where, first_at)
        label = parse_label(row.get("label"), where, identifier)
        sentence = bounded_text(required(row, "sentence", where), where, "field 'sentence'")
        records.append(NLVR2Pair(identifier, sentence, label, where, where))
    if not records:
        raise ConversionError(f"{rows}: no rows to convert")
    check_labels(records, str(rows), "row", lambda pair: f"{pair.where}: field 'label' of {pair.identifier!r} is null")
    return records


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
    rows = ParquetRows(parquet, COLUMNS, images=list(IMAGE_COLUMNS))
    records = read_pair_rows(rows)
    split = records[0].identifier.split("-")[0]
    if split != "train":
        evaluation_note(rows, "NLVR2", split, "the official train.json and its images")

    def pairs() -> Iterator[tuple[NLVR2Pair, ImageCell, ImageCell]]:
        for record, (where, cells) in zip(records, rows.images(), strict=True):
            where = f"{where} ({record.identifier})"
            yield record, *(ImageCell(cells[column], column, where) for column in IMAGE_COLUMNS)

    extra = rows.provenance(f"every row: the files hold NLVR2 {split} (named by the first identifier)")
    labelled = records[0].label is not None
    return write_nlvr2_split(out, name or f"nlvr2-{split}", pairs(), labelled, shard_size, extra)
