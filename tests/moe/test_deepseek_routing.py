"""DeepSeek's routing details (DeepSeekMoE's all-choices balance loss, DeepSeek-V3's sequence-wise balance loss, the
routed scaling factor, DeepSeek-V2 / V3 group-limited top-k) and Switch Transformer's router jitter, against the
per-token reference of tests/moe/routing_reference.py, by hand, and their refusals."""

from __future__ import annotations

import pytest
import torch

from mmoe.moe import MoEConfig, MoELayer
from mmoe.moe.cost import active_parameters_per_token, flops_per_token, moe_parameter_count
from tests.moe.routing_reference import assert_details_match_reference
from tests.moe.routing_reference import make_detail_layer as make_layer

DEEPSEEK_V3_LIKE = dict(
    num_experts=8, top_k=4, expert_groups=4, top_groups=2, group_score="top_sum", balance_choices="all",
    balance_batch="sequence", routed_scaling_factor=2.5,
)  # fmt: skip


def padded_input(seed: int = 1, batch: int = 3, length: int = 7):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, 16, generator=generator, dtype=torch.double)
    padding = torch.zeros(batch, length, dtype=torch.bool)
    padding[1, 4:] = True
    padding[2, :] = True  # a sequence of padding only: left out of the sequence-wise mean
    return x, padding


CASES = [
    dict(router="linear", top_k=2, balance_choices="all"),
    dict(router="xmoe", top_k=3, heads=2, balance_choices="all", balance_batch="sequence"),
    dict(router="linear", top_k=2, balance_batch="sequence", routed_scaling_factor=16.0, renormalize=False),
    dict(router="linear", num_experts=8, top_k=2, expert_groups=4, top_groups=1, group_score="max"),
    dict(router="xmoe", **DEEPSEEK_V3_LIKE),
    dict(router="linear", **DEEPSEEK_V3_LIKE, bias_update_rate=1e-3, capacity_factor=1.0),
    dict(router="linear", num_experts=8, top_k=3, heads=2, expert_groups=2, top_groups=1, gate="sigmoid"),
    dict(router="linear", **DEEPSEEK_V3_LIKE, gate="sigmoid", bias_update_rate=1e-3),
    dict(router="xmoe", top_k=2, heads=2, gate="sigmoid", balance_choices="all"),
    dict(router="linear", top_k=2, gate="sigmoid", balance_batch="sequence", bias_update_rate=1e-3),
]


@pytest.mark.parametrize("fields", CASES, ids=[str(i) for i in range(len(CASES))])
def test_deepseek_details_match_the_per_token_reference(fields):
    layer = make_layer(**fields)
    x, padding = padded_input()
    assert_details_match_reference(layer, x, padding)


@pytest.mark.parametrize("heads", [1, 2])
def test_router_jitter_matches_the_reference_in_training_and_is_off_in_eval(heads):
    layer = make_layer(router="linear", top_k=2, heads=heads, router_jitter=0.3)
    x, padding = padded_input()
    assert_details_match_reference(layer.train(), x, padding, jitter_seed=7)
    plain = make_layer(router="linear", top_k=2, heads=heads)
    y_eval, _ = layer.eval()(x, padding)
    torch.testing.assert_close(y_eval, plain.eval()(x, padding)[0])
    torch.manual_seed(0)
    _, jittered = layer.train()(x, padding)
    _, clean = plain.train()(x, padding)
    assert not torch.equal(jittered.expert_index, clean.expert_index)  # eps = 0.3 moves some choices


