"""Expert-choice routing (Zhou et al., 2022, "Mixture-of-Experts with Expert Choice Routing", §3.1-3.2).

Each expert picks its top-C (sub-)tokens of the batch by gate score (§3.2, Eq. 1-3): C = ceil(c * n / E) for n
tokens, E experts and the capacity factor c ("on average each token is processed by c experts"); S = Softmax(X W_g)
(here the router's gate values: softmax or sigmoid, X-MoE or linear scores), G, I = TopK(S^T, C), and the output of a
token is the sum of G * FFN_e(x) over the experts that took it. A token may be taken by no expert (it then gets
nothing: the block's residual carries it) or by many.

Rows come out sorted by expert (E slices of C rows), so the grouped experts and the expert-parallel exchange run on
them as on a token-choice plan; the combine is a weighted ``index_add`` (the rows are not a permutation of the
tokens). n counts every (sub-)token of the batch, padding included, so C is a static shape (no host sync); padding
scores -inf and is never kept.

Shape legend: S (sub-)tokens, E experts, C rows = E * capacity, D width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class ExpertChoicePlan:
    """Which (sub-)tokens each expert took.

    Attributes:
        token_C: the (sub-)token of each row, rows grouped by expert (expert e owns rows e*C .. e*C + C - 1).
        expert_C: the expert of each row (non-decreasing).
        offsets_E: int32 slice ends per expert, for grouped GEMMs.
        weight_C: the gate value of each row, 0 where the row is padding (differentiable).
        expert_counts_E: long, real (sub-)tokens each expert took.
        expert_index_SE: long, the experts that took each (sub-)token, highest gate first, then -1.
        unrouted_fraction: share of the real (sub-)tokens no expert took.
        capacity: C, the rows of every expert (a static shape: the experts run batched on E x C rows).
    """

    token_C: torch.Tensor
    expert_C: torch.Tensor
    offsets_E: torch.Tensor
    weight_C: torch.Tensor
    expert_counts_E: torch.Tensor
    expert_index_SE: torch.Tensor
    unrouted_fraction: torch.Tensor
    capacity: int


def expert_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """C = ceil(c * n / E) (Zhou et al. §3.2), at most n: every c >= E gives n (c is clipped to E first, so that a
    huge c never overflows; the config refuses an infinite one)."""
    return min(num_tokens, math.ceil(min(capacity_factor, num_experts) * num_tokens / num_experts))


def plan_expert_choice(
    scores_SE: torch.Tensor, valid_S: torch.Tensor | None, capacity_factor: float
) -> ExpertChoicePlan:
    """Every expert's top-C (sub-)tokens by ``scores_SE`` (the gate values, softmax or sigmoid)."""
    num_tokens, num_experts = scores_SE.shape
    device = scores_SE.device
    capacity = expert_capacity(num_tokens, num_experts, capacity_factor)
    valid_S = torch.ones(num_tokens, dtype=torch.bool, device=device) if valid_S is None else valid_S
    ranking_SE = scores_SE.detach().masked_fill(~valid_S[:, None], -math.inf)
    _, token_EC = ranking_SE.t().topk(capacity, dim=-1)  # each expert's top-C, best first
    token_C = token_EC.reshape(-1)
    experts_E = torch.arange(num_experts, device=device)
    expert_C = experts_E.repeat_interleave(capacity)
    kept_C = valid_S.index_select(0, token_C)
    weight_C = scores_SE[token_C, expert_C] * kept_C.to(scores_SE.dtype)

    taken_SE = torch.zeros(num_tokens, num_experts, dtype=torch.bool, device=device)
    taken_SE[token_C, expert_C] = kept_C
    # Each token's experts by gate value, highest first; experts that did not take it sort last as -1.
    key_SE = torch.where(taken_SE, scores_SE.detach(), torch.full_like(scores_SE, -1.0))
    order_SE = key_SE.argsort(dim=-1, descending=True, stable=True)
    expert_index_SE = torch.where(taken_SE.gather(-1, order_SE), order_SE, torch.full_like(order_SE, -1))
    num_valid = valid_S.sum()
    unrouted = (valid_S & ~taken_SE.any(-1)).sum()
    return ExpertChoicePlan(
        token_C=token_C,
        expert_C=expert_C,
        offsets_E=((experts_E + 1) * capacity).to(torch.int32),
        weight_C=weight_C,
        expert_counts_E=taken_SE.sum(0),
        expert_index_SE=expert_index_SE,
        unrouted_fraction=unrouted.float() / num_valid.clamp_min(1).float(),
        capacity=capacity,
    )


def combine_expert_choice(y_CD: torch.Tensor, plan: ExpertChoicePlan, num_tokens: int) -> torch.Tensor:
    """Zhou et al. §3.2: each (sub-)token's sum of G * FFN_e(x) over the experts that took it, (S, D)."""
    weighted_CD = y_CD * plan.weight_C.to(y_CD.dtype)[:, None]
    return y_CD.new_zeros(num_tokens, y_CD.shape[-1]).index_add(0, plan.token_C, weighted_CD)
