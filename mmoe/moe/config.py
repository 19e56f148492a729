"""Typed configuration of one Mixture-of-Experts layer.

Every MoE variant mmoe implements is a value of this one dataclass:

* Switch / GShard SMoE: ``router="linear"``, ``gate="softmax"``, ``top_k`` 1 or 2.
* X-MoE (Chi et al., 2022, §3.1, Eq. 7-9): ``router="xmoe"`` — low-dimensional projection (``routing_dim``),
  L2-normalised token and expert embeddings, learnable temperature, balance loss at a fixed temperature.
* MH-MoE (Wu et al., 2024, §3, Eq. 3-9, App. D-E): ``heads > 1`` splits each token into sub-tokens.
* Stratified MoE (Xu et al., 2023, §3, Eq. 4-11): ``strata=[n_1, ..., n_L]``.
* DeepSeekMoE (Dai et al., 2024, §3.1-3.2): fine-grained experts (``beta = 1/m`` with m times the experts and
  m times ``top_k``) and ``shared_experts`` always-on experts added to the routed output.
* Auxiliary-loss-free balancing (Wang et al., 2024, §3, Algorithm 1): ``bias_update_rate > 0``.
* Global-batch balance loss (Qiu et al., 2025): ``balance_batch="global"``.
* Expert-choice routing (Zhou et al., 2022, §3.2): ``routing="expert_choice"``.
* MoMa's modality-aware expert pools (Lin et al., 2024): a backbone's plan, ``mmoe.model.MoEPlan.experts_by_modality``,
  which builds each modality's layers with their own ``num_experts``.
* LIMoE's entropy losses and V-MoE's batch-priority routing, DeepSeek's balance-loss conventions, routed scaling and
  group-limited top-k, Switch Transformer's router jitter: :class:`mmoe.moe.routing_details.RoutingDetails`.

The routing choices, with their defaults and their checks, are :class:`RoutingChoices`; :class:`MoEConfig` adds one
layer's widths to them, and a backbone's plan of MoE layers adds where the layers go.
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass, field
from typing import Literal

from mmoe.moe.routing_details import RoutingDetails

ROUTERS = ("linear", "xmoe")
GATES = ("softmax", "sigmoid")
EXPERT_KERNELS = ("torch", "triton")
BALANCE_BATCHES = ("local", "global", "sequence")
ROUTINGS = ("token_choice", "expert_choice")

#: X-MoE App. A: the gating temperature starts at 0.3 for softmax gates and 0.07 for sigmoid gates; the balance loss
#: (X-MoE Eq. 9) uses the same values as its fixed temperature tau_0.
INITIAL_TEMPERATURE = {"softmax": 0.3, "sigmoid": 0.07}

#: X-MoE §3.1 "Implementation Tips": expert embeddings start at, and are kept at, this L2 norm.
EXPERT_EMBEDDING_NORM = 0.1

#: X-MoE §4.1 / MH-MoE Table 9: routing dimension d_e for one head; MH-MoE uses d_e = 16 / h.
DEFAULT_ROUTING_DIM = 16


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite_or_none(value: float | None) -> bool:
    return value is None or math.isfinite(value)


@dataclass(frozen=True, kw_only=True)
class RoutingChoices(RoutingDetails):
    """How MoE layers route, whatever their width: each choice, its default and its check, stated once.

    Errors name the field as ``<class>.<field>`` of the config that holds it. The routing details of LIMoE, V-MoE,
    Switch Transformer and DeepSeek are fields of the base :class:`mmoe.moe.routing_details.RoutingDetails`.

    Args:
        num_experts: number of experts N (for Stratified MoE, the sum over strata).
        top_k: experts per (sub-)token, any k <= num_experts (k > 2 as in fine-grained MoE: DeepSeekMoE, Dai et al.,
            2024, §3.1, Eq. 9-11, routes m*K of m*N segmented experts).
        renormalize: with top-k > 1, divide the k gate weights by their sum (GShard, torchscale; before any capacity
            drop). False keeps the raw gate values, as MH-MoE Eq. 2 / 6 and Stratified MoE Eq. 6 write the mix.
        router: ``"linear"`` scores s_i = h·e_i (Switch / GShard); ``"xmoe"`` scores s_i = cos(W h, e_i) with W a
            bias-free ``routing_dim x D'`` projection (X-MoE Eq. 7) and a learnable temperature (X-MoE Eq. 8).
        gate: ``"softmax"`` over experts or element-wise ``"sigmoid"`` (X-MoE Eq. 8).
        heads: MH-MoE heads h: each token is split into h sub-tokens of width D/h that are routed independently
            (MH-MoE Eq. 4); 1 means plain MoE with no extra layers.
        strata: Stratified MoE: number of experts in each stratum (Xu et al., §3). None for a plain MoE layer.
        capacity_factor: None = dropless (default). Otherwise each expert takes at most
            ``ceil(capacity_factor * top_k * T / N)`` choices, T the non-padding (sub-)tokens; first choices win
            over second choices, then earlier tokens over later ones (GShard); overflow is dropped. Infinity
            (``.inf`` in YAML) is no limit, the same as None. With expert choice: Zhou et al.'s c, each expert takes
            ``ceil(c * n / N)`` of the batch's n (sub-)tokens (required and finite; c >= N gives every expert every
            token).
        eval_capacity_factor: capacity factor in eval mode; None = same as ``capacity_factor``.
        frozen: X-MoE §3.3 frozen routing for fine-tuning: router and experts get no gradient, the balance loss is
            still returned (and still trains the layers below through the token representations).
        routing_dim: X-MoE routing dimension d_e. None = 16 for one head (X-MoE §4.1, its N = 32 setting; the
            paper's rule of thumb is d_e = N/2) and ``16 // heads`` with heads (MH-MoE Table 9), resolved by
            :class:`MoEConfig`.
        beta: expert width as a fraction of ``ffn_dim`` (MH-MoE's expert width multiplier, App. D). 1.0 keeps the
            FLOPs per token of a plain MoE, as the public MH-MoE code does (App. D.1); beta ~ h matches the parameter
            count of a plain MoE instead (Table 11). DeepSeekMoE's fine-grained expert segmentation (Dai et al.,
            2024, §3.1, Eq. 6-8) splits each expert into m: ``beta = 1/m`` with ``m * N`` experts; the active FLOPs
            stay those of N experts at top-K only when ``top_k = m * K`` (with ``shared_experts`` counted among
            them), which is the config's choice, not derived here.
        shared_experts: DeepSeekMoE shared expert isolation (§3.2, Eq. 9): K_s experts of the routed experts' shape
            that every (sub-)token passes through, their outputs added to the routed output with weight 1 (inside
            the MH-MoE split and merge, on sub-tokens). 0 = none. Not defined for Stratified MoE, whose passes
            route every expert (refused).
        bias_update_rate: auxiliary-loss-free load balancing (Wang et al., 2024, §3, Eq. 3 and Algorithm 1): each
            router keeps a per-expert bias b (a buffer, saved in checkpoints) added to the gate scores for the top-k
            selection only (the gate weights stay the unbiased scores) and updated after each optimiser step by
            ``b_i += u * sign(mean load - load_i)`` with u this rate (the paper's u = 0.001), the loads counted over
            the step's (sub-)token choices on every data-parallel rank. 0 = off. The balance-loss weight can then
            be 0. Not defined for Stratified MoE gates (refused).
        balance_batch: the batch the balance loss's expert frequencies f_i are counted over. ``"local"``: this
            process's (sub-)tokens. ``"global"``: every data-parallel rank's (Qiu et al., 2025, "Demons in the
            Detail", §3: f_i all-reduced before the Switch product N * sum_i f_i * P_i): in training, with a process
            group, each rank's loss is N * sum_i f_i * P_i with the global f_i and its own share of the global P_i,
            so that the ranks' mean (what data-parallel gradient averaging trains) equals one process's loss on the
            global batch. Every rank must then run the same MoE layers in the same order (an all-reduce per
            router). Not defined for Stratified MoE, whose later gates see a data-dependent subset (refused).
        routing: ``"token_choice"``: each (sub-)token picks its top-k experts. ``"expert_choice"`` (Zhou et al., 2022,
            §3.2, :mod:`mmoe.moe.expert_choice`): each expert picks its top-C (sub-)tokens of the batch by gate value,
            C from ``capacity_factor``; a token may be taken by no expert (``RoutingRecord.unrouted_fraction``) or by
            several. Balanced by construction: its balance loss is 0. top_k must stay 1 (unused); refused with
            strata, ``bias_update_rate`` and ``balance_batch: global`` (nothing to balance) and without a finite
            capacity factor. The experts run batched as E slices of C rows, or through the fused kernels with
            ``expert_kernels: triton``.
            A token's routing depends on the other tokens of its batch: evaluation results change with the
            evaluation batch size (and which samples share a batch), and tasks whose text is causal (captioning)
            refuse it, since an earlier token's routing would depend on later ones.
        expert_kernels: ``"torch"`` (default): the reference path, gather rows, grouped GEMMs, gather back.
            ``"triton"``: the first expert linear gathers its rows (bias and GELU in its epilogue) and the second
            scatters its outputs inside the GEMM (:mod:`mmoe.moe.triton_experts`, Hopper wgmma tiles); used on CUDA
            tensors (and on the CPU under ``TRITON_INTERPRET=1``), elsewhere the layer warns once and keeps the
            reference path. Stratified layers always use the reference path. Equal to the reference within float
            tolerance (tested); its speed on a GPU is not yet measured.
    """

    num_experts: int = 8
    top_k: int = 1
    renormalize: bool = True
    router: Literal["linear", "xmoe"] = "xmoe"
    gate: Literal["softmax", "sigmoid"] = "softmax"
    heads: int = 1
    strata: list[int] | None = None
    capacity_factor: float | None = None
    eval_capacity_factor: float | None = None
    frozen: bool = False
    routing_dim: int | None = None
    beta: float = 1.0
    shared_experts: int = 0
    bias_update_rate: float = 0.0
    balance_batch: Literal["local", "global", "sequence"] = "local"
    routing: Literal["token_choice", "expert_choice"] = "token_choice"
    expert_kernels: Literal["torch", "triton"] = "torch"

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for name in ("num_experts", "heads", "top_k"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"{owner}.{name} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"{owner}.top_k={self.top_k} exceeds {owner}.num_experts={self.num_experts}")
        if not _is_int(self.shared_experts) or self.shared_experts < 0:
            raise ValueError(f"{owner}.shared_experts must be a non-negative integer, got {self.shared_experts!r}")
        if self.router not in ROUTERS:
            raise ValueError(f"{owner}.router must be one of {ROUTERS}, got {self.router!r}")
        if self.gate not in GATES:
            raise ValueError(f"{owner}.gate must be one of {GATES}, got {self.gate!r}")
        for name in ("capacity_factor", "eval_capacity_factor"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{owner}.{name} must be positive or None, got {value!r}")
        if not (self.bias_update_rate >= 0 and math.isfinite(self.bias_update_rate)):
            raise ValueError(f"{owner}.bias_update_rate must be a finite number >= 0, got {self.bias_update_rate!r}")
        if self.balance_batch not in BALANCE_BATCHES:
            raise ValueError(f"{owner}.balance_batch must be one of {BALANCE_BATCHES}, got {self.balance_batch!r}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"{owner}.routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.routing == "expert_choice":
            self._validate_expert_choice()
        if self.expert_kernels not in EXPERT_KERNELS:
            raise ValueError(f"{owner}.expert_kernels must be one of {EXPERT_KERNELS}, got {self.expert_kernels!r}")
        if not (self.beta > 0 and math.isfinite(self.beta)):
            raise ValueError(f"{owner}.beta must be a finite positive number, got {self.beta!r}")
        if self.routing_dim is not None and (not isinstance(self.routing_dim, int) or self.routing_dim <= 0):
            raise ValueError(f"{owner}.routing_dim must be a positive integer or None, got {self.routing_dim!r}")
        if self.strata is not None:
            self._validate_strata()
        self._validate_details()

    def require_divisible_width(self, dim: int, owner: str) -> None:
        """Refuse a token width ``dim`` (a field of ``owner``) that MH-MoE's split into ``heads`` sub-tokens of
        width D/h (MH-MoE Eq. 4) does not divide."""
        if dim % self.heads:
            raise ValueError(f"{owner}.dim={dim} is not divisible by {type(self).__name__}.heads={self.heads}")

    def _validate_strata(self) -> None:
        owner = type(self).__name__
        strata = list(self.strata)
        if not strata or any(not _is_int(n) or n <= 0 for n in strata):
            raise ValueError(f"{owner}.strata must be a non-empty list of positive integers, got {self.strata!r}")
        if sum(strata) != self.num_experts:
            raise ValueError(
                f"{owner}.strata={strata} sums to {sum(strata)}, but {owner}.num_experts={self.num_experts}"
            )
        if self.top_k != 2:
            raise ValueError(f"{owner}.top_k must be 2 with strata (Stratified MoE routes top-2), got {self.top_k}")
        if self.heads != 1:
            raise ValueError(f"{owner}.heads must be 1 with strata, got {self.heads}")
        if self.shared_experts:
            raise ValueError(
                f"{owner}.shared_experts={self.shared_experts} with strata: Stratified MoE has no always-on expert "
                "(every gate pass routes); set shared_experts: 0"
            )
        if self.bias_update_rate:
            raise ValueError(
                f"{owner}.bias_update_rate={self.bias_update_rate} with strata: loss-free balancing is not defined "
                "for Stratified MoE gates (each sees a different share of the tokens); set bias_update_rate: 0"
            )
        if self.balance_batch != "local":
            raise ValueError(
                f"{owner}.balance_batch={self.balance_batch!r} with strata: a global batch is not defined for "
                "Stratified MoE gates (each sees a data-dependent share of the tokens); set balance_batch: local"
            )
        object.__setattr__(self, "strata", strata)  # frozen: the one normalisation, a tuple given becomes a list

    def _validate_expert_choice(self) -> None:
        infinite = "each expert takes ceil(c * n / num_experts) tokens: c must be finite (c = num_experts already "
        infinite += "gives every expert every token)"
        refused = [
            ("capacity_factor", self.capacity_factor is None, "each expert's share needs Zhou et al.'s c, e.g. 2.0"),
            ("capacity_factor", not _finite_or_none(self.capacity_factor), infinite),
            ("eval_capacity_factor", not _finite_or_none(self.eval_capacity_factor), infinite),
            ("top_k", self.top_k != 1, "experts pick the tokens; leave top_k at 1"),
            ("strata", self.strata is not None, "Stratified MoE gates route by token choice"),
            ("bias_update_rate", self.bias_update_rate > 0, "every expert's load is fixed at its capacity"),
            ("balance_batch", self.balance_batch != "local", "expert choice has no balance loss"),
        ]
        for name, bad, why in refused:
            if bad:
                raise ValueError(
                    f"{type(self).__name__}.{name}={getattr(self, name)!r} with routing='expert_choice': {why}"
                )


@dataclass(frozen=True)
class MoEConfig(RoutingChoices):
    """One MoE layer replacing an FFN ``dim -> ffn_dim -> dim``, routed as its :class:`RoutingChoices` say.

    ``MoEConfig(dim=768, ffn_dim=3072, num_experts=8, top_k=2)``; every field but ``dim`` and ``ffn_dim`` is
    keyword-only.

    Args:
        dim: token width D.
        ffn_dim: inner width of the dense FFN this layer replaces; each expert's inner width is ``ffn_dim * beta``.
        subln: apply a LayerNorm to each expert's hidden activation before its second linear (BEiT-3's Sub-LN FFN),
            so that a one-expert layer equals the backbone's dense FFN.
    """

    dim: int
    ffn_dim: int
    _: KW_ONLY
    subln: bool = False
    # Derived in __post_init__.
    head_dim: int = field(init=False, repr=False)
    expert_dim: int = field(init=False, repr=False)
    initial_temperature: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("dim", "ffn_dim"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"MoEConfig.{name} must be a positive integer, got {value!r}")
        super().__post_init__()
        self.require_divisible_width(self.dim, "MoEConfig")
        derived = {
            "routing_dim": self.routing_dim or max(1, DEFAULT_ROUTING_DIM // self.heads),
            "head_dim": self.dim // self.heads,
            "expert_dim": max(1, round(self.ffn_dim * self.beta)),
            "initial_temperature": INITIAL_TEMPERATURE[self.gate],
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)  # frozen: derived once, here

    def active_capacity_factor(self, training: bool) -> float | None:
        """The capacity factor in force: ``capacity_factor`` in training, else ``eval_capacity_factor`` if set."""
        if training or self.eval_capacity_factor is None:
            return self.capacity_factor
        return self.eval_capacity_factor

    def routes_each_token_alone(self, training: bool) -> bool:
        """Whether each (sub-)token's experts, and so its output, depend on that token alone: token choice with no
        capacity factor in force (no token is dropped for others). A decoder may then reuse earlier tokens' outputs
        instead of running them again beside new ones."""
        return self.routing == "token_choice" and self.active_capacity_factor(training) is None
