"""The value checks every part of the routing choices shares: one-line ``ValueError``s naming ``<class>.<field>``
of the config that holds the field (``RoutingChoices``, ``MoEConfig``, ``MoEPlan``)."""

from __future__ import annotations

import math


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def finite_at_least(value: object, low: float) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= low


def finite_or_none(value: float | None) -> bool:
    return value is None or math.isfinite(value)


def require(config: object, ranges: list[tuple[str, bool, str]]) -> None:
    """Raise for the first ``(field, good, expected)`` that is not good: ``<class>.<field> must be <expected>``."""
    for name, good, expected in ranges:
        if not good:
            raise ValueError(f"{type(config).__name__}.{name} must be {expected}, got {getattr(config, name)!r}")


def refuse(config: object, refusals: list[tuple[str, bool, str]], context: str = "") -> None:
    """Raise for the first ``(field, bad, why)`` that is bad: ``<class>.<field>=<value><context>: <why>``."""
    for name, bad, why in refusals:
        if bad:
            raise ValueError(f"{type(config).__name__}.{name}={getattr(config, name)!r}{context}: {why}")
