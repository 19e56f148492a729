"""img2dataset / DataComp shard folders as they are: ``mmoe data index DIR`` writes the manifest mmoe's readers use.

img2dataset (``--output_format webdataset``) writes ``00000.tar``, ``00001.tar``, ... with ``<key>.jpg|webp|png``,
``<key>.txt`` (the caption) and ``<key>.json`` per sample, and beside each tar ``00000.parquet``: one row per
attempted sample, failed downloads included (only successful ones are in the tar). DataComp adds a ``uid`` per sample.

The index counts each shard's samples from its parquet (the rows whose ``status`` is ``success``) or, without one,
from the tar's member headers (plus the small ``.json`` members, for status, size and uid); image bytes are never read.
With a parquet the tar's headers are read too: a tar sample the parquet does not list is refused (the parquet is of
another tar), and each tar sample is decided as its parquet row says. ``shard_stats`` records each tar's size and
modification time: :func:`mmoe.data.shards.manifest_shards` refuses a folder whose tars changed since.
It decides which samples a run leaves out, in shard order, and records them in the manifest by cause:

* ``status``: the sample's ``status`` is not ``success`` (a failed row of the parquet is never in the tar: it is
  counted in the manifest only; a tar sample with another status is left out when read);
* ``duplicate_key`` / ``duplicate_uid``: a key or DataComp ``uid`` an earlier kept sample already has (the first kept
  one claims it: a failed download or a left-out sample claims nothing);
* ``too_small``: the image's smaller side below ``min_side``: ``original_width`` / ``original_height`` where the
  json / parquet gives both (img2dataset's ``width`` / ``height`` are the sizes after its ``--image_size`` resize, so
  a 25-px original resized to 64 px would pass), else ``width`` / ``height``; ``sides_read_from`` counts which.

``shard_samples`` counts the samples in each tar, left-out ones included, so a reader counts a truncated shard's
losses against it; the stream skips the left-out samples without decoding them and reports them by cause
(:func:`mmoe.data.shards.excluded_samples`, :mod:`mmoe.data.accounting`).
"""

from __future__ import annotations

import json
import os
import re
import tarfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmoe.atomic import write_json_atomic
from mmoe.data.converters.common import ConversionError
from mmoe.data.shards import INDEX_FORMAT, MANIFEST, check_shard_name, read_manifest, shard_stats

SUCCESS = "success"
#: Default smallest image side kept (pixels).
DEFAULT_MIN_SIDE = 64
#: A ``.json`` member larger than this is not read (its sample keeps what the parquet or nothing says).
MAX_JSON_BYTES = 1 << 20
#: webdataset's rule: a member's sample key is its path up to the first dot of its file name.
_MEMBER = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")
CAUSES = ("status", "duplicate_key", "duplicate_uid", "too_small")
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

    try:
        columns = set(pq.read_schema(path).names)
        read = ("key", "status", *(field for fields in SIDE_FIELDS for field in fields), "uid")
        wanted = [name for name in read if name in columns]
        table = pq.read_table(path, columns=wanted)  # DataComp's metadata has many more columns: not read
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


def _tar_groups(path: Path) -> Iterator[tuple[str, dict[str, tarfile.TarInfo], tarfile.TarFile]]:
    """(key, extension -> member) per sample, grouped as webdataset groups consecutive members."""
    try:
        archive = tarfile.open(path, "r:")
    except (tarfile.TarError, OSError) as error:
        raise ConversionError(f"{path}: not a readable tar file ({error})") from None
    with archive:
        key, members = None, {}
        for member in archive:
            match = _MEMBER.match(member.name) if member.isfile() else None
            if match is None:
                continue
            if match.group(1) != key and members:
                yield key, members, archive
                members = {}
            key = match.group(1)
            members[match.group(2)] = member
        if members:
            yield key, members, archive


def _json_meta(archive: tarfile.TarFile, member: tarfile.TarInfo | None) -> dict[str, Any]:
    if member is None or member.size > MAX_JSON_BYTES:
        return {}
    try:
        value = json.loads(archive.extractfile(member).read())
    except (ValueError, OSError, tarfile.TarError):
        return {}
    return value if isinstance(value, dict) else {}


