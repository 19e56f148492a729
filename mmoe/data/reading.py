"""Shards read as raw samples (:func:`read_shards`), each carrying the samples skipped in reading just before it
(:class:`Read`), so a stream counts a left-out or lost sample when it uses the sample read after it, not when a shuffle
buffer reads past it (:class:`mmoe.data.accounting.SkipLedger`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import NamedTuple

from mmoe.data.accounting import SkipCount, SkipLedger, UnusableStreamError
from mmoe.data.redact import redact
from mmoe.data.remote import RemoteReading, tar_samples
from mmoe.data.samples import Sample


class Read(NamedTuple):
    """A raw ``sample`` as read, carrying the samples ``skipped`` in reading just before it (:meth:`SkipLedger.claim`),
    so they are counted when it is used, wherever a shuffle buffer moves it."""

    sample: Sample
    skipped: SkipCount | None


def read_shards(
    shards: Iterable[dict[str, str]],
    ledger: SkipLedger,
    expected: dict[str, int] | None,
    shards_per_pass: int,
    repeat: bool,
    excluded: dict[str, dict[str, str]] | None = None,
    reading: RemoteReading | None = None,
) -> Iterator[Sample]:
    """Raw samples of each shard in turn (webdataset groups tar members by key).

    A shard that gives fewer samples than ``expected[url]`` (its manifest's count) lost the difference; without a
    manifest count each read error counts as one lost sample (a lower bound). ``expected=None`` reports no loss. The
    samples ``excluded[url]`` names (key -> cause), and a key read a second time in one shard, are left out without
    decoding and counted by cause (unless ``expected`` is None). Each count waits in ``ledger`` for the next sample. A
    repeating stream whose shards give no sample in a whole pass stops with :class:`UnusableStreamError`. Remote
    shards are read as ``reading`` says (:mod:`mmoe.data.remote`: bounded retries), and counted the same way.
    """
    empty_in_a_row = 0
    for shard in shards:
        url = shard["url"]
        errors: list[str] = []

        def on_error(error: Exception, errors: list[str] = errors) -> bool:
            errors.append(f"{type(error).__name__}: {error.args[0] if error.args else error}")
            return True

        read = kept = 0
        left_out, seen = (excluded or {}).get(url, {}), set()
        for sample in tar_samples(url, on_error, reading or RemoteReading()):
            read += 1
            key = sample.get("__key__")
            cause = left_out.get(key) or ("duplicate_key" if key in seen else None)
            seen.add(key)
            if cause:
                if expected is not None:
                    ledger.left_out(url, key, cause)
                continue
            kept += 1
            yield sample
        if expected is not None:
            count = expected.get(url)
            if count is not None and read < count:
                first = f" (first error: {errors[0]})" if errors else ""
                ledger.lost(url, count - read, f"read {read} of the {count} samples its manifest lists{first}")
            elif count is None and errors:
                ledger.lost(url, len(errors), f"{len(errors)} read errors, no manifest count (first: {errors[0]})")
        empty_in_a_row = 0 if kept else empty_in_a_row + 1
        if repeat and empty_in_a_row >= shards_per_pass:
            raise UnusableStreamError(
                f"{ledger.stream or 'data'}: a whole pass over the shards gave no sample (e.g. {redact(url)}"
                f"{': ' + redact(errors[0], url) if errors else ''})"
            )


def carrying_skips(samples: Iterable[Sample], ledger: SkipLedger) -> Iterator[Read]:
    """Each sample with the skips ``ledger`` noted in reading since the previous one."""
    for sample in samples:
        yield Read(sample, ledger.claim())


def split_reads(reads: Iterable[Read], index: int, count: int, ledger: SkipLedger) -> Iterator[Read]:
    """Every ``count``-th read from ``index``: one consumer's share of shards every consumer reads, each consumer
    counting the skips its own samples carry (and those after the last sample when the next one would be its own)."""
    position = 0
    for position, read in enumerate(reads, start=1):
        if (position - 1) % count == index:
            yield read
    if position % count != index:
        ledger.claim()  # another consumer's to count
