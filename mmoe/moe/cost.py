"""Closed-form parameter counts and FLOPs per token of one MoE layer (MH-MoE App. D, Eq. 12-24, with biases).

MH-MoE App. D counts weights only, with a linear router: Gamma = 2d^2 + dN/h + 8 beta d^2 N / h for an FFN of inner
width 4d (MH-MoE Eq. 21-24). mmoe's layer also has biases (experts: H + D/h each; multi-head layer: d; merge layer:
d), each router counts its own scorer (:mod:`mmoe.moe.scorers`: an X-MoE router has a (D/h x d_e) projection, N x d_e
expert embeddings and a temperature in place of the (D/h x N) linear router), and an optional Sub-LN adds 2H per
expert. DeepSeekMoE's shared experts (Dai et al., 2024, §3.2, Eq. 9) are K_s more experts of the same shape that every
sub-token passes through; fine-grained experts (§3.1) are the same formulas at a smaller H = beta * ffn_dim. With
expert-choice routing (Zhou et al., 2022) a token is taken by a data-dependent number of experts, c on average (the
capacity factor): the per-token counts use that mean, rounded; so do they with top-p routing (Huang et al., 2024) at
its controller's target mean. Soft MoE (Puigcerver et al., 2024, :mod:`mmoe.moe.soft_moe`) has slot parameters Phi (d
x n*p) and a scale in place of a router, and its per-token FLOPs depend on the m tokens of the sequence
(:func:`soft_moe_flops_per_token`). With null / zero-computation experts (AdaMoE, MoE++: :mod:`mmoe.moe.null_experts`)
the router scores E + Z experts, the constant experts add their vectors and 2 x D/h mixing matrices, and a sub-token's
routed experts are counted at their expected number when the balance loss has spread the choices evenly over the pool,
``top_k * E / (E + Z)`` (the most is top_k); the copy and constant experts' element-wise work is not counted, as
biases and activations are not. FLOPs count a multiply-add as 2.
"""

from __future__ import annotations

from collections.abc import Sequence

from mmoe.moe.config import MoEConfig
from mmoe.moe.scorers import SCORERS


def router_parameters(config: MoEConfig, num_experts: int | None = None) -> int:
    """One router's parameters, as its scorer counts them (:meth:`mmoe.moe.scorers.Scorer.parameter_count`), plus
    MoE++'s P x P gating-residual map W_g."""
    num_experts = config.num_experts + config.zero_computation_experts if num_experts is None else num_experts
    residual = num_experts * num_experts if config.gating_residual else 0
    return SCORERS[config.router].parameter_count(config, num_experts) + residual


def expert_parameters(config: MoEConfig) -> int:
    """One expert: D/h -> H -> D/h with biases (MH-MoE Eq. 20 / 23 per expert, plus biases and Sub-LN)."""
    head_dim, hidden = config.head_dim, config.expert_dim
    return 2 * head_dim * hidden + hidden + head_dim + (2 * hidden if config.subln else 0)


def moe_parameter_count(config: MoEConfig) -> int:
    """All parameters of a plain, multi-head, Stratified or Soft MoE layer (:class:`mmoe.moe.MoEFeedForward`)."""
    if config.routing == "soft":  # Phi (d x n*p), the scale, the experts
        return config.dim * soft_slots(config) + 1 + config.num_experts * expert_parameters(config)
    if config.strata is not None:
        # One LayerNorm and one gate over the visible experts per stratum, one shared expert list.
        gates = sum(
            2 * config.dim + router_parameters(config, sum(config.strata[i:])) for i in range(len(config.strata))
        )
        return gates + config.num_experts * expert_parameters(config)
    # MH-MoE Eq. 21 and 24, with biases
    split_merge = 2 * (config.dim * config.dim + config.dim) if config.heads > 1 else 0
    experts = (config.num_experts + config.shared_experts) * expert_parameters(config)
    return split_merge + router_parameters(config) + experts + constant_expert_parameters(config)


def constant_expert_parameters(config: MoEConfig) -> int:
    """MoE++'s constant experts: a vector v and a 2 x D/h mixing matrix each (:mod:`mmoe.moe.null_experts`)."""
    return config.constant_experts * 3 * config.head_dim


