"""Auxiliary-loss-free load balancing (Wang et al., 2024): the selection bias against the per-token reference and the
bias update against a hand computation."""

from __future__ import annotations

import pytest
import torch

from mmoe.moe import MoEConfig
from tests.moe.reference import assert_matches_reference
from tests.moe.test_layer import make_layer, padded_input


@pytest.mark.parametrize(
    "router,gate,top_k,heads,capacity",
    [("linear", "softmax", 1, 1, None), ("xmoe", "sigmoid", 2, 2, 1.0), ("xmoe", "softmax", 3, 1, None)],
)
def test_biased_selection_matches_the_reference(router, gate, top_k, heads, capacity):
    """The bias changes which experts are chosen; the gate weights stay the unbiased scores (Eq. 3)."""
    layer = make_layer(
        router=router, gate=gate, top_k=top_k, heads=heads, capacity_factor=capacity, bias_update_rate=0.01
    )
    x, padding = padded_input()
    _, unbiased = layer(x, padding)
    with torch.no_grad():
        layer.router.selection_bias.copy_(torch.tensor([0.3, -0.2, 0.1, -0.25], dtype=torch.double))
    routing = assert_matches_reference(layer, x, padding)
    assert not torch.equal(routing.expert_index, unbiased.expert_index)


def test_bias_update_by_hand():
    layer = make_layer(bias_update_rate=0.01)
    router = layer.router
    assert router.selection_bias.tolist() == [0.0] * 4
    router.update_selection_bias(torch.tensor([5, 1, 3, 3]))  # mean 3: errors -2, 2, 0, 0
    torch.testing.assert_close(router.selection_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0], dtype=torch.double))
    router.update_selection_bias(torch.tensor([0, 4, 4, 4]))  # mean 3: errors 3, -1, -1, -1
    torch.testing.assert_close(router.selection_bias, torch.tensor([0.0, 0.0, -0.01, -0.01], dtype=torch.double))


def test_z_score_bias_update_by_hand():
    layer = make_layer(bias_update_rate=0.01, bias_update_rule="z_score")
    router = layer.router
    router.update_selection_bias(torch.tensor([5, 1, 3, 3]))  # mean 3: errors -2, 2, 0, 0; spread sqrt(8 / 4)
    step = 0.01 / 2**0.5
    torch.testing.assert_close(router.selection_bias, torch.tensor([-2 * step, 2 * step, 0.0, 0.0], dtype=torch.double))
    router.update_selection_bias(torch.tensor([3, 3, 3, 3]))  # equal loads: no spread, no move
    torch.testing.assert_close(router.selection_bias, torch.tensor([-2 * step, 2 * step, 0.0, 0.0], dtype=torch.double))
    router.update_selection_bias(torch.tensor([0, 4, 4, 4]))  # mean 3: errors 3, -1, -1, -1; spread sqrt(12 / 4)
    expected = torch.tensor([-2 * step, 2 * step, 0.0, 0.0], dtype=torch.double)
    expected += 0.01 * torch.tensor([3.0, -1.0, -1.0, -1.0], dtype=torch.double) / 3**0.5
    torch.testing.assert_close(router.selection_bias, expected)


def test_bias_is_saved_in_the_state_dict_and_only_when_on():
    layer = make_layer(bias_update_rate=0.01)
    layer.router.update_selection_bias(torch.tensor([1, 2, 3, 6]))
    state = layer.state_dict()
    assert "router.selection_bias" in state
    restored = make_layer(seed=5, bias_update_rate=0.01)
    restored.load_state_dict(state)
    torch.testing.assert_close(restored.router.selection_bias, layer.router.selection_bias)
    assert "router.selection_bias" not in make_layer().state_dict()
    assert make_layer().router.selection_bias is None


def test_bad_rate_and_strata_are_refused():
    with pytest.raises(ValueError, match="bias_update_rate must be a finite number >= 0, got -0.1"):
        MoEConfig(dim=16, ffn_dim=32, num_experts=4, bias_update_rate=-0.1)
    with pytest.raises(
        ValueError, match=r"bias_update_rule='z_score': moves the loss-free bias, which bias_update_rate"
    ):
        MoEConfig(dim=16, ffn_dim=32, num_experts=4, bias_update_rule="z_score")
    with pytest.raises(ValueError, match=r"bias_update_rule must be one of \('sign', 'z_score'\), got 'zscore'"):
        MoEConfig(dim=16, ffn_dim=32, num_experts=4, bias_update_rate=0.01, bias_update_rule="zscore")
    with pytest.raises(ValueError, match="bias_update_rate=0.01 with strata"):
        MoEConfig(dim=16, ffn_dim=32, num_experts=4, top_k=2, strata=[2, 2], bias_update_rate=0.01)
