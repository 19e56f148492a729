"""The study's noise rule: how a measured difference becomes a verdict, and which tokens each claim is judged on.

Every claim compares two things (X-MoE against the linear router, MH-MoE against X-MoE, object against background
patches) through one difference whose sign the paper predicts. The difference gets a 95% percentile-bootstrap
interval over the units the measurement was made on (held-out batches, images, router-input rows, fine-tuning
windows; :func:`mmoe.stats.bootstrap`) or a Student-t interval over seeds (:func:`mmoe.stats.seed_interval`), and
then (:func:`direction_verdict`, the interval's side of zero: :func:`mmoe.stats.side_of_zero`):

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

from collections.abc import Iterable

import numpy as np

from mmoe.stats import NOT_SEPARATED, side_of_zero

REPRODUCES = "reproduces"
OPPOSITE = "opposite"
SATURATED = "saturated"
UNINFORMATIVE = "uninformative"
#: A claim whose runs the preset does not train: nothing measured; its summary (its plan's words) says which preset
#: runs it.
NOT_RUN = "not run"
#: That verdict as the default plan words it (fixed before ``--scale gpu-tasks`` took the task order over; the default
#: report keeps it).
SHIPPED_NOT_RUN = "not run: --scale gpu only"
#: Claim 5's within-run term where the routing is not saturated: the judged windows of one set of fine-tunings are
#: neither independent nor many (two by default), so their interval describes the spread, it decides nothing.
DESCRIPTIVE = "descriptive, no verdict"
VERDICTS = (REPRODUCES, OPPOSITE, NOT_SEPARATED, SATURATED, UNINFORMATIVE, NOT_RUN, SHIPPED_NOT_RUN, DESCRIPTIVE)


def is_not_run(verdict: str) -> bool:
    """Whether ``verdict`` says the claim was not run (under today's words or the default plan's)."""
    return verdict in (NOT_RUN, SHIPPED_NOT_RUN)


MODALITIES = ("language", "vision")


def modality(key: str) -> str:
    """The modality of a routing key ``"layer{i}/{modality}"``."""
    return key.split("/", 1)[1]


def keys_of(keys: Iterable[str], wanted: str) -> list[str]:
    """The keys of one modality, in the order given."""
    return [key for key in keys if modality(key) == wanted]


def direction_verdict(interval: list[float] | None, expected_sign: int) -> str:
    """:data:`REPRODUCES` when ``interval`` (of a difference the paper predicts to have ``expected_sign``) excludes
    zero on the predicted side, :data:`OPPOSITE` on the other, else (or without an interval) :data:`NOT_SEPARATED`."""
    return {1: REPRODUCES, -1: OPPOSITE, 0: NOT_SEPARATED}[expected_sign * side_of_zero(interval)]


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
