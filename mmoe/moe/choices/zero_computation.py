"""Zero-computation experts beside the FFN experts (AdaMoE, Zeng et al., 2024; MoE++, Jin et al., 2025): a
(sub-)token whose top-k choices include some of them uses fewer real experts (:mod:`mmoe.moe.null_experts`)."""

from __future__ import annotations

from dataclasses import dataclass

from mmoe.moe.choices.values import is_int, refuse, require


@dataclass(frozen=True, kw_only=True)
class ZeroComputation:
    """Experts that cost no FFN, scored and chosen with the real ones (a part of :class:`mmoe.moe.RoutingChoices`).

    The router scores ``num_experts`` real experts and then these, in this order (ids E.., null first, then copy,
    then constant), takes the top-k of them all, renormalises the weights over the choices that are not null experts
    (AdaMoE's released code; MoE++'s zeroes its zero expert's gate before renormalising), and counts all of them
    in the balance loss (AdaMoE: its released loss counts real and null experts). ``top_k`` is then the most real
    experts a (sub-)token may use; ``num_experts`` stays the number of FFN experts.

    Args:
        null_experts: AdaMoE's null experts, MoE++'s zero experts: their output is 0, so a (sub-)token that chooses
            one uses one real expert fewer. 0 = none.
        copy_experts: MoE++'s copy experts: output the (sub-)token itself, times its gate weight. 0 = none.
        constant_experts: MoE++'s constant experts: ``a_1 x + a_2 v`` with v a learned vector and
            ``[a_1, a_2] = softmax(W x)``, W a learned 2 x D' matrix (the released code's ``ConstantExpert``),
            times its gate weight. 0 = none.
        gating_residual: MoE++'s gating residuals (§3.3; the released code's ``Router.gate_map``): the router's logits
            plus a learned map of the logits of the (sub-)token's previous MoE layer, ``G_j = W_j x + W_g G_{j-1}``,
            W_g a bias-free (E + Z) x (E + Z) linear map and G_{j-1} that layer's logits with its own residual. The
            backbone hands each (sub-)token's logits on from MoE layer to MoE layer (its first one gets G_0 = 0),
            through dense layers, and split or joined where a VL-FFN serves both modalities
            (:mod:`mmoe.model.gate_residuals`). Token choice only; every MoE layer of the plan the same pool and heads.
    """

    null_experts: int = 0
    copy_experts: int = 0
    constant_experts: int = 0
    gating_residual: bool = False

    @property
    def zero_computation_experts(self) -> int:
        """How many experts the router scores beside the ``num_experts`` FFN experts."""
        return self.null_experts + self.copy_experts + self.constant_experts

    def _check_zero_computation(self) -> None:
        """Each count's range, then what the pool does not combine with (reads the other parts' fields)."""
        count = "a non-negative integer"
        require(self, [(name, is_int(getattr(self, name)) and getattr(self, name) >= 0, count) for name in NAMES])
        require(self, [("gating_residual", isinstance(self.gating_residual, bool), "true or false")])
        if self.gating_residual:
            refuse(
                self,
                [
                    ("strata", self.strata is not None, "Stratified MoE's gates have no one logit vector to carry"),
                    ("routing", self.routing != "token_choice", "the residual adds to a token-choice router's logits"),
                ],
                context=" with gating_residual=True",
            )
        if not self.zero_computation_experts:
            return
        name = next(name for name in NAMES if getattr(self, name))
        refuse(
            self,
            [
                (name, self.strata is not None, "Stratified MoE gates score their strata's FFN experts only"),
                (name, self.routing != "token_choice", "zero-computation experts are chosen by token choice"),
                (name, self.bias_update_rate > 0, "the loss-free bias moves the FFN experts' loads only"),
                (name, self.expert_groups > 1, "group-limited top-k groups the FFN experts only"),
                (name, self.routed_scaling_factor != 1, "DeepSeek's routed scaling is not defined with them"),
                (name, self.top_p is not None, "top-p routing already varies the experts a token uses; not combined"),
                (name, self.gate == "relu", "ReLU gates (ReMoE) already vary the experts a token uses; not combined"),
            ],
        )


NAMES = ("null_experts", "copy_experts", "constant_experts")
