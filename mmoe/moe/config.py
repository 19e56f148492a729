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
* LIMoE's entropy losses (:class:`mmoe.moe.choices.Balance`), V-MoE's batch-priority routing
  (:class:`mmoe.moe.choices.Capacity`), DeepSeek's balance-loss conventions, routed scaling and group-limited top-k
  (:class:`mmoe.moe.choices.Selection`), Switch Transformer's router jitter (:class:`mmoe.moe.choices.Scoring`).
* AdaMoE's null experts and MoE++'s zero, copy and constant experts (:class:`mmoe.moe.choices.ZeroComputation`).

The routing choices, with their defaults and their checks, are :class:`RoutingChoices`: the six parts of
:mod:`mmoe.moe.choices`. :class:`MoEConfig` adds one layer's widths to them, and a backbone's plan of MoE layers adds
where the layers go. A router's scorer is one module of :mod:`mmoe.moe.scorers`, named by ``router``.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field

from mmoe.moe.choices import Balance, Capacity, ExpertPool, Scoring, Selection, ZeroComputation
from mmoe.moe.choices.values import finite_at_least, is_int

#: X-MoE App. A: the gating temperature starts at 0.3 for softmax gates and 0.07 for sigmoid gates; the balance loss
#: (X-MoE Eq. 9) uses the same values as its fixed temperature tau_0.
INITIAL_TEMPERATURE = {"softmax": 0.3, "sigmoid": 0.07}

#: X-MoE §4.1 / MH-MoE Table 9: routing dimension d_e for one head; MH-MoE uses d_e = 16 / h.
DEFAULT_ROUTING_DIM = 16


@dataclass(frozen=True, kw_only=True)
class RoutingChoices(ExpertPool, Scoring, Selection, Capacity, Balance, ZeroComputation):
    """How MoE layers route, whatever their width: the six parts of :mod:`mmoe.moe.choices` (see each for its
    fields), checked in turn. Errors name the field as ``<class>.<field>`` of the config that holds it."""

    def __post_init__(self) -> None:
        self._check_experts()
        self._check_scoring()
        self._check_capacity()
        self._check_selection()
        if self.strata is not None:
            self._check_strata()
        self._check_balance()
        self._check_zero_computation()


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
        layernorm_eps: the epsilon of the layer's LayerNorms (the experts' Sub-LN, a Stratified layer's LayerNorm
            per stratum); a backbone's MoE layers take its ``MultiwayConfig.layernorm_eps``, as its dense FFNs do.
    """

    dim: int
    ffn_dim: int
    _: KW_ONLY
    subln: bool = False
    layernorm_eps: float = 1e-5
    # Derived in __post_init__.
    head_dim: int = field(init=False, repr=False)
    expert_dim: int = field(init=False, repr=False)
    initial_temperature: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("dim", "ffn_dim"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ValueError(f"MoEConfig.{name} must be a positive integer, got {value!r}")
        if not finite_at_least(self.layernorm_eps, 0.0):  # nn.LayerNorm's range
            raise ValueError(f"MoEConfig.layernorm_eps must be a finite number >= 0, got {self.layernorm_eps!r}")
        super().__post_init__()
        self.require_divisible_width(self.dim, "MoEConfig")
        derived = {
            "routing_dim": self.routing_dim or max(1, DEFAULT_ROUTING_DIM // self.heads),
            "head_dim": self.dim // self.heads,
            "expert_dim": max(1, round(self.ffn_dim * self.beta)),
            "initial_temperature": INITIAL_TEMPERATURE.get(self.gate, 1.0),  # ReLU gates: linear scorer, none
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)  # frozen: derived once, here

    def routes_each_token_alone(self, training: bool) -> bool:
        """Whether each (sub-)token's experts, and so its output, depend on that token alone: token choice with no
        capacity factor in force (no token is dropped for others). A decoder may then reuse earlier tokens' outputs
        instead of running them again beside new ones."""
        return self.routing == "token_choice" and self.active_capacity_factor(training) is None
