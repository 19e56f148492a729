"""Batch Prioritized Routing (V-MoE, Riquelme et al., 2021, "Scaling Vision with Sparse Mixture of Experts", arXiv
2106.05974): what a capacity drops.

GShard's capacity keeps first choices before second choices, then earlier tokens before later ones, so the end of a
batch is dropped whatever its routing. Batch-priority routing keeps first choices before second choices too, but
orders the (sub-)tokens by a priority score, the top gate value ``max_e p(e | x)``, highest first: when an expert
overflows, the tokens the router is least sure of are dropped. The score is the raw gate value of the first choice
(before any top-k renormalisation), which is that maximum unless loss-free balancing's bias picked another expert.

Checked against V-MoE's released code (google-research/vmoe, ``vmoe/moe.py``, ``batch_priority=True``): the items
are sorted by their largest gate value before each expert's buffer positions are counted, every item's k-th choice
before any item's (k+1)-th. The paper's section number is unchecked, so none is cited here.

The plan is :func:`mmoe.moe.dispatch.plan_dispatch`'s dropless plan (the sort by expert does not depend on the order
of the choices inside an expert's slice) with the kept choices, counts and dropped share decided here.

Shape legend: S (sub-)tokens, K choices per (sub-)token, C = K*S choices, E experts.
"""

from __future__ import annotations

import dataclasses

import torch

from mmoe.moe.dispatch import DispatchPlan, plan_dispatch


def plan_token_dispatch(
    expert_SK: torch.Tensor,
    priority_S: torch.Tensor | None,
    valid_S: torch.Tensor | None,
    num_experts: int,
    capacity_factor: float | None,
) -> DispatchPlan:
    """:func:`plan_dispatch`, with the capacity applied in batch-priority order when ``priority_S`` (the (sub-)tokens'
    top gate values) is given and a capacity is in force."""
    if priority_S is None or capacity_factor is None:
        return plan_dispatch(expert_SK, valid_S, num_experts, capacity_factor)
    plan = plan_dispatch(expert_SK, valid_S, num_experts, None)
    num_tokens, top_k = expert_SK.shape
    valid_SK = plan.kept_SK  # dropless: every non-padding choice
    rank_S = torch.empty_like(expert_SK[:, 0]).scatter_(
        0, priority_S.detach().argsort(descending=True, stable=True), torch.arange(num_tokens, device=expert_SK.device)
    )
    order_SK = torch.arange(top_k, device=expert_SK.device)[None, :] * num_tokens + rank_S[:, None]  # k, then priority
    key_C = (expert_SK * (top_k * num_tokens) + order_SK).reshape(-1)
    sorted_C = key_C.argsort()
    valid_sorted_C = valid_SK.reshape(-1)[sorted_C].long()
    expert_sorted_C = expert_SK.reshape(-1)[sorted_C]
    valid_before_C = valid_sorted_C.cumsum(0) - valid_sorted_C
    per_expert_E = torch.zeros(num_experts, dtype=torch.long, device=expert_SK.device)
    per_expert_E.index_add_(0, expert_sorted_C, valid_sorted_C)
    start_E = per_expert_E.cumsum(0) - per_expert_E
    position_C = valid_before_C - start_E[expert_sorted_C]
    capacity = torch.ceil(valid_SK[:, 0].sum().double() * (capacity_factor * top_k / num_experts))
    kept_C = torch.empty_like(valid_sorted_C, dtype=torch.bool).scatter_(
        0, sorted_C, (position_C < capacity) & valid_sorted_C.bool()
    )
    kept_SK = kept_C.view(num_tokens, top_k)
    counts_E = torch.zeros_like(per_expert_E).index_add_(0, expert_SK.reshape(-1), kept_SK.reshape(-1).long())
    dropped = (valid_SK.sum() - kept_SK.sum()).float() / valid_SK.sum().clamp_min(1).float()
    return dataclasses.replace(plan, kept_SK=kept_SK, expert_counts_E=counts_E, dropped_fraction=dropped)
