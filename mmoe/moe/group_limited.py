"""Group-limited top-k: DeepSeek-V2's device-limited and DeepSeek-V3's node-limited routing.

The N experts are split into G groups of N/G consecutive ids (a device's or a node's experts). Each (sub-)token ranks
the groups, keeps its M best, and chooses its top-k experts among theirs:

* DeepSeek-V2 (2024, §2.1.3, device-limited routing; ``group_score="max"``): a group's score is its best expert's;
* DeepSeek-V3 (2024, §2.1.2, node-limited routing; ``group_score="top_sum"``): the sum of its K/M highest scores.

Shape legend: S (sub-)tokens, E experts, G groups, K top-k.
"""

from __future__ import annotations

import torch


def group_limited_top_k(
    scores_SE: torch.Tensor, top_k: int, groups: int, top_groups: int | None, group_score: str
) -> torch.Tensor:
    """(S, K) experts, best first: the top-k of ``scores_SE`` inside each row's ``top_groups`` best groups."""
    if groups == 1 or top_groups is None or top_groups >= groups:
        return scores_SE.topk(top_k, dim=-1).indices
    num_tokens, num_experts = scores_SE.shape
    grouped_SGX = scores_SE.view(num_tokens, groups, num_experts // groups)
    if group_score == "max":
        group_SG = grouped_SGX.amax(dim=-1)
    else:
        group_SG = grouped_SGX.topk(top_k // top_groups, dim=-1).values.sum(dim=-1)
    best_SM = group_SG.topk(top_groups, dim=-1).indices
    chosen_SG = torch.zeros_like(group_SG, dtype=torch.bool).scatter_(1, best_SM, True)
    allowed_SE = chosen_SG[:, :, None].expand_as(grouped_SGX).reshape(num_tokens, num_experts)
    masked_SE = scores_SE.masked_fill(~allowed_SE, float("-inf"))
    return masked_SE.topk(top_k, dim=-1).indices
