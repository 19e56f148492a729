"""A pipeline of stages, each done once and reused (a marker per stage), and lanes of them run at once in processes:
what the demo and the claims study are built from."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from mmoe.host_memory import keep_freed_memory
from mmoe.io import read_json, write_json
from mmoe.process_exit import freeze_at_exit


class RunFolder(Protocol):
    """What the stages need of a run (:class:`mmoe.pipeline.layout.PipelineRun`): its output folder."""

    out: Path


class PipelineError(RuntimeError):
    """A stage failed; the message names the stage and what it ran."""


def print_progress(message: str) -> None:
    """One line of a pipeline's progress on stdout, flushed at once (lanes in other processes print beside it)."""
    print(message, flush=True)


def quiet_lightning() -> None:
    """Lightning's info lines (devices, parameter counts) off in this process: a pipeline prints its own progress."""
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)


@dataclass(frozen=True)
class StageKey:
    """The name of a stage: its parts, from the group (a variant, ``pretrain/<run>``) to the step.

    Attributes:
        parts: e.g. ``("mhmoe", "vqav2", "eval")``; printed joined by ``/``, the marker file joins them by ``-``.
    """

    parts: tuple[str, ...]

    @classmethod
    def of(cls, *parts: str) -> StageKey:
        return cls(tuple(part for name in parts for part in name.split("/")))

    def __str__(self) -> str:
        return "/".join(self.parts)

    @property
    def marker_name(self) -> str:
        return "-".join(self.parts)


@dataclass(frozen=True)
class Stage:
    """One step of a pipeline: done when ``output`` exists and its marker says so.

    Attributes:
        key: its name.
        output: the file whose existence (with the marker) means the stage is done.
        run: does the work; returns a JSON-able result (scores, files written) kept in the marker.
    """

    key: StageKey
    output: Path
    run: Callable[[], dict]


def marker_path(run: RunFolder, stage: Stage) -> Path:
    return run.out / "stages" / f"{stage.key.marker_name}.json"


def is_done(run: RunFolder, stage: Stage) -> bool:
    """Whether ``stage`` ran to its end: its output exists and its marker says so."""
    return marker_path(run, stage).is_file() and stage.output.exists()


def run_stage(run: RunFolder, stage: Stage, reused_by: str = "an earlier run") -> dict:
    """Runs ``stage`` unless it is done; returns its marker (``seconds``, ``result``, ``reused``). ``reused_by``: what
    the line for a done stage says ran it ("" prints none)."""
    marker = marker_path(run, stage)
    if is_done(run, stage):
        record = read_json(marker, "stage marker")
        if reused_by:
            print_progress(f"[{stage.key}] done in {reused_by} ({record['seconds']:.0f} s), reused")
        return record | {"reused": bool(reused_by)}
    print_progress(f"[{stage.key}] ...")
    start = time.perf_counter()
    result = stage.run()
    if not stage.output.exists():
        raise PipelineError(f"stage {stage.key} finished without writing {stage.output}")
    record = {"stage": str(stage.key), "output": str(stage.output), "seconds": time.perf_counter() - start}
    record["result"] = result
    write_json(marker, record)
    print_progress(f"[{stage.key}] done in {record['seconds']:.0f} s")
    return record | {"reused": False}


def lanes_by_cost(groups: Sequence[str], cost: Callable[[str], float], jobs: int) -> list[list[str]]:
    """``groups`` dealt to at most ``jobs`` lanes by Graham's longest-processing-time rule: the costliest first (ties
    in the order given), each to the lane with the least cost so far; empty lanes are dropped."""
    lanes: list[list[str]] = [[] for _ in range(max(1, jobs))]
    loads = [0.0] * len(lanes)
    for group in sorted(groups, key=lambda group: -cost(group)):
        lane = loads.index(min(loads))
        lanes[lane].append(group)
        loads[lane] += cost(group)
    return [lane for lane in lanes if lane]


def run_parallel(lanes: Sequence[Sequence[str]], run_lane: Callable[[tuple[str, ...]], None], jobs: int) -> None:
    """Runs ``run_lane(lane)`` for each lane (stage-name prefixes run one after the other, e.g. ``["mhmoe/vqav2",
    "mhmoe/nlvr2"]``) in its own spawned Python process, all lanes at once, each with ``os.cpu_count() // jobs`` torch
    threads (at least 1; the same count whichever lanes are left, so a resumed run trains as the first did); their
    output goes to this process's. ``run_lane`` crosses to the process pickled, with the typed run it closes over
    (a ``functools.partial`` of a module-level function): no option is turned into text and read back. One process per
    lane pays the imports of torch and Lightning once instead of once per group. PipelineError naming the first lane
    whose process failed, after every lane ended.

    On a 2-core CPU a tiny model's step takes about as long on one thread as on two, so two fine-tunings at once take
    about half the time of one after the other (the demo's docs give the measurement)."""
    threads = str(max(1, (os.cpu_count() or 1) // jobs))
    context = multiprocessing.get_context("spawn")
    processes = {
        " ".join(lane): context.Process(
            target=_run_lane, args=(run_lane, tuple(lane), multiprocessing.get_start_method()), name=" ".join(lane)
        )
        for lane in lanes
    }
    with _thread_environment(threads):  # a spawned interpreter reads them when it imports torch
        for process in processes.values():
            process.start()
    for process in processes.values():
        process.join()
    failed = [f"{name} (exit status {process.exitcode})" for name, process in processes.items() if process.exitcode]
    if failed:
        raise PipelineError(f"stages {failed[0]} failed; the messages above name the stage")


@contextlib.contextmanager
def _thread_environment(threads: str) -> Iterator[None]:
    """``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` set to ``threads`` in this process's environment while lanes start
    (what a spawned process inherits), restored after."""
    names = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
    before = {name: os.environ.get(name) for name in names}
    os.environ.update(dict.fromkeys(names, threads))
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _run_lane(run_lane: Callable[[tuple[str, ...]], None], lane: tuple[str, ...], start_method: str) -> None:
    """A lane's process: its stages, ending with exit status 1 and the one-line reason when one fails. Freed host
    memory is kept for reuse here, and the objects alive at exit are frozen, as the ``mmoe`` command does (a spawned
    process starts with glibc's defaults and the interpreter's own shutdown). Its DataLoader workers start as the
    parent's do (``start_method``): a spawned process's default is spawn, under which every worker imports torch
    again and Lightning warns to keep them alive."""
    multiprocessing.set_start_method(start_method, force=True)
    keep_freed_memory()
    freeze_at_exit()
    try:
        run_lane(lane)
    except PipelineError as error:
        print(f"mmoe: error: {error}", file=sys.stderr, flush=True)
        sys.exit(1)
