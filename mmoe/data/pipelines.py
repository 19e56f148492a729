"""Reading webdataset shards: a pipeline of stages (shards -> split by node and worker -> tar members -> samples ->
shuffle -> decode -> batch), a named error handler that skips, counts and reports corrupt samples, and a mixture of
streams for pre-training.

Splitting: every consumer (DataLoader worker of every process) reads a disjoint part. With at least as many shards as
consumers the shards are dealt out (``split="shard"``); with fewer, every consumer reads all shards and keeps every
n-th sample (``split="sample"``); ``"auto"`` picks. Shard order is shuffled identically on every consumer (seed and
epoch only), so the parts stay disjoint and together complete.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

logger = logging.getLogger("mmoe.data")

Sample = dict[str, Any]
Decoder = Callable[[Sample], "Sample | list[Sample] | None"]
Collator = Callable[[list[Sample], np.random.Generator], Sample]


class CorruptSampleError(Exception):
    """A sample that cannot be decoded: bad image bytes, a missing entry, bad JSON.

    Args:
        shard: the shard's path or URL.
        key: the sample's key.
        reason: what is wrong.
    """

    def __init__(self, shard: str, key: str, reason: str) -> None:
        super().__init__(f"{shard}: sample {key!r}: {reason}")
        self.shard, self.key, self.reason = shard, key, reason


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


class SkipCorruptSamples:
    """webdataset error handler: logs each bad sample with its shard and key, counts it, and continues.

    The count lives in shared memory, one slot per DataLoader worker, so the main process sees the samples its
    workers skipped (``skipped``).

    Args:
        stream: a name for the log lines (e.g. ``"vqa/train"``).
    """

    SLOTS = 64

    def __init__(self, stream: str = "") -> None:
        self.stream = stream
        self._counts = torch.zeros(self.SLOTS, dtype=torch.long).share_memory_()

    def __call__(self, error: Exception) -> bool:
        if isinstance(error, CorruptSampleError):
            where, reason = f"shard {error.shard}, key {error.key!r}", error.reason
        else:
            shards = [arg for arg in error.args[1:] if isinstance(arg, str)]
            where = f"shard {shards[-1]}" if shards else "unknown shard"
            reason = f"{type(error).__name__}: {error.args[0] if error.args else error}"
        info = get_worker_info()
        self._counts[min((info.id + 1) if info else 0, self.SLOTS - 1)] += 1
        label = f" [{self.stream}]" if self.stream else ""
        logger.warning("skipped a corrupt sample%s: %s: %s", label, where, reason)
        return True

    @property
    def skipped(self) -> int:
        """Samples skipped so far, by this process and its DataLoader workers."""
        return int(self._counts.sum())


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


def decoded(samples: Iterable[Sample], decode: Decoder, handler: Callable[[Exception], bool]) -> Iterator[Sample]:
    """Applies ``decode``; a decoder may return one item, a list of items, or None (dropped). Errors go to
    ``handler``."""
    for sample in samples:
        try:
            result = decode(sample)
        except Exception as error:  # the handler decides; CorruptSampleError carries shard and key
            if not isinstance(error, CorruptSampleError):
                error = CorruptSampleError(sample.get("__url__", "?"), sample.get("__key__", "?"), repr(error))
            if handler(error):
                continue
            raise error from None
        if result is None:
            continue
        if isinstance(result, list):
            yield from result
        else:
            yield result


def batched(
    items: Iterable[Sample], batch_size: int, collate: Collator, rng: np.random.Generator, drop_last: bool
) -> Iterator[Sample]:
    """Groups items into lists of ``batch_size`` and collates each (the last short one kept unless ``drop_last``)."""
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, batch_size)):
        if len(batch) < batch_size and drop_last:
            return
        yield collate(batch, rng)


class ShardStream(IterableDataset):
    """Samples or batches read from webdataset shards.

    Args:
        shards: shard paths or URLs.
        decode: sample dict (raw bytes per extension, ``__key__``, ``__url__``) -> item(s); raise
            :class:`CorruptSampleError` for a bad sample, return None to drop one.
        collate: (items, rng) -> batch; None yields single items.
        batch_size: items per batch (with ``collate``).
        drop_last: drop a last short batch.
        shuffle_buffer: sample shuffle buffer; > 0 also shuffles the shard order every epoch.
        repeat: start over when the shards are exhausted (an endless stream, pre-training).
        seed: seeds shard order, sample shuffling and the collate generator (masks).
        split: ``"shard"``, ``"sample"`` or ``"auto"`` (shards when there are enough of them for every consumer).
        handler: receives decoding and reading errors; default: a fresh :class:`SkipCorruptSamples`.
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
        handler: Callable[[Exception], bool] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        super().__init__()
        if not shards:
            raise ValueError("ShardStream needs at least one shard")
        if split not in ("auto", "shard", "sample"):
            raise ValueError(f"ShardStream.split must be 'auto', 'shard' or 'sample', got {split!r}")
        self.shards = list(shards)
        self.decode, self.collate = decode, collate
        self.batch_size, self.drop_last = batch_size, drop_last
        self.shuffle_buffer, self.repeat, self.seed, self.split = shuffle_buffer, repeat, seed, split
        self.handler = handler if handler is not None else SkipCorruptSamples()
        self.rank, self.world_size = rank, world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Shard order, shuffling and masks differ per epoch (reproducibly)."""
        self.epoch = epoch

    def _shard_order(self, rng: np.random.Generator) -> Iterator[dict[str, str]]:
        for _ in itertools.count() if self.repeat else range(1):
            order = rng.permutation(len(self.shards)) if self.shuffle_buffer > 0 else range(len(self.shards))
            yield from (dict(url=self.shards[i]) for i in order)

    def __iter__(self) -> Iterator[Sample]:
        consumer = Consumer.current(self.rank, self.world_size)
        by_shard = self.split == "shard" or (self.split == "auto" and len(self.shards) >= consumer.count)
        shared_rng = np.random.default_rng([self.seed, self.epoch])  # identical on every consumer
        own_rng = np.random.default_rng([self.seed, self.epoch, consumer.rank, consumer.worker, 1])
        stages: list[Callable[[Iterable], Iterable]] = [
            lambda shards: split_items(shards, consumer) if by_shard else shards,
            wds.tarfile_to_samples(handler=self.handler),
            lambda samples: samples if by_shard else split_items(samples, consumer),
            lambda samples: shuffled(samples, self.shuffle_buffer, own_rng),
            lambda samples: decoded(samples, self.decode, self.handler),
        ]
        if self.collate is not None:
            stages.append(lambda items: batched(items, self.batch_size, self.collate, own_rng, self.drop_last))
        data: Iterable = self._shard_order(shared_rng)
        for stage in stages:
            data = stage(data)
        return iter(data)


class StreamMixture(IterableDataset):
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
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        for stream in self.streams.values():
            stream.set_epoch(epoch)

    def __iter__(self) -> Iterator[Sample]:
        consumer = Consumer.current(
            next(iter(self.streams.values())).rank, next(iter(self.streams.values())).world_size
        )
        rng = np.random.default_rng([self.seed, self.epoch, consumer.rank, consumer.worker, 2])
        limit = math.inf
        if self.batches_per_epoch is not None:
            share, extra = divmod(self.batches_per_epoch, consumer.num_workers)
            limit = share + (consumer.worker < extra)
        active = {name: iter(stream) for name, stream in self.streams.items()}
        produced = 0
        while self.joint and produced < limit:
            try:
                step = {name: {**next(iterator), "kind": name} for name, iterator in active.items()}
            except StopIteration:
                return
            produced += 1
            yield step
        while active and produced < limit:
            names = list(active)
            weights = np.array([self.ratios[name] for name in names], dtype=np.float64)
            name = names[int(rng.choice(len(names), p=weights / weights.sum()))]
            try:
                batch = next(active[name])
            except StopIteration:
                del active[name]
                continue
            batch["kind"] = name
            produced += 1
            yield batch


class EpochDataLoader(DataLoader):
    """A DataLoader that tells its dataset the epoch (``set_epoch``) each time it is iterated, before the workers
    start, so shuffling and masks change from epoch to epoch yet stay reproducible."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._epochs_started = 0

    def __iter__(self):
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self._epochs_started)
        self._epochs_started += 1
        return super().__iter__()


def eval_image_batches(
    spec: str | Sequence[str], image_size: int, batch_size: int = 64, num_workers: int = 0
) -> Iterator[torch.Tensor]:
    """Image tensors (B, 3, image_size, image_size) from any shards holding images (image-only, pairs, VQA, captions),
    with the evaluation transform, in shard order: for fitting a visual codebook or computing statistics."""
    from mmoe.data.decoders import ImageDecoder
    from mmoe.data.shards import resolve_shards
    from mmoe.data.transforms import eval_transform

    stream = ShardStream(
        resolve_shards(spec),
        ImageDecoder(eval_transform(image_size), min_side=image_size),
        collate=lambda items, rng: torch.stack([item["image"] for item in items]),
        batch_size=batch_size,
        handler=SkipCorruptSamples("images"),
    )
    yield from DataLoader(stream, batch_size=None, num_workers=num_workers)
