"""Statistics over independent training runs: a claim about a router, a variant or pre-training is decided over runs
(seeds) per arm, never over the batches, images or rows of one run.

* :func:`welch`: the difference of the arms' means over runs with Welch's t interval (Welch 1947; the
  Welch-Satterthwaite degrees of freedom) and its two-sided p-value.
* :func:`detectable_effect`: the smallest difference the runs can detect at the plan's power and alpha (by default
  0.8 and 0.05) from the run-to-run spread, (t_{1-alpha/2, df} + t_{power, df}) x the standard error (the usual t
  approximation of the noncentral t's power; Cohen 1988, ch. 2).
* :func:`holm`: Holm's step-down family-wise correction (Holm 1979) of a claim decided by several gaps.
* :func:`run_verdict`: the verdict of one gap over runs at the plan's level, alpha and power, with the within-run
  resampling interval as a secondary term; an arm with one run is :data:`UNDECIDABLE`, whatever the within-run
  interval says.

Student's t distribution comes from mpmath (the regularized incomplete beta function, inverted by bisection on a
bracket: a monotone CDF always converges, where a secant-type solver stalls far in the tail): numpy has no t quantile
and torch's StudentT has no inverse CDF.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import mpmath
import numpy as np

from mmoe.study.verdicts import NOT_SEPARATED, direction_verdict

#: The verdict where an arm has a single run: no run-to-run spread, nothing decided.
UNDECIDABLE = "undecidable: 1 run per arm"
#: The default interval level, family-wise error rate and power of the run-level decisions (a plan's noise rule may
#: name others).
LEVEL = 0.95
ALPHA = 0.05
POWER = 0.8
#: The relative width at which :func:`t_quantile` stops bisecting (a few hundred ulps of a double).
QUANTILE_TOLERANCE = 1e-13


def t_cdf(value: float, degrees: float) -> float:
    """P(T <= value) for Student's t with ``degrees`` (> 0, not necessarily whole) degrees of freedom."""
    if not degrees > 0:
        raise ValueError(f"Student's t needs positive degrees of freedom, got {degrees}")
    tail = 0.5 * float(mpmath.betainc(degrees / 2, 0.5, 0, degrees / (degrees + value * value), regularized=True))
    return 1 - tail if value >= 0 else tail


def t_quantile(probability: float, degrees: float) -> float:
    """The ``probability`` quantile of Student's t with ``degrees`` degrees of freedom (0 < probability < 1), by
    bisection of the monotone CDF on a doubling bracket to a relative width of :data:`QUANTILE_TOLERANCE`."""
    if not 0 < probability < 1:
        raise ValueError(f"a quantile needs a probability strictly between 0 and 1, got {probability}")
    if probability < 0.5:
        return -t_quantile(1 - probability, degrees)
    if probability == 0.5:
        return 0.0
    lower, upper = 0.0, 1.0
    while t_cdf(upper, degrees) < probability:
        lower, upper = upper, upper * 2
    while upper - lower > QUANTILE_TOLERANCE * upper:
        middle = (lower + upper) / 2
        if middle in (lower, upper):  # adjacent floats: the bracket cannot narrow further
            break
        lower, upper = (middle, upper) if t_cdf(middle, degrees) < probability else (lower, middle)
    return (lower + upper) / 2


@dataclass(frozen=True)
class Welch:
    """The difference of two arms' means over runs.

    Attributes:
        difference: mean(a) - mean(b).
        interval: its ``level`` Welch t interval.
        degrees: Welch-Satterthwaite degrees of freedom.
        p_value: two-sided, of no difference.
        standard_error: sqrt(s_a^2 / n_a + s_b^2 / n_b).
        runs: runs per arm [n_a, n_b].
        std: the run-to-run sample standard deviation per arm [s_a, s_b].
    """

    difference: float
    interval: list[float]
    degrees: float
    p_value: float
    standard_error: float
    runs: list[int]
    std: list[float]

    def to_json(self) -> dict:
        return asdict(self)


def welch_degrees(variances: Sequence[float], runs: Sequence[int]) -> float:
    """Welch-Satterthwaite degrees of freedom of two means with sample ``variances`` over ``runs`` runs; n_a + n_b - 2
    where both variances are 0 (no spread: any df gives the same zero-width interval)."""
    terms = [v / n for v, n in zip(variances, runs, strict=True)]
    denominator = sum(term**2 / (n - 1) for term, n in zip(terms, runs, strict=True))
    return sum(terms) ** 2 / denominator if denominator > 0 else float(sum(runs) - 2)


def welch(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> Welch | None:
    """mean(a) - mean(b) with Welch's t interval over runs; None when either arm has fewer than two runs."""
    if len(a) < 2 or len(b) < 2:
        return None
    arms = [np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)]
    variances = [float(arm.var(ddof=1)) for arm in arms]
    runs = [len(arm) for arm in arms]
    difference = float(arms[0].mean() - arms[1].mean())
    error = math.sqrt(sum(v / n for v, n in zip(variances, runs, strict=True)))
    degrees = welch_degrees(variances, runs)
    if error == 0:
        p_value = 1.0 if difference == 0 else 0.0
        half = 0.0
    else:
        p_value = 2 * (1 - t_cdf(abs(difference) / error, degrees))
        half = t_quantile(1 - (1 - level) / 2, degrees) * error
    std = [math.sqrt(v) for v in variances]
    return Welch(difference, [difference - half, difference + half], degrees, p_value, error, runs, std)


