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

A tar cut short (a download cut off, or one img2dataset is still writing) is indexed up to the cut, named on stderr
and listed in the manifest's ``cut_shards``; an index that keeps no sample is a ConversionError, as an empty
conversion is.

``shard_samples`` counts the samples in each tar, left-out ones included, so a reader counts a truncated shard's
losses against it; the stream skips the left-out samples without decoding them and reports them by cause
(:func:`mmoe.data.shards.excluded_samples`, :mod:`mmoe.data.accounting`).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from mmoe.atomic import write_json_atomic
from mmoe.data.converters.common import ConversionError
from mmoe.data.img2dataset_records import SUCCESS, SampleRecord, parquet_shard, records_from_tar
from mmoe.data.shards import INDEX_FORMAT, MANIFEST, check_shard_name, read_manifest, shard_stats
from mmoe.io import parse_json

#: Default smallest image side kept (pixels).
DEFAULT_MIN_SIDE = 64
CAUSES = ("status", "duplicate_key", "duplicate_uid", "too_small")


class Exclusions:
    """Which samples a run leaves out, decided in shard order: the first kept sample of a key or uid claims it (one
    left out, a failed download above all, claims nothing, so a later sample with its key or uid may be kept)."""

    def __init__(self, min_side: int) -> None:
        self.min_side = min_side
        self.keys: set[str] = set()
        self.uids: set[str] = set()
        self.counts: Counter[str] = Counter()
        self.statuses: Counter[str] = Counter()
        self.kept = 0
        #: The fields each ``min_side`` check read the sides from ("unknown": none given, the sample is kept).
        self.sides_read_from: Counter[str] = Counter()
        #: The parquet's rows of samples the tars never held (failed downloads and resizes), by status.
        self.not_in_tars: Counter[str] = Counter()

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
            self.kept += 1
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


def check_replaceable_index(folder: Path, index_format: str = INDEX_FORMAT, what: str = "an img2dataset index") -> None:
    """An index may write ``folder``'s manifest: there is none, or it is an index of ``index_format`` (``what``)."""
    path = folder / MANIFEST
    if not path.exists():
        return
    try:
        existing = parse_json(path.read_text())
    except (ValueError, OSError):
        existing = None
    if not isinstance(existing, dict) or existing.get("format") != index_format:
        raise ConversionError(f"{path}: exists and is not {what}; it is left as it is")


def _index_shard(tar: Path, exclusions: Exclusions, cuts: dict[str, str]) -> tuple[str, int, dict[str, str]]:
    """Where ``tar``'s samples were counted from (``parquet`` or ``tar``), how many the tar holds, and which of them
    a run leaves out (key -> cause); ``exclusions`` counts them and the failed rows."""
    parquet = tar.with_suffix(".parquet")
    from_parquet = parquet.is_file() and not parquet.is_symlink()
    records = parquet_shard(tar, parquet, cuts) if from_parquet else [(r, True) for r in records_from_tar(tar, cuts)]
    left_out: dict[str, str] = {}
    in_shard: set[str] = set()
    for record, in_this_tar in records:
        cause = exclusions.cause(record, repeated_in_shard=in_this_tar and record.key in in_shard)
        exclusions.not_in_tars[record.status] += not in_this_tar
        # A key read twice in one shard: the reader drops the repeat itself (the first is kept).
        if in_this_tar and cause and record.key not in in_shard:
            left_out[record.key] = cause
        if in_this_tar:
            in_shard.add(record.key)
    return ("parquet" if from_parquet else "tar"), sum(in_tar for _, in_tar in records), left_out


def index_folder(folder: str | os.PathLike, min_side: int = DEFAULT_MIN_SIDE) -> dict[str, Any]:
    """Indexes an img2dataset shard folder and writes its ``manifest.json`` (whole or absent); returns it. A folder
    where no sample is kept is a ConversionError (nothing is written); tars cut short are named on stderr."""
    folder = Path(folder)
    tars = shard_tars(folder)
    check_replaceable_index(folder)
    exclusions = Exclusions(min_side)
    shard_samples: list[int] = []
    excluded: dict[str, dict[str, str]] = {}
    counted_from: dict[str, str] = {}
    cuts: dict[str, str] = {}
    for tar in tars:
        counted_from[tar.name], in_tar, left_out = _index_shard(tar, exclusions, cuts)
        shard_samples.append(in_tar)
        if left_out:
            excluded[tar.name] = left_out
    if exclusions.kept == 0:
        raise ConversionError(_nothing_kept(folder, exclusions, min_side, cuts))
    if cuts:
        print(_cut_line(folder, cuts), file=sys.stderr)
    name = folder.resolve().name
    manifest = {
        "name": name if _valid_name(name) else "img2dataset",
        "format": INDEX_FORMAT,
        "samples": exclusions.kept,
        "skipped": sum(exclusions.counts.values()),
        "shards": len(tars),
        "shard_files": [tar.name for tar in tars],
        "shard_samples": shard_samples,
        "skipped_by_cause": {cause: exclusions.counts[cause] for cause in CAUSES},
        "statuses": dict(sorted(exclusions.statuses.items())),
        "not_in_tars": {status: n for status, n in sorted(exclusions.not_in_tars.items()) if n},
        "min_side": min_side,
        "sides_read_from": dict(sorted(exclusions.sides_read_from.items())),
        "counted_from": counted_from,
        "cut_shards": cuts,
        "shard_stats": shard_stats(folder, [tar.name for tar in tars]),
        "excluded": excluded,
    }
    write_json_atomic(folder / MANIFEST, manifest)
    return manifest


def _nothing_kept(folder: Path, exclusions: Exclusions, min_side: int, cuts: dict[str, str]) -> str:
    """The error of an index that keeps no sample: why each was left out (or that the tars hold none)."""
    causes = ", ".join(f"{count} {cause}" for cause, count in sorted(exclusions.counts.items()) if count)
    why = f"every sample is left out ({causes}; --min-side {min_side})" if causes else "the tars hold no sample"
    more = f" and {len(cuts) - 1} more" if len(cuts) > 1 else ""
    cut = f"; {next(iter(cuts))}{more} cut short" if cuts else ""
    return f"{folder}: {why}{cut}. Nothing was written"


def _cut_line(folder: Path, cuts: dict[str, str]) -> str:
    """One line naming the tars cut short, whose samples before the cut were indexed."""
    first, where = next(iter(cuts.items()))
    more = f" and {len(cuts) - 1} more (manifest.json's cut_shards)" if len(cuts) > 1 else ""
    return (
        f"{folder}: {first} is {where}{more}; the samples before the cut are indexed. A truncated download loses "
        "the rest; if img2dataset is still writing the folder, index it again when it has finished"
    )


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
