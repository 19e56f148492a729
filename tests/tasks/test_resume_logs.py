"""A real two-process `mmoe fit` (DDP on the CPU) stopped after a checkpoint that falls inside a routing statistics
window and resumed from it writes the uninterrupted run's statistics and metrics.csv rows. A one-process run killed
with SIGKILL and resumed is tests/tasks/test_resume_exact.py's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mmoe.runtime.run_lock import LOCK_FILE
from mmoe.runtime.run_logs import CSV_LOGGER
from tests.tasks.resumable_fit import ENV, metrics
from tests.tasks.test_pretraining_run import tiny_config

pytestmark = pytest.mark.slow


def two_process_config(corpus: Path, root: Path, steps: int) -> Path:
    """The tiny pre-training in two CPU processes (DDP) into ``root``, ``steps`` steps of one 30-batch epoch (the same
    data order whatever ``steps``): CSV logs in ``csv/version_0`` written every step, a checkpoint every 3 steps, all
    kept, and a routing statistics window every 2, so the checkpoint at step 3 lies inside a window."""
    path = tiny_config("mhmoe", corpus, root, steps=30)
    config = yaml.safe_load(path.read_text())
    csv_logs = {"save_dir": str(root), "name": "csv", "version": 0, "flush_logs_every_n_steps": 1}
    config["trainer"]["logger"] = [{"class_path": CSV_LOGGER, "init_args": csv_logs}]
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
        # ``-m mmoe.cli``, not resumable_fit's ``-c`` command: Lightning starts the second process by re-running
        # this one's module or script, and a ``-c`` process has neither.
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
    logged, expected_rows = (metrics(root, "version_0") for root in (stopped, straight))
    assert [row["step"] for row in logged] == [row["step"] for row in expected_rows]
