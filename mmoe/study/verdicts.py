"""The study's noise rule: how a measured difference becomes a verdict, and which tokens each claim is judged on.

Every claim compares two things (X-MoE against the linear router, MH-MoE against X-MoE, object against background
patches) through one difference whose sign the paper predicts. The difference gets a 95% percentile-bootstrap
interval over the units the measurement was made on (held-out batches, images, router-input rows, fine-tuning
windows; :func:`bootstrap`) or a Student-t interval over seeds (:func:`seed_interval`), and then:

* **reproduces**: the interval lies wholly on the paper's side of zero;
* **opposite**: wholly on the other side;
* **not separated**: it contains zero;
* **saturated**: both sides sit at a ceiling where no difference can show (e.g. h sub-tokens already reach h
  distinct experts), whatever the interval says;
* **uninformative**: the measurement is at its no-learning level (a task below its chance level, routing that
  changes as often as random reassignment), whatever the interval says.

Modalities are judged apart: each claim's plan names the modality its paper measured
(:attr:`mmoe.study.plan.ClaimPlan.paper_modality`: the X-MoE analyses and MH-MoE's activation are on text, the
sub-token maps on images) and the claim shows the other beside it; values are never averaged across modalities.

These intervals resample inside one training run; the decision over runs is :mod:`mmoe.study.run_statistics`'.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

REPRODUCES = "reproduces"
OPPOSITE = "opposite"
NOT_SEPARATED = "not separated"
SATURATED = "saturated"
UNINFORMATIVE = "uninformative"
#: A claim whose runs the preset does not train: nothing measured; its summary (its plan's words) says which preset
#: runs it.
NOT_RUN = "not run"
#: That verdict as the default plan words it (fixed before ``--scale gpu-tasks`` took the task order over; the default
#: report keeps it).
SHIPPED_NOT_RUN = "not run: --scale gpu only"
VERDICTS = (REPRODUCES, OPPOSITE, NOT_SEPARATED, SATURATED, UNINFORMATIVE, NOT_RUN, SHIPPED_NOT_RUN)


def is_not_run(verdict: str) -> bool:
    """Whether ``verdict`` says the claim was not run (under today's words or the default plan's)."""
    return verdict in (NOT_RUN, SHIPPED_NOT_RUN)


#: Bootstrap resamples and the interval's coverage.
RESAMPLES = 1000
LEVEL = 0.95
#: Student's t 0.975 quantiles for 1-30 degrees of freedom (seed intervals: a handful of seeds estimate the noise,
#: so the normal z = 1.96 would be too narrow); beyond 30 the normal's.
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


def t_975(degrees: int) -> float:
    """The two-sided 95% quantile of Student's t with ``degrees`` degrees of freedom."""
    return T_975[degrees - 1] if degrees <= len(T_975) else Z_975


MODALITIES = ("language", "vision")


def modality(key: str) -> str:
    """The modality of a routing key ``"layer{i}/{modality}"``."""
    return key.split("/", 1)[1]


def keys_of(keys: Iterable[str], wanted: str) -> list[str]:
    """The keys of one modality, in the order given."""
    return [key for key in keys if modality(key) == wanted]


def bootstrap(statistic: Callable[[np.ndarray], float], units: int, resamples: int = RESAMPLES, seed: int = 0):
    """``statistic`` of ``resamples`` draws of ``units`` unit indices with replacement ((units,) int arrays);
    returns the finite replicates as an array."""
    generator = np.random.default_rng(seed)
    replicates = [statistic(generator.integers(0, units, units)) for _ in range(resamples)]
    values = np.asarray([r for r in replicates if r is not None and np.isfinite(r)], dtype=np.float64)
    return values


def percentile_interval(replicates: np.ndarray, level: float = LEVEL) -> list[float] | None:
    """The central ``level`` percentile interval of bootstrap replicates (None without replicates)."""
    if len(replicates) == 0:
        return None
    tail = 100 * (1 - level) / 2
    return [float(np.percentile(replicates, tail)), float(np.percentile(replicates, 100 - tail))]


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


def direction_verdict(interval: list[float] | None, expected_sign: int) -> str:
    """:data:`REPRODUCES` when ``interval`` (of a difference the paper predicts to have ``expected_sign``) excludes
    zero on the predicted side, :data:`OPPOSITE` on the other, else (or without an interval) :data:`NOT_SEPARATED`."""
    if interval is None:
        return NOT_SEPARATED
    low, high = (expected_sign * value for value in interval)
    low, high = min(low, high), max(low, high)
    if low > 0:
        return REPRODUCES
    if high < 0:
        return OPPOSITE
    return NOT_SEPARATED


def gated(verdict: str, saturated: bool = False, uninformative: bool = False) -> str:
    """The verdict, overridden where the measurement cannot show the effect."""
    if uninformative:
        return UNINFORMATIVE
    if saturated:
        return SATURATED
    return verdict


def combined(verdicts: Iterable[str]) -> str:
    """One verdict of several comparisons that all test the claim (runs, gaps, tasks): those that can show something
    decide; every one must reproduce for the claim to, and a reversal with no support makes it opposite."""
    verdicts = list(verdicts)
    telling = [v for v in verdicts if v not in (SATURATED, UNINFORMATIVE)]
    if not telling:
        if not verdicts:
            return NOT_SEPARATED
        return UNINFORMATIVE if UNINFORMATIVE in verdicts else SATURATED
    if all(v == REPRODUCES for v in telling):
        return REPRODUCES
    if OPPOSITE in telling and REPRODUCES not in telling:
        return OPPOSITE
    return NOT_SEPARATED


def log_mean(values: Iterable[float]) -> float | None:
    """Geometric mean of positive values (RC is a heavy-tailed ratio: one near-singular layer would dominate an
    arithmetic mean); None if any value is missing or not positive."""
    values = list(values)
    if not values or any(v is None or not v > 0 for v in values):
        return None
    return float(np.exp(np.mean(np.log(values))))


def describe(interval: list[float] | None, scale: float = 1.0, digits: int = 3) -> str:
    """``[low, high]`` as text (``no interval`` without one)."""
    if interval is None:
        return "no interval"
    return f"[{scale * interval[0]:.{digits}g}, {scale * interval[1]:.{digits}g}]"
