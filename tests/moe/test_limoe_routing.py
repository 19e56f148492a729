"""LIMoE's entropy losses (Mustafa et al., 2022) and V-MoE's batch-priority routing (Riquelme et al., 2021) against
the per-token reference of tests/moe/routing_reference.py, by hand, and their refusals."""

from __future__ import annotations

import math

import pytest
import torch

from mmoe.moe import MoEConfig, MoELayer
from mmoe.moe.cost import active_parameters_per_token, flops_per_token, moe_parameter_count
from tests.moe.routing_reference import assert_details_match_reference
from tests.moe.routing_reference import make_detail_layer as make_layer

LIMOE = dict(local_entropy_weight=0.3, global_entropy_weight=0.7, capacity_priority="batch_priority")


def joint_input(seed: int = 1, batch: int = 3, length: int = 9):
    """A shared FFN's joint sequence: 4 image tokens then 5 text tokens, the text of one sample partly padding."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, 16, generator=generator, dtype=torch.double)
    padding = torch.zeros(batch, length, dtype=torch.bool)
    padding[1, 6:] = True
    return x, padding


@pytest.mark.parametrize(
    "router,heads,top_k,capacity,threshold",
    [
        ("linear", 1, 1, 0.75, None),
        ("linear", 1, 2, 0.6, 3.0),
        ("xmoe", 2, 2, 1.0, 2.0),
        ("xmoe", 1, 1, 0.5, 4.0),
        ("linear", 2, 3, 0.8, 1.5),
    ],
)
def test_entropy_losses_and_batch_priority_match_the_per_token_reference(router, heads, top_k, capacity, threshold):
    layer = make_layer(
        router=router, heads=heads, top_k=top_k, capacity_factor=capacity, global_entropy_min_experts=threshold, **LIMOE
    )
    x, padding = joint_input()
    routing = assert_details_match_reference(layer, x, padding, segment_lengths=[4, 5])
    assert routing.dropped_fraction.item() > 0  # the capacity drops, so the priority decides something
    assert set(routing.auxiliary_losses) == {"local_entropy_loss", "global_entropy_loss"}


def test_one_modality_without_segments_matches_the_reference():
    layer = make_layer(local_entropy_weight=1.0, global_entropy_weight=1.0)
    x, padding = joint_input()
    assert_details_match_reference(layer, x, padding)


def test_global_entropy_by_hand_and_its_threshold():
    """A linear router scoring by the input: one modality spread evenly over 2 of 4 experts has H(p̃) = log 2 at a
    confident gate; the threshold log S charges log S - log 2 for S > 2 and nothing for S <= 2."""
    x = torch.zeros(1, 4, 4, dtype=torch.double)
    x[0, [0, 1], 0] = 60.0  # confident: expert 0
    x[0, [2, 3], 1] = 60.0  # confident: expert 1
    for minimum, expected in [(None, -math.log(2)), (2.0, 0.0), (1.0, 0.0), (3.0, math.log(3 / 2))]:
        config = MoEConfig(dim=4, ffn_dim=8, num_experts=4, router="linear", global_entropy_weight=2.0,
                           local_entropy_weight=1.0, global_entropy_min_experts=minimum)  # fmt: skip
        layer = MoELayer(config).double()
        with torch.no_grad():
            layer.router.scorer.weight.copy_(torch.eye(4, dtype=torch.double))
        _, routing = layer(x)
        assert routing.auxiliary_losses["global_entropy_loss"].item() == pytest.approx(2.0 * expected, abs=1e-12)
        assert routing.auxiliary_losses["local_entropy_loss"].item() == pytest.approx(0.0, abs=1e-12)
    # Two modalities, each on its own expert: the sum over modalities charges each log 2 below S = 2.
    two = MoELayer(MoEConfig(dim=4, ffn_dim=8, num_experts=4, router="linear", global_entropy_weight=1.0,
                             global_entropy_min_experts=2.0)).double()  # fmt: skip
    with torch.no_grad():
        two.router.scorer.weight.copy_(torch.eye(4, dtype=torch.double))
    _, routing = two(x, segment_lengths=[2, 2])
    assert routing.auxiliary_losses["global_entropy_loss"].item() == pytest.approx(2 * math.log(2), abs=1e-12)


def test_batch_priority_drops_the_least_confident_tokens_first():
    """Four tokens for one expert with room for two: GShard keeps the first two, batch-priority routing the two whose
    top gate value is highest, wherever they stand."""
    confidence = [0.5, 1.0, 4.0, 3.0]  # the logit margin of expert 0 over the other three
    x = torch.zeros(1, 4, 4, dtype=torch.double)
    x[0, :, 0] = torch.tensor(confidence, dtype=torch.double)
    kept = {}
    for priority in ("position", "batch_priority"):
        config = MoEConfig(dim=4, ffn_dim=8, num_experts=4, router="linear", capacity_factor=2.0,
                           capacity_priority=priority)  # fmt: skip
        layer = MoELayer(config).double()
        with torch.no_grad():
            layer.router.scorer.weight.copy_(torch.eye(4, dtype=torch.double))
        _, routing = layer(x)
        kept[priority] = (routing.expert_index[0, :, 0, 0] == 0).tolist()
    assert kept["position"] == [True, True, False, False]
    assert kept["batch_priority"] == [False, False, True, True]


def test_losses_are_zero_free_and_absent_when_off():
    _, routing = make_layer()(joint_input()[0])
    assert routing.auxiliary_losses == {}


def test_entropy_losses_ignore_padding():
    layer = make_layer(**LIMOE, capacity_factor=None, eval_capacity_factor=1.0)
    x, padding = joint_input()
    garbage = x.clone()
    garbage[padding] = 50 * torch.randn_like(garbage[padding])
    _, clean = layer(x, padding, [4, 5])
    _, noisy = layer(garbage, padding, [4, 5])
    for name in clean.auxiliary_losses:
        torch.testing.assert_close(clean.auxiliary_losses[name], noisy.auxiliary_losses[name])


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(num_experts=1, local_entropy_weight=0.1), "MoEConfig.local_entropy_weight=0.1: the entropy over one"),
        (dict(gate="sigmoid", global_entropy_weight=0.1), "MoEConfig.global_entropy_weight=0.1: LIMoE's entropies"),
        (dict(routing="expert_choice", capacity_factor=2.0, local_entropy_weight=0.1), "token-choice routing"),
        (dict(strata=[2, 2], top_k=2, local_entropy_weight=0.1), "not defined for Stratified MoE gates"),
        (dict(local_entropy_weight=-1.0), "MoEConfig.local_entropy_weight must be a finite number >= 0, got -1.0"),
        (dict(global_entropy_min_experts=5.0), "MoEConfig.global_entropy_min_experts=5.0: exceeds num_experts=4"),
        (dict(global_entropy_min_experts=0.5), "MoEConfig.global_entropy_min_experts=0.5: expected None or"),
        (dict(capacity_priority="batch_priority"), "MoEConfig.capacity_priority='batch_priority': batch-priority"),
        (dict(capacity_priority="random"), "MoEConfig.capacity_priority must be one of ('position', 'batch_pri"),
        (dict(capacity_priority="batch_priority", capacity_factor=math.inf), "set a finite capacity_factor"),
    ],
)
def test_refusals_are_one_line_naming_field_value_and_expectation(fields, message):
    with pytest.raises(ValueError, match=None) as error:
        MoEConfig(**{"dim": 16, "ffn_dim": 12, "num_experts": 4, **fields})
    assert message in str(error.value) and "\n" not in str(error.value)


def test_counts_are_unchanged():
    """The entropy losses and the priority change no parameter and no FLOP (mmoe info's closed forms)."""
    plain = MoEConfig(dim=16, ffn_dim=12, num_experts=4, top_k=2, capacity_factor=1.0)
    limoe = MoEConfig(dim=16, ffn_dim=12, num_experts=4, top_k=2, capacity_factor=1.0, **LIMOE)
    for count in (moe_parameter_count, active_parameters_per_token, flops_per_token):
        assert count(limoe) == count(plain)
    assert moe_parameter_count(limoe) == sum(p.numel() for p in MoELayer(limoe).parameters())
