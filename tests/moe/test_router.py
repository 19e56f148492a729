"""The router (:mod:`mmoe.moe.router`): the ST-MoE router z-loss (Zoph et al., 2022, Eq. 5) by hand, and its gradient
reaching every gate's router."""

from __future__ import annotations

import math

import pytest
import torch

from mmoe.moe import MoEConfig, build_moe_layer
from mmoe.moe.router import Router


def test_router_z_loss_has_the_st_moe_value_by_hand():
    router = Router(MoEConfig(dim=2, ffn_dim=4, num_experts=2, router="linear"))
    with torch.no_grad():
        router.scorer.weight.copy_(torch.eye(2))  # logits = the inputs
    x = torch.tensor([[1.0, 2.0], [0.0, 0.0], [5.0, -3.0]])
    both = ((math.log(math.e + math.e**2)) ** 2 + math.log(2) ** 2) / 2
    assert router(x, torch.tensor([True, True, False])).z_loss.item() == pytest.approx(both, rel=1e-6)
    every = (math.log(math.e + math.e**2) ** 2 + math.log(2) ** 2 + math.log(math.exp(5) + math.exp(-3)) ** 2) / 3
    assert router(x, None).z_loss.item() == pytest.approx(every, rel=1e-6)


@pytest.mark.parametrize("fields", [dict(heads=2), dict(strata=[2, 2], top_k=2)])
def test_z_loss_reaches_the_router_parameters(fields):
    layer = build_moe_layer(MoEConfig(dim=16, ffn_dim=32, num_experts=4, **fields))
    _, record = layer(torch.randn(2, 5, 16))
    assert record.z_loss.item() > 0
    record.z_loss.backward()
    routers = layer.gate_routers()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for r in routers for p in r.parameters())
