"""A real `mmoe fit` killed with SIGKILL after a checkpoint and resumed from it writes the logs of the run that was
never interrupted: the same metrics.csv rows (steps and losses) in its fixed version folder, and the same routing
statistics windows and totals."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mmoe.tasks.run_lock import LOCK_FILE
from mmoe.tasks.run_logs import CSV_LOGGER
from tests.tasks.test_pretraining_run import tiny_config
from tests.tasks.test_resume_exact import ENV, fit_command, killed_fit, saved_step

pytestmark = pytest.mark.slow

STEPS, EVERY = 30, 5


def logged_config(corpus: Path, root: Path) -> Path:
    """The tiny pre-training into ``root``: CSV logs in ``csv/version_0`` written every step, a checkpoint and a
    routing statistics window every :data:`EVERY` steps."""
    path = tiny_config("mhmoe", corpus, root, steps=STEPS)
    config = yaml.safe_load(path.read_text())
    csv_logs = {"save_dir": str(root), "name": "csv", "version": 0, "flush_logs_every_n_steps": 1}
    config["trainer"]["logger"] = [{"class_path": CSV_LOGGER, "init_args": csv_logs}]
    for callback in config["trainer"]["callbacks"]:
        if callback["class_path"].endswith("ModelCheckpoint"):
            callback["init_args"].update(every_n_train_steps=EVERY)
        if callback["class_path"].endswith("RoutingStatsCallback"):
            callback["init_args"].update(every_n_steps=EVERY)
    path.write_text(yaml.safe_dump(config))
    return path


#: Logged by ``Throughput`` over its own windows, which a resumed run starts afresh (not compared here).
THROUGHPUT_METRICS = {"step", "train/tokens_per_s", "train/mfu"}


def metrics(root: Path) -> list[dict[str, str]]:
    """The rows of the run's metrics.csv, less those holding only throughput."""
    with open(root / "csv" / "version_0" / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    return [row for row in rows if any(value for key, value in row.items() if key not in THROUGHPUT_METRICS)]


def losses(rows: list[dict[str, str]]) -> dict[int, str]:
    return {int(row["step"]): row["train/loss"] for row in rows if row.get("train/loss")}


def test_a_killed_and_resumed_run_logs_the_rows_and_routing_windows_of_the_uninterrupted_run(
    synthetic_corpus, tmp_path
):
    straight = tmp_path / "straight"
    straight.mkdir()
    done = subprocess.run(fit_command(logged_config(synthetic_corpus, straight)), cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    expected_stats = json.loads((straight / "routing_stats.json").read_text())
    assert [window["step"] for window in expected_stats["windows"]] == list(range(EVERY, STEPS + 1, EVERY))

    run = tmp_path / "killed"
    run.mkdir()
    config = logged_config(synthetic_corpus, run)
    returncode, stderr = killed_fit(config, 2 * EVERY + 2, tmp_path)  # two steps after a checkpoint
    assert returncode == -signal.SIGKILL, stderr
    resumed_from = saved_step(run / "checkpoints" / "last.ckpt")
    assert resumed_from == 2 * EVERY
    logged_before = losses(metrics(run))
    assert 0 in logged_before  # the rows of the steps before the checkpoint, which a resume must keep

    resumed = subprocess.run(fit_command(config, "--ckpt_path", str(run / "checkpoints" / "last.ckpt")),
                             cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"mmoe fit: run folder {run}: taking over the lock of a run that ended without releasing it (host " in (
        resumed.stderr
    )
    assert not (run / LOCK_FILE).exists()

    rows, expected_rows = metrics(run), metrics(straight)
    assert [row["step"] for row in rows] == [row["step"] for row in expected_rows]
    assert losses(rows) == losses(expected_rows)
    assert sorted(losses(rows)) == list(range(STEPS))
    stats = json.loads((run / "routing_stats.json").read_text())
    assert [window["step"] for window in stats["windows"]] == list(range(EVERY, STEPS + 1, EVERY))
    assert stats["total_tokens"] == expected_stats["total_tokens"]
    assert stats["total_loads"] == expected_stats["total_loads"]
    assert stats["windows"] == expected_stats["windows"]


def two_process_config(corpus: Path, root: Path, steps: int) -> Path:
    """The tiny pre-training in two CPU processes (DDP) into ``root``: a checkpoint every 3 steps, all kept, and a
    routing statistics window every 2, so the checkpoint at step 3 lies inside a window."""
    path = logged_config(corpus, root)
    config = yaml.safe_load(path.read_text())
    config["trainer"].update(max_steps=steps, devices=2, strategy="ddp_find_unused_parameters_true",
                             limit_val_batches=0)  # fmt: skip
    for callback in config["trainer"]["callbacks"]:
        if callback["class_path"].endswith("ModelCheckpoint"):
            callback["init_args"].update(every_n_train_steps=3, save_top_k=-1)
        if callback["class_path"].endswith("RoutingStatsCallback"):
            callback["init_args"].update(every_n_steps=2)
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_two_process_run_resumed_inside_a_routing_window_writes_the_uninterrupted_run_s_statistics(
    synthetic_corpus, tmp_path
):
    def fit(root: Path, steps: int, *extra: str) -> None:
        root.mkdir(exist_ok=True)
        command = [sys.executable, "-m", "mmoe.cli", "fit", "--config", str(two_process_config(synthetic_corpus,
                   root, steps)), *extra]  # fmt: skip
        done = subprocess.run(command, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]  # the second process takes no lock of its own
        assert not (root / LOCK_FILE).exists()

    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    fit(straight, 8)
    fit(stopped, 5)
    fit(stopped, 8, "--ckpt_path", str(stopped / "checkpoints" / "epoch=0-step=3.ckpt"))
    expected, stats = (json.loads((root / "routing_stats.json").read_text()) for root in (straight, stopped))
    assert [window["step"] for window in expected["windows"]] == [2, 4, 6, 8]
    assert stats == expected  # the window open at step 3 summed both processes' counts
    assert [row["step"] for row in metrics(stopped)] == [row["step"] for row in metrics(straight)]
