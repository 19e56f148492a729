"""Verdicts over independent training runs: a claim about a router, a variant or pre-training is decided over runs
(seeds) per arm, never over the batches, images or rows of one run. The tests are :mod:`mmoe.stats`' (Welch's t, the
one-sample t, the detectable effect, Holm's correction).

* :func:`run_verdict`: the verdict of one gap over runs at the plan's level, alpha and power, with the within-run
  resampling interval as a secondary term; an arm with one run is :data:`UNDECIDABLE`, whatever the within-run
  interval says.
* :func:`one_sample_verdict`: one arm's mean over runs against zero, in the same form.
* :func:`family_verdicts`: the gaps of one claim under Holm's step-down correction.
"""

from __future__ import annotations

from collections.abc import Sequence

from mmoe.stats import (
    ALPHA,
    LEVEL,
    NOT_SEPARATED,
    POWER,
    Welch,
    detectable_effect,
    holm_adjusted,
    one_sample,
    welch,
)
from mmoe.study.verdicts import direction_verdict

#: The verdict where an arm has a single run: no run-to-run spread, nothing decided.
UNDECIDABLE = "undecidable: 1 run per arm"


def one_sample_verdict(
    values: Sequence[float], expected_sign: int, *, level: float = LEVEL, alpha: float = ALPHA, power: float = POWER
) -> dict:
    """One arm's mean over runs against zero (the paper predicts ``expected_sign``): Student's t interval over the runs,
    its p-value and detectable effect, in :func:`run_verdict`'s form (``welch`` holds the one-sample test, ``runs``
    one count); :data:`UNDECIDABLE` with fewer than two runs."""
    return _decided(one_sample(values, level), [len(values)], None, expected_sign, alpha, power)


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
    return _decided(welch(a, b, level), [len(a), len(b)], within_run, expected_sign, alpha, power)


def _decided(
    test: Welch | None, runs: list[int], within_run: list[float] | None, expected_sign: int, alpha: float, power: float
) -> dict:
    """A gap's entry from its t test (None where an arm has one run: :data:`UNDECIDABLE`): the interval's side of zero
    decides where the p-value is at most ``alpha``."""
    entry: dict = {"runs": runs, "within_run": within_run}
    if test is None:
        return entry | {"welch": None, "detectable": None, "verdict": UNDECIDABLE}
    detectable = detectable_effect(test.std, test.runs, alpha, power)
    verdict = direction_verdict(test.interval, expected_sign) if test.p_value <= alpha else NOT_SEPARATED
    return entry | {"welch": test.to_json(), "detectable": detectable, "verdict": verdict}


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