def detectable_effect(std: Sequence[float], runs: Sequence[int], alpha: float = ALPHA, power: float = POWER) -> float:
    """The smallest difference of means a two-sided Welch test at ``alpha`` detects with probability ``power``, from
    the arms' run-to-run standard deviations ``std`` and ``runs`` per arm: (t_{1-alpha/2} + t_{power}) x SE."""
    variances = [s * s for s in std]
    error = math.sqrt(sum(v / n for v, n in zip(variances, runs, strict=True)))
    degrees = welch_degrees(variances, runs)
    return (t_quantile(1 - alpha / 2, degrees) + t_quantile(power, degrees)) * error


def one_sample_verdict(
    values: Sequence[float], expected_sign: int, *, level: float = LEVEL, alpha: float = ALPHA, power: float = POWER
) -> dict:
    """One arm's mean over runs against zero (the paper predicts ``expected_sign``): Student's t interval over the runs,
    its p-value and detectable effect, in :func:`run_verdict`'s form (``welch`` holds the one-sample test, ``runs``
    one count); :data:`UNDECIDABLE` with fewer than two runs."""
    values = np.asarray(values, dtype=np.float64)
    entry: dict = {"runs": [len(values)], "within_run": None}
    if len(values) < 2:
        return entry | {"welch": None, "detectable": None, "verdict": UNDECIDABLE}
    mean, std, degrees = float(values.mean()), float(values.std(ddof=1)), len(values) - 1
    error = std / math.sqrt(len(values))
    if error == 0:
        p_value, half = (1.0 if mean == 0 else 0.0), 0.0
    else:
        p_value = 2 * (1 - t_cdf(abs(mean) / error, degrees))
        half = t_quantile(1 - (1 - level) / 2, degrees) * error
    test = Welch(mean, [mean - half, mean + half], float(degrees), p_value, error, [len(values)], [std])
    detectable = (t_quantile(1 - alpha / 2, degrees) + t_quantile(power, degrees)) * error
    verdict = direction_verdict(test.interval, expected_sign) if p_value <= alpha else NOT_SEPARATED
    return entry | {"welch": test.to_json(), "detectable": detectable, "verdict": verdict}


def holm(p_values: Sequence[float], alpha: float = ALPHA) -> list[bool]:
    """Holm's step-down procedure: which hypotheses are rejected at family-wise level ``alpha``. The i-th smallest
    p-value (i from 0) is compared with alpha / (m - i), stopping at the first that is not below it."""
    order = sorted(range(len(p_values)), key=lambda index: p_values[index])
    rejected = [False] * len(p_values)
    for rank, index in enumerate(order):
        if p_values[index] > alpha / (len(p_values) - rank):
            break
        rejected[index] = True
    return rejected


def holm_adjusted(p_values: Sequence[float]) -> list[float]:
    """Holm-adjusted p-values: max over the earlier ranks of min(1, (m - i) p_(i)); rejected at alpha where <= alpha."""
    order = sorted(range(len(p_values)), key=lambda index: p_values[index])
    adjusted, running = [1.0] * len(p_values), 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted


def run_verdict(
    a: Sequence[float],
    b: Sequence[float],
    expected_sign: int,
    within_run: list[float] | None = None,
    *,
    level: float = LEVEL,
    alpha: float = ALPHA,
    power: float = POWER,
) -> dict:
    """One gap decided over runs: arm ``a`` minus arm ``b``, whose sign the paper predicts to be ``expected_sign``.

    Returns ``runs`` per arm, ``welch`` (:class:`Welch` as JSON with its ``level`` interval, None with one run in an
    arm), the ``detectable`` effect at ``alpha`` and ``power``, the ``within_run`` interval (secondary: resampling
    inside the runs, not a verdict) and the ``verdict``: :data:`UNDECIDABLE` with one run in an arm; else from the
    Welch interval's side of zero, and not separated unless the p-value is also at most ``alpha`` (the same test
    where level = 1 - alpha)."""
    result = welch(a, b, level)
    entry: dict = {"runs": [len(a), len(b)], "within_run": within_run}
    if result is None:
        return entry | {"welch": None, "detectable": None, "verdict": UNDECIDABLE}
    detectable = detectable_effect(result.std, result.runs, alpha, power)
    verdict = direction_verdict(result.interval, expected_sign) if result.p_value <= alpha else NOT_SEPARATED
    return entry | {"welch": result.to_json(), "detectable": detectable, "verdict": verdict}


def family_verdicts(gaps: list[dict], alpha: float = ALPHA) -> list[dict]:
    """Gaps of one claim (each a :func:`run_verdict`) under Holm's correction: a gap keeps its direction only where
    Holm rejects at ``alpha``, else it is not separated; each gains ``holm_p`` (None where undecidable)."""
    decided = [index for index, gap in enumerate(gaps) if gap["welch"] is not None]
    adjusted = holm_adjusted([gaps[index]["welch"]["p_value"] for index in decided])
    out = [gap | {"holm_p": None} for gap in gaps]
    for index, p in zip(decided, adjusted, strict=True):
        verdict = out[index]["verdict"] if p <= alpha else NOT_SEPARATED
        out[index] = out[index] | {"holm_p": p, "unadjusted_verdict": out[index]["verdict"], "verdict": verdict}
    return out
