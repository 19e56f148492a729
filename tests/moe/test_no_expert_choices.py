"""Choices of no expert (the id E), what adaptive routers (top-p, ReLU gates, null experts) leave empty: the dispatch
neither runs, counts nor drops them, the experts run on the real choices' rows only, the balance loss leaves them
out, and the routing statistics count the experts each (sub-)token used."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmoe.metrics.routing import RoutingTotals, active_experts_histogram, mean_active_experts
from mmoe.model import MoEPlan
from mmoe.moe import MoEConfig, MoELayer
from mmoe.moe.balance import balance_loss, sequence_balance_loss
from mmoe.moe.dispatch import plan_dispatch
from tests.moe.reference import reference_expert

NUM_EXPERTS = 4


class AdaptiveConfig(MoEConfig):
    """A top-2 config whose router may leave a choice empty (what an adaptive router's config says)."""

    @property
    def may_choose_no_expert(self) -> bool:
        return True


def test_plan_leaves_no_expert_choices_out_of_slices_counts_and_drops() -> None:
    none = NUM_EXPERTS
    expert_SK = torch.tensor([[2, none], [0, 1], [none, none], [2, 0], [1, none]])
    valid_S = torch.tensor([True, True, True, True, False])
    for capacity_factor in (None, 8.0):
        plan = plan_dispatch(expert_SK, valid_S, NUM_EXPERTS, capacity_factor)
        expected_kept = (expert_SK < none) & valid_S[:, None]
        assert torch.equal(plan.kept_SK, expected_kept)
        assert plan.expert_counts_E.tolist() == [2, 1, 2, 0]
        assert float(plan.dropped_fraction) == 0.0
        real_rows = int((expert_SK < none).sum())  # padding rows stay in their slices; no-expert rows do not
        assert int(plan.offsets_E[-1]) == real_rows
        assert (plan.expert_C[:real_rows] < none).all() and (plan.expert_C[real_rows:] == none).all()


def test_capacity_counts_real_tokens_and_drops_only_real_choices() -> None:
    none = NUM_EXPERTS
    # Five tokens all first-choosing expert 0; capacity ceil(0.4 * 2 * 5 / 4) = 1 keeps one of them.
    expert_SK = torch.tensor([[0, none]] * 5)
    plan = plan_dispatch(expert_SK, None, NUM_EXPERTS, 0.4)
    assert plan.kept_SK[:, 0].tolist() == [True, False, False, False, False]
    assert not plan.kept_SK[:, 1].any()
    assert abs(float(plan.dropped_fraction) - 4 / 5) < 1e-6  # 4 of the 5 real choices, none of the empty ones


def _adaptive_layer(seed: int = 0) -> MoELayer:
    torch.manual_seed(seed)
    config = AdaptiveConfig(dim=12, ffn_dim=20, num_experts=NUM_EXPERTS, top_k=2, renormalize=False, router="linear")
    layer = MoELayer(config).double()
    with torch.no_grad():
        layer.router.scorer.weight.normal_(0.0, 1.0)  # scores of order 1-4: no ties, a real mix of empty choices
    original = layer.router.forward

    def leave_weak_second_choices_empty(x_SD, valid_S, layout=None):
        routed = original(x_SD, valid_S, layout)
        empty_SK = torch.zeros_like(routed.expert_SK, dtype=torch.bool)
        empty_SK[:, 1] = routed.weight_SK[:, 1] < 0.2
        routed.expert_SK = torch.where(empty_SK, NUM_EXPERTS, routed.expert_SK)
        routed.weight_SK = torch.where(empty_SK, torch.zeros_like(routed.weight_SK), routed.weight_SK)
        layer.last_choices = routed.expert_SK
        return routed

    layer.router.forward = leave_weak_second_choices_empty
    return layer


def test_layer_runs_the_real_choices_only_and_matches_a_per_token_loop() -> None:
    layer = _adaptive_layer()
    x = torch.randn(2, 7, 12, dtype=torch.double, requires_grad=True)
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[1, 5:] = True
    rows_run = []
    experts_forward = layer.experts.forward

    def counting_forward(x_RD, expert_R, offsets_E, rows_per_expert=None):
        rows_run.append(x_RD.shape[0])
        return experts_forward(x_RD, expert_R, offsets_E, rows_per_expert)

    layer.experts.forward = counting_forward
    y, routing = layer(x, padding)

    index = routing.expert_index[:, :, 0]  # (B, L, K), -1 at padding and at empty choices
    used = index >= 0
    assert (~used[..., 1][~padding]).any() and used[..., 1][~padding].any(), "want both one- and two-expert tokens"
    real_choices = int(used.sum())
    assert rows_run == [int((layer.last_choices < NUM_EXPERTS).sum())]  # padding's rows still run (static slices)
    assert rows_run[0] < layer.last_choices.numel()
    assert int(routing.expert_counts.sum()) == real_choices
    assert float(routing.dropped_fraction) == 0.0

    gate_logits, _ = layer.router.scorer(x.reshape(-1, 12))
    probs = gate_logits.softmax(-1).view(2, 7, NUM_EXPERTS)
    expected = torch.zeros_like(y)
    for b in range(2):
        for t in range(7):
            if padding[b, t]:
                continue
            for expert in index[b, t].tolist():
                if expert >= 0:
                    expected[b, t] += probs[b, t, expert] * reference_expert(layer.experts, expert, x[b, t])
    torch.testing.assert_close(y, expected)

    weights = torch.randn_like(y)
    inputs = [x, *layer.experts.parameters(), *layer.router.parameters()]
    grads = torch.autograd.grad((y * weights).sum(), inputs)
    expected_grads = torch.autograd.grad((expected * weights).sum(), inputs)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_balance_losses_leave_empty_choices_out() -> None:
    probs_SE = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.2, 0.5, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    chosen_SK = torch.tensor([[0], [NUM_EXPERTS], [1]])
    weights_S = torch.ones(3)
    # f = (1/3, 1/3, 0, 0): the empty choice counts for no expert; P the mean of the rows.
    mean_prob = probs_SE.mean(0)
    expected = NUM_EXPERTS * (mean_prob[0] / 3 + mean_prob[1] / 3)
    torch.testing.assert_close(balance_loss(probs_SE, chosen_SK, weights_S), expected)
    one_sequence = sequence_balance_loss(probs_SE, chosen_SK, weights_S, torch.zeros(3, dtype=torch.long), 1)
    torch.testing.assert_close(one_sequence, expected)
    # Two sequences: an empty choice in the first must not count for the second's expert 0.
    two = sequence_balance_loss(probs_SE, chosen_SK, weights_S, torch.tensor([0, 0, 1]), 2)
    first = NUM_EXPERTS * (probs_SE[:2].mean(0)[0] / 2)
    second = NUM_EXPERTS * probs_SE[2, 1]
    torch.testing.assert_close(two, (first + second) / 2)


def test_active_experts_histogram_counts_the_experts_each_token_used() -> None:
    layer = _adaptive_layer(seed=1)
    x = torch.randn(2, 7, 12, dtype=torch.double)
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[0, 6] = True
    _, routing = layer(x, padding)
    used = (routing.expert_index >= 0).sum(-1)[..., 0][~padding]
    histogram = active_experts_histogram(routing, NUM_EXPERTS + 1)
    assert histogram.tolist() == [int((used == n).sum()) for n in range(NUM_EXPERTS + 1)]
    assert int(histogram.sum()) == 13  # the real tokens only
    torch.testing.assert_close(float(mean_active_experts(histogram)), float(used.double().mean()))

    totals = RoutingTotals()
    totals.add([routing, routing])
    assert totals.active[next(iter(totals.active))].tolist() == (2 * histogram).tolist()
    summary = next(iter(totals.summary().values()))
    assert abs(summary["active_experts"] - float(used.double().mean())) < 1e-12


def test_top_k_layers_use_k_experts_per_token() -> None:
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(dim=12, ffn_dim=20, num_experts=NUM_EXPERTS, top_k=2, heads=2))
    _, routing = layer(torch.randn(3, 5, 12))
    histogram = active_experts_histogram(routing, NUM_EXPERTS + 1)
    assert histogram.tolist() == [0, 0, 3 * 5 * 2, 0, 0]  # every sub-token: two experts


def test_expert_parallelism_refuses_an_adaptive_router() -> None:
    class AdaptivePlan(MoEPlan):
        @property
        def may_choose_no_expert(self) -> bool:
            return True

    fields = {"num_experts": 4, "router": "linear"}
    assert dataclasses.replace(AdaptivePlan(**fields), expert_parallel=1).expert_parallel == 1
    with pytest.raises(ValueError, match=r"^MoEPlan.expert_parallel=2 with an adaptive router"):
        AdaptivePlan(**fields, expert_parallel=2)
