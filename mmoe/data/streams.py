"""Reading webdataset shards as a pipeline of stages: shards -> split by node and worker -> tar members -> samples ->
shuffle -> decode -> batch (:meth:`ShardStream.deliveries`), resumable at any position.

Splitting: every consumer (DataLoader worker of every process) reads a disjoint part. With at least as many shards as
consumers the shards are dealt out (``split="shard"``); with fewer, every consumer reads all shards and keeps every
n-th sample (``split="sample"``); ``"auto"`` picks. Shard order is shuffled identically on every consumer (seed and
epoch only), so the parts stay disjoint and together complete.

Randomness is a function of the position, never of what ran before: the shard order draws from (seed, epoch), the
shuffle buffer from (seed, epoch, consumer), a sample's random image transform from its ordinal in the consumer's
shuffled stream, a batch's masks from the batch's ordinal and a mixture's choice of stream from the step
(:class:`SeedDomain` keeps a consumer's streams apart). So a stream can restart at any position: it re-reads the
shards up to it without decoding (cheap) and continues with the batches the uninterrupted stream would have given.

What a stream could not use is counted by :mod:`mmoe.data.accounting`, as the samples it uses reach it
(:mod:`mmoe.data.reading`).
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import IterableDataset

from mmoe.data.accounting import END, Delivery, SkipCount, SkipLedger, add_skips
from mmoe.data.reading import Read, carrying_skips, read_shards, split_reads
from mmoe.data.remote import RemoteReading
from mmoe.data.samples import Collator, CorruptSampleError, Decoder, Sample
from mmoe.data.shards import expected_and_excluded_samples
from mmoe.data.shuffle import read_identity, shuffled


class SeedDomain(enum.IntEnum):
    """The salt after (seed, epoch, rank, worker) in a consumer's seed, one per random stream, so no two draw alike.

    The values are part of the data's reproducibility: changing one changes every shuffle, crop, mask or mixture
    choice drawn from it.
    """

    #: The sample shuffle buffer.
    SHUFFLE = 1
    #: A :class:`mmoe.data.mixture.StreamMixture`'s choice of stream per step.
    MIXTURE = 2
    #: A batch's collate generator (masks).
    BATCH = 3
    #: A sample's random image transforms.
    SAMPLE = 4


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


def split_items(items: Iterable[Any], consumer: Consumer) -> Iterator[Any]:
    """Every ``consumer.count``-th item, starting at ``consumer.index``."""
    return itertools.islice(items, consumer.index, None, consumer.count)


def consumer_entropy(seed: int, epoch: int, consumer: Consumer, domain: SeedDomain, *ordinals: int) -> list[int]:
    """The entropy of one of ``consumer``'s random streams in ``epoch``: (seed, epoch, rank, worker, domain,
    ordinals...), for :class:`numpy.random.SeedSequence` or :func:`numpy.random.default_rng`."""
    return [seed, epoch, consumer.rank, consumer.worker, int(domain), *ordinals]


def sample_seed(seed: int, epoch: int, consumer: Consumer, ordinal: int) -> int:
    """Seed of the random image transforms of one sample: its consumer's ``ordinal``-th shuffled sample."""
    entropy = consumer_entropy(seed, epoch, consumer, SeedDomain.SAMPLE, ordinal)
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


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
        excluded: samples to leave out, shard -> {key: cause} (:func:`mmoe.data.shards.excluded_samples`); None =
            read the manifests next to the shards.
        reports: count what the stream skips; False for a stream over shards another stream reads and reports
            (pre-training's image and text objectives drawing from the pairs).
        remote: how remote shards (``s3://``, ``gs://``, ``hf://``, ``https://``) are read: retries, pauses, range
            size (:class:`mmoe.data.remote.RemoteReading`); None = its defaults.
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
        excluded: dict[str, dict[str, str]] | None = None,
        reports: bool = True,
        remote: RemoteReading | None = None,
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
        if expected is None or excluded is None:
            read_expected, read_excluded = expected_and_excluded_samples(self.shards)  # the manifests, read once
            expected = read_expected if expected is None else expected
            excluded = read_excluded if excluded is None else excluded
        self.expected, self.excluded = expected, excluded
        self.reports = reports
        self.remote = remote or RemoteReading()
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
        quiet_below = start.samples + (start.items > 0) if self.reports else sys.maxsize
        # With split by sample every consumer reads every shard: the first warns of what a shard lost.
        warns = by_shard or consumer.index == 0
        ledger = SkipLedger(self.name, self.shards, quiet_below=quiet_below, warns_of_losses=warns)
        order: Iterable = self._shard_order(np.random.default_rng([self.seed, self.epoch]))
        if by_shard:
            order = split_items(order, consumer)
        reads: Iterable[Read] = carrying_skips(
            read_shards(order, ledger, self.expected, len(self.shards), self.repeat, self.excluded, self.remote),
            ledger,
        )
        if not by_shard:
            reads = split_reads(reads, consumer.index, consumer.count, ledger)
        own_rng = np.random.default_rng(consumer_entropy(self.seed, self.epoch, consumer, SeedDomain.SHUFFLE))
        # A repeating stream over a corpus smaller than the buffer holds copies of a sample: a batch gets one of them.
        spacing = self.batch_size if self.repeat and self.collate is not None else 0
        items = self._items(
            shuffled(reads, self.shuffle_buffer, own_rng, spacing, read_identity), consumer, start, ledger
        )
        if self.collate is None:
            for item, position in items:
                yield Delivery(item, consumer.key, position, ledger.take())
        else:
            yield from self._batched(items, consumer, start.batches, ledger)
        ledger.consumed(ledger.claim())  # skipped after the last sample: met by the stream's end
        yield Delivery(None, consumer.key, END, ledger.take())

    def _items(
        self, reads: Iterable[Read], consumer: Consumer, start: Position, ledger: SkipLedger
    ) -> Iterator[tuple[Any, Position]]:
        """(item, position after it) from ``start``: samples before it are read, not decoded; the skips a sample
        carries are counted as it is used."""
        iterator = iter(reads)
        ordinal = 0
        while True:
            ledger.ordinal = ordinal
            try:
                sample, carried = next(iterator)
            except StopIteration:
                return
            ledger.consumed(carried)
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
            rng = np.random.default_rng(consumer_entropy(self.seed, self.epoch, consumer, SeedDomain.BATCH, batches))
            batch = self.collate([item for item, _ in chunk], rng)
            batches += 1
            yield Delivery(batch, consumer.key, chunk[-1][1]._replace(batches=batches), ledger.take())
