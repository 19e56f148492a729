"""Balance losses of a router: the Switch / GShard form and DeepSeek's conventions.

* GShard / X-MoE Eq. 9 (``balance_choices="first"``): ``N * sum_i f_i * P_i``, f_i the share of non-padding
  (sub-)tokens whose *first* choice is expert i, P_i their mean routing probability.
* DeepSeekMoE (Dai et al., 2024, §3.3, Eq. 12-14; ``balance_choices="all"``): ``sum_i f_i * P_i`` with
  ``f_i = N / (K T) * (selections of expert i among all K choices of the T (sub-)tokens)``. With K = 1 both agree.
* Global batch (Qiu et al., 2025; ``balance_batch="global"``): f_i all-reduced over the data-parallel ranks, P_i each
  rank's share of the global mean, so that the ranks' mean is the loss of the global batch.
* Sequence-wise (DeepSeek-V3, 2024, §2.1.2, Eq. 17-20; ``balance_batch="sequence"``): the loss of each sequence's
  (sub-)tokens alone, averaged over the sequences that have any.
* The scores a sigmoid gate's DeepSeek loss reads (DeepSeek-V3 Eq. 18-20; ``gate="sigmoid"`` with
  ``balance_choices="all"`` or ``balance_batch="sequence"``, :func:`deepseek_v3_scores`): P_i averages the affinities
  normalised per (sub-)token, ``s'_i = s_i / sum_j s_j`` (Eq. 19-20), and f_i counts each (sub-)token's top-K of the
  scores s themselves (Eq. 18): the loss-free selection bias, which only selects (Eq. 16), is left out, and so is the
  group limit. Every other balance loss takes P from a softmax (X-MoE's convention, for a sigmoid gate too) and counts
  the experts selected.

Shape legend: S (sub-)tokens, E experts, K counted choices per (sub-)token, B sequences.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def deepseek_v3_scores(balance_logits_SE: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 Eq. 18-20 for a sigmoid gate: (P's per-(sub-)token terms s' = s / sum_j s_j, the top-K experts of s
    best first), s = sigmoid of the balance logits."""
    scores_SE = balance_logits_SE.sigmoid()
    normalised_SE = scores_SE / scores_SE.sum(dim=-1, keepdim=True)  # Eq. 19; a sigmoid is > 0, so the sum is too
    return normalised_SE, scores_SE.detach().topk(top_k, dim=-1).indices  # Eq. 18: no selection bias, no group limit


def counted_choices(expert_SK: torch.Tensor, balance_choices: str) -> torch.Tensor:
    """The choices f_i counts: the first one (GShard) or all K (DeepSeekMoE Eq. 13)."""
    return expert_SK[:, :1] if balance_choices == "first" else expert_SK


def balance_loss(probs_SE, chosen_SK, weights_S, global_batch: bool = False) -> torch.Tensor:
    """``N / K * sum_i (c_i / T) * P_i`` over the rows of weight 1, c_i the counted choices of expert i and K their
    number per row (K = 1: X-MoE Eq. 9; all K: DeepSeekMoE Eq. 12-14). ``global_batch``: c_i and T over every rank's
    rows and P_i this rank's share of the global mean (Qiu et al., 2025)."""
    num_experts, counted = probs_SE.shape[-1], chosen_SK.shape[-1]
    weights_SK = weights_S[:, None].expand_as(chosen_SK)
    # E + 1 bins: the id E, an adaptive router's "no expert", is counted apart and left out (f sums to below 1).
    counts_E = probs_SE.new_zeros(num_experts + 1).index_add_(0, chosen_SK.reshape(-1), weights_SK.reshape(-1))
    counts_E = counts_E[:num_experts]
    local_rows = weights_S.sum()
    if global_batch:
        totals = torch.cat([counts_E, local_rows[None]]).detach()
        dist.all_reduce(totals)
        counts_E, rows = totals[:-1], totals[-1].clamp_min(1.0)
        mean_prob_E = (weights_S @ probs_SE) * dist.get_world_size() / rows  # this rank's share of P_i
    else:
        rows = local_rows.clamp_min(1.0)
        mean_prob_E = (weights_S @ probs_SE) / rows  # P_i
    return num_experts / counted * (counts_E / rows * mean_prob_E).sum()


def sequence_balance_loss(probs_SE, chosen_SK, weights_S, sequence_S, num_sequences: int) -> torch.Tensor:
    """DeepSeek-V3 Eq. 17-20: :func:`balance_loss` of each sequence's rows, averaged over the sequences with rows."""
    num_experts, counted = probs_SE.shape[-1], chosen_SK.shape[-1]
    slots_SK = sequence_S[:, None] * (num_experts + 1) + chosen_SK  # E + 1 bins per sequence: E is no expert
    counts_BE = probs_SE.new_zeros(num_sequences * (num_experts + 1))
    counts_BE = counts_BE.index_add_(0, slots_SK.reshape(-1), weights_S[:, None].expand_as(chosen_SK).reshape(-1))
    counts_BE = counts_BE.view(num_sequences, num_experts + 1)[:, :num_experts]
    rows_B = probs_SE.new_zeros(num_sequences).index_add_(0, sequence_S, weights_S)
    prob_sums_BE = probs_SE.new_zeros(num_sequences, num_experts)
    prob_sums_BE = prob_sums_BE.index_add_(0, sequence_S, weights_S[:, None] * probs_SE)
    denominator_B = rows_B.clamp_min(1.0)
    loss_B = num_experts / counted * (counts_BE * prob_sums_BE).sum(-1) / denominator_B.square()
    present_B = (rows_B > 0).to(loss_B.dtype)
    return (loss_B * present_B).sum() / present_B.sum().clamp_min(1.0)
