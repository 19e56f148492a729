"""How a router scores (sub-)tokens against experts: the scorer by name (one module each, :mod:`mmoe.moe.scorers`),
the gate over its logits (ReMoE's ReLU gates and their adaptive L1 penalty: :mod:`mmoe.moe.relu_routing`), X-MoE's
routing dimension and Switch Transformer's input jitter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmoe.moe.choices.values import finite_at_least, is_int, refuse, require
from mmoe.moe.scorers import SCORERS

GATES = ("softmax", "sigmoid", "relu")


@dataclass(frozen=True, kw_only=True)
class Scoring:
    """How a router scores (a part of :class:`mmoe.moe.RoutingChoices`).

    Args:
        router: the scorer's name, a key of :data:`mmoe.moe.scorers.SCORERS`. ``"linear"`` scores s_i = h·e_i
            (Switch / GShard); ``"xmoe"`` scores s_i = cos(W h, e_i) with W a bias-free ``routing_dim x D'``
            projection (X-MoE Eq. 7) and a learnable temperature (X-MoE Eq. 8).
        gate: ``"softmax"`` over experts or element-wise ``"sigmoid"`` (X-MoE Eq. 8), then top-k. ``"relu"``
            (ReMoE, Wang et al., 2025, :mod:`mmoe.moe.relu_routing`): g = ReLU(W_r x) of the linear scorer, every
            expert with g_e > 0 used (0 to E per (sub-)token, no renormalisation), held at ``top_k`` experts per
            (sub-)token on average by an L1 penalty whose coefficient adapts after every training step (the task adds
            it as ``relu_l1_loss``). Needs ``router: linear``, ``renormalize: false``, token choice, no capacity
            factor, no strata, no loss-free bias and no expert groups (refused).
        routing_dim: X-MoE routing dimension d_e. None = 16 for one head (X-MoE §4.1, its N = 32 setting; the
            paper's rule of thumb is d_e = N/2) and ``16 // heads`` with heads (MH-MoE Table 9), resolved by
            :class:`mmoe.moe.MoEConfig`.
        router_jitter: Switch Transformer's jitter (Fedus et al., 2022; its released Mesh TensorFlow code): in
            training, the router's input is multiplied element-wise by noise drawn uniformly from
            ``[1 - eps, 1 + eps]``; the experts see the clean input, and evaluation never jitters. 0 = off (the
            default; Switch Transformer's code uses 1e-2).
        relu_l1_initial: ReMoE's lambda_0, the L1 coefficient a ReLU-gated router starts from (their 1e-8; a short
            run starts higher, since lambda grows by ``relu_l1_multiplier`` per step). A buffer afterwards, saved in
            checkpoints, moved only after training steps.
        relu_l1_multiplier: ReMoE's alpha > 1: lambda times alpha after a step denser than the target, divided by it
            after a sparser one (their 1.2).
        relu_l1_balanced: ReMoE's load-balanced L1 (each expert's L1 weighted by its load; their released code's only
            form, the default) or, false, the plain mean L1 norm of the gates.
        relu_l1_per_router: false (ReMoE's released code): one lambda for the whole model, moved by the mean over
            the routers of their sparsities, so single layers may drift far from the target while the mean holds it
            (in a 300-step tiny run, layer 1's image tokens came to use 0.01 experts and its text tokens 2). True:
            each router's lambda moves by its own sparsity against its own target, each layer and modality
            driven toward ``top_k`` (not ReMoE's; how each held its target in 100 steps: docs/routers.md).
    """

    router: str = "xmoe"
    gate: Literal["softmax", "sigmoid", "relu"] = "softmax"
    routing_dim: int | None = None
    router_jitter: float = 0.0
    relu_l1_initial: float = 1e-8
    relu_l1_multiplier: float = 1.2
    relu_l1_balanced: bool = True
    relu_l1_per_router: bool = False

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
                (
                    "relu_l1_initial",
                    finite_at_least(self.relu_l1_initial, 0.0) and self.relu_l1_initial > 0,
                    "a finite number > 0",
                ),
                (
                    "relu_l1_multiplier",
                    finite_at_least(self.relu_l1_multiplier, 0.0) and self.relu_l1_multiplier > 1,
                    "a finite number > 1",
                ),
                ("relu_l1_balanced", isinstance(self.relu_l1_balanced, bool), "true or false"),
                ("relu_l1_per_router", isinstance(self.relu_l1_per_router, bool), "true or false"),
            ],
        )
        if self.gate == "relu":
            refuse(self, self._relu_refusals(), context=" with gate='relu'")

    def _relu_refusals(self) -> list[tuple[str, bool, str]]:
        """What ReMoE's ReLU gates cannot be combined with (read before the other parts' own checks)."""
        return [
            ("router", self.router != "linear", "ReMoE's gates are ReLU(W_r x) of the linear scorer"),
            ("renormalize", self.renormalize, "ReLU gate values are used as they are; set renormalize: false"),
            ("routing", self.routing != "token_choice", "ReLU gates are a token-choice router"),
            ("capacity_factor", self.capacity_factor is not None, "ReMoE is dropless: leave it null"),
            ("strata", self.strata is not None, "Stratified MoE gates pick their top-k"),
            ("bias_update_rate", self.bias_update_rate > 0, "the adaptive L1 penalty sets the experts used"),
            ("expert_groups", self.expert_groups != 1, "groups limit a top-k choice"),
        ]
