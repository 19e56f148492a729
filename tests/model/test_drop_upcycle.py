"""Drop-Upcycling (Nakamura et al., ICLR 2025, §3): each expert a copy of the dense FFN with a share r of its
intermediate units drawn again from the statistics of the dense tensor each weight was copied from. Checked unit by
unit against the dense FFN, on dense weights whose tensors each have their own mean and spread, so a unit drawn from
another tensor's statistics (or from a fresh initialisation) shows."""

from __future__ import annotations

import pytest
import torch
import yaml

from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.model.layers import LANGUAGE, VISION
from mmoe.model.upcycle import upcycle
from mmoe.runtime.checkpoint import export_backbone, load_backbone
from tests.cli_fixtures import run_mmoe

DENSE = MultiwayConfig.preset("test", vocab_size=50, ffn_dim=256)
#: (mean, std) given to each dense FFN tensor: far apart, so each redrawn unit tells which statistics it came from.
STATISTICS = {
    "fc1.weight": (0.3, 1.5),
    "fc1.bias": (-0.5, 0.2),
    "fc2.weight": (-0.2, 0.7),
    "fc2.bias": (0.8, 0.05),
    "norm.weight": (1.2, 0.1),
    "norm.bias": (0.1, 0.3),
}


#: Each expert tensor with units and the dense FFN tensor it is copied from.
DENSE_TENSOR = {
    "fc1_weight": "fc1.weight",
    "fc1_bias": "fc1.bias",
    "fc2_weight": "fc2.weight",
    "ln_weight": "norm.weight",
    "ln_bias": "norm.bias",
}


def dense_backbone() -> MultiwayTransformer:
    torch.manual_seed(0)
    backbone = MultiwayTransformer(DENSE).eval()
    with torch.no_grad():
        for name, parameter in backbone.named_parameters():
            for suffix, (mean, std) in STATISTICS.items():
                if ".ffn." in name and name.endswith(suffix):
                    parameter.normal_(mean, std)
    return backbone


def upcycled(dense: MultiwayTransformer, plan: MoEPlan, seed: int, **options) -> MultiwayTransformer:
    """``upcycle`` with the global generator seeded as ``mmoe upcycle --seed`` seeds it (the new routers draw there)."""
    torch.manual_seed(seed)
    return upcycle(dense, plan, seed=seed, **options)


def dense_units(ffn, block: slice) -> dict[str, torch.Tensor]:
    """The dense FFN's tensors in the experts' layout (x @ W), units along dim 0 for each (fc2's bias: no units)."""
    return {
        "fc1_weight": ffn.fc1.weight[:, block],
        "fc1_bias": ffn.fc1.bias,
        "fc2_weight": ffn.fc2.weight[block, :].T,
        "ln_weight": ffn.norm.weight,
        "ln_bias": ffn.norm.bias,
    }


def expert_units(experts, expert: int) -> dict[str, torch.Tensor]:
    return {
        "fc1_weight": experts.fc1_weight[expert].T,
        "fc1_bias": experts.fc1_bias[expert],
        "fc2_weight": experts.fc2_weight[expert],
        "ln_weight": experts.ln_weight[expert],
        "ln_bias": experts.ln_bias[expert],
    }


def redrawn_units(moe: MultiwayTransformer, dense: MultiwayTransformer, heads: int = 1):
    """Per (layer, expert): the units whose weights differ from the dense FFN's, one set per tensor, with each
    tensor's redrawn values; and that fc2's bias is the copy."""
    found = []
    for slot in moe.moe_layers():
        experts = slot.layer.experts
        ffn = dense.layers[slot.index].ffn[VISION if slot.modality == "vision" else LANGUAGE]
        width = DENSE.dim // heads
        for expert in range(experts.num_experts):
            block = slice((expert % heads) * width, (expert % heads + 1) * width)
            assert torch.equal(experts.fc2_bias[expert], ffn.fc2.bias[block])
            reference, actual = dense_units(ffn, block), expert_units(experts, expert)
            changed = {}
            for name, units in actual.items():
                differs = (units != reference[name]).reshape(units.shape[0], -1)
                assert torch.equal(differs.all(1), differs.any(1)), name  # a unit is redrawn whole or kept whole
                changed[name] = (differs.any(1).nonzero().flatten(), units[differs.any(1)].flatten())
            found.append(changed)
    return found


