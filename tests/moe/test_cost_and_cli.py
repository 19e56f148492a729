"""Closed-form counts against the modules and MH-MoE App. D; the ``mmoe moe-info`` command."""

from __future__ import annotations

import itertools
import json

import pytest

from mmoe.cli import main
from mmoe.moe import MoEConfig, MoELayer
from mmoe.moe.cost import flops_per_token, moe_parameter_count


@pytest.mark.parametrize(
    "router,heads,beta,subln", list(itertools.product(("linear", "xmoe"), (1, 2, 4), (1.0, 0.75), (False, True)))
)
def test_closed_form_parameter_count_matches_module(router, heads, beta, subln):
    config = MoEConfig(dim=64, ffn_dim=256, num_experts=8, router=router, heads=heads, beta=beta, subln=subln)
    assert moe_parameter_count(config) == sum(p.numel() for p in MoELayer(config).parameters())


@pytest.mark.parametrize("heads,beta", [(1, 1.0), (4, 1.0), (4, 63 / 64), (8, 2.0)])
def test_weights_follow_mhmoe_appendix_d(heads, beta):
    d, n = 64, 16
    config = MoEConfig(dim=d, ffn_dim=4 * d, num_experts=n, router="linear", heads=heads, beta=beta)
    layer = MoELayer(config)
    weights = sum(p.numel() for name, p in layer.named_parameters() if "bias" not in name)
    gamma_experts = round(8 * beta * d * d * n / heads)  # Eq. 20 / 23
    gamma_router = d * n // heads  # Eq. 19 / 22
    gamma_split_merge = 2 * d * d if heads > 1 else 0  # Eq. 21 + 24
    assert weights == gamma_split_merge + gamma_router + gamma_experts


def test_flops_equal_a_plain_moe_at_beta_one():
    plain = MoEConfig(dim=768, ffn_dim=3072, num_experts=8, router="linear")
    multi = MoEConfig(dim=768, ffn_dim=3072, num_experts=8, router="linear", heads=4)
    experts_plain = flops_per_token(plain) - 2 * 768 * 8
    experts_multi = flops_per_token(multi) - 2 * 768 * 8 - 4 * 768 * 768
    assert experts_plain == experts_multi == 4 * 768 * 3072  # Eq. 13 vs Eq. 16 at beta = 1


def test_moe_info_command_prints_counts(capsys):
    assert (
        main(["moe-info", "--moe.dim", "64", "--moe.ffn_dim", "256", "--moe.num_experts", "8", "--moe.heads", "4"]) == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["parameters"] == report["parameters_counted"]
    assert report["config"]["routing_dim"] == 4


@pytest.mark.parametrize("subln", [False, True])
def test_moe_info_dense_ffn_is_the_backbone_dense_ffn(capsys, subln):
    """The dense baseline moe-info reports is the backbone's FFN, Sub-LN included (mmoe.model.cost)."""
    from mmoe.model.layers import FeedForward

    argv = ["moe-info", "--moe.dim", "64", "--moe.ffn_dim", "256", "--moe.num_experts", "8", "--moe.subln", str(subln)]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["dense_ffn_parameters"] == sum(p.numel() for p in FeedForward(64, 256, subln, 1e-5).parameters())
    assert report["dense_ffn_flops_per_token"] == 4 * 64 * 256


def test_moe_info_rejects_bad_config(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["moe-info", "--moe.dim", "30", "--moe.ffn_dim", "64", "--moe.num_experts", "4", "--moe.heads", "4"])
    assert exit_info.value.code != 0
    assert "MoEConfig.dim=30" in capsys.readouterr().err


def test_unknown_command_exits_2(capsys):
    assert main(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err
