"""Sparse upcycling: experts copied from the dense FFNs, against the dense model's outputs (per-layer references)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.model.layers import LANGUAGE, VISION
from mmoe.model.upcycle import upcycle
from mmoe.runtime.checkpoint import export_backbone, load_backbone
from mmoe.tasks.nlvr2 import NLVR2FineTuning
from tests.cli_fixtures import run_mmoe

DENSE = MultiwayConfig.preset("test", vocab_size=50)


def dense_backbone(seed: int = 0) -> MultiwayTransformer:
    torch.manual_seed(seed)
    backbone = MultiwayTransformer(DENSE).eval()
    with torch.no_grad():  # LayerNorms away from 1 / 0, so that copying them is checked too
        for name, parameter in backbone.named_parameters():
            if "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    return backbone


def forward(backbone: MultiwayTransformer) -> torch.Tensor:
    """Hidden states of an image + text batch at the non-padding positions (a MoE layer leaves padding untouched,
    a dense FFN does not; no token reads them)."""
    generator = torch.Generator().manual_seed(1)
    image = torch.randn(2, 3, 32, 32, generator=generator)
    text = torch.randint(0, 50, (2, 6), generator=generator)
    padding = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    with torch.no_grad():
        hidden = backbone.eval()(image=image, text=text, text_padding_mask=padding).hidden
    keep = torch.cat([torch.ones(2, hidden.shape[1] - 6, dtype=torch.bool), ~padding], dim=1)
    return hidden[keep]


@pytest.mark.parametrize(
    "plan",
    [
        MoEPlan(num_experts=4, top_k=2, router="xmoe", every=1),
        MoEPlan(num_experts=4, top_k=2, router="linear", every=2),
        MoEPlan(num_experts=4, top_k=2, every=1, mode="shared"),
        MoEPlan(num_experts=4, top_k=2, every=1, strata=[4]),  # one stratum: every token makes one pass
    ],
    ids=["xmoe", "switch", "shared", "stratified-one-gate"],
)
def test_top2_upcycled_backbone_equals_the_dense_one(plan):
    dense = dense_backbone()
    if plan.mode == "shared":  # one expert pool from both FFNs: equal only where the two FFNs are equal
        with torch.no_grad():
            for block in dense.layers:
                block.ffn[LANGUAGE].load_state_dict(block.ffn[VISION].state_dict())
    moe = upcycle(dense, plan)
    assert len(list(moe.moe_layers())) > 0
    torch.testing.assert_close(forward(moe), forward(dense), atol=1e-5, rtol=0)


def test_top1_upcycled_layer_scales_the_dense_ffn_by_its_gate_weight():
    dense = dense_backbone()
    moe = upcycle(dense, MoEPlan(num_experts=4, top_k=1, every=1))
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(2))
    for slot in moe.moe_layers():
        modality = VISION if slot.modality == "vision" else LANGUAGE
        with torch.no_grad():
            y, record = slot.layer(x)
            routed = slot.layer.router(x.reshape(-1, 32), None)
            expected, _ = dense.layers[slot.index].ffn[modality](x)
        assert record.expert_counts.sum() == 10
        torch.testing.assert_close(y, routed.weight_SK[:, 0].reshape(2, 5, 1) * expected, atol=1e-6, rtol=0)


def test_everything_outside_the_experts_is_the_dense_backbone_and_routers_are_new():
    dense = dense_backbone()
    moe = upcycle(dense, MoEPlan(num_experts=4, every=1))
    sparse = moe.state_dict()
    for key, value in dense.state_dict().items():
        if ".ffn." not in key:
            assert torch.equal(sparse[key], value), key
    fresh = MultiwayTransformer(moe.config).state_dict()
    router_keys = [key for key in sparse if ".router." in key]
    assert router_keys and all(sparse[key].shape == fresh[key].shape for key in router_keys)


def test_stratified_layers_copy_the_pre_ffn_norm_into_every_stratum():
    dense = dense_backbone()
    moe = upcycle(dense, MoEPlan(num_experts=4, top_k=2, every=1, strata=[2, 2]))
    for slot in moe.moe_layers():
        modality = VISION if slot.modality == "vision" else LANGUAGE
        for norm in slot.layer.norms:
            assert torch.equal(norm.weight, dense.layers[slot.index].ffn_norm[modality].weight)
    forward(moe)  # runs; a token making two passes adds two updates, so no equality is claimed


def test_mhmoe_starts_from_identity_head_layers_and_dense_ffn_blocks():
    dense = dense_backbone()
    moe = upcycle(dense, MoEPlan(num_experts=4, every=1, heads=2))
    slot = next(iter(moe.moe_layers()))
    layer, ffn = slot.layer, dense.layers[slot.index].ffn[VISION]
    assert torch.equal(layer.multi_head.weight, torch.eye(32)) and torch.equal(layer.merge.weight, torch.eye(32))
    for expert in range(4):
        block = slice((expert % 2) * 16, (expert % 2 + 1) * 16)
        assert torch.equal(layer.experts.fc1_weight[expert], ffn.fc1.weight[:, block].T)
        assert torch.equal(layer.experts.fc2_weight[expert], ffn.fc2.weight[block, :].T)


def test_noise_separates_the_experts_reproducibly():
    dense = dense_backbone()
    plan = MoEPlan(num_experts=4, every=1)
    first, again = upcycle(dense, plan, noise=0.01, seed=3), upcycle(dense, plan, noise=0.01, seed=3)
    experts = next(iter(first.moe_layers())).layer.experts.fc1_weight
    assert not torch.equal(experts[0], experts[1])
    assert torch.equal(experts, next(iter(again.moe_layers())).layer.experts.fc1_weight)
    assert (experts[0] - experts[1]).abs().max() < 0.1 * experts[0].abs().max()


def test_what_cannot_be_upcycled_is_refused():
    dense = dense_backbone()
    with pytest.raises(ValueError, match="needs beta 1"):
        upcycle(dense, MoEPlan(num_experts=4, every=1, beta=2.0))
    with pytest.raises(ValueError, match="has MoE layers already"):
        upcycle(upcycle(dense, MoEPlan(num_experts=2)), MoEPlan(num_experts=2))
    with pytest.raises(ValueError, match="shared_experts=1: upcycling copies the dense FFN"):
        upcycle(dense, MoEPlan(num_experts=4, shared_experts=1))


def test_upcycle_command_writes_a_backbone_that_fine_tuning_starts_from(tmp_path, capsys):
    export_backbone(dense_backbone(), tmp_path / "dense.pt")
    plan = {"num_experts": 4, "top_k": 2, "router": "xmoe", "every": 2}
    config = {"model": {"class_path": "mmoe.tasks.nlvr2.NLVR2FineTuning", "init_args": {"backbone": {"moe": plan}}}}
    (tmp_path / "moe.yaml").write_text(yaml.safe_dump(config))
    argv = ["upcycle", "--ckpt", str(tmp_path / "dense.pt"), "--config", str(tmp_path / "moe.yaml")]
    code, out, err = run_mmoe([*argv, "--out", str(tmp_path / "init.pt")], capsys)
    assert code == 0, err
    assert json.loads(out)["moe_layers"] == [1]
    upcycled = load_backbone(tmp_path / "init.pt")
    assert upcycled.config.moe == MoEPlan(**plan)
    task = NLVR2FineTuning(pretrained=str(tmp_path / "init.pt"))
    torch.testing.assert_close(forward(task.backbone), forward(dense_backbone()), atol=1e-5, rtol=0)

    dense = {"model": {"class_path": config["model"]["class_path"], "init_args": {"backbone": {"dim": 32}}}}
    (tmp_path / "dense.yaml").write_text(yaml.safe_dump(dense))
    code, _, err = run_mmoe(["upcycle", "--ckpt", str(tmp_path / "dense.pt"), "--config", str(tmp_path / "dense.yaml"),
                             "--out", str(tmp_path / "x.pt")], capsys)  # fmt: skip
    assert code == 2 and err.strip().count("\n") == 0 and "has no model.init_args.backbone.moe" in err
    # The config is read by the CLI's own parser: one that mmoe fit would refuse is refused, in one line.
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"model": {"init_args": {"backbone": {"dim": 32}}}}))
    code, _, err = run_mmoe([*argv[:4], str(tmp_path / "bad.yaml"), "--out", str(tmp_path / "x.pt")], capsys)
    assert code == 2 and err.strip().count("\n") == 0 and 'bad.yaml: Parser key "model"' in err
    code, _, err = run_mmoe([*argv[:2], str(tmp_path / "nowhere.pth"), *argv[3:], "--out", "x.pt"], capsys)
    assert code == 2 and "nowhere.pth does not exist" in err and not (tmp_path / "x.pt").exists()
    # Repeated configs merge in order, as in mmoe fit: the dense one, then the plan.
    merged = [*argv[:4], str(tmp_path / "dense.yaml"), *argv[3:], "--out", str(tmp_path / "merged.pt")]
    code, _, err = run_mmoe(merged, capsys)
    assert code == 0, err
    assert load_backbone(tmp_path / "merged.pt").config.moe == MoEPlan(**plan)
