"""What every MoE layer is to its callers, and the routing record every MoE forward returns.

:class:`MoEFeedForward` declares only what the plain layer (:class:`mmoe.moe.MoELayer`: top-k, X-MoE, MH-MoE) and the
Stratified layer (:class:`mmoe.moe.StratifiedMoELayer`) really share: a config, a set of grouped experts, the routers
in the order a token meets them, and ``y, routing = layer(x, padding_mask)``. ``isinstance(x, MoEFeedForward)`` means
"any MoE layer"; ``isinstance(x, MoELayer)`` means the plain layer (the one expert parallelism shards).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from mmoe.moe.config import MoEConfig
from mmoe.moe.experts import GroupedExperts
from mmoe.moe.router import Router


@dataclass
class RoutingRecord:
    """What one MoE layer did in one forward.

    Attributes:
        balance_loss: differentiable scalar (X-MoE Eq. 9 over non-padding (sub-)tokens; 0 with no token).
        z_loss: differentiable scalar, the router z-loss (ST-MoE Eq. 5 over non-padding (sub-)tokens).
        expert_counts: (E,) long, (sub-)token choices each expert processed; padding and drops excluded.
        expert_index: (B, L, heads, top_k) long, the expert of every sub-token choice; -1 at padding and drops.
        dropped_fraction: scalar, share of non-padding choices dropped by the capacity (0 when dropless).
        requested_capacity: scalar, mean FFN passes per token (Stratified MoE RC); 1 for a plain MoE layer.
        router_entropy: scalar, mean entropy of the routing distribution (detached; for logging).
        layer: index of the backbone layer that produced the record (set by the backbone).
        modality: "vision", "language" or "shared" (set by the backbone).
        stratum_path: (B, L, n_strata) long, each gate's first choice, -1 where skipped (Stratified MoE only).
        unrouted_fraction: scalar, share of non-padding (sub-)tokens no expert took (expert-choice routing only;
            ``expert_index`` is then (B, L, heads, E): the experts that took each sub-token, highest gate first).
        token_mask: (B, L) bool, True at the non-padding tokens. It tells a token that no expert took (expert choice,
            every choice dropped by the capacity) from padding, which ``expert_index`` marks alike; None = read the
            tokens from ``expert_index``.
        auxiliary_losses: the config's further differentiable losses by name, already weighted, for the task to add
            to its objective and log as ``<stage>/<name>`` (LIMoE's ``local_entropy_loss`` and
            ``global_entropy_loss``, :mod:`mmoe.moe.entropy_losses`); empty when the config turns none on.
        gate_logits: (B, L, heads, E + Z) float, differentiable: the router's logits with MoE++'s gating residual
            added, which the backbone hands to each token's next MoE layer; None unless ``gating_residual``.
    """

    balance_loss: torch.Tensor
    z_loss: torch.Tensor
    expert_counts: torch.Tensor
    expert_index: torch.Tensor
    dropped_fraction: torch.Tensor
    requested_capacity: torch.Tensor
    router_entropy: torch.Tensor
    layer: int | None = None
    modality: str | None = None
    stratum_path: torch.Tensor | None = None
    unrouted_fraction: torch.Tensor | None = None
    token_mask: torch.Tensor | None = None
    auxiliary_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    gate_logits: torch.Tensor | None = None


class MoEFeedForward(nn.Module):
    """An FFN slot filled by a Mixture of Experts: ``y, routing = layer(x, padding_mask)``.

    The output is the update the block adds to its residual stream, of x's shape; ``routing`` carries the auxiliary
    losses (balance, z-loss) and the routing statistics. Subclasses set ``config`` and ``experts`` in ``__init__``.

    Attributes:
        config: the layer's :class:`MoEConfig`.
        experts: the layer's experts (every expert, or this rank's share when expert-parallel).
    """

    config: MoEConfig
    experts: GroupedExperts

    def gate_routers(self) -> list[Router]:
        """The layer's routers in the order a token meets them; the first one sees every (sub-)token."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, RoutingRecord]:
        """Args:
            x: (B, L, D) tokens.
            padding_mask: (B, L) bool, True = padding; padding neither counts nor changes other tokens.

        Returns:
            ``(y, routing)`` with y of x's shape and dtype (the autocast dtype under autocast).
        """
        raise NotImplementedError


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype expert GEMMs run in: the autocast dtype when autocast is on for x's device, else x's dtype."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype
