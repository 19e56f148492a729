"""What an img2dataset / DataComp shard says about each attempted sample, read without decoding an image: the rows of
its parquet (:func:`records_from_parquet`) or the member headers and small ``.json`` members of its tar
(:func:`records_from_tar`, a tar cut short read up to the cut), and the two read together (:func:`parquet_shard`).
:mod:`mmoe.data.img2dataset` decides from them which samples a run leaves out."""

from __future__ import annotations

import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmoe.data.converters.common import ConversionError
from mmoe.io import parse_json

SUCCESS = "success"
#: A ``.json`` member larger than this is not read (its sample keeps what the parquet or nothing says).
MAX_JSON_BYTES = 1 << 20
#: webdataset's rule: a member's sample key is its path up to the first dot of its file name.
_MEMBER = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")
#: Where a sample's sides are read, first choice first: the original image's, else the stored (resized) image's.
SIDE_FIELDS = (("original_width", "original_height"), ("width", "height"))


@dataclass(frozen=True)
class SampleRecord:
    """What the index knows of one attempted sample: its ``key``, ``status``, its image's ``width`` / ``height``
    (read from the fields ``sides_from`` names, one of :data:`SIDE_FIELDS` joined by "/") and DataComp ``uid`` (None
    where absent)."""

    key: str
    status: str
    width: int | None = None
    height: int | None = None
    uid: str | None = None
    sides_from: str | None = None

    @property
    def in_tar(self) -> bool:
        """Whether the tar holds it (img2dataset writes only successful downloads)."""
        return self.status == SUCCESS


#: A stored side above this is not a pixel count (a corrupt value, not an image).
MAX_SIDE = 1 << 20


def pixels(value: Any, where: str, field: str) -> int | None:
    """A stored ``width`` / ``height``: a whole number or a numeric string ("64", "64.0"); None where absent (or a
    float NaN, pandas' missing value). Anything else is a ConversionError naming ``where`` and ``field``."""
    if value is None or (isinstance(value, float) and value != value):
        return None
    number = value
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    if isinstance(number, int | float) and not isinstance(number, bool) and 0 <= number <= MAX_SIDE:
        return int(number)
    raise ConversionError(f"{where}: field '{field}' is {value!r}, expected a pixel count (0 to {MAX_SIDE})")


def records_from_parquet(path: Path) -> list[SampleRecord]:
    """The rows of img2dataset's per-shard parquet (``key`` and ``status`` required; ``width``, ``height`` and
    ``uid`` read where present), in order."""
    import pyarrow.parquet as pq

    try:  # opened by Python: pyarrow cannot open a path whose name is not UTF-8
        with open(path, "rb") as file:
            columns = set(pq.read_schema(file).names)
            read = ("key", "status", *(field for fields in SIDE_FIELDS for field in fields), "uid")
            wanted = [name for name in read if name in columns]
            table = pq.read_table(file, columns=wanted)  # DataComp's metadata has many more columns: not read
    except Exception as error:  # pyarrow raises several types for a file that is not parquet
        raise ConversionError(f"{path}: not a readable parquet file ({type(error).__name__})") from None
    for required in ("key", "status"):
        if required not in columns:
            raise ConversionError(f"{path}: no '{required}' column (img2dataset's metadata has key and status)")
    rows = table.to_pylist()
    records = []
    for index, row in enumerate(rows):
        for field in ("key", "status"):
            if not isinstance(row[field], str) or not row[field]:
                raise ConversionError(f"{path}: row {index}: field '{field}' is {row[field]!r}, expected a string")
        records.append(_record(row["key"], row["status"], row, f"{path}: row {index}"))
    return records


def _record(key: str, status: str, meta: dict[str, Any], where: str) -> SampleRecord:
    uid = meta.get("uid")
    sides = {field: pixels(meta.get(field), where, field) for fields in SIDE_FIELDS for field in fields}
    for fields in SIDE_FIELDS:
        if None not in (width := sides[fields[0]], height := sides[fields[1]]):
            return SampleRecord(key, status, width, height, None if uid is None else str(uid), "/".join(fields))
    return SampleRecord(key, status, uid=None if uid is None else str(uid))


