"""Expert-choice routing (Zhou et al., 2022) against a brute-force per-expert top-C (outputs, gradients, counts and
choices), tokens no expert took, and the combinations it refuses."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.moe import MoEConfig
from mmoe.moe.expert_choice import expert_capacity
from tests.moe.reference import assert_matches_reference
from tests.moe.test_layer import make_layer, padded_input


@pytest.mark.parametrize(
    "router,gate,heads,capacity,shared",
    [
        ("linear", "softmax", 1, 2.0, 0),
        ("xmoe", "softmax", 1, 1.0, 0),
        ("xmoe", "sigmoid", 2, 2.0, 0),
        ("linear", "softmax", 4, 0.5, 1),
    ],
)
def test_expert_choice_matches_a_brute_force_top_c(router, gate, heads, capacity, shared):
    layer = make_layer(
        router=router, gate=gate, heads=heads, routing="expert_choice", capacity_factor=capacity, shared_experts=shared
    )
    x, padding = padded_input()
    routing = assert_matches_reference(layer, x, padding)
    sub_tokens = 2 * 7 * heads
    capacity_rows = math.ceil(capacity * sub_tokens / 4)
    assert routing.expert_index.shape == (2, 7, heads, 4)
    assert routing.expert_counts.tolist() == [capacity_rows] * 4  # fewer real sub-tokens than C never happens here
    assert routing.balance_loss.item() == 0.0 and routing.dropped_fraction.item() == 0.0
    real = (~padding)[..., None].expand(-1, -1, heads)
    unrouted = ((routing.expert_index == -1).all(-1) & real).sum() / real.sum()
    assert routing.unrouted_fraction.item() == pytest.approx(unrouted.item())
    assert torch.all(routing.expert_index[padding] == -1)


def test_tokens_no_expert_takes_get_nothing_and_are_reported():
    layer = make_layer(router="linear", routing="expert_choice", capacity_factor=0.5)
    x, _ = padded_input(length=8)
    y, routing = layer(x)
    unrouted = (routing.expert_index == -1).all(-1).squeeze(-1)  # (B, L)
    assert unrouted.any() and routing.unrouted_fraction.item() == pytest.approx(unrouted.float().mean().item())
    assert torch.all(y[unrouted] == 0)
    assert expert_capacity(16, 4, 0.5) == 2 and routing.expert_counts.tolist() == [2, 2, 2, 2]


def test_capacity_is_at_most_the_tokens_and_empty_batches_work():
    layer = make_layer(routing="expert_choice", capacity_factor=8.0)
    x, padding = padded_input(length=3)
    routing = assert_matches_reference(layer, x, padding)
    assert routing.expert_counts.tolist() == [int((~padding).sum())] * 4  # every expert takes every real token
    assert expert_capacity(16, 4, 4.0) == expert_capacity(16, 4, 1e308) == 16  # c >= E: all, never an overflow
    y, routing = layer(torch.randn(0, 5, 16, dtype=torch.double))
    assert y.shape == (0, 5, 16) and routing.expert_counts.sum() == 0


def test_multiway_backbone_with_expert_choice():
    plan = MoEPlan(num_experts=4, routing="expert_choice", capacity_factor=2.0, every=1, heads=2)
    model = MultiwayTransformer(MultiwayConfig.preset("test", moe=plan))
    out = model(image=torch.randn(2, 3, 32, 32), text=torch.randint(0, 100, (2, 5)))
    (out.hidden * torch.randn_like(out.hidden)).sum().backward()
    assert len(out.routing) == 4 and all(record.unrouted_fraction is not None for record in out.routing)
    assert all(slot.layer.experts.fc1_weight.grad.abs().sum() > 0 for slot in model.moe_layers())


@pytest.mark.parametrize(
    "fields,named",
    [
        (dict(), "capacity_factor=None with routing='expert_choice'"),
        (dict(capacity_factor=2.0, top_k=2), "top_k=2 with routing='expert_choice'"),
        (dict(capacity_factor=2.0, bias_update_rate=0.01), "bias_update_rate=0.01 with routing"),
        (dict(capacity_factor=2.0, balance_batch="global"), "balance_batch='global' with routing"),
        (dict(capacity_factor=2.0, routing="experts"), "routing must be one of"),
    ],
)
def test_undefined_combinations_are_one_line(fields, named):
    fields = {"routing": "expert_choice"} | fields
    with pytest.raises(ValueError, match=named) as error:
        MoEConfig(dim=16, ffn_dim=32, num_experts=4, **fields)
    assert "\n" not in str(error.value)


def test_expert_choice_cost_uses_the_mean_experts_per_token():
    """Zhou et al.: a token is processed by c experts on average; the FLOPs per token averaged over a batch where
    every expert takes exactly C = c n / E tokens equal the closed form."""
    from mmoe.moe.cost import expert_parameters, flops_per_token, router_flops

    config = MoEConfig(dim=16, ffn_dim=32, num_experts=4, router="linear", routing="expert_choice", capacity_factor=2.0)
    layer = make_layer(router="linear", ffn_dim=32, routing="expert_choice", capacity_factor=2.0)
    _, routing = layer(torch.randn(2, 8, 16, dtype=torch.double))
    rows = int(routing.expert_counts.sum())  # E * C = c * n
    mean_flops = router_flops(config, 4) + rows / 16 * 2 * 2 * 16 * 32
    assert flops_per_token(config) == round(mean_flops)
    assert expert_parameters(config) == 2 * 16 * 32 + 32 + 16


def test_a_token_no_expert_took_is_still_counted_as_a_token_not_as_padding():
    from mmoe.metrics.routing import RoutingTotals, valid_tokens

    layer = make_layer(routing="expert_choice", capacity_factor=0.5)
    x, padding = padded_input()
    for mask in (padding, None):
        _, routing = layer(x, mask)
        unrouted = (routing.expert_index == -1).all(-1).all(-1)
        assert unrouted.any()  # c = 0.5: half the sub-tokens go to no expert
        real = torch.ones_like(padding) if mask is None else ~padding
        assert torch.equal(valid_tokens(routing), real)
        totals = RoutingTotals()
        totals.add([dataclasses.replace(routing, layer=0, modality="vision")])
        assert totals.summary()["layer0/vision"]["tokens"] == real.sum().item()
