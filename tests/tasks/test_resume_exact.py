"""Exact resume: a real `mmoe fit` killed with SIGKILL and resumed with `--ckpt_path last` logs the same losses, step
by step, as the run that was never interrupted (fp32, CPU, one thread; random crops, flips, masks, stochastic depth
and a DataLoader worker included)."""

from __future__ import annotations

import contextlib
import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.tasks.test_pretraining_run import tiny_config

pytestmark = pytest.mark.slow

STEPS, EVERY = 40, 10


def resumable_config(corpus: Path, out: Path, version: str) -> Path:
    path = tiny_config("mhmoe", corpus, out, steps=STEPS)
    config = yaml.safe_load(path.read_text())
    config["trainer"].update(val_check_interval=20, limit_val_batches=2)
    config["trainer"]["logger"][0]["init_args"]["version"] = version
    for callback in config["trainer"]["callbacks"]:
        if callback["class_path"].endswith("ModelCheckpoint"):
            callback["init_args"].update(every_n_train_steps=EVERY, save_top_k=-1)
    config["model"]["init_args"]["backbone"]["drop_path"] = 0.2
    data = config["data"]["init_args"]
    data.update(num_workers=1, crop_scale=[0.5, 1.0], hflip=True, shuffle_buffer=16, batches_per_epoch=15)
    path = out / f"{version}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def fit_command(config: Path, *extra: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from mmoe.cli import main; sys.exit(main(sys.argv[1:]))", "fit",
            "--config", str(config), *extra]  # fmt: skip


ENV = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


KILLED_FIT = Path(__file__).resolve().parents[1] / "scripts" / "fit_killed_at_step.py"


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


def saved_step(path: Path) -> int | None:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)["global_step"]
    except (OSError, RuntimeError, KeyError, EOFError):  # not there yet, or being written
        return None


def losses(out: Path, version: str) -> dict[int, str]:
    """step -> logged train/loss, as written (exact text)."""
    with open(out / "csv" / version / "metrics.csv") as handle:
        return {int(row["step"]): row["train/loss"] for row in csv.DictReader(handle) if row.get("train/loss")}


def uninterrupted_losses(corpus: Path, tmp_path: Path) -> dict[int, str]:
    """The losses of the run never interrupted (in ``tmp_path / "straight"``), step by step."""
    straight = tmp_path / "straight"
    straight.mkdir()
    done = subprocess.run(fit_command(resumable_config(corpus, straight, "v")), cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return losses(straight, "v")


def test_killed_and_resumed_run_logs_the_losses_of_the_uninterrupted_run(synthetic_corpus, tmp_path):
    expected = uninterrupted_losses(synthetic_corpus, tmp_path)
    assert sorted(expected) == list(range(STEPS))  # two epochs of 15 steps and part of a third

    run = tmp_path / "killed"
    run.mkdir()
    config = resumable_config(synthetic_corpus, run, "first")
    # Killed mid-epoch: at the start of step 25 (epoch 1, step 10 of 15), last.ckpt holds step 20.
    returncode, stderr = killed_fit(config, 25, tmp_path)
    assert returncode == -signal.SIGKILL, stderr
    assert saved_step(run / "checkpoints" / "last.ckpt") == 20
    assert not (run / "checkpoints" / "epoch=2-step=30.ckpt").exists()

    resumed_config = yaml.safe_load(config.read_text())
    resumed_config["trainer"]["logger"][0]["init_args"]["version"] = "resumed"
    config.write_text(yaml.safe_dump(resumed_config))
    resumed = subprocess.run(fit_command(config, "--ckpt_path", "last"), cwd=tmp_path, env=ENV,
                             capture_output=True, text=True, timeout=900)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = losses(run, "resumed")
    assert sorted(after) == list(range(20, STEPS))
    assert after == {step: expected[step] for step in after}