def tar_groups(path: Path, cuts: dict[str, str]) -> Iterator[tuple[str, dict[str, tarfile.TarInfo], tarfile.TarFile]]:
    """(key, extension -> member) per sample, grouped as webdataset groups consecutive members. A tar cut short (a
    truncated download, or one img2dataset is still writing) gives the samples before the cut, the last one with its
    members that are whole, and ``cuts[path.name]`` says where it ends."""
    try:
        archive = tarfile.open(path, "r:")
    except (tarfile.TarError, OSError) as error:
        if isinstance(error, tarfile.ReadError) and path.stat().st_size < tarfile.BLOCKSIZE:
            cuts[path.name] = f"cut short after 0 samples ({error})"  # not one whole header yet: a tar just begun
            return
        raise ConversionError(f"{path}: not a readable tar file ({error})") from None
    with archive:
        key, members, count = None, {}, 0
        try:
            for member in archive:
                match = _MEMBER.match(member.name) if member.isfile() else None
                if match is None:
                    continue
                if match.group(1) != key and members:
                    yield key, members, archive
                    members, count = {}, count + 1
                key = match.group(1)
                members[match.group(2)] = member
            cut = None if _ends_whole(path, archive.offset) else "no end-of-archive block"
        except tarfile.ReadError as error:
            cut = str(error)
        if cut is not None:
            size = path.stat().st_size
            # The reader gives the last sample with the members whole before the cut (none: no sample).
            members = {name: m for name, m in members.items() if m.offset_data + m.size <= size}
            cuts[path.name] = f"cut short after {count + bool(members)} samples ({cut})"
        if members:
            yield key, members, archive


def _ends_whole(path: Path, offset: int) -> bool:
    """Whether the tar ends as a whole one does, in a zero block at ``offset`` (where tarfile stopped reading
    headers); tarfile ends a tar cut at or inside a header silently."""
    with open(path, "rb") as file:
        file.seek(offset)
        return file.read(tarfile.BLOCKSIZE) == bytes(tarfile.BLOCKSIZE)


def _json_meta(archive: tarfile.TarFile, member: tarfile.TarInfo | None) -> dict[str, Any]:
    if member is None or member.size > MAX_JSON_BYTES:
        return {}
    try:
        value = parse_json(archive.extractfile(member).read())
    except (ValueError, OSError, tarfile.TarError):
        return {}
    return value if isinstance(value, dict) else {}


def records_from_tar(path: Path, cuts: dict[str, str]) -> list[SampleRecord]:
    """The samples of a tar from its member headers, with status, size and uid from each small ``.json`` member
    (a sample without one counts as a success of unknown size); a cut tar's in ``cuts`` (:func:`tar_groups`)."""
    records = []
    for key, members, archive in tar_groups(path, cuts):
        meta = _json_meta(archive, members.get("json"))
        status = meta.get("status", SUCCESS)
        status = status if isinstance(status, str) else str(status)
        records.append(_record(key, status, meta, f"{path}: sample {key}'s json"))
    return records


def tar_keys(path: Path, cuts: dict[str, str]) -> list[str]:
    """The sample keys of a tar from its member headers, in order (a cut tar: the keys before the cut, and the cut in
    ``cuts``; the reader counts the samples after it as lost against the parquet's count)."""
    return [key for key, _, _ in tar_groups(path, cuts)]


def parquet_shard(tar: Path, parquet: Path, cuts: dict[str, str]) -> list[tuple[SampleRecord, bool]]:
    """(record, in the tar) for a shard with a parquet: the tar's samples in its order, each as its parquet row
    describes it (a success row first), then the rows whose key the tar lacks (a success there is a lost sample).
    A tar sample the parquet does not list is a ConversionError: the parquet describes another tar."""
    rows = records_from_parquet(parquet)
    described: dict[str, SampleRecord] = {}
    for record in rows:
        if record.key not in described or (record.in_tar and not described[record.key].in_tar):
            described[record.key] = record
    keys = tar_keys(tar, cuts)
    in_tar = set(keys)
    unlisted = [key for key in keys if key not in described]
    if unlisted:
        count, remedy = (
            f"{len(unlisted)} of the tar's {len(keys)} samples",
            f"remove {parquet.name} to index the tar alone",
        )
        raise ConversionError(
            f"{tar}: sample {unlisted[0]!r} is not in {parquet.name} ({count} are not): the parquet "
            f"describes another tar; {remedy}"
        )
    return [(described[key], True) for key in keys] + [(row, row.in_tar) for row in rows if row.key not in in_tar]
