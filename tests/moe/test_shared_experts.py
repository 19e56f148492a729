"""DeepSeekMoE's shared experts and fine-grained experts (Dai et al., 2024, §3.1-3.2) against the per-token reference,
and in a multiway backbone (their cost: tests/cli/test_info.py)."""

from __future__ import annotations

import pytest
import torch

from mmoe.model import MultiwayConfig, MultiwayTransformer
from mmoe.model.config import MoEPlan
from mmoe.moe import MoEConfig
from tests.moe.reference import assert_matches_reference
from tests.moe.test_layer import make_layer, padded_input

CASES = [
    # router, top_k, heads, capacity, shared, beta (fine-grained experts: beta = 1/m with m times the experts)
    ("linear", 1, 1, None, 1, 1.0),
    ("xmoe", 2, 1, 1.0, 2, 1.0),
    ("xmoe", 3, 2, None, 1, 0.25),
    ("linear", 4, 4, 0.75, 2, 0.5),
]


@pytest.mark.parametrize("router,top_k,heads,capacity,shared,beta", CASES)
def test_shared_and_fine_grained_experts_match_the_reference(router, top_k, heads, capacity, shared, beta):
    layer = make_layer(
        router=router, top_k=top_k, heads=heads, capacity_factor=capacity, shared_experts=shared, beta=beta
    )
    assert layer.shared_experts.num_experts == shared
    assert layer.experts.hidden_dim == round(12 * beta)
    x, padding = padded_input()
    assert_matches_reference(layer, x, padding)


def test_shared_experts_with_sub_ln_and_frozen_routing():
    layer = make_layer(top_k=2, shared_experts=1, subln=True)
    x, padding = padded_input()
    assert_matches_reference(layer, x, padding)
    frozen = make_layer(top_k=2, shared_experts=1, frozen=True)
    assert not any(p.requires_grad for p in frozen.shared_experts.parameters())


def test_padding_gets_nothing_from_the_shared_experts():
    layer = make_layer(shared_experts=2, heads=2)
    x, padding = padded_input()
    y, _ = layer(x, padding)
    assert torch.all(y[padding] == 0)


def test_shared_experts_are_refused_with_strata():
    with pytest.raises(ValueError, match="MoEConfig.shared_experts=1 with strata"):
        MoEConfig(dim=16, ffn_dim=32, num_experts=4, top_k=2, strata=[2, 2], shared_experts=1)
    with pytest.raises(ValueError, match="shared_experts must be a non-negative integer"):
        MoEConfig(dim=16, ffn_dim=32, num_experts=4, shared_experts=-1)


@pytest.mark.parametrize("mode", ["per_modality", "shared"])
def test_multiway_backbone_builds_shared_experts_in_every_moe_ffn(mode):
    plan = MoEPlan(num_experts=8, top_k=3, beta=0.25, shared_experts=1, every=1, mode=mode)
    model = MultiwayTransformer(MultiwayConfig.preset("test", moe=plan))
    layers = [slot.layer for slot in model.moe_layers()]
    assert len(layers) == (4 if mode == "per_modality" else 2)
    assert all(layer.shared_experts.num_experts == 1 and layer.experts.hidden_dim == 16 for layer in layers)
    out = model(image=torch.randn(2, 3, 32, 32), text=torch.randint(0, 100, (2, 5)))
    ((out.hidden * torch.randn_like(out.hidden)).sum() + sum(r.balance_loss for r in out.routing)).backward()
    assert all(layer.shared_experts.fc1_weight.grad.abs().sum() > 0 for layer in layers)
    assert all(record.expert_counts.sum() == record.expert_index.ge(0).sum() for record in out.routing)
