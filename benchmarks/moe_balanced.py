"""Benchmark-only views of an MoE layer that separate kernel speed from load imbalance: the same layer with its
routing forced to be balanced, and the grouped-GEMM floor of its experts.

* :func:`forced_balanced`: a copy of a token-choice :class:`mmoe.moe.MoELayer` (sharing its parameters) whose router
  still scores every (sub-)token, so its cost counts, but whose k choices per (sub-)token are replaced by a round robin:
  choice j of (sub-)token s goes to expert ``(s * K + j) % E`` (K distinct experts per token, every expert the same
  K*S/E rows when E divides K*S), weighted by the router's own gate values for those experts (renormalised as the
  router would). Nothing in the library changes: the copy exists only here.
* :class:`ExpertFloor`: the layer's expert GEMMs alone (``GroupedExperts.forward_batched``: one batched GEMM per
  linear, biases fused) on an already sorted, perfectly balanced batch of the rows the layer routes (K*S choices,
  E*C rows for expert choice), plus the shared experts on the S (sub-)tokens: no routing, no permutation, no combine.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import torch
from torch import nn

from mmoe.moe import MoELayer
from mmoe.moe.expert_choice import expert_capacity
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
        num_tokens, top_k = routed.expert_SK.shape
        num_experts = routed.scores_SE.shape[-1]
        device = routed.expert_SK.device
        rank_SK = torch.arange(num_tokens, device=device)[:, None] * top_k + torch.arange(top_k, device=device)
        expert_SK = rank_SK % num_experts
        weight_SK = routed.scores_SE.gather(-1, expert_SK)
        if top_k > 1 and self.router.renormalize:
            weight_SK = weight_SK / weight_SK.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(weight_SK.dtype).tiny)
        return replace(routed, expert_SK=expert_SK, weight_SK=weight_SK)


def forced_balanced(layer: MoELayer) -> MoELayer:
    """``layer`` with round-robin choices (module docstring), sharing its parameters; expert choice is balanced by
    construction, and an adaptive router (ReLU gates) has no fixed K to deal round, so such a layer comes back as it
    is."""
    if layer.config.routing == "expert_choice" or layer.config.may_choose_no_expert:
        return layer
    balanced = copy.copy(layer)  # a shallow copy: the same submodules and parameters
    balanced._modules = dict(layer._modules)
    balanced.router = RoundRobinRouter(layer.router)
    return balanced


def routed_rows(layer: MoELayer, tokens: int) -> int:
    """The rows the layer's experts compute for ``tokens`` tokens: K per (sub-)token, or E*C for expert choice."""
    config = layer.config
    sub_tokens = tokens * config.heads
    if config.routing == "expert_choice":
        capacity_factor = config.active_capacity_factor(layer.training)
        return config.num_experts * expert_capacity(sub_tokens, config.num_experts, capacity_factor)
    return sub_tokens * layer.router.top_k


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
