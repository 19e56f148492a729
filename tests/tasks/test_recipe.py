"""Fine-tuning recipe options: the router z-loss term in a task's objective (ST-MoE), evaluation capacity factor
from the task config, and a resolution change for released BEiT-3 files."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.model.beit3 import to_beit3
from mmoe.tasks.base import StepLosses
from mmoe.tasks.nlvr2 import NLVR2FineTuning


def tiny(**overrides) -> MultiwayConfig:
    return MultiwayConfig.preset("test", **overrides)


def task_loss_with(coefficient: float, monkeypatch) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(0)
    task = NLVR2FineTuning(backbone=tiny(moe=MoEPlan(num_experts=4)), z_loss_coefficient=coefficient)
    out = task.backbone(image=torch.randn(2, 3, 32, 32), text=torch.randint(0, 100, (2, 5)))
    logged = {}
    monkeypatch.setattr(task, "log_dict", lambda values, **kwargs: logged.update(values))
    monkeypatch.setattr(task, "log", lambda *args, **kwargs: None)
    monkeypatch.setattr(task, "step_losses", lambda batch: StepLosses(torch.zeros(()), {}, out.routing, 2))
    loss, _, _ = task.shared_step({}, "train")
    return loss, logged


def test_the_task_adds_coefficient_times_the_summed_z_losses(monkeypatch):
    loss, logged = task_loss_with(1e-3, monkeypatch)
    without, logged_without = task_loss_with(0.0, monkeypatch)
    assert logged["train/z_loss"] == logged_without["train/z_loss"] > 0  # logged whether or not it is trained
    torch.testing.assert_close(loss - without, 1e-3 * logged["train/z_loss"])
    with pytest.raises(ValueError, match="z_loss_coefficient must be a finite number >= 0"):
        NLVR2FineTuning(backbone=tiny(), z_loss_coefficient=-1.0)


def test_eval_capacity_factor_from_the_task_config(tmp_path):
    from mmoe.runtime.checkpoint import export_backbone

    export_backbone(MultiwayTransformer(tiny(moe=MoEPlan(num_experts=4, every=1))), tmp_path / "backbone.pt")
    task = NLVR2FineTuning(pretrained=str(tmp_path / "backbone.pt"), eval_capacity_factor=0.25)
    assert task.backbone.config.moe.eval_capacity_factor == 0.25
    assert task.hparams.backbone["moe"]["eval_capacity_factor"] == 0.25  # the checkpoint rebuilds it
    inputs = dict(image=torch.randn(4, 3, 32, 32), text=torch.randint(0, 100, (4, 6)))
    task.train()
    assert all(float(r.dropped_fraction) == 0 for r in task.backbone(**inputs).routing)  # dropless in training
    task.eval()
    with torch.no_grad():
        assert all(float(r.dropped_fraction) > 0 for r in task.backbone(**inputs).routing)


def test_a_released_beit3_file_fine_tunes_at_another_resolution(tmp_path):
    config = tiny(position_offset=2, output_norm=False)
    torch.manual_seed(0)
    path = tmp_path / "beit3_tiny.pth"
    source = MultiwayTransformer(config)
    torch.save({"model": to_beit3(source)}, path)
    task = NLVR2FineTuning(pretrained=str(path), backbone=dataclasses.replace(config, image_size=64))
    table = task.backbone.vision_positions
    assert table.shape == (2 + 1 + 16, 32)
    torch.testing.assert_close(table[:3], source.vision_positions[:3])  # offset rows and CLS kept
    torch.testing.assert_close(task.backbone.text_embed.weight, source.text_embed.weight)