def active_parameters_per_token(config: MoEConfig, gates: Sequence[int] | None = None) -> int:
    """Parameters a token touches: split/merge layers, router, top_k routed experts per sub-token (at most all) and
    the shared experts.

    Stratified MoE: a token passes gate 1 and then a data-dependent subset of the later gates; ``gates`` names the
    gates passed (default: all of them, the most a token can touch), each as :func:`gate_cost`.
    """
    if config.strata is not None:
        return sum(gate_cost(config, gate)[0] for gate in _gates(config, gates))
    if config.routing == "soft":  # every token's output mixes every expert's slots
        return moe_parameter_count(config)
    split_merge = 2 * (config.dim * config.dim + config.dim) if config.heads > 1 else 0
    experts_touched = min(config.num_experts, round(config.heads * routed_experts(config))) + config.shared_experts
    touched = experts_touched * expert_parameters(config) + constant_expert_parameters(config)
    return split_merge + router_parameters(config) + touched


def flops_per_token(config: MoEConfig, gates: Sequence[int] | None = None, tokens: int | None = None) -> int:
    """Forward FLOPs per token: split/merge (MH-MoE Eq. 14, 17), router (MH-MoE Eq. 12, 15), experts (MH-MoE Eq. 13,
    16: top_k routed and the shared ones per sub-token); a multiply-add counts as 2 FLOPs. Stratified MoE: the sum
    over ``gates`` as in :func:`active_parameters_per_token`. Soft MoE: :func:`soft_moe_flops_per_token` for
    sequences of ``tokens`` tokens (required there, unused elsewhere)."""
    if config.routing == "soft":
        if tokens is None:
            raise ValueError("a Soft MoE layer's FLOPs per token depend on the tokens per sequence; give tokens")
        return soft_moe_flops_per_token(config, tokens)
    if config.strata is not None:
        return sum(gate_cost(config, gate)[1] for gate in _gates(config, gates))
    dim, heads = config.dim, config.heads
    split_merge = 2 * 2 * dim * dim if heads > 1 else 0
    experts = round(
        2 * heads * (routed_experts(config) + config.shared_experts) * 2 * config.head_dim * config.expert_dim
    )
    mixing = heads * config.constant_experts * 2 * 2 * config.head_dim  # MoE++'s softmax(W x) of each constant expert
    return split_merge + router_flops(config, config.num_experts + config.zero_computation_experts) + experts + mixing


def soft_slots(config: MoEConfig) -> int:
    """n * p, the slots of a Soft MoE layer."""
    return config.num_experts * config.slots_per_expert


def soft_moe_flops_per_token(config: MoEConfig, tokens: int) -> int:
    """Soft MoE's forward FLOPs per token of a sequence of m = ``tokens`` tokens (Puigcerver et al., 2024, §2): the
    logits (2 d n p), the dispatch X~ = D^T X and the combine Y = C Y~ (2 d n p each, per token: 2 m d n p per
    sequence), and the experts' n p slots shared by the m tokens, (n p / m) x one expert's 4 d H; the L2
    normalisations and softmaxes are left out (O(d + n p) per token). It falls as the sequence grows: the same n p
    slots serve more tokens."""
    if tokens < 1:
        raise ValueError(f"tokens must be a positive number of tokens per sequence, got {tokens!r}")
    slots = soft_slots(config)
    expert = 2 * 2 * config.dim * config.expert_dim
    return 3 * 2 * config.dim * slots + round(slots * expert / tokens)


def routed_experts(config: MoEConfig) -> float:
    """Routed experts per sub-token: top_k, or with expert choice the mean c (Zhou et al., 2022, §3.2); with top-p
    routing (Huang et al., 2024) the expected number, the controller's target, or without one every expert (the
    most a sub-token may use); ReLU gates (ReMoE) use a varying number, top_k the mean their adaptive L1 penalty
    holds, so their cost is the expected value at that target; with null / zero-computation experts the expected
    top_k * E / (E + Z) of a router balanced over the pool (AdaMoE, MoE++)."""
    if config.top_p is not None:
        return config.num_experts if config.target_active_experts is None else config.target_active_experts
    if config.routing == "expert_choice":
        return config.capacity_factor
    return config.top_k * config.num_experts / (config.num_experts + config.zero_computation_experts)


def router_flops(config: MoEConfig, num_experts: int) -> int:
    """Scores of one token's h sub-tokens over ``num_experts`` experts (MH-MoE Eq. 12, 15), each as its scorer
    counts them (:meth:`mmoe.moe.scorers.Scorer.flops_per_sub_token`), plus MoE++'s gating residual W_g G_{j-1}
    (2 P^2 per sub-token)."""
    residual = 2 * num_experts * num_experts if config.gating_residual else 0
    return config.heads * (SCORERS[config.router].flops_per_sub_token(config, num_experts) + residual)


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
