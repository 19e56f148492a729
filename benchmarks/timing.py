"""Interleaved timing shared by the benchmarks: every callable runs once per round, in alternating order."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch


def time_once(fn: Callable[[], object], device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def interleaved_medians(fns: Sequence[Callable[[], object]], rounds: int, device: str = "cpu", warmup: int = 2):
    """Median seconds of each callable over ``rounds`` rounds; the order reverses every other round so that drift
    in the machine's speed hits all alike."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for round_index in range(rounds):
        order = range(len(fns)) if round_index % 2 == 0 else reversed(range(len(fns)))
        for index in order:
            times[index].append(time_once(fns[index], device))
    return [statistics.median(t) for t in times]
