"""The zero-shot probes of a pipeline's pre-training: one validation after the last step of the demo's pre-training,
read back from its ``metrics.csv`` with their chance levels."""

from __future__ import annotations

import csv

import pytest

from mmoe.config.run_spec import read_spec
from mmoe.pipeline import PipelineRun, pretrain_spec
from mmoe.pipeline.launch import metrics_csv
from mmoe.pipeline.probes import logged_probes, probes_text
from mmoe.pipeline.settings import DEMO_FAST
from mmoe.tasks.zero_shot_probes import DEFAULT_PROBE_PAIRS, probe_chance


def write_metrics(path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    header = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="", encoding="utf-8") as file:
        writer = csv.DictWriter(file, fieldnames=header)
        writer.writeheader()
        writer.writerows(rows)


def test_the_last_validation_row_s_probes_are_read_back_with_their_chance_levels(tmp_path):
    run = PipelineRun(tmp_path, DEMO_FAST)
    layout = run.pretraining("mhmoe")
    assert logged_probes(layout) is None  # no logs yet
    rows = [{"step": "0", "train/loss": "9.1"}, {"step": "79", "train/loss": "4.2"},
            {"step": "79", "val/loss": "4.4", "val/probe/pairs": "128", "val/probe/i2t_r1": "0.125",
             "val/probe/i2t_r5": "0.453", "val/probe/color_acc": "0.578", "val/probe/shape_acc": "0.258"}]  # fmt: skip
    write_metrics(metrics_csv(layout), rows[:2])
    assert logged_probes(layout) is None  # trained without probes
    write_metrics(metrics_csv(layout), rows)
    probes = logged_probes(layout)
    assert probes["step"] == 79 and probes["values"]["val/probe/color_acc"] == 0.578
    assert probes["chance"] == {
        "val/probe/i2t_r1": 1 / 128, "val/probe/i2t_r5": 5 / 128, "val/probe/color_acc": 1 / 6,
        "val/probe/shape_acc": 1 / 4,
    }  # fmt: skip
    assert "color_acc 0.578 (chance 0.167)" in probes_text(probes) and "128 held-out pairs at step 79" in probes_text(
        probes
    )


def test_pooled_recall_has_the_chance_of_recall_and_a_tiny_set_caps_it_at_one():
    chance = probe_chance({"val/probe/pairs": 4.0, "val/probe/pooled_t2i_r5": 0.5, "val/probe/pooled_i2t_r1": 0.25})
    assert chance == {"val/probe/pooled_t2i_r5": 1.0, "val/probe/pooled_i2t_r1": 0.25}


@pytest.mark.parametrize("probes", [False, True])
def test_only_a_watched_pre_training_validates_on_the_probe_pairs_batches_and_logs_to_tensorboard(tmp_path, probes):
    run = PipelineRun(tmp_path, DEMO_FAST)
    spec = pretrain_spec(run, "mhmoe", run.pretraining("mhmoe"), DEMO_FAST.pretrain_steps, watched=probes)
    trainer = read_spec(spec).trainer
    batches = -(-DEFAULT_PROBE_PAIRS // DEMO_FAST.batch_size) if probes else 0
    assert trainer.limit_val_batches == batches and trainer.val_check_interval == DEMO_FAST.pretrain_steps
    loggers = [logger.class_path.rsplit(".", 1)[-1] for logger in trainer.logger]
    assert loggers == (["ContinuingCSVLogger", "TensorBoardLogger"] if probes else ["ContinuingCSVLogger"])


def test_the_tensorboard_figure_script_draws_a_demo_s_heatmap_loss_and_probes(tmp_path):
    """``scripts/demo_tensorboard_figure.py`` on logs written as a watched pre-training writes them."""
    import subprocess
    import sys
    from pathlib import Path

    import numpy as np
    from PIL import Image
    from torch.utils.tensorboard import SummaryWriter

    layout = PipelineRun(tmp_path, DEMO_FAST).pretraining("mhmoe")
    writer = SummaryWriter(str(layout.tensorboard_logs / "version_0"))
    heatmap = np.zeros((3, 4, 16), dtype=np.uint8)
    heatmap[0] = 200  # a red picture: the figure must show it
    for step in (10, 20):
        writer.add_scalar("train/loss", 9.0 - step / 10, step)
    writer.add_image("routing/load_heatmap", heatmap, 20)
    writer.close()
    write_metrics(metrics_csv(layout), [{"step": "20", "val/probe/pairs": "128", "val/probe/i2t_r5": "0.4",
                                         "val/probe/color_acc": "0.5"}])  # fmt: skip
    out = tmp_path / "figure.png"
    script = Path(__file__).resolve().parents[2] / "scripts" / "demo_tensorboard_figure.py"
    command = [sys.executable, str(script), str(tmp_path), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    pixels = np.asarray(Image.open(out).convert("RGB")).astype(int)
    assert pixels.shape[1] > 1000 and ((pixels[..., 0] > 150) & (pixels[..., 1] < 60)).sum() > 100