def records_from_tar(path: Path) -> list[SampleRecord]:
    """The samples of a tar from its member headers, with status, size and uid from each small ``.json`` member
    (a sample without one counts as a success of unknown size)."""
    records = []
    for key, members, archive in _tar_groups(path):
        meta = _json_meta(archive, members.get("json"))
        status = meta.get("status", SUCCESS)
        status = status if isinstance(status, str) else str(status)
        records.append(_record(key, status, meta, f"{path}: sample {key}'s json"))
    return records


def tar_keys(path: Path) -> list[str]:
    """The sample keys of a tar from its member headers, in order (a cut tar: the keys before the cut)."""
    keys = []
    try:
        for key, _, _ in _tar_groups(path):
            keys.append(key)
    except tarfile.ReadError:
        pass  # the samples after the cut are lost: the reader counts them against the parquet's count
    return keys


def parquet_shard(tar: Path, parquet: Path) -> list[tuple[SampleRecord, bool]]:
    """(record, in the tar) for a shard with a parquet: the tar's samples in its order, each as its parquet row
    describes it (a success row first), then the rows whose key the tar lacks (a success there is a lost sample).
    A tar sample the parquet does not list is a ConversionError: the parquet describes another tar."""
    rows = records_from_parquet(parquet)
    described: dict[str, SampleRecord] = {}
    for record in rows:
        if record.key not in described or (record.in_tar and not described[record.key].in_tar):
            described[record.key] = record
    keys = tar_keys(tar)
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


class Exclusions:
    """Which samples a run leaves out, decided in shard order: the first kept sample of a key or uid claims it (one
    left out, a failed download above all, claims nothing, so a later sample with its key or uid may be kept)."""

    def __init__(self, min_side: int) -> None:
        self.min_side = min_side
        self.keys: set[str] = set()
        self.uids: set[str] = set()
        self.counts: Counter[str] = Counter()
        self.statuses: Counter[str] = Counter()
        #: The fields each ``min_side`` check read the sides from ("unknown": none given, the sample is kept).
        self.sides_read_from: Counter[str] = Counter()

    def cause(self, record: SampleRecord, repeated_in_shard: bool = False) -> str | None:
        """Why ``record`` is left out (one of :data:`CAUSES`), or None; counts it. ``repeated_in_shard``: its shard
        already holds its key (the reader keeps only a key's first sample in a shard, left out or not)."""
        cause = None
        if record.status != SUCCESS:
            cause = "status"
            self.statuses[record.status] += 1
        elif repeated_in_shard or record.key in self.keys:
            cause = "duplicate_key"
        elif record.uid is not None and record.uid in self.uids:
            cause = "duplicate_uid"
        elif self._too_small(record):
            cause = "too_small"
        if cause:
            self.counts[cause] += 1
        else:
            self.keys.add(record.key)
            if record.uid is not None:
                self.uids.add(record.uid)
        return cause

    def _too_small(self, record: SampleRecord) -> bool:
        """Whether the image's smaller side is below ``min_side`` (an unknown size is kept)."""
        self.sides_read_from[record.sides_from or "unknown"] += 1
        if record.width is None or record.height is None:
            return False
        return min(record.width, record.height) < self.min_side


def shard_tars(folder: Path) -> list[Path]:
    """The folder's ``*.tar`` files in name order; a tar that is a symbolic link is refused (never followed)."""
    if not folder.is_dir():
        raise ConversionError(f"{folder}: not a folder")
    tars = sorted(path for path in folder.iterdir() if path.name.endswith(".tar"))
    for path in tars:
        if path.is_symlink() or not path.is_file():
            raise ConversionError(f"{path}: a shard must be a regular file in {folder} (links are not followed)")
    if not tars:
        raise ConversionError(f"{folder}: no .tar shards (img2dataset's webdataset output: 00000.tar, ...)")
    return tars


def _check_replaceable(folder: Path) -> None:
    path = folder / MANIFEST
    if not path.exists():
        return
    try:
        existing = json.loads(path.read_text())
    except (ValueError, OSError):
        existing = None
    if not isinstance(existing, dict) or existing.get("format") != INDEX_FORMAT:
        raise ConversionError(f"{path}: exists and is not an img2dataset index; it is left as it is")


