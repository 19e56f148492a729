"""Benchmark-only views of an MoE layer that separate kernel speed from load imbalance: the same layer with its
routing forced to be balanced, and the grouped-GEMM floor of its experts.

* :func:`forced_balanced`: a copy of a token-choice :class:`mmoe.moe.MoELayer` (sharing its parameters) whose router
  still scores every (sub-)token, so its cost counts, but whose k choices per (sub-)token are replaced by a round robin:
  choice j of (sub-)token s goes to expert ``(s * K + j) % E`` (K distinct experts per token, every expert the same
  K*S/E rows when E divides K*S), weighted by the router's own gate values for those experts (renormalised as the
  router would); an adaptive router's empty choices stay empty and the round robin counts the real ones only.
  With null / zero-computation experts the round robin runs over the whole pool (E real then Z zero-computation
  experts), and the choices are split as the router splits them (``split_choices``): a share E / (E + Z) of the rows
  reaches the real experts. Nothing in the library changes: the copy exists only here.
* :class:`ExpertFloor`: the layer's expert GEMMs alone (``GroupedExperts.forward_batched``: one batched GEMM per
  linear, biases fused) on an already sorted, perfectly balanced batch of the rows the layer routes (K*S choices,
  K*S*E/(E+Z) with zero-computation experts, E*C rows for expert choice), plus the shared experts on the S
  (sub-)tokens: no routing, no permutation, no combine.
* :class:`SoftMoEFloor`: a Soft MoE layer's plain-GEMM floor: the dispatch matmul X~ = D^T X and the combine matmul
  Y = C Y~ per sequence (``bmm``, with fixed dispatch and combine weights that take gradients as the layer's do), and
  between them the experts' batched GEMMs on the B*p rows of each expert's slots: no logits, normalisation, softmax
  or padding mask.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import torch
from torch import nn

from mmoe.moe import MoELayer, SoftMoELayer
from mmoe.moe.expert_choice import expert_capacity
from mmoe.moe.null_experts import split_choices
from mmoe.moe.router import Router, RouterOutput


class RoundRobinRouter(nn.Module):
    """A router whose choices are a balanced round robin (module docstring); scores and losses are the wrapped
    router's."""

    def __init__(self, router: Router) -> None:
        super().__init__()
        self.router = router

    def forward(self, x_SD: torch.Tensor, *context) -> RouterOutput:
        """``context``: the router's further arguments (padding, layout), passed on."""
        routed = self.router(x_SD, *context)
        top_k = routed.expert_SK.shape[1]
        num_experts = routed.scores_SE.shape[-1]
        # The round robin runs over the real choices: an adaptive router's empty ones (the id E) stay empty.
        real_SK = routed.expert_SK < num_experts
        rank_SK = real_SK.reshape(-1).cumsum(0).view_as(real_SK) - 1
        expert_SK = torch.where(real_SK, rank_SK % num_experts, num_experts)
        weight_SK = routed.scores_SE.gather(-1, expert_SK.clamp_max(num_experts - 1)) * real_SK
        renormalize = top_k > 1 and self.router.renormalize
        if self.router.config.zero_computation_experts:
            expert_SK, weight_SK, cheap = split_choices(expert_SK, weight_SK, self.router.config, renormalize)
            return replace(routed, expert_SK=expert_SK, weight_SK=weight_SK, zero_computation=cheap)
        if renormalize:
            weight_SK = weight_SK / weight_SK.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(weight_SK.dtype).tiny)
        return replace(routed, expert_SK=expert_SK, weight_SK=weight_SK)


def forced_balanced(layer: MoELayer) -> MoELayer:
    """``layer`` with round-robin choices (module docstring), sharing its parameters; expert choice is balanced by
    construction, and an adaptive router (ReLU gates) has no fixed K to deal round, so such a layer comes back as it
    is."""
    if layer.config.routing == "expert_choice" or layer.config.gate == "relu":
        return layer
    balanced = copy.copy(layer)  # a shallow copy: the same submodules and parameters
    balanced._modules = dict(layer._modules)
    balanced.router = RoundRobinRouter(layer.router)
    return balanced


def routed_rows(layer: MoELayer, tokens: int) -> int:
    """The rows the layer's experts compute for ``tokens`` tokens: K per (sub-)token (K * E / (E + Z) with Z
    zero-computation experts, balanced over the pool), or E*C for expert choice."""
    config = layer.config
    sub_tokens = tokens * config.heads
    if config.routing == "expert_choice":
        capacity_factor = config.active_capacity_factor(layer.training)
        return config.num_experts * expert_capacity(sub_tokens, config.num_experts, capacity_factor)
    if config.target_active_experts is not None:  # top-p held at its target (the case sets p to reach it)
        return round(sub_tokens * config.target_active_experts)
    pool = config.num_experts + config.zero_computation_experts
    return round(sub_tokens * layer.router.top_k * config.num_experts / pool)


class ExpertFloor(nn.Module):
    """The grouped-GEMM floor of ``layer`` for ``tokens`` tokens (module docstring); ``forward(x_RD)`` takes
    :attr:`rows` rows of the experts' width (routed rows, padded up to a multiple of E, then the shared experts'
    (sub-)tokens)."""

    def __init__(self, layer: MoELayer, tokens: int) -> None:
        super().__init__()
        self.experts, self.shared_experts = layer.experts, layer.shared_experts
        num_experts = layer.experts.num_experts
        self.routed = num_experts * math.ceil(routed_rows(layer, tokens) / num_experts)
        self.rows = self.routed + (tokens * layer.config.heads if self.shared_experts is not None else 0)
        self.width = layer.config.head_dim

    def forward(self, x_RD: torch.Tensor) -> torch.Tensor:
        y_RD = self.experts.forward_batched(x_RD[: self.routed])
        if self.shared_experts is None:
            return y_RD
        return torch.cat([y_RD, self.shared_experts.forward_every_expert(x_RD[self.routed :])])


class SoftMoEFloor(nn.Module):
    """The plain-GEMM floor of a Soft MoE ``layer`` on (B, L, D) inputs of ``batch`` x ``length`` tokens (module
    docstring); ``forward(x_BLD)``."""

    def __init__(self, layer: SoftMoELayer, batch: int, length: int) -> None:
        super().__init__()
        self.layer = layer
        slots = layer.num_slots
        weights = torch.softmax(torch.randn(batch, length, slots), dim=1)
        self.dispatch_BSL = nn.Parameter(weights.transpose(1, 2).contiguous())
        self.combine_BLS = nn.Parameter(torch.softmax(torch.randn(batch, length, slots), dim=-1))

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        slots_BSD = torch.bmm(self.dispatch_BSL.to(x_BLD.dtype), x_BLD)
        return torch.bmm(self.combine_BLS.to(x_BLD.dtype), self.layer.run_experts(slots_BSD))
