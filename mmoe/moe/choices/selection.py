"""Which experts a router picks and how their outputs are weighed: top-k token choice, expert choice (Zhou et al.,
2022, :mod:`mmoe.moe.expert_choice`) or Soft MoE's slots (Puigcerver et al., 2024, :mod:`mmoe.moe.soft_moe`),
loss-free balancing's selection bias (Wang et al., 2024), DeepSeek-V2/V3's group-limited top-k
(:mod:`mmoe.moe.group_limited`) and routed scaling factor, and top-p routing (Huang et al.,
2024, :mod:`mmoe.moe.top_p`) with its controller."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmoe.moe.choices.top_p import top_p_refusals
from mmoe.moe.choices.values import finite_at_least, finite_or_none, is_int, refuse, require

ROUTINGS = ("token_choice", "expert_choice", "soft")
BIAS_UPDATE_RULES = ("sign", "z_score")
GROUP_SCORES = ("max", "top_sum")


@dataclass(frozen=True, kw_only=True)
class Selection:
    """How a router selects and weighs experts (a part of :class:`mmoe.moe.RoutingChoices`).

    Args:
        top_k: experts per (sub-)token, any k <= num_experts (k > 2 as in fine-grained MoE: DeepSeekMoE, Dai et al.,
            2024, §3.1, Eq. 9-11, routes m*K of m*N segmented experts).
        renormalize: with top-k > 1, divide the k gate weights by their sum (GShard, torchscale; before any capacity
            drop). False keeps the raw gate values, as MH-MoE Eq. 2 / 6 and Stratified MoE Eq. 6 write the mix.
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
            ``"soft"`` (Soft MoE, Puigcerver et al., 2024, §2, :mod:`mmoe.moe.soft_moe`): each expert processes
            ``slots_per_expert`` slots per sequence, each slot a softmax-weighted mix of the sequence's tokens, and
            each token's output a softmax-weighted mix of every slot's output. No token is dropped and no balance loss
            exists. Per sequence, not per batch; captioning refuses it (every token of a sequence reaches every slot).
            Refused with top_k != 1, capacity factors, strata, heads > 1, shared experts, Triton kernels, router
            jitter, the loss-free bias and the balance options, which it has no use for.
        slots_per_expert: Soft MoE's p, the slots each expert processes per sequence (the paper's LAION recipe:
            1). Must stay 1 unless ``routing: soft``.
        bias_update_rate: auxiliary-loss-free load balancing (Wang et al., 2024, §3, Eq. 3 and Algorithm 1): each
            router keeps a per-expert bias b (a buffer, saved in checkpoints) added to the gate scores for the top-k
            selection only (the gate weights stay the unbiased scores) and updated after each optimiser step by
            ``b_i += u * sign(mean load - load_i)`` with u this rate (the paper's u = 0.001), the loads counted over
            the step's (sub-)token choices on every data-parallel rank. 0 = off. The balance-loss weight can then
            be 0. Not defined for Stratified MoE gates (refused).
        bias_update_rule: how the loss-free bias moves: ``"sign"`` (Wang et al., 2024, Algorithm 1, above) or
            ``"z_score"`` (MoE-ViE's update): ``b_i += u * (mean load - load_i) / std(load)``, the loads' population
            standard deviation over the experts, no move when every load is equal. Needs ``bias_update_rate > 0``.
        routed_scaling_factor: DeepSeek-V2/V3's routed scaling factor: the routed experts' combined output (the gate
            weights, after any renormalisation) is multiplied by this constant; shared experts are not scaled.
            1.0 = none (the default; DeepSeek-V2's released config uses 16.0, DeepSeek-V3's 2.5).
        expert_groups: group-limited routing (DeepSeek-V2 §2.1.3 device-limited routing, DeepSeek-V3 §2.1.2
            node-limited routing): the experts in G equal groups of consecutive ids; each (sub-)token first chooses
            its ``top_groups`` best groups, then its top-k experts inside them. 1 = no groups (the default).
        top_groups: M, the groups each (sub-)token may route to (DeepSeek-V2: M = 3 of its 8 devices; DeepSeek-V3:
            M = 4 of its 8 nodes). None = every group (no limit).
        group_score: how a group is ranked. ``"max"`` (DeepSeek-V2): its best expert's score. ``"top_sum"``
            (DeepSeek-V3): the sum of its K/M highest scores (2 in V3: K = 8, M = 4). Scores are the gate values,
            plus the loss-free selection bias when set (as DeepSeek-V3 ranks with the biased scores).
        top_p: top-p (dynamic) routing (Huang et al., 2024, §3.1, :mod:`mmoe.moe.top_p`): each (sub-)token uses its
            experts in descending gate probability until their sum reaches this p (the expert that reaches it
            included), between 1 and num_experts of them, weighted by their raw probabilities with
            ``renormalize: false`` (the paper's mix). The paper's p = 0.4. K is the most any (sub-)token uses; top_k
            stays 1 (unused). Needs a softmax gate and token-choice routing; dropless (no capacity factor). With
            ``target_active_experts`` it is the controller's starting value. None = top-k routing.
        target_active_experts: k*, the mean number of experts per non-padding (sub-)token that a controller holds
            by moving p in training (``logit(p) += top_p_rate * (k* - measured) / k*`` after each backward; mmoe's
            rule after DTop-p, arXiv 2512.13996; :mod:`mmoe.moe.top_p`); evaluation uses the frozen p, a buffer
            saved in checkpoints. 1 < k* < num_experts. None = p fixed.
        top_p_rate: the controller's step on logit(p) per unit of relative error (0.5: measuring a tenth fewer
            experts than the target raises logit(p) by 0.05).
        dynamic_loss_weight: Huang et al.'s dynamic loss (§3.2): the mean entropy of the (sub-)tokens' routing
            distributions, minimised with this weight (the paper's 1e-4), returned as the router's
            ``dynamic_loss``. 0 = off. Needs ``top_p``.
    """

    top_k: int = 1
    renormalize: bool = True
    routing: Literal["token_choice", "expert_choice", "soft"] = "token_choice"
    slots_per_expert: int = 1
    bias_update_rate: float = 0.0
    bias_update_rule: Literal["sign", "z_score"] = "sign"
    routed_scaling_factor: float = 1.0
    expert_groups: int = 1
    top_groups: int | None = None
    group_score: Literal["max", "top_sum"] = "max"
    top_p: float | None = None
    target_active_experts: float | None = None
    top_p_rate: float = 0.5
    dynamic_loss_weight: float = 0.0

    @property
    def may_choose_no_expert(self) -> bool:
        """Whether the router may leave some of a (sub-)token's ``top_k`` choices empty (an adaptive router: the
        number of experts a (sub-)token uses then varies); such a choice names the expert id ``num_experts``, which
        the dispatch never runs (:mod:`mmoe.moe.dispatch`)."""
        # top-p (mmoe.moe.top_p); ReLU gates (ReMoE: the zero gates' choices); null / zero-computation experts
        return self.top_p is not None or self.gate == "relu" or self.zero_computation_experts > 0

    def _check_selection(self) -> None:
        """Each choice's range, then the combinations (reads ``num_experts``, ``strata`` and the capacity)."""
        owner = type(self).__name__
        require(self, [("top_k", is_int(self.top_k) and self.top_k > 0, "a positive integer")])
        if self.top_k > self.num_experts:
            raise ValueError(f"{owner}.top_k={self.top_k} exceeds {owner}.num_experts={self.num_experts}")
        scaling = self.routed_scaling_factor
        require(
            self,
            [
                ("bias_update_rate", finite_at_least(self.bias_update_rate, 0.0), "a finite number >= 0"),
                ("bias_update_rule", self.bias_update_rule in BIAS_UPDATE_RULES, f"one of {BIAS_UPDATE_RULES}"),
                ("routing", self.routing in ROUTINGS, f"one of {ROUTINGS}"),
                ("routed_scaling_factor", finite_at_least(scaling, 0.0) and scaling != 0, "a finite number > 0"),
                ("group_score", self.group_score in GROUP_SCORES, f"one of {GROUP_SCORES}"),
                ("slots_per_expert", is_int(self.slots_per_expert) and self.slots_per_expert > 0, "a positive integer"),
            ],
        )
        if self.routing == "expert_choice":
            self._check_expert_choice()
        if self.routing == "soft":
            self._check_soft()
        refuse(
            self, [("slots_per_expert", self.slots_per_expert != 1 and self.routing != "soft", "needs routing: soft")]
        )
        refuse(self, self._group_refusals())
        refuse(self, top_p_refusals(self))
        refuse(
            self,
            [
                (
                    "routed_scaling_factor",
                    scaling != 1 and self.routing != "token_choice",
                    "DeepSeek's routed scaling applies to token-choice routing",
                ),
                (
                    "bias_update_rule",
                    self.bias_update_rule != "sign" and not self.bias_update_rate,
                    "moves the loss-free bias, which bias_update_rate 0 turns off",
                ),
            ],
        )

    def _check_expert_choice(self) -> None:
        infinite = "each expert takes ceil(c * n / num_experts) tokens: c must be finite (c = num_experts already "
        infinite += "gives every expert every token)"
        refuse(
            self,
            [
                (
                    "capacity_factor",
                    self.capacity_factor is None,
                    "each expert's share needs Zhou et al.'s c, e.g. 2.0",
                ),
                ("capacity_factor", not finite_or_none(self.capacity_factor), infinite),
                ("eval_capacity_factor", not finite_or_none(self.eval_capacity_factor), infinite),
                ("top_k", self.top_k != 1, "experts pick the tokens; leave top_k at 1"),
                ("strata", self.strata is not None, "Stratified MoE gates route by token choice"),
                ("bias_update_rate", self.bias_update_rate > 0, "every expert's load is fixed at its capacity"),
                ("balance_batch", self.balance_batch != "local", "expert choice has no balance loss"),
            ],
            context=" with routing='expert_choice'",
        )

    def _check_soft(self) -> None:
        mixed = "Soft MoE gives every expert its slots, a mix of every token"
        refuse(
            self,
            [
                ("strata", self.strata is not None, "Stratified MoE gates route by token choice"),
                ("top_k", self.top_k != 1, "Soft MoE has no top-k; leave top_k at 1"),
                ("capacity_factor", self.capacity_factor is not None, f"{mixed}: nothing is dropped; give null"),
                ("eval_capacity_factor", self.eval_capacity_factor is not None, f"{mixed}: give null"),
                ("heads", self.heads != 1, "MH-MoE sub-tokens are not implemented for Soft MoE; give heads: 1"),
                ("shared_experts", self.shared_experts != 0, "not implemented for Soft MoE; give shared_experts: 0"),
                ("expert_kernels", self.expert_kernels != "torch", "Soft MoE's slots run batched; give torch"),
                ("router_jitter", self.router_jitter > 0, "Soft MoE's logits are not a router's; give 0"),
                ("bias_update_rate", self.bias_update_rate > 0, "every expert takes its slots: no load to balance"),
                ("balance_batch", self.balance_batch != "local", "Soft MoE has no balance loss"),
                ("balance_choices", self.balance_choices != "first", "Soft MoE has no balance loss"),
            ],
            context=" with routing='soft'",
        )

    def _group_refusals(self) -> list[tuple[str, bool, str]]:
        groups = self.expert_groups
        if not is_int(groups) or groups < 1:
            return [("expert_groups", True, "expected a positive integer")]
        per_group = self.num_experts // groups
        top = groups if self.top_groups is None else self.top_groups
        good_top = is_int(top) and 1 <= top <= groups
        summed = self.top_k // top if good_top else 1
        return [
            ("expert_groups", self.num_experts % groups != 0,
             f"must divide num_experts={self.num_experts} (groups of equal size)"),
            ("top_groups", not good_top, f"expected None or an integer in [1, expert_groups={groups}]"),
            ("top_groups", good_top and self.top_k > top * per_group,
             f"top_k={self.top_k} exceeds the {top} x {per_group} experts of the groups chosen"),
            ("group_score", self.group_score == "top_sum" and groups > 1 and not 1 <= summed <= per_group,
             f"sums the top_k // top_groups = {summed} best scores of a group of {per_group}; needs 1 to {per_group}"),
            ("expert_groups", groups > 1 and self.routing != "token_choice", "groups limit token-choice routing"),
            ("expert_groups", groups > 1 and self.strata is not None, "Stratified MoE gates see a stratum's experts"),
        ]  # fmt: skip
