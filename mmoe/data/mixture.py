"""Pre-training batches from several shard streams (image / text / pair): one stream per step drawn with given ratios,
or one batch of every stream per step (``joint``), resumable at any step like the streams themselves."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from mmoe.data.accounting import END, Delivery, SkipCount, add_skips
from mmoe.data.streams import Consumer, Position, ResumableStream, SeedDomain, ShardStream, consumer_entropy


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
                    entropy = consumer_entropy(self.seed, self.epoch, consumer, SeedDomain.MIXTURE, produced)
                    rng = np.random.default_rng(entropy)
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
