"""The experts a MoE layer routes to: how many, how wide, split into MH-MoE heads or Stratified MoE strata, shared
(DeepSeekMoE), frozen (X-MoE) and which kernels run them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmoe.moe.choices.values import finite_at_least, is_int, require

EXPERT_KERNELS = ("torch", "triton")


@dataclass(frozen=True, kw_only=True)
class ExpertPool:
    """The experts of a MoE layer (a part of :class:`mmoe.moe.RoutingChoices`).

    Args:
        num_experts: number of experts N (for Stratified MoE, the sum over strata).
        heads: MH-MoE heads h: each token is split into h sub-tokens of width D/h that are routed independently
            (MH-MoE Eq. 4); 1 means plain MoE with no extra layers.
        strata: Stratified MoE: number of experts in each stratum (Xu et al., §3). None for a plain MoE layer.
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
        frozen: X-MoE §3.3 frozen routing for fine-tuning: router and experts get no gradient, the balance loss is
            still returned (and still trains the layers below through the token representations).
        expert_kernels: ``"torch"`` (default): the reference path, gather rows, grouped GEMMs, gather back.
            ``"triton"``: the first expert linear gathers its rows (bias and GELU in its epilogue) and the second
            scatters its outputs inside the GEMM (:mod:`mmoe.moe.triton_experts`, Hopper wgmma tiles); used on CUDA
            tensors (and on the CPU under ``TRITON_INTERPRET=1``), elsewhere the layer warns once and keeps the
            reference path. Stratified layers always use the reference path. Equal to the reference within float
            tolerance (tested); its speed on a GPU is not yet measured.
    """

    num_experts: int = 8
    heads: int = 1
    strata: list[int] | None = None
    beta: float = 1.0
    shared_experts: int = 0
    frozen: bool = False
    expert_kernels: Literal["torch", "triton"] = "torch"

    def _check_experts(self) -> None:
        positive = "a positive integer"
        ranges = [
            ("num_experts", is_int(self.num_experts) and self.num_experts > 0, positive),
            ("heads", is_int(self.heads) and self.heads > 0, positive),
            ("shared_experts", is_int(self.shared_experts) and self.shared_experts >= 0, "a non-negative integer"),
            ("beta", finite_at_least(self.beta, 0.0) and self.beta > 0, "a finite positive number"),
            ("expert_kernels", self.expert_kernels in EXPERT_KERNELS, f"one of {EXPERT_KERNELS}"),
        ]
        require(self, ranges)

    def require_divisible_width(self, dim: int, owner: str) -> None:
        """Refuse a token width ``dim`` (a field of ``owner``) that MH-MoE's split into ``heads`` sub-tokens of
        width D/h (MH-MoE Eq. 4) does not divide."""
        if dim % self.heads:
            raise ValueError(f"{owner}.dim={dim} is not divisible by {type(self).__name__}.heads={self.heads}")

    def _check_strata(self) -> None:
        """Stratified MoE's strata, and what its gates do not define (reads ``top_k``, ``bias_update_rate`` and
        ``balance_batch`` of the other parts)."""
        owner = type(self).__name__
        strata = list(self.strata)
        if not strata or any(not is_int(n) or n <= 0 for n in strata):
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
