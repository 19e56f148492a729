"""The statistics of the demo's comparison (:mod:`mmoe.pipeline.compare`) and the claims study (:mod:`mmoe.study`):
one bootstrap, one percentile interval, one rule for an interval's verdict, the t tests over runs and their
corrections.

* :func:`bootstrap`: a statistic over :data:`RESAMPLES` draws of the units with replacement, from a numpy Generator
  seeded ``seed`` (Efron & Tibshirani, An Introduction to the Bootstrap, 1993). A paired or cluster bootstrap is the
  caller's statistic: it scores both arms, or the clusters' summed rows, on the one draw of indices it is given.
* :func:`percentile_interval`: the central :data:`LEVEL` interval of the replicates (ibid., ch. 13, the percentile
  interval).
* :func:`side_of_zero`: the verdict rule every caller words its own way: an interval wholly above zero (+1), wholly
  below (-1), or containing it (0: :data:`NOT_SEPARATED`).
* :func:`welch`: the difference of two arms' means over independent runs with Welch's t test and interval (Welch 1947;
  the Welch-Satterthwaite degrees of freedom, :func:`welch_degrees`); :func:`one_sample`: one arm's mean against zero
  (Student's t). Student's t distribution: :func:`t_tail` and :func:`t_cdf` from mpmath's regularized incomplete
  beta function, :func:`t_quantile` the CDF inverted (numpy has no t distribution and torch's ``StudentT`` no inverse
  CDF). ``tests/test_stats.py`` checks them against SciPy's tests where SciPy is installed (``.venv-eval/``).
* :func:`detectable_effect`: the smallest difference the runs detect at a power and alpha from the run-to-run spread,
  (t_{1-alpha/2, df} + t_{power, df}) x the standard error (the usual t approximation of the noncentral t's power;
  Cohen 1988, ch. 2).
* :func:`holm`, :func:`holm_adjusted`: Holm's step-down family-wise correction (Holm 1979).
* :func:`seed_interval`, :func:`pooled_std`: a difference of means over seeds with the pooled seed spread and the
  tabulated t quantile :func:`t_975`.

SciPy is not a dependency: torchmetrics, which Lightning imports, imports ``scipy.signal`` whenever SciPy is installed,
about 1.3 CPU-s more for every process that imports Lightning (``docs/harness.md``). mpmath is imported by the
functions that use it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

#: Bootstrap resamples, the default interval level, family-wise error rate and power.
RESAMPLES = 1000
LEVEL = 0.95
ALPHA = 0.05
POWER = 0.8
#: An interval that contains zero, in every caller's words.
NOT_SEPARATED = "not separated"
#: Student's t 0.975 quantiles for 1-30 degrees of freedom, as printed in the usual tables (the seed intervals of the
#: claims study: a handful of seeds estimate the noise, so the normal z = 1.96 would be too narrow); beyond 30 the
#: normal's.
T_975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)
Z_975 = 1.959963984540054
#: The relative width at which :func:`t_quantile` stops bisecting (a few hundred ulps of a double).
QUANTILE_TOLERANCE = 1e-13


def bootstrap(
    statistic: Callable[[np.ndarray], float | None], units: int, resamples: int = RESAMPLES, seed: int = 0
) -> np.ndarray:
    """``statistic`` of ``resamples`` draws of ``units`` unit indices with replacement ((units,) int arrays, drawn by
    ``numpy.random.default_rng(seed)``); the finite replicates as an array (a replicate that is None, infinite or NaN
    is left out: fewer than ``resamples`` tells the caller some were undefined)."""
    generator = np.random.default_rng(seed)
    with np.errstate(divide="ignore", invalid="ignore"):  # an undefined replicate is left out
        replicates = [statistic(generator.integers(0, units, units)) for _ in range(resamples)]
    return np.asarray([r for r in replicates if r is not None and np.isfinite(r)], dtype=np.float64)


def percentile_interval(replicates: np.ndarray, level: float = LEVEL) -> list[float] | None:
    """The central ``level`` percentile interval of bootstrap replicates (None without replicates)."""
    if len(replicates) == 0:
        return None
    tail = 100 * (1 - level) / 2
    return [float(bound) for bound in np.percentile(replicates, [tail, 100 - tail])]


def side_of_zero(interval: Sequence[float] | None) -> int:
    """+1 when ``interval`` lies wholly above zero, -1 wholly below, 0 when it contains zero (or is None)."""
    if interval is None:
        return 0
    low, high = min(interval), max(interval)
    return 1 if low > 0 else -1 if high < 0 else 0


def t_975(degrees: int) -> float:
    """The two-sided 95% quantile of Student's t with ``degrees`` degrees of freedom, from :data:`T_975`."""
    return T_975[degrees - 1] if degrees <= len(T_975) else Z_975


def t_tail(value: float, degrees: float) -> float:
    """P(|T| >= |value|) for Student's t with ``degrees`` (> 0, not necessarily whole) degrees of freedom: the
    regularized incomplete beta function I_{d / (d + t^2)}(d / 2, 1 / 2) (Abramowitz & Stegun 26.7.1), from mpmath."""
    import mpmath

    if not degrees > 0:
        raise ValueError(f"Student's t needs positive degrees of freedom, got {degrees}")
    return float(mpmath.betainc(degrees / 2, 0.5, 0, degrees / (degrees + value * value), regularized=True))


