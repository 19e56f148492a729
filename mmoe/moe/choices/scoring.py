"""How a router scores (sub-)tokens against experts: the scorer by name (one module each, :mod:`mmoe.moe.scorers`),
the gate over its logits, X-MoE's routing dimension and Switch Transformer's input jitter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmoe.moe.choices.values import finite_at_least, is_int, require
from mmoe.moe.scorers import SCORERS

GATES = ("softmax", "sigmoid")


@dataclass(frozen=True, kw_only=True)
class Scoring:
    """How a router scores (a part of :class:`mmoe.moe.RoutingChoices`).

    Args:
        router: the scorer's name, a key of :data:`mmoe.moe.scorers.SCORERS`. ``"linear"`` scores s_i = h·e_i
            (Switch / GShard); ``"xmoe"`` scores s_i = cos(W h, e_i) with W a bias-free ``routing_dim x D'``
            projection (X-MoE Eq. 7) and a learnable temperature (X-MoE Eq. 8).
        gate: ``"softmax"`` over experts or element-wise ``"sigmoid"`` (X-MoE Eq. 8).
        routing_dim: X-MoE routing dimension d_e. None = 16 for one head (X-MoE §4.1, its N = 32 setting; the
            paper's rule of thumb is d_e = N/2) and ``16 // heads`` with heads (MH-MoE Table 9), resolved by
            :class:`mmoe.moe.MoEConfig`.
        router_jitter: Switch Transformer's jitter (Fedus et al., 2022; its released Mesh TensorFlow code): in
            training, the router's input is multiplied element-wise by noise drawn uniformly from
            ``[1 - eps, 1 + eps]``; the experts see the clean input, and evaluation never jitters. 0 = off (the
            default; Switch Transformer's code uses 1e-2).
    """

    router: str = "xmoe"
    gate: Literal["softmax", "sigmoid"] = "softmax"
    routing_dim: int | None = None
    router_jitter: float = 0.0

    def _check_scoring(self) -> None:
        jitter = self.router_jitter
        require(
            self,
            [
                ("router", self.router in SCORERS, f"one of {tuple(SCORERS)}"),
                ("gate", self.gate in GATES, f"one of {GATES}"),
                (
                    "routing_dim",
                    self.routing_dim is None or (is_int(self.routing_dim) and self.routing_dim > 0),
                    "a positive integer or None",
                ),
                ("router_jitter", finite_at_least(jitter, 0.0) and jitter < 1, "in [0, 1)"),
            ],
        )
