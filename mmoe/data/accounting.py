"""Accounting of the samples a stream could not use, and the records that carry the counts out of DataLoader workers.

A sample that cannot be used is *corrupt* (its bytes do not decode: bad image, missing entry, bad JSON) or *lost* (a
shard holds fewer samples than its manifest's ``shard_samples`` says, e.g. a truncated tar loses every sample after
the cut). Both are logged with the shard and counted (:class:`SkipLedger`) when the stream uses the sample read after
them, not when a shuffle buffer reads past them; the counts travel with the batches (:class:`Delivery`), so
:class:`mmoe.data.loader.EpochDataLoader` in the main process sees what its workers skipped, counts only what the
training loop consumed (not what workers prefetched), and keeps the totals across a resume. A stream that skips
:data:`MAX_SKIPS_IN_A_ROW` samples in a row, or a repeating stream whose shards hold no sample at all, stops with
:class:`UnusableStreamError` naming its shards instead of looping forever.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from mmoe.data.redact import redact
from mmoe.data.samples import CorruptSampleError

logger = logging.getLogger("mmoe.data")

#: A stream that skips this many samples in a row, without one usable sample between them, stops with an error.
MAX_SKIPS_IN_A_ROW = 1000
#: How many shard names a skip count keeps for the report.
SHOWN_SHARDS = 5
#: The position of a consumer whose stream has ended (its last :class:`Delivery`).
END = "end"


class UnusableStreamError(ValueError):
    """A stream that gives no usable sample: its shards do not hold what its decoder reads, or hold nothing."""

    @classmethod
    def from_worker(cls, error: UnusableStreamError) -> UnusableStreamError:
        """The error a DataLoader worker raised, with its own message: the DataLoader re-raises it in the main
        process with the worker's traceback as the message, which ends ``<module>.UnusableStreamError: <message>``."""
        prefix = f"{cls.__module__}.{cls.__qualname__}: "
        lines = [line for line in str(error).splitlines() if line.startswith(prefix)]
        return cls(lines[-1].removeprefix(prefix)) if lines else error


@dataclass
class SkipCount:
    """Samples a stream could not use: ``corrupt`` (undecodable), ``lost`` (missing from truncated or unreadable
    shards), ``left_out`` (cause -> samples its shards' index leaves out: :mod:`mmoe.data.img2dataset`) and the first
    few ``shards`` they came from."""

    corrupt: int = 0
    lost: int = 0
    shards: list[str] = field(default_factory=list)
    left_out: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.corrupt + self.lost + sum(self.left_out.values())

    def note_shard(self, shard: str) -> None:
        shard = redact(shard)  # kept in checkpoints: no credentials
        if shard not in self.shards and len(self.shards) < SHOWN_SHARDS:
            self.shards.append(shard)

    def add(self, other: SkipCount) -> None:
        self.corrupt += other.corrupt
        self.lost += other.lost
        for cause, count in other.left_out.items():
            self.left_out[cause] = self.left_out.get(cause, 0) + count
        for shard in other.shards:
            self.note_shard(shard)

    def to_state(self) -> dict[str, Any]:
        state = {"corrupt": self.corrupt, "lost": self.lost, "shards": list(self.shards)}
        return state | ({"left_out": dict(self.left_out)} if self.left_out else {})

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> SkipCount:
        left_out = {str(cause): int(count) for cause, count in state.get("left_out", {}).items()}
        return cls(int(state["corrupt"]), int(state["lost"]), [str(shard) for shard in state["shards"]], left_out)


def add_skips(totals: dict[str, SkipCount], skipped: dict[str, SkipCount] | None) -> None:
    """Adds the per-stream counts ``skipped`` into ``totals``."""
    for stream, count in (skipped or {}).items():
        totals.setdefault(stream, SkipCount()).add(count)


def describe_skips(totals: dict[str, SkipCount]) -> str:
    """One line: ``"train/pair: 12 skipped (3 corrupt, 9 lost; from a.tar, b.tar)"`` per stream, or ``"none"``; a
    stream with left-out samples adds them by cause (``"..., 4 left out: 3 too_small, 1 duplicate_uid; from ..."``)."""
    parts = []
    for stream, count in sorted(totals.items()):
        if not count.total:
            continue
        left_out = ", ".join(f"{n} {cause}" for cause, n in sorted(count.left_out.items()) if n)
        left_out = f", {sum(count.left_out.values())} left out: {left_out}" if left_out else ""
        counts = f"{count.corrupt} corrupt, {count.lost} lost{left_out}"
        parts.append(f"{stream}: {count.total} skipped ({counts}; from {', '.join(count.shards)})")
    return "; ".join(parts) or "none"


