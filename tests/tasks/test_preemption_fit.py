"""A real `mmoe fit` stopped by a signal: the step in progress is trained, logged and saved to `last.ckpt`, one line
on stderr names the signal, the step and the resume command, the exit code is 128 + the signal's number, and the
resumed run logs the losses of the run that was never interrupted, step by step."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.tasks.test_resume_exact import (
    ENV,
    STEPS,
    fit_command,
    losses,
    resumable_config,
    saved_step,
    uninterrupted_losses,
)

pytestmark = pytest.mark.slow


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


def test_sigterm_saves_the_step_in_progress_and_the_resumed_run_continues_exactly(synthetic_corpus, tmp_path):
    expected = uninterrupted_losses(synthetic_corpus, tmp_path)

    run = tmp_path / "signalled"
    run.mkdir()
    config = resumable_config(synthetic_corpus, run, "first")
    checkpoint = run / "checkpoints" / "last.ckpt"
    process = start_fit(config, tmp_path)
    wait_for_checkpoint(process, checkpoint, 10)  # mid-epoch 0 (15 steps), before the next checkpoint (step 20)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 128 + signal.SIGTERM == 143
    line = stop_line(stderr, "SIGTERM")
    step = saved_step_in(line, checkpoint)
    before = losses(run, "first")
    assert step > 10 and sorted(before) == list(range(step))  # every step trained was logged, and saved

    resumed_config = yaml.safe_load(config.read_text())
    resumed_config["trainer"]["logger"][0]["init_args"]["version"] = "resumed"
    config.write_text(yaml.safe_dump(resumed_config))
    resume = shlex.split(line.split("resume with: mmoe ", 1)[1])
    assert resume == ["fit", "--config", str(config), "--ckpt_path", "last"]
    resumed = subprocess.run(fit_command(config, "--ckpt_path", "last"), cwd=tmp_path, env=ENV,
                             capture_output=True, text=True, timeout=900)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = losses(run, "resumed")
    assert sorted(after) == list(range(step, STEPS))
    assert after == {s: expected[s] for s in after}
    assert before == {s: expected[s] for s in before}


# SIGTERM from `timeout`, SLURM or `kill -- -PGID`; SIGINT from Ctrl-C in a terminal; SIGHUP from a shell whose SSH
# session dropped.
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_signal_to_the_process_group_stops_the_workers_without_a_traceback(stop, synthetic_corpus, tmp_path):
    config = resumable_config(synthetic_corpus, tmp_path, "first")
    assert yaml.safe_load(config.read_text())["data"]["init_args"]["num_workers"] == 1
    checkpoint = tmp_path / "checkpoints" / "last.ckpt"
    process = start_fit(config, tmp_path)
    wait_for_checkpoint(process, checkpoint, 10)
    os.killpg(process.pid, stop)  # the loader worker gets it too
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 128 + stop
    assert "DataLoader worker" not in stderr and "KeyboardInterrupt" not in stderr
    step = saved_step_in(stop_line(stderr, stop.name), checkpoint)
    assert sorted(losses(tmp_path, "first")) == list(range(step))
    deadline = time.monotonic() + 300  # a bound for a loaded machine: the loop ends once the worker is gone
    while group_alive(process.pid):  # the worker is shut down with its main process
        assert time.monotonic() < deadline
        time.sleep(0.1)


def group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True
