"""Timing shared by the benchmarks: interleaved medians (every callable runs once per round, in alternating order),
and the seconds a profile spent under the MoE layer's ``record_function`` labels."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch.autograd import DeviceType

#: The profiler's name of one autograd node's backward.
BACKWARD_EVENT = "autograd::engine::evaluate_function"


def time_once(fn: Callable[[], object], device: str, clock: Callable[[], float] = time.perf_counter) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = clock()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return clock() - start


def interleaved_medians(
    fns: Sequence[Callable[[], object]],
    rounds: int,
    device: str = "cpu",
    warmup: int = 2,
    clock: Callable[[], float] = time.perf_counter,
):
    """Median seconds of each callable over ``rounds`` rounds; the order reverses every other round so that drift
    in the machine's speed hits all alike. ``clock``: wall time, or :func:`time.thread_time` (the CPU seconds of
    this thread: with one torch thread, the work itself, which other jobs on the machine do not stretch)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for round_index in range(rounds):
        order = range(len(fns)) if round_index % 2 == 0 else reversed(range(len(fns)))
        for index in order:
            times[index].append(time_once(fns[index], device, clock))
    return [statistics.median(t) for t in times]


def labelled_seconds(profile, steps: int, device_time: bool = False) -> dict[str, float]:
    """Seconds per step of a ``torch.profiler`` profile under each ``mmoe.moe.<label>`` range (keyed ``<label>``), and
    under ``"backward"``: the autograd engine's outermost ``evaluate_function`` ranges (no node counted twice).

    Host-side ranges only: their CPU time, or with ``device_time`` the kernels launched inside them (the
    ``gpu_user_annotation`` copy of a range would span the idle gaps between its kernels too)."""
    totals_us: dict[str, float] = {}
    for event in profile.events():
        if event.device_type != DeviceType.CPU:
            continue
        label = event.name.removeprefix("mmoe.moe.") if event.name.startswith("mmoe.moe.") else None
        if label is None and event.name.startswith(BACKWARD_EVENT) and not inside_backward_node(event):
            label = "backward"
        if label is not None:
            spent = event.device_time_total if device_time else event.cpu_time_total
            totals_us[label] = totals_us.get(label, 0.0) + spent
    return {label: total / steps / 1e6 for label, total in totals_us.items()}


def inside_backward_node(event) -> bool:
    """Whether a profiler event runs inside an autograd engine ``evaluate_function`` range."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(BACKWARD_EVENT):
            return True
        parent = parent.cpu_parent
    return False
