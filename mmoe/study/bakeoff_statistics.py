"""The bake-off's decisions: per tested measure, each router's mean over its seeds against the baseline's (Switch
top-1) by Welch's t test (Welch 1947: the Welch-Satterthwaite interval of the difference of means), the routers'
p-values on that measure adjusted by Holm's step-down correction (Holm 1979) at the plan's alpha. The tests are
:mod:`mmoe.stats`' (checked there against ``scipy.stats.ttest_ind``).

A decision is ``better`` or ``worse`` than the baseline (by the measure's ``better`` direction, ``above`` / ``below``
where neither is better) where Holm's adjusted p-value is at most alpha, else ``not separated``; a router without
the measure (the dense backbone has no MoE layer to balance) is ``not measured`` and leaves the family."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from mmoe.stats import NOT_SEPARATED, holm_adjusted, one_sample, welch
from mmoe.study.bakeoff_plan import BakeoffPlan, Measure

NOT_MEASURED = "not measured"


def seed_values(results: Sequence[Mapping], router: str, measure: str) -> list[float] | None:
    """``measure``'s value in each seed's results of ``router`` (in seed order); None where a seed lacks it."""
    runs = sorted((result for result in results if result["router"] == router), key=lambda result: result["seed"])
    values = [result["values"].get(measure) for result in runs]
    return None if not values or any(value is None for value in values) else [float(value) for value in values]


def summary(values: list[float] | None, level: float) -> dict | None:
    """The mean over seeds with its ``level`` Student-t interval and the seeds' standard deviation."""
    if values is None:
        return None
    test = one_sample(values, level)
    spread = float(np.std(values, ddof=1)) if len(values) > 1 else None
    return {"mean": float(np.mean(values)), "interval": None if test is None else test.interval, "std": spread}


def decision(difference: float, adjusted: float, alpha: float, better: str) -> str:
    """The word for a gap (router minus baseline) whose Holm-adjusted p-value is ``adjusted``."""
    if adjusted > alpha or difference == 0:
        return NOT_SEPARATED
    if better == "none":
        return "above" if difference > 0 else "below"
    return "better" if (difference > 0) == (better == "higher") else "worse"


def measure_decisions(plan: BakeoffPlan, results: Sequence[Mapping], measure: Measure) -> list[dict]:
    """One row per router but the baseline on ``measure``: its seeds' values, Welch's test against the baseline's,
    Holm's adjusted p-value over the routers measured, and the decision."""
    test = plan.test
    baseline = seed_values(results, test.against, measure.name)
    rows = []
    for router in (router.name for router in plan.routers if router.name != test.against):
        values = seed_values(results, router, measure.name)
        gap = None if values is None or baseline is None else welch(values, baseline, test.level)
        rows.append({"router": router, "measure": measure.name, "values": values, "welch": gap and gap.to_json()})
    decided = [row for row in rows if row["welch"] is not None]
    for row, adjusted in zip(decided, holm_adjusted([row["welch"]["p_value"] for row in decided]), strict=True):
        row["holm_p"] = adjusted
        row["decision"] = decision(row["welch"]["difference"], adjusted, test.alpha, measure.better)
    for row in rows:
        row.setdefault("holm_p", None)
        row.setdefault("decision", NOT_MEASURED)
    return rows


def bakeoff_decisions(plan: BakeoffPlan, results: Sequence[Mapping]) -> list[dict]:
    """:func:`measure_decisions` of every tested measure of the plan, in the plan's order."""
    return [row for measure in plan.measures if measure.tested for row in measure_decisions(plan, results, measure)]