def index_folder(folder: str | os.PathLike, min_side: int = DEFAULT_MIN_SIDE) -> dict[str, Any]:
    """Indexes an img2dataset shard folder and writes its ``manifest.json`` (whole or absent); returns it."""
    folder = Path(folder)
    tars = shard_tars(folder)
    _check_replaceable(folder)
    exclusions = Exclusions(min_side)
    shard_samples: list[int] = []
    excluded: dict[str, dict[str, str]] = {}
    counted_from: dict[str, str] = {}
    kept = 0
    not_in_tars: Counter[str] = Counter()  # the parquet's rows of samples the tars never held: failed downloads
    for tar in tars:
        parquet = tar.with_suffix(".parquet")
        from_parquet = parquet.is_file() and not parquet.is_symlink()
        records = parquet_shard(tar, parquet) if from_parquet else [(r, True) for r in records_from_tar(tar)]
        counted_from[tar.name] = "parquet" if from_parquet else "tar"
        left_out: dict[str, str] = {}
        in_shard: set[str] = set()
        in_tar = 0
        for record, in_this_tar in records:
            cause = exclusions.cause(record, repeated_in_shard=in_this_tar and record.key in in_shard)
            not_in_tars[record.status] += not in_this_tar
            if in_this_tar:
                # A key read twice in one shard: the reader drops the repeat itself (the first is kept).
                if cause and record.key not in in_shard:
                    left_out[record.key] = cause
                kept += not cause
                in_shard.add(record.key)
                in_tar += 1
        shard_samples.append(in_tar)
        if left_out:
            excluded[tar.name] = left_out
    name = folder.resolve().name
    manifest = {
        "name": name if _valid_name(name) else "img2dataset",
        "format": INDEX_FORMAT,
        "samples": kept,
        "skipped": sum(exclusions.counts.values()),
        "shards": len(tars),
        "shard_files": [tar.name for tar in tars],
        "shard_samples": shard_samples,
        "skipped_by_cause": {cause: exclusions.counts[cause] for cause in CAUSES},
        "statuses": dict(sorted(exclusions.statuses.items())),
        "not_in_tars": {status: n for status, n in sorted(not_in_tars.items()) if n},
        "min_side": min_side,
        "sides_read_from": dict(sorted(exclusions.sides_read_from.items())),
        "counted_from": counted_from,
        "shard_stats": shard_stats(folder, [tar.name for tar in tars]),
        "excluded": excluded,
    }
    write_json_atomic(folder / MANIFEST, manifest)
    return manifest


def not_downloaded(folder: str) -> str | None:
    """One line on the samples img2dataset tried and did not store in a local indexed ``folder`` (its manifest's
    ``not_in_tars``: the parquet's failed downloads and resizes), which a run over it never meets, so its skip report
    never counts them; None for a folder that is not an index (or one indexed before ``not_in_tars``) or lost
    nothing. A tar sample with a failed status is not among them: a run reads it and counts it as left out."""
    if not os.path.isfile(os.path.join(folder, MANIFEST)):
        return None
    manifest = read_manifest(folder)
    statuses = manifest.get("not_in_tars")
    if manifest.get("format") != INDEX_FORMAT or not isinstance(statuses, dict):
        return None
    counts = {status: n for status, n in statuses.items() if isinstance(n, int) and n > 0}
    failed, tried = sum(counts.values()), manifest["samples"] + manifest["skipped"]
    if not failed:
        return None
    listed = ", ".join(f"{n} {status}" for status, n in counts.items())
    return (
        f"mmoe: {folder}: {failed} of the {tried} samples img2dataset tried ({100 * failed / max(tried, 1):.1f}%) "
        f"are not in its tars ({listed}; {MANIFEST}'s not_in_tars): this run never reads them, and its skip report "
        "does not count them"
    )


def _valid_name(name: str) -> bool:
    try:
        check_shard_name(name)
    except ValueError:
        return False
    return True
