"""Reading webdataset shards: a pipeline of stages (shards -> split by node and worker -> tar members -> samples ->
shuffle -> decode -> batch), the accounting of samples that could not be used, exact resumption, and a mixture of
streams for pre-training.

Splitting: every consumer (DataLoader worker of every process) reads a disjoint part. With at least as many shards as
consumers the shards are dealt out (``split="shard"``); with fewer, every consumer reads all shards and keeps every
n-th sample (``split="sample"``); ``"auto"`` picks. Shard order is shuffled identically on every consumer (seed and
epoch only), so the parts stay disjoint and together complete.

Randomness is a function of the position, never of what ran before: the shard order draws from (seed, epoch), the
shuffle buffer from (seed, epoch, consumer), a sample's random image transform from its ordinal in the consumer's
shuffled stream, a batch's masks from the batch's ordinal and a mixture's choice of stream from the step. So a stream
can restart at any position: it re-reads the shards up to it without decoding (cheap) and continues with the batches
the uninterrupted stream would have given.

Accounting: a sample that cannot be used is *corrupt* (its bytes do not decode: bad image, missing entry, bad JSON)
or *lost* (a shard holds fewer samples than its manifest's ``shard_samples`` says, e.g. a truncated tar loses every
sample after the cut). Both are logged with the shard and counted; the counts travel with the batches
(:class:`Delivery`), so :class:`EpochDataLoader` in the main process sees what its workers skipped, counts only what
the training loop consumed, and keeps the totals across a resume. A stream that skips :data:`MAX_SKIPS_IN_A_ROW`
samples in a row, or a repeating stream whose shards hold no sample at all, stops with :class:`UnusableStreamError`
naming its shards instead of looping forever.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset

from mmoe.data.decoders import ImageDecoder
from mmoe.data.samples import Collator, CorruptSampleError, Decoder, Sample
from mmoe.data.shards import expected_samples, resolve_shards
from mmoe.data.transforms import eval_transform

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


@dataclass(frozen=True)
class Consumer:
    """Who reads: ``rank`` of ``world_size`` processes, DataLoader ``worker`` of ``num_workers``."""

    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1

    @property
    def index(self) -> int:
        return self.rank * self.num_workers + self.worker

    @property
    def count(self) -> int:
        return self.world_size * self.num_workers

    @property
    def key(self) -> str:
        """``"<rank>/<worker>"``: names this consumer's position in a loader's state."""
        return f"{self.rank}/{self.worker}"

    @classmethod
    def current(cls, rank: int | None = None, world_size: int | None = None) -> Consumer:
        """This process's rank (torch.distributed, or RANK / WORLD_SIZE) and worker, unless given explicitly."""
        auto_rank, auto_world, worker, num_workers = wds.utils.pytorch_worker_info()
        return cls(
            auto_rank if rank is None else rank,
            auto_world if world_size is None else world_size,
            worker,
            num_workers,
        )


class Position(NamedTuple):
    """Where one consumer's stream stands after a batch: ``samples`` shuffled samples used up, the first ``items``
    items of the next one already batched (a caption sample gives one item per caption), ``batches`` batches made."""

    samples: int = 0
    items: int = 0
    batches: int = 0


