"""Null and zero-computation experts (:class:`mmoe.moe.choices.ZeroComputation`): experts that cost no FFN, routed
beside the real ones, so that a (sub-)token may use fewer real experts.

* AdaMoE (Zeng et al., EMNLP Findings 2024; released code ``CengZihao/AdaMoE``): N null experts whose output is
  0 join the pool; the router scores the E + N experts, takes the top-k of them all, and the balance loss counts all
  E + N (the Switch / GShard loss over the larger pool). A (sub-)token choosing j null experts uses k - j real ones.
  The released code renormalises the weights over the real choices only.
* MoE++ (Jin et al., ICLR 2025; released code ``SkyworkAI/MoE-plus-plus``, ``moe_plus_plus_layer.py``): zero
  experts (output 0, AdaMoE's null experts), copy experts (output x) and constant experts (output
  ``a_1 x + a_2 v``, ``[a_1, a_2] = softmax(W x)``, v a learned vector, W a learned 2 x D matrix without bias).
  The released code zeroes the zero expert's gate and renormalises over the other choices (copy and constant
  experts included). Its "gating residuals" (each layer's router logits plus a learned map of the previous layer's)
  are the router's (``gating_residual``, :class:`mmoe.moe.Router`), carried by the backbone
  (:mod:`mmoe.model.gate_residuals`). MoE++'s heterogeneous
  balance loss (a smaller weight on the zero-computation experts' terms) is not implemented: every expert of the
  pool weighs 1, as AdaMoE's loss has it. The released code's ``inputs *= top_k`` scaling is not taken either.

Where they run: the router gives every choice of a zero-computation expert the expert id E ("no expert", weight 0,
never dispatched: :mod:`mmoe.moe.dispatch`) and hands the copy and constant experts' choices apart
(:class:`ZeroComputationChoices`); :class:`ZeroComputationExperts` adds their weighted outputs in the layer
(:class:`mmoe.moe.MoELayer`, beside the shared experts), at O(D) per (sub-)token: no FFN, no dispatch. In the routing
record these choices show as ``expert_index`` -1 and are not in ``expert_counts`` (E real experts); the routing
logger's ``active_experts`` counts the real experts a (sub-)token used.

Shape legend: S (sub-)tokens, K choices, D width, J copy + constant experts, C constant experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from mmoe.moe.config import MoEConfig


@dataclass
class ZeroComputationChoices:
    """The copy and constant experts among a router's choices.

    Attributes:
        index_SK: the chosen copy or constant expert (0 .. copy_experts - 1 copy experts, then the constant experts),
            -1 where the choice is a real or a null expert.
        weight_SK: its gate weight (after renormalisation), 0 where ``index_SK`` is -1.
    """

    index_SK: torch.Tensor
    weight_SK: torch.Tensor


def split_choices(
    expert_SK: torch.Tensor, weight_SK: torch.Tensor, config: MoEConfig, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor, ZeroComputationChoices]:
    """Top-k choices over the E real then N null, copy and constant experts -> (real experts with E where a choice is
    not one, their weights with 0 there, the copy and constant choices). ``renormalize``: the weights divided by
    their sum over the choices that are not null experts (AdaMoE's and MoE++'s released code); a (sub-)token whose
    choices are all null gets weight 0 everywhere."""
    num_experts = config.num_experts
    pool_SK = expert_SK - num_experts  # the id among the zero-computation experts; negative for a real expert
    null_SK = (pool_SK >= 0) & (pool_SK < config.null_experts)
    weight_SK = torch.where(null_SK, torch.zeros_like(weight_SK), weight_SK)
    if renormalize:
        weight_SK = weight_SK / weight_SK.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(weight_SK.dtype).tiny)
    cheap_SK = pool_SK >= config.null_experts  # a copy or constant expert
    real_SK = pool_SK < 0
    choices = ZeroComputationChoices(
        torch.where(cheap_SK, pool_SK - config.null_experts, torch.full_like(pool_SK, -1)),
        torch.where(cheap_SK, weight_SK, torch.zeros_like(weight_SK)),
    )
    real_expert_SK = torch.where(real_SK, expert_SK, torch.full_like(expert_SK, num_experts))
    return real_expert_SK, torch.where(real_SK, weight_SK, torch.zeros_like(weight_SK)), choices


class ZeroComputationExperts(nn.Module):
    """MoE++'s copy experts (output x) and constant experts (``a_1 x + a_2 v``, ``[a_1, a_2] = softmax(W x)``), each
    times its gate weight, summed per (sub-)token. v starts as N(0, 1) (the released code's ``normal_``), W as
    ``nn.Linear``'s default, uniform in ±1/sqrt(D) (the released code's ``nn.Linear(hidden, 2, bias=False)``)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.copy_experts, self.constant_experts = config.copy_experts, config.constant_experts
        width, constants = config.head_dim, config.constant_experts
        self.constant_CD = self.mix_weight_C2D = None  # no zero-size parameters (FSDP2 refuses them)
        if constants:
            self.constant_CD = nn.Parameter(torch.randn(constants, width))  # v
            bound = 1 / math.sqrt(width)
            self.mix_weight_C2D = nn.Parameter(torch.empty(constants, 2, width).uniform_(-bound, bound))  # W

    def forward(
        self, y_SD: torch.Tensor, x_SD: torch.Tensor, choices: ZeroComputationChoices, valid_S: torch.Tensor | None
    ) -> torch.Tensor:
        """``y_SD`` plus the copy and constant experts' weighted outputs of every (sub-)token (none for padding).

        Both kinds scale x per (sub-)token, so their weights are summed into one scale first and x is read once:
        ``y + s * x + (w_C * a_2) @ v`` with ``s = w_copy + sum_c w_c a_1,c`` (two full-width operations, forward,
        where one per term wrote (S, D) temporaries)."""
        experts = self.copy_experts + self.constant_experts
        chosen_SK = choices.index_SK >= 0
        weight_SK = choices.weight_SK.to(x_SD.dtype)
        if valid_S is not None:
            weight_SK = weight_SK * valid_S[:, None].to(weight_SK.dtype)
        weight_SJ = weight_SK.new_zeros(x_SD.shape[0], experts)
        weight_SJ = weight_SJ.scatter_add(1, choices.index_SK.clamp_min(0), torch.where(chosen_SK, weight_SK, 0.0))
        scale_S = weight_SJ[:, : self.copy_experts].sum(-1)  # copy experts
        if self.constant_CD is not None:
            constants = self.constant_experts
            mix_weight_MD = self.mix_weight_C2D.to(x_SD.dtype).flatten(0, 1)  # M = 2C rows: (c, a_1), (c, a_2)
            mix_SC2 = (x_SD @ mix_weight_MD.T).view(-1, constants, 2).softmax(dim=-1)
            weight_SC = weight_SJ[:, self.copy_experts :]
            scale_S = scale_S + (weight_SC * mix_SC2[..., 0]).sum(-1)
            y_SD = torch.addmm(y_SD, weight_SC * mix_SC2[..., 1], self.constant_CD.to(x_SD.dtype))
        return torch.addcmul(y_SD, scale_S[:, None], x_SD)
