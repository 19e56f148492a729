"""How many (sub-)token choices each expert takes, and which a full expert drops: GShard's capacity factor and
V-MoE's batch-priority routing (Riquelme et al., 2021, arXiv 2106.05974; :mod:`mmoe.moe.priority`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from mmoe.moe.choices.values import refuse, require

CAPACITY_PRIORITIES = ("position", "batch_priority")


@dataclass(frozen=True, kw_only=True)
class Capacity:
    """Each expert's capacity (a part of :class:`mmoe.moe.RoutingChoices`).

    Args:
        capacity_factor: None = dropless (default). Otherwise each expert takes at most
            ``ceil(capacity_factor * top_k * T / N)`` choices, T the non-padding (sub-)tokens; first choices win
            over second choices, then earlier tokens over later ones (GShard); overflow is dropped. Infinity
            (``.inf`` in YAML) is no limit, the same as None. With expert choice: Zhou et al.'s c, each expert takes
            ``ceil(c * n / N)`` of the batch's n (sub-)tokens (required and finite; c >= N gives every expert every
            token).
        eval_capacity_factor: capacity factor in eval mode; None = same as ``capacity_factor``.
        capacity_priority: which choices a finite capacity drops. ``"position"`` (GShard, the default): first
            choices before second choices, then earlier tokens before later ones. ``"batch_priority"`` (V-MoE,
            Riquelme et al., 2021, batch-priority routing): first choices before second
            choices, then the tokens by their top gate value (max_e p(e | x), before any top-k renormalisation),
            highest first, so that the least confident tokens are dropped first. Needs a capacity factor.
    """

    capacity_factor: float | None = None
    eval_capacity_factor: float | None = None
    capacity_priority: Literal["position", "batch_priority"] = "position"

    def active_capacity_factor(self, training: bool) -> float | None:
        """The capacity factor in force: ``capacity_factor`` in training, else ``eval_capacity_factor`` if set."""
        if training or self.eval_capacity_factor is None:
            return self.capacity_factor
        return self.eval_capacity_factor

    def _check_capacity(self) -> None:
        """The factors and the priority, then what batch priority needs (reads ``routing`` and ``strata``)."""
        require(
            self,
            [
                (name, getattr(self, name) is None or getattr(self, name) > 0, "positive or None")
                for name in ("capacity_factor", "eval_capacity_factor")
            ]
            + [("capacity_priority", self.capacity_priority in CAPACITY_PRIORITIES, f"one of {CAPACITY_PRIORITIES}")],
        )
        capacities = (self.capacity_factor, self.eval_capacity_factor)
        limited = any(value is not None and math.isfinite(value) for value in capacities)
        priority = self.capacity_priority == "batch_priority"
        refuse(
            self,
            [
                (
                    "capacity_priority",
                    priority and not limited,
                    "batch-priority routing decides what a capacity drops; set a finite capacity_factor",
                ),
                (
                    "capacity_priority",
                    priority and self.routing != "token_choice",
                    "experts pick tokens in expert choice",
                ),
                (
                    "capacity_priority",
                    priority and self.strata is not None,
                    "Stratified MoE gates keep their own order",
                ),
            ],
        )
