"""A real ``mmoe fit`` of the tiny pre-training as the resume and preemption tests run it: its config (fp32, CPU,
one thread; random crops, flips, masks, stochastic depth and a DataLoader worker included), its command, a run that
SIGKILLs itself at a chosen step, a run stopped once a checkpoint holds a step, and what a run logged and saved."""

from __future__ import annotations

import contextlib
import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

from mmoe.runtime.run_logs import CSV_LOGGER
from tests.tasks.test_pretraining_run import tiny_config

#: Steps of the run, and the steps between its checkpoints (all kept) and between its routing statistics windows.
STEPS, EVERY = 40, 10
ENV = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
KILLED_FIT = Path(__file__).resolve().parents[1] / "scripts" / "fit_killed_at_step.py"


def resumable_config(corpus: Path, out: Path, version: str, *, flush_every_step: bool = False) -> Path:
    """The tiny pre-training into ``out``: :data:`STEPS` steps in epochs of 15 (so a checkpoint can fall mid-epoch),
    validated at step 20, a checkpoint and a routing statistics window every :data:`EVERY` steps, its CSV logs in
    ``out/csv/<version>`` (the logger the mmoe CLI gives, which continues a resumed run's rows), written every step
    with ``flush_every_step`` (else at Lightning's default interval and when the run ends)."""
    path = tiny_config("mhmoe", corpus, out, steps=STEPS)
    config = yaml.safe_load(path.read_text())
    trainer = config["trainer"]
    trainer.update(val_check_interval=20, limit_val_batches=2)
    logs = {"save_dir": str(out), "name": "csv", "version": version}
    if flush_every_step:
        logs["flush_logs_every_n_steps"] = 1
    trainer["logger"] = [{"class_path": CSV_LOGGER, "init_args": logs}]
    for callback in trainer["callbacks"]:
        if callback["class_path"].endswith("ModelCheckpoint"):
            callback["init_args"].update(every_n_train_steps=EVERY, save_top_k=-1)
        if callback["class_path"].endswith("RoutingStatsCallback"):
            callback["init_args"].update(every_n_steps=EVERY)
    config["model"]["init_args"]["backbone"]["drop_path"] = 0.2
    data = config["data"]["init_args"]
    data.update(num_workers=1, crop_scale=[0.5, 1.0], hflip=True, shuffle_buffer=16, batches_per_epoch=15)
    path = out / f"{version}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def fit_command(config: Path, *extra: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from mmoe.cli import main; sys.exit(main(sys.argv[1:]))", "fit",
            "--config", str(config), *extra]  # fmt: skip


def fit(config: Path, cwd: Path, *extra: str) -> subprocess.CompletedProcess:
    """``mmoe fit --config config`` run to its end, checked to exit 0."""
    done = subprocess.run(fit_command(config, *extra), cwd=cwd, env=ENV, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def killed_fit(config: Path, step: int, cwd: Path) -> tuple[int, str]:
    """Runs ``mmoe fit --config config`` until it SIGKILLs itself at the start of training step ``step``
    (tests/scripts/fit_killed_at_step.py); kills what it left of its process group (DataLoader workers) and returns
    its exit status and the end of its stderr."""
    command = [sys.executable, str(KILLED_FIT), str(step), "fit", "--config", str(config)]
    process = subprocess.Popen(command, cwd=cwd, env=ENV, start_new_session=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        _, stderr = process.communicate(timeout=900)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    return process.returncode, stderr[-3000:]


def handled_as_in_a_terminal() -> None:
    """SIGINT and SIGHUP handled by default, as in a terminal's foreground job, whatever this test run inherited (a
    background job of a non-interactive shell ignores SIGINT, ``nohup`` SIGHUP, and a fit leaves them ignored)."""
    for number in (signal.SIGINT, signal.SIGHUP):
        signal.signal(number, signal.SIG_DFL)


def start_fit(config: Path, cwd: Path) -> subprocess.Popen:
    """``mmoe fit --config config`` in a new session (its own process group), stderr captured."""
    return subprocess.Popen(fit_command(config), cwd=cwd, env=ENV, start_new_session=True,
                            preexec_fn=handled_as_in_a_terminal,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip


def saved_step(path: Path) -> int | None:
    """The ``global_step`` of checkpoint ``path``; None while it is absent or being written."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)["global_step"]
    except (OSError, RuntimeError, KeyError, EOFError):
        return None


def wait_for_checkpoint(process: subprocess.Popen, path: Path, step: int) -> None:
    """Returns once ``path`` holds step ``step`` or a later one. Loaded only when it changed (a checkpoint is renamed
    into place whole), so that a loaded machine's slow loads do not let the run pass its last checkpoint unseen."""
    deadline, seen = time.monotonic() + 600, None
    while True:
        changed = path.stat().st_mtime_ns if path.exists() else None
        if changed != seen:
            seen = changed
            if (saved_step(path) or 0) >= step:
                return
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)


def stop_line(stderr: str, name: str) -> str:
    """The last stderr line, checked to be the one the signal ``name`` ends `mmoe fit` with."""
    assert "Traceback" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"mmoe fit: stopped by {name} after global step "), stderr[-3000:]
    return last


def saved_step_in(line: str, checkpoint: Path) -> int:
    """The step the line says it saved, checked against the checkpoint it names."""
    said = line.split("global step ", 1)[1]
    step, rest = said.split(", saved to ", 1)
    assert rest.startswith(f"{checkpoint}; resume with: mmoe fit ")
    assert saved_step(checkpoint) == int(step)
    return int(step)


#: Logged by ``Throughput`` over its own windows, which a resumed run starts afresh (not compared).
THROUGHPUT_METRICS = {"step", "train/tokens_per_s", "train/mfu"}


def metrics(out: Path, version: str) -> list[dict[str, str]]:
    """The rows of ``out/csv/<version>/metrics.csv``, less those holding only throughput."""
    with open(out / "csv" / version / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    return [row for row in rows if any(value for key, value in row.items() if key not in THROUGHPUT_METRICS)]


def losses(out: Path, version: str) -> dict[int, str]:
    """step -> logged train/loss, as written (exact text)."""
    return {int(row["step"]): row["train/loss"] for row in metrics(out, version) if row.get("train/loss")}
