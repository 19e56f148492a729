"""Logs that continue across a resume: the CSV rows of the steps before the resume step stay, the rows of the steps
the resumed run logs again are replaced; routing statistics continue from the checkpoint, an open window included."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from mmoe.runtime.routing_callback import RoutingStatsCallback
from mmoe.runtime.run_logs import ContinueCSVLogs, ContinuingCSVLogger
from tests.metrics.test_routing import TinyRoutingTask


def write_rows(root: Path, steps: range, value: float, **extra: float) -> ContinuingCSVLogger:
    """A run's logger writing ``loss = value + step`` (and ``extra``) at ``steps`` into ``root/csv/version_0``."""
    logger = ContinuingCSVLogger(root, name="csv", version=0)
    for step in steps:
        logger.log_metrics({"loss": value + step, **extra}, step=step)
    logger.save()
    return logger


def rows(root: Path) -> list[dict[str, str]]:
    with open(root / "csv" / "version_0" / "metrics.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def test_a_resumed_run_keeps_the_rows_before_its_step_and_replaces_the_rows_it_logs_again(tmp_path):
    write_rows(tmp_path, range(13), 0.0)  # killed after step 12, its checkpoint at step 10
    resumed = ContinuingCSVLogger(tmp_path, name="csv", version=0)
    resumed.continue_from(10)
    for step in range(10, 15):
        resumed.log_metrics({"loss": 100.0 + step}, step=step)
    resumed.save()
    assert [(row["step"], row["loss"]) for row in rows(tmp_path)] == [
        *((str(step), str(float(step))) for step in range(10)),
        *((str(step), str(100.0 + step)) for step in range(10, 15)),
    ]


def test_a_run_from_scratch_replaces_every_row_and_an_evaluation_appends_under_a_wider_header(tmp_path):
    write_rows(tmp_path, range(5), 0.0)
    fresh = ContinuingCSVLogger(tmp_path, name="csv", version=0)
    fresh.continue_from(0)
    assert not (tmp_path / "csv" / "version_0" / "metrics.csv").exists()
    fresh.log_metrics({"loss": 7.0}, step=0)
    fresh.save()
    write_rows(tmp_path, range(3, 4), 0.0, accuracy=0.5)  # e.g. mmoe validate into the same version: appended
    assert [(row["step"], row["loss"], row["accuracy"]) for row in rows(tmp_path)] == [
        ("0", "7.0", ""),
        ("3", "3.0", "0.5"),
    ]


def fit(root: Path, steps: int, ckpt_path: Path | None = None) -> RoutingStatsCallback:
    """The tiny routing task for ``steps`` steps on one repeated batch, routing windows of 2 steps, a checkpoint
    every 3 steps (which leaves a window open) and CSV logs in ``root``."""
    torch.manual_seed(0)
    images, texts = torch.randn(2, 3, 32, 32), torch.randint(0, 100, (2, 5))
    data = TensorDataset(images.repeat(steps, 1, 1, 1), texts.repeat(steps, 1))
    callback = RoutingStatsCallback(every_n_steps=2, save_dir=root)
    checkpoints = ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=3, save_top_k=-1)
    trainer = L.Trainer(
        max_steps=steps, logger=ContinuingCSVLogger(root, name="csv", version=0), log_every_n_steps=1,
        callbacks=[callback, checkpoints, ContinueCSVLogs()], enable_progress_bar=False, enable_model_summary=False,
        accelerator="cpu", devices=1,
    )  # fmt: skip
    trainer.fit(TinyRoutingTask(), DataLoader(data, batch_size=2), ckpt_path=ckpt_path)
    return callback


def test_routing_statistics_and_csv_rows_continue_from_a_checkpoint_inside_a_window(tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    fit(straight, steps=7)
    fit(stopped, steps=5)  # a run that ended at step 5; its checkpoint at step 3 lies inside the window (2, 4]
    fit(stopped, steps=7, ckpt_path=stopped / "checkpoints" / "epoch=0-step=3.ckpt")
    expected, stats = (json.loads((root / "routing_stats.json").read_text()) for root in (straight, stopped))
    assert [window["step"] for window in expected["windows"]] == [2, 4, 6, 7]
    assert stats == expected
    assert [row["step"] for row in rows(stopped)] == [row["step"] for row in rows(straight)]
