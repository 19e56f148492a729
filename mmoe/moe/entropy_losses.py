"""LIMoE's auxiliary entropy losses (Mustafa et al., 2022, "Multimodal Contrastive Learning with LIMoE: the
Language-Image Mixture of Experts", arXiv 2206.02770).

For the (sub-)tokens x_1..x_n of one modality m in the batch and the router's softmax gate p_m(experts | x):

* local entropy loss ``Omega_local(m) = 1/n * sum_i H(p_m(experts | x_i))``, low when each token makes a confident
  choice;
* global entropy loss ``Omega_global(m) = -H(p̃_m(experts))`` with ``p̃_m = 1/n * sum_i p_m(experts | x_i)`` the
  modality's mean gate distribution, low when the modality is spread over many experts;
* thresholded global loss ``Omega_global^tau(m) = max{0, tau + Omega_global(m)} = max(0, tau - H(p̃_m))`` with
  ``tau = log S`` (``global_entropy_min_experts`` = S, the paper's "soft minimum" number of experts): no penalty once
  the modality's mean distribution is as spread as a uniform one over S experts (or a wider, non-uniform one).

Written from the paper's text on the thresholded loss (its form, tau = log(S) and the soft minimum S) and from its
description of the two losses; the paper's section and equation numbers are unchecked, so none is cited here.

Each loss is summed over the modalities a layer routes and multiplied by its weight (``local_entropy_weight``,
``global_entropy_weight``). A per-modality MoE FFN sees one modality; a shared FFN (or the VL-FFN) learns the
modalities from the ``segment_lengths`` the backbone passes (:class:`mmoe.moe.token_layout.TokenLayout`; image
tokens, then text tokens). Padding never counts; a modality with no token adds nothing. Computed in the router's
dtype (fp32 or wider), from the log-softmax so that a gate value that underflows to 0 gives 0, not NaN. The task adds
the weighted losses to its objective and logs them (:meth:`mmoe.tasks.base.BackboneTask.auxiliary_losses`).

Shape legend: S (sub-)tokens, E experts, M segments (modalities).
"""

from __future__ import annotations

import math

import torch

from mmoe.moe.config import MoEConfig


def entropy_losses(
    logits_SE: torch.Tensor, weights_S: torch.Tensor, segment_S: torch.Tensor, num_segments: int, config: MoEConfig
) -> dict[str, torch.Tensor]:
    """The weighted losses the config turns on: ``{"local_entropy_loss": ..., "global_entropy_loss": ...}`` (a
    key only for a weight > 0), from the softmax gate's logits ``logits_SE``; ``weights_S`` 1 at the (sub-)tokens
    that count, 0 at padding."""
    losses: dict[str, torch.Tensor] = {}
    if config.local_entropy_weight <= 0 and config.global_entropy_weight <= 0:
        return losses
    log_probs_SE = logits_SE.log_softmax(dim=-1)
    probs_SE = log_probs_SE.exp()
    rows_M = logits_SE.new_zeros(num_segments).index_add_(0, segment_S, weights_S)
    present_M = rows_M > 0
    denominator_M = rows_M.clamp_min(1.0)
    if config.local_entropy_weight > 0:
        token_entropy_S = -(probs_SE * log_probs_SE).sum(-1)  # H(p(experts | x_i)) of Omega_local
        local_M = logits_SE.new_zeros(num_segments).index_add_(0, segment_S, weights_S * token_entropy_S)
        losses["local_entropy_loss"] = config.local_entropy_weight * (local_M / denominator_M).sum()
    if config.global_entropy_weight > 0:
        sums_ME = logits_SE.new_zeros(num_segments, logits_SE.shape[-1])
        mean_ME = sums_ME.index_add_(0, segment_S, weights_S[:, None] * probs_SE) / denominator_M[:, None]  # p̃_m
        tiny = torch.finfo(mean_ME.dtype).tiny
        entropy_M = -(mean_ME * mean_ME.clamp_min(tiny).log()).sum(-1)  # H(p̃_m) of Omega_global
        if config.global_entropy_min_experts is None:
            global_M = -entropy_M
        else:
            global_M = (math.log(config.global_entropy_min_experts) - entropy_M).clamp_min(0.0)
        global_M = torch.where(present_M, global_M, torch.zeros_like(global_M))
        losses["global_entropy_loss"] = config.global_entropy_weight * global_M.sum()
    return losses
