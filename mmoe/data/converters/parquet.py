"""Benchmark rows from HF ``datasets`` parquet files: what the parquet readers share (:class:`ParquetRows`, the
image cells as :class:`ImageCell` sources).

``mmoe data convert vqav2 | coco-captions | flickr30k | nlvr2 --parquet FILE [FILE ...]`` reads the Hub's parquet
copies of the benchmarks into the same shards as the official files (:mod:`.parquet_vqav2`,
:mod:`.parquet_captions`, :mod:`.parquet_nlvr2`). The files of one split are read as one table, in the order given.
Each file's columns are checked against the public schema when it is opened; the rows are read twice, first without
their images (validated into the typed records of :mod:`.records`, as the official files' readers give them), then
the images alone, a few rows at a time, while the benchmark's builder writes the shards. A file that is not parquet,
a missing column, a column of the wrong type or a null where a value is needed stops the conversion before anything is
written, with one line naming the file, the row (counted from 0, as pyarrow and the Hub's viewer count) and the
field.

An image column is ``datasets``' Image feature, a struct ``{bytes, path}``. Only ``bytes`` is read: ``path`` names the
file the copy was made from, never a file on this machine. The bytes are kept as they are when they decode as JPEG,
PNG or WebP and re-encoded as 8-bit RGB PNG otherwise, as :func:`mmoe.data.converters.common.read_image` treats an
image file, so a parquet copy of a file gives a sample byte for byte equal to the file's. A row without image bytes,
or with bytes no decoder reads, is skipped and counted like a missing or unreadable image file.

Every parquet split's manifest records its provenance: ``source`` (the files), ``sha256`` (each input file's digest)
and ``split_rule`` (how its rows were chosen).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mmoe.data.converters.common import ConversionError, Skip, image_of_bytes, unreadable
from mmoe.data.converters.provenance import provenance
from mmoe.io import one_line

#: Rows whose images are held in memory at once while shards are written.
IMAGE_ROWS_PER_BATCH = 32


#: The formats a sample keeps as they are, and their extensions (as for image files).
@dataclass(frozen=True)
class Kind:
    """What a column must hold: ``description`` is said in errors, ``accepts`` checks an arrow type."""

    description: str
    accepts: Callable[[pa.DataType], bool]


def _is_text(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind)


def _struct_with(kind: pa.DataType, name: str, accepts: Callable[[pa.DataType], bool]) -> bool:
    return pa.types.is_struct(kind) and kind.get_field_index(name) >= 0 and accepts(kind.field(name).type)


def _is_bytes(kind: pa.DataType) -> bool:
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind)


INTEGER = Kind("an integer", pa.types.is_integer)
TEXT = Kind("a string", _is_text)
BOOLEAN = Kind("a boolean", pa.types.is_boolean)
IMAGE = Kind("an image struct {bytes, path}", lambda kind: _struct_with(kind, "bytes", _is_bytes))


def list_of(kind: Kind) -> Kind:
    """A list column whose elements are ``kind``."""
    return Kind(f"a list of {kind.description}", lambda arrow: _is_list(arrow) and kind.accepts(arrow.value_type))


def struct_with(name: str, kind: Kind) -> Kind:
    """A struct column with a field ``name`` of ``kind`` (other fields allowed)."""
    return Kind(f"a struct with {name!r} ({kind.description})", lambda arrow: _struct_with(arrow, name, kind.accepts))


def either(first: Kind, second: Kind) -> Kind:
    return Kind(f"{first.description} or {second.description}", lambda a: first.accepts(a) or second.accepts(a))


class ParquetRows:
    """The rows of one split's parquet files, read as one table in the order of ``paths``.

    Args:
        paths: the files.
        columns: column name -> :class:`Kind`, checked in every file on opening.
        images: the image columns (each :data:`IMAGE`), read only by :meth:`images`.
    """

    def __init__(self, paths: Sequence[str | os.PathLike], columns: Mapping[str, Kind], images: Sequence[str]):
        if not paths:
            raise ConversionError("--parquet: give at least one parquet file")
        self.paths = [Path(path) for path in paths]
        self.columns = dict(columns)
        self.image_columns = list(images)
        expected = {**self.columns, **{name: IMAGE for name in self.image_columns}}
        self._files = [_open_checked(path, expected) for path in self.paths]

    def rows(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(``FILE: row N``, the row without its images) for every row."""
        yield from self._read(list(self.columns), batch_size=1024)

    def images(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(``FILE: row N``, the row's image cells) for every row, in the order of :meth:`rows`."""
        yield from self._read(self.image_columns, batch_size=IMAGE_ROWS_PER_BATCH)

    def _read(self, columns: list[str], batch_size: int) -> Iterator[tuple[str, dict[str, Any]]]:
        for path, parquet in zip(self.paths, self._files, strict=True):
            row = 0
            try:
                for batch in parquet.iter_batches(batch_size=batch_size, columns=columns):
                    for values in batch.to_pylist():
                        yield f"{path}: row {row}", values
                        row += 1
            except (OSError, pa.ArrowException) as error:
                raise ConversionError(f"{path}: row {row}: unreadable ({one_line(error)})") from None

    def provenance(self, split_rule: str, **more_sources: str | os.PathLike) -> dict[str, Any]:
        """The manifest fields of a parquet split: ``source`` (the files; ``more_sources`` beside them), ``sha256``
        (every input file's digest) and ``split_rule``."""
        others = {name: Path(path) for name, path in more_sources.items()}
        source = {"parquet": [str(path) for path in self.paths], **{k: str(v) for k, v in others.items()}}
        return {"source": source, **provenance([*self.paths, *others.values()], split_rule)}

    def __str__(self) -> str:
        return ", ".join(str(path) for path in self.paths)


def _open_checked(path: Path, columns: Mapping[str, Kind]) -> pq.ParquetFile:
    """``path`` opened as parquet, its schema holding ``columns``; otherwise a one-line ConversionError."""
    try:
        parquet = pq.ParquetFile(path)
        schema = parquet.schema_arrow
    except (OSError, pa.ArrowException) as error:
        raise ConversionError(f"{path}: not a readable parquet file ({one_line(error)})") from None
    for name, kind in columns.items():
        if name not in schema.names:
            raise ConversionError(
                f"{path}: missing column {name!r} ({kind.description}); the file has {', '.join(schema.names)}"
            )
        if not kind.accepts(schema.field(name).type):
            raise ConversionError(
                f"{path}: every row: field {name!r} is {schema.field(name).type}, expected {kind.description}"
            )
    return parquet


def required(row: Mapping[str, Any], name: str, where: str) -> Any:
    """``row[name]``; a null is a ConversionError naming ``where`` (file and row) and the field."""
    value = row.get(name)
    if value is None:
        raise ConversionError(f"{where}: field {name!r} is null")
    return value


def image_or_skip(cell: Mapping[str, Any] | None, column: str, where: str) -> tuple[bytes, str] | Skip:
    """The sample bytes and extension of an image cell, or a :class:`Skip` (named ``where``) saying why not."""
    data = cell.get("bytes") if isinstance(cell, Mapping) else None
    if not data:
        return Skip(f"{where}: field {column!r}", "missing (no image bytes)")
    try:
        return image_of_bytes(data)
    except Exception as error:  # any decoder failure makes the image unusable
        return Skip(f"{where}: field {column!r}", unreadable(error))


@dataclass(frozen=True)
class ImageCell:
    """The image of one parquet cell (:class:`mmoe.data.converters.records.ImageSource`); ``where`` names its row."""

    cell: Mapping[str, Any] | None
    column: str
    where: str

    def load(self) -> tuple[bytes, str] | Skip:
        return image_or_skip(self.cell, self.column, self.where)

    def digest_id(self) -> None:
        return None


def evaluation_note(rows: ParquetRows, benchmark: str, split: str, training: str) -> None:
    """Says on stderr, in one line, that a parquet split holds no training part: its rows are for evaluation."""
    print(
        f"{rows}: note: {benchmark} split {split!r} from parquet is for evaluation (the Hub's parquet copies of "
        f"{benchmark} hold no training split); fine-tune on {training}",
        file=sys.stderr,
    )
