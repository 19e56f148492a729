"""A pipeline of stages, each done once and reused (a marker per stage): the demo's and the claims study's."""

from __future__ import annotations

import contextlib
import io
import shlex
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


def run_stage(run: DemoRun, stage: Stage) -> dict:
    """Runs ``stage`` unless it is done; returns its marker (``seconds``, ``result``, ``reused``)."""
    marker = marker_path(run, stage)
    if marker.is_file() and stage.output.exists():
        record = read_json(marker, "stage marker")
        say(f"[{stage.key}] done in an earlier run ({record['seconds']:.0f} s), reused")
        return record | {"reused": True}
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
