"""A pipeline of stages, each done once and reused (a marker per stage): the demo's and the claims study's."""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mmoe.demo.report import say
from mmoe.demo.settings import DemoError, DemoRun
from mmoe.io import read_json, write_json


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


def marker_path(run: DemoRun, stage: Stage) -> Path:
    return run.out / "stages" / f"{stage.key.marker_name}.json"


def is_done(run: DemoRun, stage: Stage) -> bool:
    """Whether ``stage`` ran to its end: its output exists and its marker says so."""
    return marker_path(run, stage).is_file() and stage.output.exists()


def run_stage(run: DemoRun, stage: Stage, reused_by: str = "an earlier run") -> dict:
    """Runs ``stage`` unless it is done; returns its marker (``seconds``, ``result``, ``reused``). ``reused_by``: what
    the line for a done stage says ran it ("" prints none)."""
    marker = marker_path(run, stage)
    if is_done(run, stage):
        record = read_json(marker, "stage marker")
        if reused_by:
            say(f"[{stage.key}] done in {reused_by} ({record['seconds']:.0f} s), reused")
        return record | {"reused": bool(reused_by)}
    say(f"[{stage.key}] ...")
    start = time.perf_counter()
    result = stage.run()
    if not stage.output.exists():
        raise DemoError(f"stage {stage.key} finished without writing {stage.output}")
    record = {"stage": str(stage.key), "output": str(stage.output), "seconds": time.perf_counter() - start}
    record["result"] = result
    write_json(marker, record)
    say(f"[{stage.key}] done in {record['seconds']:.0f} s")
    return record | {"reused": False}


def run_command(key: StageKey, name: str, command: Callable[[Sequence[str]], int], argv: list[str]) -> None:
    """Runs one of mmoe's argparse commands (``mmoe data``, ``mmoe tokenizer``, ``mmoe viz``) in this process with
    its stdout (its JSON summary) dropped: the demo prints its own summary. ``name``: the command's name (``data``).
    DemoError when it fails."""
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            code = command(argv)
    except SystemExit as stop:  # argparse exits on bad options
        code = stop.code if isinstance(stop.code, int) else 1
    if code not in (0, None):
        raise DemoError(f"stage {key}: `{shlex.join(['mmoe', name, *argv])}` exited with status {code}")


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


def run_parallel(lanes: Sequence[Sequence[str]], argv: Callable[[Sequence[str]], list[str]], jobs: int) -> None:
    """Runs each lane (stage-name prefixes run one after the other, e.g. ``["mhmoe/vqav2", "mhmoe/nlvr2"]``) in its
    own ``python -m mmoe`` process with ``argv(lane)`` as arguments, all lanes at once, each with ``os.cpu_count() //
    jobs`` torch threads (at least 1; the same count whichever lanes are left, so a resumed run trains as the first
    did); their output goes to this process's. One process per lane pays the imports of torch and Lightning once
    instead of once per group (the default demo: 14 s less of its wall time outside the stages on the 2-core CPU).
    DemoError naming the first lane whose process failed, after every lane ended.

    On a 2-core CPU a tiny model's step takes about as long on one thread as on two (NLVR2: 111 s for 250 steps
    both ways), so two fine-tunings at once take about half the time of one after the other."""
    threads = str(max(1, (os.cpu_count() or 1) // jobs))
    env = os.environ | {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    processes = {
        " ".join(lane): subprocess.Popen([sys.executable, "-m", "mmoe", *argv(lane)], env=env) for lane in lanes
    }
    codes = {name: process.wait() for name, process in processes.items()}
    failed = [f"{name} (exit status {code})" for name, code in codes.items() if code != 0]
    if failed:
        raise DemoError(f"stages {failed[0]} failed; the messages above name the stage")