class Delivery(NamedTuple):
    """What a stream yields to its loader: a ``batch``, the ``consumer`` that made it, its ``position`` after the
    batch, and the samples ``skipped`` since the previous delivery, per stream. Every consumer's stream ends with one
    delivery without a batch, at position :data:`END`.

    A named tuple, so the DataLoader's conversion and memory pinning reach the batch inside it.
    """

    batch: Any
    consumer: str
    position: Any
    skipped: dict[str, SkipCount] | None


class SkipLedger:
    """One consumer's record of skipped samples while it reads; :meth:`take` hands the counts since the last take to
    the next delivery.

    Samples skipped while the shards are read (left out, lost) are counted only once the stream gets as far as them
    in what it consumes, not when a shuffle buffer reads past them: they wait as *unclaimed* until the next kept sample
    is read, which takes them (:meth:`claim`) and carries them through the shuffle buffer; :meth:`consumed` counts
    them when that sample is used (its first item batched). Corrupt samples are found when used and counted then.

    Events at shuffled-sample ordinals below ``quiet_below`` are the re-reading of a resumed stream: they were counted
    before the interruption and are only logged at debug level now. Without ``warns_of_losses`` losses are logged at
    debug level too (a consumer reading the same shards as another, which warns).
    """

    def __init__(self, stream: str, shards: Sequence[str], quiet_below: int = 0, warns_of_losses: bool = True) -> None:
        self.stream, self.shards, self.quiet_below = stream, shards, quiet_below
        self.warns_of_losses = warns_of_losses
        self.ordinal = 0
        self.pending = SkipCount()
        self.unclaimed = SkipCount()
        self.in_a_row = 0
        self.last_reason = ""

    @property
    def quiet(self) -> bool:
        return self.ordinal < self.quiet_below

    def corrupt(self, error: CorruptSampleError) -> None:
        self._log(f"skipped a corrupt sample{self._label}: shard {error.shard}, key {error.key!r}: {error.reason}")
        self.in_a_row += 1
        self.last_reason = redact(f"{error.shard}, key {error.key!r}: {error.reason}")
        if not self.quiet:
            self.pending.corrupt += 1
            self.pending.note_shard(error.shard)
        if self.in_a_row >= MAX_SKIPS_IN_A_ROW:
            raise UnusableStreamError(
                redact(
                    f"{self.stream or 'data'}: {self.in_a_row} samples in a row could not be used (last: "
                    f"{self.last_reason}); check that the shards {', '.join(self.shards[:SHOWN_SHARDS])}"
                    f"{' ...' if len(self.shards) > SHOWN_SHARDS else ''} hold what this stream reads"
                )
            )

    def lost(self, shard: str, count: int, why: str) -> None:
        message = redact(f"lost {count} samples{self._label}: shard {shard}: {why}")
        logger.log(logging.WARNING if self.warns_of_losses and not self.quiet else logging.DEBUG, "%s", message)
        self.unclaimed.lost += count
        self.unclaimed.note_shard(shard)

    def left_out(self, shard: str, key: str, cause: str) -> None:
        """A sample the shards' index leaves out (``cause``: :data:`mmoe.data.img2dataset.CAUSES`), not decoded."""
        logger.debug("left out a sample%s: shard %s, key %r: %s", self._label, redact(shard), key, cause)
        self.unclaimed.left_out[cause] = self.unclaimed.left_out.get(cause, 0) + 1
        self.unclaimed.note_shard(shard)

    def claim(self) -> SkipCount | None:
        """The samples skipped in reading since the last claim, for the sample read now to carry."""
        if not self.unclaimed.total:
            return None
        claimed, self.unclaimed = self.unclaimed, SkipCount()
        return claimed

    def consumed(self, carried: SkipCount | None) -> None:
        """Counts the skips a sample carried (:meth:`claim`) as it is used: not again for a resumed stream's
        re-reading (below ``quiet_below``)."""
        if carried is not None and not self.quiet:
            self.pending.add(carried)

    def used(self) -> None:
        self.in_a_row = 0

    def take(self) -> dict[str, SkipCount] | None:
        if not self.pending.total:
            return None
        pending, self.pending = self.pending, SkipCount()
        return {self.stream: pending}

    @property
    def _label(self) -> str:
        return f" [{self.stream}]" if self.stream else ""

    def _log(self, message: str) -> None:
        logger.log(logging.DEBUG if self.quiet else logging.WARNING, "%s", redact(message))
