"""The routing details of LIMoE, V-MoE, Switch Transformer and DeepSeek, as typed choices with their checks.

:class:`RoutingDetails` is a base of :class:`mmoe.moe.RoutingChoices`: its fields are routing choices like the others
(a backbone's plan carries them to every layer), kept here so that each module stays one screen of choices. Every
default leaves routing as it was without the field; each paper's own value is named in the field's docstring.

* LIMoE (Mustafa et al., 2022): per-modality local and global entropy losses (:mod:`mmoe.moe.entropy_losses`).
* V-MoE (Riquelme et al., 2021, arXiv 2106.05974): batch-priority routing, the least confident choices dropped first
  (:mod:`mmoe.moe.priority`).
* DeepSeekMoE (Dai et al., 2024, §3.3, Eq. 12-14): a balance loss that counts every one of the K choices; DeepSeek-V3
  (2024, §2.1.2, Eq. 17-20): the sequence-wise balance loss (``RoutingChoices.balance_batch="sequence"``);
  DeepSeek-V2/V3: the routed scaling factor and group-limited top-k (:mod:`mmoe.moe.group_limited`).
* Switch Transformer (Fedus et al., 2022; as in its released Mesh TensorFlow code): multiplicative jitter on the
  router input in training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

BALANCE_CHOICES = ("first", "all")
CAPACITY_PRIORITIES = ("position", "batch_priority")
GROUP_SCORES = ("max", "top_sum")


def _finite_at_least(value: object, low: float) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= low


@dataclass(frozen=True, kw_only=True)
class RoutingDetails:
    """Routing details beyond the router's kind and top-k (a base of :class:`mmoe.moe.RoutingChoices`).

    Args:
        local_entropy_weight: LIMoE's local entropy loss (Mustafa et al., 2022), weighted by this value:
            per modality, the mean over its non-padding (sub-)tokens of the entropy H(p(experts | x)) of each one's
            softmax gate, which pushes each token to a confident choice. Summed over the modalities a layer routes
            (one for a per-modality MoE FFN; image and text for a shared one when the backbone passes the split:
            ``segment_lengths`` of :meth:`mmoe.moe.MoELayer.forward`). 0 = off (one weight for both
            modalities). Returned weighted in ``RoutingRecord.auxiliary_losses``.
        global_entropy_weight: LIMoE's global entropy loss, weighted by this value: per modality,
            minus the entropy of the modality's mean gate distribution p̃(experts), which keeps a modality spread
            over several experts; thresholded as ``global_entropy_min_experts`` says. 0 = off.
        global_entropy_min_experts: LIMoE's threshold tau on the global entropy loss, given as tau = log(S) for S
            this value: the loss becomes ``max(0, tau - H(p̃))``, zero once the modality's mean distribution is at
            least as spread as a uniform one over S experts. None = no threshold (the plain ``-H(p̃)``).
            1 <= S <= num_experts.
        capacity_priority: which choices a finite capacity drops. ``"position"`` (GShard, the default): first
            choices before second choices, then earlier tokens before later ones. ``"batch_priority"`` (V-MoE,
            Riquelme et al., 2021, batch-priority routing): first choices before second
            choices, then the tokens by their top gate value (max_e p(e | x), before any top-k renormalisation),
            highest first, so that the least confident tokens are dropped first. Needs a capacity factor.
        balance_choices: which choices the balance loss's f_i counts. ``"first"`` (GShard, X-MoE Eq. 9,
            torchscale; the default): ``N * sum_i f_i P_i`` with f_i the share of (sub-)tokens whose first choice
            is expert i. ``"all"`` (DeepSeekMoE, Dai et al., 2024, §3.3, Eq. 12-14; DeepSeek-V2/V3):
            ``sum_i f_i P_i`` with ``f_i = N / (K T) * (choices of expert i among all K choices of the T
            (sub-)tokens)``; both are 1 for a uniform router.
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
        router_jitter: Switch Transformer's jitter (Fedus et al., 2022; its released Mesh TensorFlow code): in
            training, the router's input is multiplied element-wise by noise drawn uniformly from
            ``[1 - eps, 1 + eps]``; the experts see the clean input, and evaluation never jitters. 0 = off (the
            default; Switch Transformer's code uses 1e-2).
    """

    local_entropy_weight: float = 0.0
    global_entropy_weight: float = 0.0
    global_entropy_min_experts: float | None = None
    capacity_priority: Literal["position", "batch_priority"] = "position"
    balance_choices: Literal["first", "all"] = "first"
    routed_scaling_factor: float = 1.0
    expert_groups: int = 1
    top_groups: int | None = None
    group_score: Literal["max", "top_sum"] = "max"
    router_jitter: float = 0.0

    def _validate_details(self) -> None:
        """Each detail's own range, then the combinations that make no sense; run by RoutingChoices after its
        own checks (it reads num_experts, top_k, gate, routing, strata and the capacity factors)."""
        owner = type(self).__name__
        ranges = [
            ("local_entropy_weight", _finite_at_least(self.local_entropy_weight, 0.0), "a finite number >= 0"),
            ("global_entropy_weight", _finite_at_least(self.global_entropy_weight, 0.0), "a finite number >= 0"),
            ("routed_scaling_factor", _finite_at_least(self.routed_scaling_factor, 0.0), "a finite number > 0"),
            ("routed_scaling_factor", self.routed_scaling_factor != 0, "a finite number > 0"),
            ("router_jitter", _finite_at_least(self.router_jitter, 0.0) and self.router_jitter < 1, "in [0, 1)"),
            ("capacity_priority", self.capacity_priority in CAPACITY_PRIORITIES, f"one of {CAPACITY_PRIORITIES}"),
            ("balance_choices", self.balance_choices in BALANCE_CHOICES, f"one of {BALANCE_CHOICES}"),
            ("group_score", self.group_score in GROUP_SCORES, f"one of {GROUP_SCORES}"),
        ]
        for name, good, expected in ranges:
            if not good:
                raise ValueError(f"{owner}.{name} must be {expected}, got {getattr(self, name)!r}")
        for name, bad, why in self._entropy_refusals() + self._priority_refusals() + self._group_refusals():
            if bad:
                raise ValueError(f"{owner}.{name}={getattr(self, name)!r}: {why}")

    def _entropy_refusals(self) -> list[tuple[str, bool, str]]:
        minimum = self.global_entropy_min_experts
        entropy_on = self.local_entropy_weight > 0 or self.global_entropy_weight > 0
        name = "local_entropy_weight" if self.local_entropy_weight > 0 else "global_entropy_weight"
        return [
            ("global_entropy_min_experts", minimum is not None and not _finite_at_least(minimum, 1.0),
             "expected None or a number of experts S >= 1 (the threshold is log S)"),
            ("global_entropy_min_experts", minimum is not None and _finite_at_least(minimum, 1.0)
             and minimum > self.num_experts,
             f"exceeds num_experts={self.num_experts}: no distribution over them reaches entropy log S"),
            (name, entropy_on and self.num_experts == 1, "the entropy over one expert is always 0; set it to 0"),
            (name, entropy_on and self.gate != "softmax",
             "LIMoE's entropies are of a softmax gate's distribution over experts; set gate: softmax"),
            (name, entropy_on and self.routing != "token_choice", "LIMoE's entropy losses need token-choice routing"),
            (name, entropy_on and self.strata is not None, "not defined for Stratified MoE gates (set it to 0)"),
        ]  # fmt: skip

    def _priority_refusals(self) -> list[tuple[str, bool, str]]:
        capacities = (self.capacity_factor, self.eval_capacity_factor)
        limited = any(value is not None and math.isfinite(value) for value in capacities)
        priority = self.capacity_priority == "batch_priority"
        return [
            ("capacity_priority", priority and not limited,
             "batch-priority routing decides what a capacity drops; set a finite capacity_factor"),
            ("capacity_priority", priority and self.routing != "token_choice", "experts pick tokens in expert choice"),
            ("capacity_priority", priority and self.strata is not None, "Stratified MoE gates keep their own order"),
            ("balance_choices", self.balance_choices == "all" and self.routing != "token_choice",
             "expert choice has no balance loss"),
            ("routed_scaling_factor", self.routed_scaling_factor != 1 and self.routing != "token_choice",
             "DeepSeek's routed scaling applies to token-choice routing"),
        ]  # fmt: skip

    def _group_refusals(self) -> list[tuple[str, bool, str]]:
        groups = self.expert_groups
        if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
            return [("expert_groups", True, "expected a positive integer")]
        per_group = self.num_experts // groups
        top = groups if self.top_groups is None else self.top_groups
        good_top = isinstance(top, int) and not isinstance(top, bool) and 1 <= top <= groups
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
