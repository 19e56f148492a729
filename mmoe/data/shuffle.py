"""The sample shuffle buffer of a shard stream (:class:`mmoe.data.streams.ShardStream`): items drawn at random from a
buffer, as webdataset's ``shuffle`` stage draws them, with a sample read again kept a batch's length away from its
earlier copy where the buffer allows it."""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

import numpy as np

from mmoe.data.reading import Read


def shuffled(
    items: Iterable[Any],
    buffer_size: int,
    rng: np.random.Generator,
    spacing: int = 0,
    identity: Callable[[Any], Hashable] | None = None,
) -> Iterator[Any]:
    """Shuffles a stream through a buffer of ``buffer_size`` items (0 or 1 = unchanged).

    With ``spacing`` and ``identity``, no item is given while one of the same identity is among the last ``spacing``
    given, as long as the buffer holds another item: a stream that repeats a corpus smaller than its buffer holds
    several copies of each sample, and a copy drawn too soon is passed over for the next item in the buffer (in buffer
    order, wrapping) that was not given so recently. Where nothing is passed over, the draw is the plain one, so the
    order is the one without ``spacing``. The buffer's last items (the end of a stream that does not repeat) are given
    in a random permutation.
    """
    if buffer_size <= 1:
        yield from items
        return
    recent: collections.deque = collections.deque()  # the identities given in the last ``spacing`` places
    given: collections.Counter = collections.Counter()  # how often each is among them (none kept at 0)

    def draw(buffer: list[Any]) -> int:
        index = int(rng.integers(len(buffer)))
        if not given:
            return index
        for offset in range(len(buffer)):
            candidate = (index + offset) % len(buffer)
            if not given[identity(buffer[candidate])]:
                return candidate
        return index  # every item was given just now: the corpus is too small to keep them apart

    def note(item: Any) -> None:
        if identity is None or spacing <= 0:
            return
        recent.append(identity(item))
        given[recent[-1]] += 1
        if len(recent) > spacing:
            old = recent.popleft()
            given[old] -= 1
            if not given[old]:
                del given[old]

    buffer: list[Any] = []
    for item in items:
        if len(buffer) < buffer_size:
            buffer.append(item)
            continue
        index = draw(buffer)
        note(buffer[index])
        yield buffer[index]
        buffer[index] = item
    order = rng.permutation(len(buffer))
    for index in order:
        yield buffer[index]


def read_identity(read: Read) -> tuple[str | None, str | None]:
    """Which sample a read is: its shard and key."""
    return read.sample.get("__url__"), read.sample.get("__key__")