def t_cdf(value: float, degrees: float) -> float:
    """P(T <= value) for Student's t with ``degrees`` degrees of freedom."""
    tail = 0.5 * t_tail(value, degrees)
    return 1 - tail if value >= 0 else tail


def t_quantile(probability: float, degrees: float) -> float:
    """The ``probability`` quantile of Student's t with ``degrees`` (> 0, not necessarily whole) degrees of freedom:
    the monotone CDF inverted by bisection on a doubling bracket to a relative width of :data:`QUANTILE_TOLERANCE`
    (a monotone CDF always converges, where a secant-type solver stalls far in the tail)."""
    if not 0 < probability < 1:
        raise ValueError(f"a quantile needs a probability strictly between 0 and 1, got {probability}")
    if not degrees > 0:
        raise ValueError(f"Student's t needs positive degrees of freedom, got {degrees}")
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
    """The difference of two arms' means over runs (or one arm's mean, :func:`one_sample`).

    Attributes:
        difference: mean(a) - mean(b).
        interval: its ``level`` t interval.
        degrees: Welch-Satterthwaite degrees of freedom (n - 1 for one arm).
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
    """Welch-Satterthwaite degrees of freedom of the arms' means with sample ``variances`` over ``runs`` runs; the sum
    of n - 1 over the arms where every variance is 0 (no spread: any df gives the same zero-width interval)."""
    terms = [v / n for v, n in zip(variances, runs, strict=True)]
    denominator = sum(term**2 / (n - 1) for term, n in zip(terms, runs, strict=True))
    return sum(terms) ** 2 / denominator if denominator > 0 else float(sum(n - 1 for n in runs))


def _t_test(arms: list[np.ndarray], level: float) -> Welch:
    """Welch's test of mean(arms[0]) - mean(arms[1]), or Student's one-sample test of mean(arms[0]) against zero:
    t = difference / SE, the two-sided p-value P(|T_df| >= |t|) and the interval difference +- t_{(1 + level) / 2, df}
    x SE."""
    variances = [float(arm.var(ddof=1)) for arm in arms]
    runs = [len(arm) for arm in arms]
    difference = float(arms[0].mean() - (arms[1].mean() if len(arms) > 1 else 0.0))
    error = math.sqrt(sum(v / n for v, n in zip(variances, runs, strict=True)))
    degrees = welch_degrees(variances, runs)
    std = [math.sqrt(v) for v in variances]
    if error == 0:  # no spread: the difference is exact
        p_value = 1.0 if difference == 0 else 0.0
        return Welch(difference, [difference, difference], degrees, p_value, 0.0, runs, std)
    p_value = t_tail(difference / error, degrees)
    half = t_quantile(1 - (1 - level) / 2, degrees) * error
    return Welch(difference, [difference - half, difference + half], degrees, p_value, error, runs, std)


def welch(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> Welch | None:
    """mean(a) - mean(b) with Welch's t test and ``level`` interval over runs; None when an arm has under two runs."""
    if len(a) < 2 or len(b) < 2:
        return None
    return _t_test([np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)], level)


def one_sample(values: Sequence[float], level: float = LEVEL) -> Welch | None:
    """mean(values) against zero with Student's t test and ``level`` interval over runs (``runs`` and ``std`` of the
    one arm); None with under two runs."""
    if len(values) < 2:
        return None
    return _t_test([np.asarray(values, dtype=np.float64)], level)


def detectable_effect(std: Sequence[float], runs: Sequence[int], alpha: float = ALPHA, power: float = POWER) -> float:
    """The smallest difference of means a two-sided t test at ``alpha`` detects with probability ``power``, from the
    arms' run-to-run standard deviations ``std`` and ``runs`` per arm (one arm: its mean against zero):
    (t_{1-alpha/2} + t_{power}) x SE."""
    variances = [s * s for s in std]
    error = math.sqrt(sum(v / n for v, n in zip(variances, runs, strict=True)))
    degrees = welch_degrees(variances, runs)
    return (t_quantile(1 - alpha / 2, degrees) + t_quantile(power, degrees)) * error


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


def seed_interval(a: list[float], b: list[float], noise: tuple[float, int] | None) -> list[float] | None:
    """95% interval of ``mean(a) - mean(b)`` over seeds: the difference ± t · s · sqrt(1/n_a + 1/n_b), with ``noise``
    = (s, degrees of freedom) the pooled seed standard deviation (:func:`pooled_std`; None when no cell has two seeds:
    the noise is unknown)."""
    if noise is None:
        return None
    std, degrees = noise
    difference = float(np.mean(a) - np.mean(b))
    half = t_975(degrees) * std * np.sqrt(1 / len(a) + 1 / len(b))
    return [difference - half, difference + half]


def pooled_std(cells: Iterable[list[float]]) -> tuple[float, int] | None:
    """The pooled sample standard deviation of the cells with two or more values and its degrees of freedom (None if
    there is no such cell)."""
    squares, degrees = 0.0, 0
    for values in cells:
        if len(values) > 1:
            squares += float(np.sum((np.asarray(values) - np.mean(values)) ** 2))
            degrees += len(values) - 1
    return (float(np.sqrt(squares / degrees)), degrees) if degrees else None
