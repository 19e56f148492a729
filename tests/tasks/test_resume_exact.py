"""Exact resume: a real `mmoe fit` killed with SIGKILL, or stopped by SIGTERM, and resumed logs what the run that was
never interrupted logs, step by step (fp32, CPU, one thread; random crops, flips, masks, stochastic depth and a
DataLoader worker included): the same losses, the same metrics.csv rows in its fixed version folder, and the same
routing statistics windows and totals. Both compare with one uninterrupted run."""

from __future__ import annotations

import json
import shlex
import shutil
import signal

import pytest
import yaml

from mmoe.runtime.run_lock import LOCK_FILE
from tests.tasks.resumable_fit import (
    EVERY,
    STEPS,
    fit,
    killed_fit,
    losses,
    metrics,
    resumable_config,
    saved_step,
    saved_step_in,
    start_fit,
    stop_line,
    wait_for_checkpoint,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def uninterrupted(synthetic_corpus, tmp_path_factory):
    """The folder of the run never interrupted: its logs in ``csv/v``, written every step, and its routing
    statistics."""
    straight = tmp_path_factory.mktemp("straight")
    fit(resumable_config(synthetic_corpus, straight, "v", flush_every_step=True), straight)
    assert sorted(losses(straight, "v")) == list(range(STEPS))  # two epochs of 15 steps and part of a third
    windows = json.loads((straight / "routing_stats.json").read_text())["windows"]
    assert [window["step"] for window in windows] == list(range(EVERY, STEPS + 1, EVERY))
    yield straight
    shutil.rmtree(straight, ignore_errors=True)


def test_a_killed_and_resumed_run_logs_the_losses_rows_and_routing_windows_of_the_uninterrupted_run(
    synthetic_corpus, uninterrupted, tmp_path
):
    run = tmp_path / "killed"
    run.mkdir()
    config = resumable_config(synthetic_corpus, run, "v", flush_every_step=True)
    # Killed mid-epoch: at the start of step 25 (epoch 1, step 10 of 15), last.ckpt holds step 20, and metrics.csv
    # the rows of steps 20-24 too, which the resumed run trains and logs again.
    returncode, stderr = killed_fit(config, 25, tmp_path)
    assert returncode == -signal.SIGKILL, stderr
    checkpoints = run / "checkpoints"
    assert saved_step(checkpoints / "last.ckpt") == 20
    assert sorted(losses(run, "v")) == list(range(25))
    saved = {path.name: path.stat().st_mtime_ns for path in checkpoints.glob("epoch=*.ckpt")}
    assert sorted(saved_step(checkpoints / name) for name in saved) == [10, 20]

    resumed = fit(config, tmp_path, "--ckpt_path", "last")
    assert f"mmoe fit: run folder {run}: taking over the lock of a run that ended without releasing it (host " in (
        resumed.stderr
    )
    assert not (run / LOCK_FILE).exists()
    # It continued from step 20: the earlier checkpoints untouched, the later ones its own.
    after = {path.name: path.stat().st_mtime_ns for path in checkpoints.glob("epoch=*.ckpt")}
    assert {name: after[name] for name in saved} == saved
    assert sorted(saved_step(checkpoints / name) for name in after.keys() - saved.keys()) == [30, 40]

    rows, expected_rows = metrics(run, "v"), metrics(uninterrupted, "v")
    assert [row["step"] for row in rows] == [row["step"] for row in expected_rows]
    assert losses(run, "v") == losses(uninterrupted, "v")
    stats, expected_stats = (json.loads((root / "routing_stats.json").read_text()) for root in (run, uninterrupted))
    assert stats["total_tokens"] == expected_stats["total_tokens"]
    assert stats["total_loads"] == expected_stats["total_loads"]
    assert stats["windows"] == expected_stats["windows"]


def test_sigterm_saves_the_step_in_progress_and_the_resumed_run_continues_exactly(
    synthetic_corpus, uninterrupted, tmp_path
):
    """The step in progress is trained, logged and saved to `last.ckpt`, one line on stderr names the signal, the step
    and the resume command, the exit code is 128 + the signal's number, and the resumed run logs the uninterrupted
    run's losses."""
    expected = losses(uninterrupted, "v")
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
    fit(config, tmp_path, "--ckpt_path", "last")
    after = losses(run, "resumed")
    assert sorted(after) == list(range(step, STEPS))
    assert after == {s: expected[s] for s in after}
    assert before == {s: expected[s] for s in before}