def test_group_limited_choices_stay_inside_the_chosen_groups():
    layer = make_layer(router="linear", **DEEPSEEK_V3_LIKE)
    _, routing = layer(torch.randn(4, 16, 16, dtype=torch.double))
    groups_used = [len(set((row // 2).tolist())) for row in routing.expert_index.view(-1, 4)]
    assert max(groups_used) <= 2 and min(groups_used) >= 1
    ungrouped = make_layer(router="linear", **{**DEEPSEEK_V3_LIKE, "expert_groups": 1, "top_groups": None})
    _, free = ungrouped(torch.randn(4, 16, 16, dtype=torch.double))
    assert max(len(set((row // 2).tolist())) for row in free.expert_index.view(-1, 4)) > 2  # the limit binds


def test_balance_conventions_by_hand():
    """A router that scores every expert alike: both conventions give 1 (N * sum_i (1/N)(1/N) * N ... = 1); with
    K = 1 'all' is 'first'; with K = 2 'all' counts the second choices that 'first' leaves out."""
    x = torch.randn(2, 5, 16, dtype=torch.double)
    for choices in ("first", "all"):
        layer = make_layer(router="linear", top_k=2, balance_choices=choices)
        torch.nn.init.zeros_(layer.router.scorer.weight)
        assert layer(x)[1].balance_loss.item() == pytest.approx(1.0)
    one_first, one_all = (make_layer(router="linear", balance_choices=c)(x)[1].balance_loss for c in ("first", "all"))
    torch.testing.assert_close(one_first, one_all)
    two_first, two_all = (
        make_layer(router="linear", top_k=2, balance_choices=c)(x)[1].balance_loss for c in ("first", "all")
    )
    assert not torch.allclose(two_first, two_all)


def test_sigmoid_sequence_wise_balance_by_hand_ignores_the_selection_bias():
    """DeepSeek-V3 Eq. 17-20 per sequence: f_i = N / (K T) x the (sub-)tokens whose top-K of the sigmoid scores s hold
    i, P_i the mean of s_i / sum_j s_j; a selection bias that moves every choice (Eq. 16) leaves the loss as it was."""
    x = torch.randn(2, 6, 16, dtype=torch.double)
    fields = dict(top_k=2, gate="sigmoid", bias_update_rate=1e-3, balance_choices="all", balance_batch="sequence")
    layer = make_layer(router="linear", **fields)
    expected = []
    for scores in (x @ layer.router.scorer.weight.t()).sigmoid():  # one sequence's (T, E) scores
        f = 4 / (2 * 6) * torch.bincount(scores.topk(2, dim=-1).indices.reshape(-1), minlength=4)
        expected.append((f * (scores / scores.sum(-1, keepdim=True)).mean(0)).sum())
    for bias in ([0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 5.0, 5.0]):
        layer.router.selection_bias.copy_(torch.tensor(bias, dtype=torch.double))
        _, routing = layer(x)
        torch.testing.assert_close(routing.balance_loss, torch.stack(expected).mean())
    assert set(routing.expert_index.unique().tolist()) == {2, 3}  # the bias chose every (sub-)token's experts


def test_sequence_wise_loss_is_the_mean_of_each_sequence_alone():
    x, padding = padded_input()
    sequence = make_layer(router="linear", top_k=2, balance_batch="sequence", balance_choices="all")
    local = make_layer(router="linear", top_k=2, balance_choices="all")
    per_sample = [local(x[b : b + 1], padding[b : b + 1])[1].balance_loss for b in range(2)]  # sample 2: padding
    torch.testing.assert_close(sequence(x, padding)[1].balance_loss, torch.stack(per_sample).mean())


def test_routed_scaling_multiplies_the_routed_experts_only():
    x = torch.randn(2, 5, 16, dtype=torch.double)
    plain, scaled = (make_layer(top_k=2, shared_experts=1, routed_scaling_factor=s) for s in (1.0, 2.5))
    shared = plain.shared_experts.forward_every_expert(x.reshape(-1, 16)).view_as(x)
    torch.testing.assert_close(scaled(x)[0] - shared, 2.5 * (plain(x)[0] - shared))


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(balance_choices="every"), "MoEConfig.balance_choices must be one of ('first', 'all'), got 'every'"),
        (dict(balance_batch="batch"), "MoEConfig.balance_batch must be one of ('local', 'global', 'sequence')"),
        (dict(strata=[2, 2], top_k=2, balance_batch="sequence"), "MoEConfig.balance_batch='sequence' with strata"),
        (dict(routing="expert_choice", capacity_factor=2.0, balance_choices="all"), "no balance loss"),
        (dict(routed_scaling_factor=0.0), "MoEConfig.routed_scaling_factor must be a finite number > 0, got 0.0"),
        (dict(routing="expert_choice", capacity_factor=2.0, routed_scaling_factor=2.0), "token-choice routing"),
        (dict(expert_groups=3), "MoEConfig.expert_groups=3: must divide num_experts=4"),
        (dict(expert_groups=0), "MoEConfig.expert_groups=0: expected a positive integer"),
        (dict(expert_groups=2, top_groups=3), "MoEConfig.top_groups=3: expected None or an integer in [1, expert_gr"),
        (dict(expert_groups=2, top_groups=1, top_k=3), "MoEConfig.top_groups=1: top_k=3 exceeds the 1 x 2 experts"),
        (dict(num_experts=8, expert_groups=2, top_groups=2, top_k=1, group_score="top_sum"), "top_k // top_groups = 0"),
        (dict(expert_groups=2, strata=[2, 2], top_k=2), "MoEConfig.expert_groups=2: Stratified MoE gates"),
        (dict(router_jitter=1.0), "MoEConfig.router_jitter must be in [0, 1), got 1.0"),
    ],
)
def test_refusals_are_one_line_naming_field_value_and_expectation(fields, message):
    with pytest.raises(ValueError) as error:
        MoEConfig(**{"dim": 16, "ffn_dim": 12, "num_experts": 4, **fields})
    assert message in str(error.value) and "\n" not in str(error.value)


def test_counts_are_unchanged():
    """Groups, scaling, jitter and the balance conventions change no parameter and no FLOP (mmoe info's counts)."""
    plain = MoEConfig(dim=16, ffn_dim=12, num_experts=8, top_k=4)
    deepseek = MoEConfig(dim=16, ffn_dim=12, router_jitter=0.01, **DEEPSEEK_V3_LIKE)
    for count in (moe_parameter_count, active_parameters_per_token, flops_per_token):
        assert count(deepseek) == count(plain)
    assert moe_parameter_count(deepseek) == sum(p.numel() for p in MoELayer(deepseek).parameters())


def test_mmoe_info_backbone_counts_and_config_round_trip_are_unchanged():
    """``mmoe info`` counts a backbone by :func:`mmoe.model.cost.backbone_cost`: every routing detail leaves its
    numbers as they are, and a backbone config with them survives the plain-dict form checkpoints store."""
    from mmoe.model import MoEPlan, MultiwayConfig
    from mmoe.model.config import config_from_dict, config_to_dict
    from mmoe.model.cost import backbone_cost

    details = dict(DEEPSEEK_V3_LIKE, router_jitter=0.01, local_entropy_weight=0.1, global_entropy_weight=0.1,
                   global_entropy_min_experts=2.0, capacity_factor=1.0, capacity_priority="batch_priority")  # fmt: skip
    plain = MultiwayConfig.preset("test", moe=MoEPlan(num_experts=8, top_k=4, capacity_factor=1.0))
    detailed = MultiwayConfig.preset("test", moe=MoEPlan(**details))
    assert backbone_cost(detailed, 24) == backbone_cost(plain, 24)
    assert config_from_dict(config_to_dict(detailed)) == detailed