@pytest.mark.parametrize("heads", [1, 2], ids=["xmoe", "mhmoe"])
def test_a_drop_ratio_of_zero_is_the_plain_copy_bit_for_bit(heads):
    dense = dense_backbone()
    plan = MoEPlan(num_experts=4, every=1, heads=heads)
    plain, dropped = upcycled(dense, plan, 3, noise=0.01), upcycled(dense, plan, 3, noise=0.01, drop_ratio=0)
    assert plain.state_dict().keys() == dropped.state_dict().keys()
    for key, value in plain.state_dict().items():
        assert torch.equal(value, dropped.state_dict()[key]), key


@pytest.mark.parametrize("heads", [1, 2], ids=["xmoe", "mhmoe"])
def test_each_expert_redraws_one_set_of_its_units_from_each_dense_tensor_s_statistics(heads):
    dense = dense_backbone()
    plan = MoEPlan(num_experts=4, every=1, heads=heads)
    moe = upcycled(dense, plan, 5, drop_ratio=0.5)
    found = redrawn_units(moe, dense, heads)
    hidden = DENSE.ffn_dim
    sets = []
    for changed in found:
        units = changed["fc1_weight"][0]
        assert units.numel() == hidden // 2  # ⌊r H⌋ of the H units, the same units in every tensor
        assert all(torch.equal(changed[name][0], units) for name in changed)
        sets.append(frozenset(units.tolist()))
    assert len(set(sets)) == len(sets)  # each expert (and each layer) draws its own units
    for name, dense_name in DENSE_TENSOR.items():
        mean, std = STATISTICS[dense_name]
        values = torch.cat([changed[name][1] for changed in found]).detach()
        assert abs(float(values.mean()) - mean) < 5 * std / values.numel() ** 0.5 + 0.05 * std, name
        assert abs(float(values.std()) / std - 1) < 0.15, name
    again = upcycled(dense, plan, 5, drop_ratio=0.5)
    assert all(torch.equal(value, again.state_dict()[key]) for key, value in moe.state_dict().items())
    other = upcycled(dense, plan, 6, drop_ratio=0.5)
    assert redrawn_units(other, dense, heads)[0]["fc1_weight"][0].tolist() != sorted(sets[0])


def test_a_drop_ratio_of_one_keeps_only_the_dense_statistics():
    dense = dense_backbone()
    moe = upcycled(dense, MoEPlan(num_experts=2, every=2), 1, drop_ratio=1.0)
    for changed in redrawn_units(moe, dense):
        assert changed["fc1_weight"][0].numel() == DENSE.ffn_dim


@pytest.mark.parametrize("ratio", ["1.5", "-0.1", "nan"])
def test_the_upcycle_command_draws_units_again_and_refuses_a_ratio_outside_0_1(tmp_path, capsys, ratio):
    export_backbone(dense_backbone(), tmp_path / "dense.pt")
    plan = {"num_experts": 4, "top_k": 1, "router": "xmoe", "every": 2}
    config = {"model": {"class_path": "mmoe.tasks.nlvr2.NLVR2FineTuning", "init_args": {"backbone": {"moe": plan}}}}
    (tmp_path / "moe.yaml").write_text(yaml.safe_dump(config))
    argv = ["upcycle", "--ckpt", str(tmp_path / "dense.pt"), "--config", str(tmp_path / "moe.yaml"), "--seed", "2"]
    code, _, err = run_mmoe([*argv, "--drop-ratio", "0.5", "--out", str(tmp_path / "init.pt")], capsys)
    assert code == 0, err
    written = load_backbone(tmp_path / "init.pt")
    expected = upcycled(dense_backbone(), MoEPlan(**plan), 2, drop_ratio=0.5)
    assert all(torch.equal(value, expected.state_dict()[key]) for key, value in written.state_dict().items())
    code, _, err = run_mmoe([*argv, "--drop-ratio", ratio, "--out", str(tmp_path / "bad.pt")], capsys)
    assert code == 2 and err.strip().count("\n") == 0 and "drop ratio must be in [0, 1]" in err
    assert not (tmp_path / "bad.pt").exists()
