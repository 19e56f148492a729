"""The checks of top-p routing's choices (Huang et al., 2024; :mod:`mmoe.moe.top_p`), fields of
:class:`mmoe.moe.choices.Selection`: each range, then what top-p routing cannot be combined with."""

from __future__ import annotations

import math

from mmoe.moe.choices.values import finite_at_least


def top_p_refusals(config) -> list[tuple[str, bool, str]]:
    """``(field, bad, why)`` for :func:`mmoe.moe.choices.values.refuse`, the first bad one raised."""
    p, target = config.top_p, config.target_active_experts
    on = p is not None
    good_p = p is None or (finite_at_least(p, 0.0) and 0 < p <= 1)
    good_target = target is None or (finite_at_least(target, 0.0) and 1 < target < config.num_experts)
    limited = [value for value in (config.capacity_factor, config.eval_capacity_factor) if value is not None]
    return [
        ("top_p", not good_p, "expected None or a probability in (0, 1] (Huang et al. use 0.4)"),
        (
            "target_active_experts",
            not good_target,
            f"expected None or a mean number of experts strictly between 1 and num_experts={config.num_experts}",
        ),
        ("target_active_experts", target is not None and not on, "the controller moves top_p; set top_p, e.g. 0.4"),
        (
            "top_p_rate",
            not (finite_at_least(config.top_p_rate, 0.0) and config.top_p_rate > 0),
            "expected a finite number > 0 (the controller's step on logit(top_p))",
        ),
        ("dynamic_loss_weight", not finite_at_least(config.dynamic_loss_weight, 0.0), "expected a finite number >= 0"),
        (
            "dynamic_loss_weight",
            config.dynamic_loss_weight > 0 and not on,
            "Huang et al.'s dynamic loss goes with top-p routing; set top_p or leave it at 0",
        ),
        ("top_p", on and config.gate != "softmax", "sums a softmax gate's probabilities; set gate: softmax"),
        ("top_p", on and config.routing != "token_choice", "each token picks its experts; set routing: token_choice"),
        ("top_p", on and config.strata is not None, "Stratified MoE gates route top-2; not defined for strata"),
        ("top_p", on and config.top_k != 1, "a token uses 1 to num_experts experts by p; leave top_k at 1"),
        (
            "top_p",
            on and any(math.isfinite(value) for value in limited),
            "top-p routing is dropless (a token's number of choices varies); set capacity_factor: null",
        ),
        ("top_p", on and config.bias_update_rate > 0, "the loss-free bias reorders top-k choices; set it to 0"),
        ("top_p", on and config.expert_groups > 1, "group-limited routing limits top-k; set expert_groups: 1"),
    ]