@dataclass
class SkipCount:
    """Samples a stream could not use: ``corrupt`` (undecodable), ``lost`` (missing from truncated or unreadable
    shards) and the first few ``shards`` they came from."""

    corrupt: int = 0
    lost: int = 0
    shards: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.corrupt + self.lost

    def note_shard(self, shard: str) -> None:
        if shard not in self.shards and len(self.shards) < SHOWN_SHARDS:
            self.shards.append(shard)

    def add(self, other: SkipCount) -> None:
        self.corrupt += other.corrupt
        self.lost += other.lost
        for shard in other.shards:
            self.note_shard(shard)

    def to_state(self) -> dict[str, Any]:
        return {"corrupt": self.corrupt, "lost": self.lost, "shards": list(self.shards)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> SkipCount:
        return cls(int(state["corrupt"]), int(state["lost"]), [str(shard) for shard in state["shards"]])


def add_skips(totals: dict[str, SkipCount], skipped: dict[str, SkipCount] | None) -> None:
    """Adds the per-stream counts ``skipped`` into ``totals``."""
    for stream, count in (skipped or {}).items():
        totals.setdefault(stream, SkipCount()).add(count)


def describe_skips(totals: dict[str, SkipCount]) -> str:
    """One line: ``"train/pair: 12 skipped (3 corrupt, 9 lost; from a.tar, b.tar)"`` per stream, or ``"none"``."""
    parts = [
        f"{stream}: {count.total} skipped ({count.corrupt} corrupt, {count.lost} lost; from {', '.join(count.shards)})"
        for stream, count in sorted(totals.items())
        if count.total
    ]
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

    Events at shuffled-sample ordinals below ``quiet_below`` are the re-reading of a resumed stream: they were counted
    before the interruption and are only logged at debug level now.
    """

    def __init__(self, stream: str, shards: Sequence[str], quiet_below: int = 0) -> None:
        self.stream, self.shards, self.quiet_below = stream, shards, quiet_below
        self.ordinal = 0
        self.pending = SkipCount()
        self.in_a_row = 0
        self.last_reason = ""

    @property
    def quiet(self) -> bool:
        return self.ordinal < self.quiet_below

    def corrupt(self, error: CorruptSampleError) -> None:
        self._log(f"skipped a corrupt sample{self._label}: shard {error.shard}, key {error.key!r}: {error.reason}")
        self.in_a_row += 1
        self.last_reason = f"{error.shard}, key {error.key!r}: {error.reason}"
        if not self.quiet:
            self.pending.corrupt += 1
            self.pending.note_shard(error.shard)
        if self.in_a_row >= MAX_SKIPS_IN_A_ROW:
            raise UnusableStreamError(
                f"{self.stream or 'data'}: {self.in_a_row} samples in a row could not be used (last: "
                f"{self.last_reason}); check that the shards {', '.join(self.shards[:SHOWN_SHARDS])}"
                f"{' ...' if len(self.shards) > SHOWN_SHARDS else ''} hold what this stream reads"
            )

    def lost(self, shard: str, count: int, why: str) -> None:
        self._log(f"lost {count} samples{self._label}: shard {shard}: {why}")
        if not self.quiet:
            self.pending.lost += count
            self.pending.note_shard(shard)

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
        logger.log(logging.DEBUG if self.quiet else logging.WARNING, "%s", message)


def split_items(items: Iterable[Any], consumer: Consumer) -> Iterator[Any]:
    """Every ``consumer.count``-th item, starting at ``consumer.index``."""
    return itertools.islice(items, consumer.index, None, consumer.count)


def shuffled(items: Iterable[Any], buffer_size: int, rng: np.random.Generator) -> Iterator[Any]:
    """Shuffles a stream through a buffer of ``buffer_size`` items (0 or 1 = unchanged)."""
    if buffer_size <= 1:
        yield from items
        return
    buffer: list[Any] = []
    for item in items:
        if len(buffer) < buffer_size:
            buffer.append(item)
            continue
        index = int(rng.integers(len(buffer)))
        yield buffer[index]
        buffer[index] = item
    order = rng.permutation(len(buffer))
    for index in order:
        yield buffer[index]


def read_shards(
    shards: Iterable[dict[str, str]],
    ledger: SkipLedger,
    expected: dict[str, int] | None,
    shards_per_pass: int,
    repeat: bool,
) -> Iterator[Sample]:
    """Raw samples of each shard in turn (webdataset groups tar members by key).

    A shard that gives fewer samples than ``expected[url]`` (its manifest's count) lost the difference; without a
    manifest count each read error counts as one lost sample (a lower bound). ``expected=None`` reports no loss (an
    other consumer reads the same shards and reports it). A repeating stream whose shards give no sample in a whole
    pass stops with :class:`UnusableStreamError`.
    """
    empty_in_a_row = 0
    for shard in shards:
        url = shard["url"]
        errors: list[str] = []

        def on_error(error: Exception, errors: list[str] = errors) -> bool:
            errors.append(f"{type(error).__name__}: {error.args[0] if error.args else error}")
            return True

        read = 0
        for sample in wds.tarfile_to_samples(handler=on_error)([shard]):
            read += 1
            yield sample
        if expected is not None:
            count = expected.get(url)
            if count is not None and read < count:
                first = f" (first error: {errors[0]})" if errors else ""
                ledger.lost(url, count - read, f"read {read} of the {count} samples its manifest lists{first}")
            elif count is None and errors:
                ledger.lost(url, len(errors), f"{len(errors)} read errors, no manifest count (first: {errors[0]})")
        empty_in_a_row = 0 if read else empty_in_a_row + 1
        if repeat and empty_in_a_row >= shards_per_pass:
            raise UnusableStreamError(
                f"{ledger.stream or 'data'}: a whole pass over the shards gave no sample (e.g. {url}"
                f"{': ' + errors[0] if errors else ''})"
            )


def sample_seed(seed: int, epoch: int, consumer: Consumer, ordinal: int) -> int:
    """Seed of the random image transforms of one sample: its consumer's ``ordinal``-th shuffled sample."""
    return int(np.random.SeedSequence([seed, epoch, consumer.rank, consumer.worker, 4, ordinal]).generate_state(1)[0])


@contextlib.contextmanager
def seeded_cpu_rng(seed: int) -> Iterator[None]:
    """torch's CPU generator seeded with ``seed`` inside the block and put back after it. Not ``torch.manual_seed``
    under ``fork_rng``: that also seeds the accelerators' generators, whose lazy seeding formats a stack trace per call
    (a third of a tiny pre-training loader's time)."""
    state = torch.get_rng_state()
    torch.default_generator.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_rng_state(state)


class ResumableStream(IterableDataset):
    """An iterable dataset that can start at a position (:class:`EpochDataLoader` sets ``start`` from a checkpoint).

    Iterated directly it yields batches (or items) and adds what it skipped in this process to ``skipped``; with
    ``tracked`` (set by :class:`EpochDataLoader`) it yields :class:`Delivery` records, which carry the counts out of
    DataLoader workers.
    """

    def __init__(self) -> None:
        super().__init__()
        self.epoch = 0
        self.tracked = False
        self.start: dict[str, Any] = {}
        self.skipped: dict[str, SkipCount] = {}

    def set_epoch(self, epoch: int) -> None:
        """Shard order, shuffling and masks differ per epoch (reproducibly)."""
        self.epoch = epoch

    def stream_names(self) -> list[str]:
        """The names its skip counts are kept under."""
        raise NotImplementedError

    def process_rank(self) -> int:
        """The rank of the process reading (the first part of its consumers' keys)."""
        raise NotImplementedError

    def deliveries(self, start: Any = None) -> Iterator[Delivery]:
        """This consumer's deliveries, from ``start`` (default: ``self.start`` for this consumer, else the
        beginning)."""
        raise NotImplementedError

    def __iter__(self) -> Iterator[Any]:
        return self.deliveries() if self.tracked else self._batches()

    def _batches(self) -> Iterator[Any]:
        for delivery in self.deliveries():
            add_skips(self.skipped, delivery.skipped)
            if delivery.batch is not None:
                yield delivery.batch


class ShardStream(ResumableStream):
    """Samples or batches read from webdataset shards.

    Args:
        shards: shard paths or URLs.
        decode: sample dict (raw bytes per extension, ``__key__``, ``__url__``) -> item(s); raise
            :class:`CorruptSampleError` for a bad sample, return None to drop one. Random transforms inside it draw
            from torch's generator, which is seeded per sample.
        collate: (items, rng) -> batch; None yields single items.
        batch_size: items per batch (with ``collate``).
        drop_last: drop a last short batch.
        shuffle_buffer: sample shuffle buffer; > 0 also shuffles the shard order every epoch.
        repeat: start over when the shards are exhausted (an endless stream, pre-training).
        seed: seeds shard order, sample shuffling, image transforms and the collate generator (masks).
        split: ``"shard"``, ``"sample"`` or ``"auto"`` (shards when there are enough of them for every consumer).
        name: the stream's name in logs and skip counts (e.g. ``"train/pair"``).
        expected: samples each shard should hold (:func:`mmoe.data.shards.expected_samples`); a shard that gives
            fewer lost the rest. None = read the manifests next to the shards.
        rank: override this process's rank (tests, custom launchers); None = torch.distributed / environment.
        world_size: override the number of processes.
    """

    def __init__(
        self,
        shards: Sequence[str],
        decode: Decoder,
        collate: Collator | None = None,
        batch_size: int = 1,
        drop_last: bool = False,
        shuffle_buffer: int = 0,
        repeat: bool = False,
        seed: int = 0,
        split: Literal["auto", "shard", "sample"] = "auto",
        name: str = "",
        expected: dict[str, int] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        super().__init__()
        if not shards:
            raise ValueError("ShardStream needs at least one shard")
        if split not in ("auto", "shard", "sample"):
            raise ValueError(f"ShardStream.split must be 'auto', 'shard' or 'sample', got {split!r}")
        if batch_size < 1:
            raise ValueError(f"ShardStream.batch_size must be >= 1, got {batch_size!r}")
        self.shards = list(shards)
        self.decode, self.collate = decode, collate
        self.batch_size, self.drop_last = batch_size, drop_last
        self.shuffle_buffer, self.repeat, self.seed, self.split = shuffle_buffer, repeat, seed, split
        self.name = name
        self.expected = expected_samples(self.shards) if expected is None else expected
        self.rank, self.world_size = rank, world_size

    def stream_names(self) -> list[str]:
        return [self.name]

    def _shard_order(self, rng: np.random.Generator) -> Iterator[dict[str, str]]:
        for _ in itertools.count() if self.repeat else range(1):
            order = rng.permutation(len(self.shards)) if self.shuffle_buffer > 0 else range(len(self.shards))
            yield from (dict(url=self.shards[i]) for i in order)

    def process_rank(self) -> int:
        return Consumer.current(self.rank, self.world_size).rank

    def deliveries(self, start: Position | str | None = None) -> Iterator[Delivery]:
        consumer = Consumer.current(self.rank, self.world_size)
        start = start or self.start.get(consumer.key) or Position()
        if start == END:
            yield Delivery(None, consumer.key, END, None)
            return
        start = Position(*start)
        by_shard = self.split == "shard" or (self.split == "auto" and len(self.shards) >= consumer.count)
        # The first shuffled sample not yet (wholly) used: skips before it were counted before the interruption.
        ledger = SkipLedger(self.name, self.shards, quiet_below=start.samples + (start.items > 0))
        order: Iterable = self._shard_order(np.random.default_rng([self.seed, self.epoch]))
        if by_shard:
            order = split_items(order, consumer)
        # With split by sample every consumer reads every shard: the first reports what a shard lost.
        reports = by_shard or consumer.index == 0
        expected = self.expected if reports else None
        samples: Iterable = read_shards(order, ledger, expected, len(self.shards), self.repeat)
        if not by_shard:
            samples = split_items(samples, consumer)
        own_rng = np.random.default_rng([self.seed, self.epoch, consumer.rank, consumer.worker, 1])
        samples = shuffled(samples, self.shuffle_buffer, own_rng)
        items = self._items(samples, consumer, start, ledger)
        if self.collate is None:
            for item, position in items:
                yield Delivery(item, consumer.key, position, ledger.take())
        else:
            yield from self._batched(items, consumer, start.batches, ledger)
        yield Delivery(None, consumer.key, END, ledger.take())

    def _items(
        self, samples: Iterable[Sample], consumer: Consumer, start: Position, ledger: SkipLedger
    ) -> Iterator[tuple[Any, Position]]:
        """(item, position after it) from ``start``: samples before it are read, not decoded."""
        iterator = iter(samples)
        ordinal = 0
        while True:
            ledger.ordinal = ordinal
            try:
                sample = next(iterator)
            except StopIteration:
                return
            if ordinal >= start.samples:
                items = self._decode(sample, sample_seed(self.seed, self.epoch, consumer, ordinal), ledger)
                first = start.items if ordinal == start.samples else 0
                for index in range(first, len(items)):
                    done = index + 1 == len(items)
                    yield items[index], Position(ordinal + 1, 0) if done else Position(ordinal, index + 1)
            ordinal += 1

    def _decode(self, sample: Sample, seed: int, ledger: SkipLedger) -> list[Any]:
        try:
            with seeded_cpu_rng(seed):
                result = self.decode(sample)
        except Exception as error:  # any decoder failure makes the sample unusable; CorruptSampleError says why
            if not isinstance(error, CorruptSampleError):
                error = CorruptSampleError(sample.get("__url__", "?"), sample.get("__key__", "?"), repr(error))
            ledger.corrupt(error)
            return []
        ledger.used()
        if result is None:
            return []
        return result if isinstance(result, list) else [result]

    def _batched(
        self, items: Iterator[tuple[Any, Position]], consumer: Consumer, batches: int, ledger: SkipLedger
    ) -> Iterator[Delivery]:
        while chunk := list(itertools.islice(items, self.batch_size)):
            if len(chunk) < self.batch_size and self.drop_last:
                return
            rng = np.random.default_rng([self.seed, self.epoch, consumer.rank, consumer.worker, 3, batches])
            batch = self.collate([item for item, _ in chunk], rng)
            batches += 1
            yield Delivery(batch, consumer.key, chunk[-1][1]._replace(batches=batches), ledger.take())


class StreamMixture(ResumableStream):
    """Pre-training batches drawn from several batch streams (image / text / pair) with given ratios.

    Every batch comes from one stream (BEiT-3 runs images, texts and pairs as separate forward passes). A stream that
    ends leaves the mixture; the mixture ends when all have ended or after ``batches_per_epoch``. With
    ``joint=True`` every step instead yields one batch of every stream, ``{name: batch}`` (BEiT-3's step over 2048
    images + 2048 texts + 2048 pairs), until one stream ends.

    Args:
        streams: name -> batch stream; each batch gets ``"kind": name``.
        ratios: name -> relative frequency (> 0).
        seed: seeds the choice of streams.
        batches_per_epoch: batches (steps, with ``joint``) per epoch and process, shared out among the DataLoader
            workers; None = until the streams end (never, for repeating streams).
        joint: yield ``{name: batch}`` with one batch of every stream instead of mixing.
    """

    def __init__(
        self,
        streams: dict[str, ShardStream],
        ratios: dict[str, float],
        seed: int = 0,
        batches_per_epoch: int | None = None,
        joint: bool = False,
    ) -> None:
        super().__init__()
        if not streams:
            raise ValueError("StreamMixture needs at least one stream")
        bad = {name: ratios.get(name) for name in streams if not (ratios.get(name) or 0) > 0}
        if bad:
            raise ValueError(f"StreamMixture ratios must be > 0 for every stream, got {bad}")
        self.streams, self.ratios, self.seed = streams, ratios, seed
        self.batches_per_epoch = batches_per_epoch
        self.joint = joint

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        for stream in self.streams.values():
            stream.set_epoch(epoch)

    def stream_names(self) -> list[str]:
        return [name for stream in self.streams.values() for name in stream.stream_names()]

    def process_rank(self) -> int:
        return next(iter(self.streams.values())).process_rank()

    def deliveries(self, start: dict[str, Any] | str | None = None) -> Iterator[Delivery]:
        first = next(iter(self.streams.values()))
        consumer = Consumer.current(first.rank, first.world_size)
        start = start or self.start.get(consumer.key) or {"steps": 0, "streams": {}}
        if start == END:
            yield Delivery(None, consumer.key, END, None)
            return
        limit = math.inf
        if self.batches_per_epoch is not None:
            share, extra = divmod(self.batches_per_epoch, consumer.num_workers)
            limit = share + (consumer.worker < extra)
        positions = {name: Position(*start["streams"].get(name, Position())) for name in self.streams}
        active = {name: stream.deliveries(positions[name]) for name, stream in self.streams.items()}
        skipped: dict[str, SkipCount] = {}
        produced = start["steps"]

        def next_batch(name: str) -> Any:
            for delivery in active[name]:
                add_skips(skipped, delivery.skipped)
                if delivery.batch is not None:
                    positions[name] = delivery.position
                    return {**delivery.batch, "kind": name}
            raise StopIteration

        def deliver(batch: Any) -> Delivery:
            nonlocal skipped
            position = {"steps": produced, "streams": {name: tuple(p) for name, p in positions.items()}}
            delivery = Delivery(batch, consumer.key, position if batch is not None else END, skipped or None)
            skipped = {}
            return delivery

        while produced < limit and active:
            try:
                if self.joint:
                    batch = {name: next_batch(name) for name in active}
                else:
                    names = list(active)
                    weights = np.array([self.ratios[name] for name in names], dtype=np.float64)
                    rng = np.random.default_rng([self.seed, self.epoch, consumer.rank, consumer.worker, 2, produced])
                    name = names[int(rng.choice(len(names), p=weights / weights.sum()))]
                    batch = next_batch(name)
            except StopIteration:
                if self.joint:
                    break
                del active[name]
                continue
            produced += 1
            yield deliver(batch)
        yield deliver(None)


class EpochDataLoader(DataLoader):
    """A DataLoader over a :class:`ResumableStream` that tells it the epoch each time it is iterated, counts the
    samples its streams skipped, and saves and restores its position (``state_dict`` / ``load_state_dict``, which
    Lightning stores in checkpoints and restores on ``--ckpt_path``), so a resumed run gets exactly the batches the
    uninterrupted run would have got, in the same order.

    Batches come from the DataLoader workers in turn (round robin; a worker whose stream ended drops out), as a
    DataLoader delivers them; the loader keeps that order itself, so it can pick it up again at any worker.

    A batch counts as consumed once the next one is asked for, or the stream ends: Lightning's training loop asks for
    the next batch before it runs the current one (it prefetches one to see the end of a loader without a length), so
    at a checkpoint every batch up to the one just trained on is consumed, and the one held back is not.

    Args:
        skipped: the dict to count skipped samples in (see Attributes); a new one by default. Lightning builds a new
            loader from this one's arguments for ``predict``: passing the dict keeps both counting in one place.

    Attributes:
        skipped: stream name -> :class:`SkipCount` of the samples skipped on the way to the batches consumed so far
            (this process; kept across a resume).
    """

    def __init__(self, *args, skipped: dict[str, SkipCount] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._epochs_started = 0
        self.resumable = isinstance(self.dataset, ResumableStream)
        if self.resumable:
            self.dataset.tracked = True
        self.skipped: dict[str, SkipCount] = {} if skipped is None else skipped
        for name in self.dataset.stream_names() if self.resumable else []:
            self.skipped.setdefault(name, SkipCount())
        self._epoch = 0
        self._finished = False
        self._positions: dict[str, Any] = {}
        self._next_worker = 0
        self._held: tuple[Delivery, int] | None = None
        self._restored: dict[str, Any] | None = None

    def __iter__(self):
        start: dict[str, Any] = {}
        next_worker = 0
        if self._restored is not None:
            start, next_worker = self._start_of_restored(self._restored)
            self._restored = None
        epoch = self._epochs_started
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        self._epochs_started += 1
        if not self.resumable:
            return super().__iter__()
        self.dataset.start = start
        self._epoch, self._finished, self._held = epoch, False, None
        self._positions, self._next_worker = dict(start), next_worker
        return self._consume(super().__iter__())

    def _consume(self, deliveries: Iterator[Delivery]) -> Iterator[Any]:
        rank = self.dataset.process_rank()
        workers = list(range(max(1, self.num_workers)))
        active = [w for w in workers if self._positions.get(f"{rank}/{w}") != END]
        turn = active.index(self._next_worker) if self._next_worker in active else 0
        waiting: dict[int, list[Delivery]] = {w: [] for w in workers}
        for delivery in _own_errors(deliveries):
            waiting[int(delivery.consumer.split("/")[1])].append(delivery)
            while active and waiting[active[turn]]:
                worker = active[turn]
                delivery = waiting[worker].pop(0)
                self._commit()
                if delivery.batch is None:  # this worker's stream ended
                    add_skips(self.skipped, delivery.skipped)
                    self._positions[delivery.consumer] = END
                    active.pop(turn)
                    turn = turn % len(active) if active else 0
                    continue
                turn = (turn + 1) % len(active)
                self._held = (delivery, active[turn])
                yield delivery.batch
        self._commit()
        self._finished = True

    def _commit(self) -> None:
        if self._held is not None:
            delivery, self._next_worker = self._held
            self._positions[delivery.consumer] = delivery.position
            add_skips(self.skipped, delivery.skipped)
            self._held = None

    def _layout(self) -> list[int]:
        world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        return [world_size, self.num_workers]

    def state_dict(self) -> dict[str, Any]:
        """The epoch, whether it ended, each consumer's position after its last consumed batch, the worker whose
        batch comes next, and the skip counts (of every process, when distributed: call it on all ranks, as
        Lightning does)."""
        own = {
            "positions": {key: _plain(position) for key, position in self._positions.items()},
            "next_worker": self._next_worker,
            "skipped": {stream: count.to_state() for stream, count in self.skipped.items()},
        }
        parts = [own]
        if torch.distributed.is_initialized():
            parts = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(parts, own)
        return {
            "epoch": self._epoch,
            "finished": self._finished,
            "layout": self._layout(),
            "positions": {key: value for part in parts for key, value in part["positions"].items()},
            "next_worker": {str(rank): part["next_worker"] for rank, part in enumerate(parts)},
            "skipped": {str(rank): part["skipped"] for rank, part in enumerate(parts)},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a :meth:`state_dict`; the next iteration continues from it."""
        self._restored = state

    def _start_of_restored(self, state: dict[str, Any]) -> tuple[dict[str, Any], int]:
        rank = str(self.dataset.process_rank() if self.resumable else 0)
        for stream, count in state.get("skipped", {}).get(rank, {}).items():
            self.skipped[stream] = SkipCount.from_state(count)
        self._epochs_started = int(state["epoch"]) + bool(state["finished"])
        if state["finished"]:
            return {}, 0
        if list(state["layout"]) != self._layout():
            warnings.warn(
                f"the checkpoint's data position was saved with {state['layout'][0]} process(es) x "
                f"{state['layout'][1]} loader worker(s), this run has {self._layout()[0]} x {self._layout()[1]}: "
                f"epoch {state['epoch']} of the training data restarts from its beginning (not an exact resume)",
                stacklevel=2,
            )
            return {}, 0
        return dict(state["positions"]), int(state["next_worker"].get(rank, 0))


def _own_errors(deliveries: Iterator[Delivery]) -> Iterator[Delivery]:
    """``deliveries``, with an :class:`UnusableStreamError` from a DataLoader worker raised with its own message."""
    try:
        yield from deliveries
    except UnusableStreamError as error:
        raise UnusableStreamError.from_worker(error) from None


def _plain(position: Any) -> Any:
    """A position as lists and dicts of ints (what ``torch.load(weights_only=True)`` reads back)."""
    if position == END:
        return END
    if isinstance(position, dict):
        return {key: _plain(value) for key, value in position.items()}
    if isinstance(position, tuple | list):
        return [int(value) for value in position]
    return position


def eval_image_batches(
    spec: str | Sequence[str], image_size: int, batch_size: int = 64, num_workers: int = 0
) -> Iterator[torch.Tensor]:
    """Image tensors (B, 3, image_size, image_size) from any shards holding images (image-only, pairs, VQA, captions),
    with the evaluation transform, in shard order: for fitting a visual codebook or computing statistics."""
    stream = ShardStream(
        resolve_shards(spec),
        ImageDecoder(eval_transform(image_size), min_side=image_size),
        collate=lambda items, rng: torch.stack([item["image"] for item in items]),
        batch_size=batch_size,
        name="images",
    )
    yield from EpochDataLoader(stream, batch_size=None, num_workers=num_workers)
