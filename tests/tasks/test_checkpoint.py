"""Backbone export / load round trips and clear errors for bad checkpoint files."""

from __future__ import annotations

import pytest
import torch

from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.runtime.checkpoint import export_backbone, load_backbone


def test_export_and_load_round_trip(tmp_path):
    config = MultiwayConfig.preset("tiny", moe=MoEPlan(num_experts=4, heads=2, strata=None))
    backbone = MultiwayTransformer(config)
    export_backbone(backbone, tmp_path / "backbone.pt")
    loaded = load_backbone(tmp_path / "backbone.pt")
    assert loaded.config == config
    for (name, want), got in zip(backbone.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(want, got), name
    assert [p.name for p in tmp_path.iterdir()] == ["backbone.pt"]  # no temporary file left behind


def test_lightning_style_checkpoint_loads(tmp_path):
    config = MultiwayConfig.preset("tiny")
    backbone = MultiwayTransformer(config)
    state = {
        "hyper_parameters": {"backbone": config},
        "state_dict": {f"backbone.{k}": v for k, v in backbone.state_dict().items()},
    }
    state["state_dict"]["head.weight"] = torch.zeros(2)
    torch.save(state, tmp_path / "task.ckpt")
    frozen = load_backbone(tmp_path / "task.ckpt", drop_path=0.1)
    assert frozen.config.drop_path == 0.1
    assert torch.equal(frozen.text_embed.weight, backbone.text_embed.weight)


def test_bad_checkpoints_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        load_backbone(tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="junk.pt could not be read"):
        load_backbone(tmp_path / "junk.pt")
    torch.save({"state_dict": {}}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="other.pt is neither"):
        load_backbone(tmp_path / "other.pt")
