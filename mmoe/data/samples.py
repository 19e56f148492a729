"""What flows from shard reading to batching: a sample, the decoder and collator signatures, and the error a decoder
raises for a sample it cannot use (:mod:`mmoe.data.streams` counts those, :mod:`mmoe.data.decoders` raises them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

#: One webdataset sample (``__key__``, ``__url__`` and an entry per file extension), or a decoded item.
Sample = dict[str, Any]
#: A sample -> one item, several items, or None (nothing to train on).
Decoder = Callable[[Sample], "Sample | list[Sample] | None"]
#: Items and the batch's random generator -> a batch.
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
