"""A pipeline of stages, each done once and reused (a marker per stage): what the demo and the studies are built
from (:mod:`mmoe.pipeline.pool` runs several at once in processes)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from mmoe.io import read_json, write_json


class RunFolder(Protocol):
    """What the stages need of a run (:class:`mmoe.pipeline.layout.PipelineRun`): its output folder."""

    out: Path


class PipelineError(RuntimeError):
    """A stage failed; the message names the stage and what it ran."""


def print_progress(message: str) -> None:
    """One line of a pipeline's progress on stdout, flushed at once (pool processes print beside it)."""
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
