"""Closed-form parameter counts and FLOPs per token of one MoE layer (MH-MoE App. D, Eq. 12-24, with biases).

MH-MoE App. D counts weights only, with a linear router: Gamma = 2d^2 + dN/h + 8 beta d^2 N / h for an FFN of inner
width 4d (MH-MoE Eq. 21-24). mmoe's layer also has biases (experts: H + D/h each; multi-head layer: d; merge layer:
d), each router counts its own scorer (:mod:`mmoe.moe.scorers`: an X-MoE router has a (D/h x d_e) projection, N x d_e
expert embeddings and a temperature in place of the (D/h x N) linear router), and an optional Sub-LN adds 2H per
expert. DeepSeekMoE's shared experts (Dai et al., 2024,
§3.2, Eq. 9) are K_s more experts of the same shape that every sub-token passes through; fine-grained experts
(§3.1) are the same formulas at a smaller H = beta * ffn_dim. With expert-choice routing (Zhou et al., 2022) a token
is taken by a data-dependent number of experts, c on average (the capacity factor): the per-token counts use that
mean, rounded. FLOPs count a multiply-add as 2.
"""

from __future__ import annotations

from collections.abc import Sequence

from mmoe.moe.config import MoEConfig
from mmoe.moe.scorers import SCORERS


def router_parameters(config: MoEConfig, num_experts: int | None = None) -> int:
    """One router's parameters, as its scorer counts them (:meth:`mmoe.moe.scorers.Scorer.parameter_count`)."""
    num_experts = config.num_experts if num_experts is None else num_experts
    return SCORERS[config.router].parameter_count(config, num_experts)


def expert_parameters(config: MoEConfig) -> int:
    """One expert: D/h -> H -> D/h with biases (MH-MoE Eq. 20 / 23 per expert, plus biases and Sub-LN)."""
    head_dim, hidden = config.head_dim, config.expert_dim
    return 2 * head_dim * hidden + hidden + head_dim + (2 * hidden if config.subln else 0)


def moe_parameter_count(config: MoEConfig) -> int:
    """All parameters of a plain, multi-head or Stratified MoE layer (:class:`mmoe.moe.MoEFeedForward`)."""
    if config.strata is not None:
        # One LayerNorm and one gate over the visible experts per stratum, one shared expert list.
        gates = sum(
            2 * config.dim + router_parameters(config, sum(config.strata[i:])) for i in range(len(config.strata))
        )
        return gates + config.num_experts * expert_parameters(config)
    # MH-MoE Eq. 21 and 24, with biases
    split_merge = 2 * (config.dim * config.dim + config.dim) if config.heads > 1 else 0
    experts = (config.num_experts + config.shared_experts) * expert_parameters(config)
    return split_merge + router_parameters(config) + experts


def active_parameters_per_token(config: MoEConfig, gates: Sequence[int] | None = None) -> int:
    """Parameters a token touches: split/merge layers, router, top_k routed experts per sub-token (at most all) and
    the shared experts.

    Stratified MoE: a token passes gate 1 and then a data-dependent subset of the later gates; ``gates`` names the
    gates passed (default: all of them, the most a token can touch), each as :func:`gate_cost`.
    """
    if config.strata is not None:
        return sum(gate_cost(config, gate)[0] for gate in _gates(config, gates))
    split_merge = 2 * (config.dim * config.dim + config.dim) if config.heads > 1 else 0
    experts_touched = min(config.num_experts, round(config.heads * routed_experts(config))) + config.shared_experts
    return split_merge + router_parameters(config) + experts_touched * expert_parameters(config)


def flops_per_token(config: MoEConfig, gates: Sequence[int] | None = None) -> int:
    """Forward FLOPs per token: split/merge (MH-MoE Eq. 14, 17), router (MH-MoE Eq. 12, 15), experts (MH-MoE Eq. 13,
    16: top_k routed and the shared ones per sub-token); a multiply-add counts as 2 FLOPs. Stratified MoE: the sum
    over ``gates`` as in :func:`active_parameters_per_token`."""
    if config.strata is not None:
        return sum(gate_cost(config, gate)[1] for gate in _gates(config, gates))
    dim, heads = config.dim, config.heads
    split_merge = 2 * 2 * dim * dim if heads > 1 else 0
    experts = round(
        2 * heads * (routed_experts(config) + config.shared_experts) * 2 * config.head_dim * config.expert_dim
    )
    return split_merge + router_flops(config, config.num_experts) + experts


def routed_experts(config: MoEConfig) -> float:
    """Routed experts per sub-token: top_k, or with expert choice the mean c (Zhou et al., 2022, §3.2). ReLU gates
    (ReMoE) use a varying number: top_k is the mean their adaptive L1 penalty holds, so their cost is the expected
    value at that target."""
    return config.capacity_factor if config.routing == "expert_choice" else config.top_k


def router_flops(config: MoEConfig, num_experts: int) -> int:
    """Scores of one token's h sub-tokens over ``num_experts`` experts (MH-MoE Eq. 12, 15), each as its scorer
    counts them (:meth:`mmoe.moe.scorers.Scorer.flops_per_sub_token`)."""
    return config.heads * SCORERS[config.router].flops_per_sub_token(config, num_experts)


def gate_cost(config: MoEConfig, gate: int) -> tuple[int, int]:
    """Stratified MoE (Eq. 4-7): (parameters touched, forward FLOPs) of one token's pass at 0-based gate ``gate``:
    the gate's LayerNorm, its scores over the E_i visible experts of strata i..L, and two experts (one where E_i = 1)
    (FLOPs in the weights, as everywhere here)."""
    visible = sum(config.strata[gate:])
    choices = min(2, visible)  # the router caps top-2 at the experts it sees
    parameters = 2 * config.dim + router_parameters(config, visible) + choices * expert_parameters(config)
    flops = router_flops(config, visible) + choices * 2 * 2 * config.head_dim * config.expert_dim  # no LayerNorm
    return parameters, flops


def _gates(config: MoEConfig, gates: Sequence[int] | None) -> Sequence[int]:
    return range(len(config.strata)) if gates is None else gates
