"""Verdicts over training runs (:mod:`mmoe.study.run_statistics`): runs as the unit of a verdict, one run per arm
undecided, Holm's correction over a claim's gaps (the tests themselves: tests/test_stats.py)."""

from __future__ import annotations

import numpy as np
import pytest

from mmoe.study.run_statistics import UNDECIDABLE, family_verdicts, run_verdict
from mmoe.study.verdicts import NOT_SEPARATED, OPPOSITE, REPRODUCES


def test_tiny_within_run_noise_and_large_run_to_run_spread_is_not_separated():
    """Each run's own resampling interval is tight and excludes zero, but the runs of each arm scatter widely: the
    verdict over runs is not separated, and the tight interval is only reported beside it."""
    generator = np.random.default_rng(1)
    a = list(1.0 + generator.normal(0, 2.0, 4))
    b = list(0.0 + generator.normal(0, 2.0, 4))
    within = [0.98, 1.02]  # bootstrap inside one run of each arm: excludes zero
    entry = run_verdict(a, b, +1, within_run=within)
    assert entry["verdict"] == NOT_SEPARATED and entry["within_run"] == within
    assert entry["welch"]["interval"][0] < 0 < entry["welch"]["interval"][1]
    assert entry["detectable"] > abs(entry["welch"]["difference"])
    separated = run_verdict([1.0, 1.1, 0.9], [0.0, 0.1, -0.1], -1)
    assert separated["verdict"] == OPPOSITE


def test_one_run_per_arm_is_undecidable_whatever_the_within_run_interval():
    entry = run_verdict([1.0], [0.0, 0.1], +1, within_run=[0.9, 1.1])
    assert entry["verdict"] == UNDECIDABLE and entry["welch"] is None and entry["detectable"] is None


def test_holm_keeps_a_gap_only_where_the_family_rejects():
    """Two gaps each below 0.05 alone but neither below 0.05 / 2: Holm rejects neither; one clear gap is kept."""
    clear = run_verdict([5.0, 5.1, 4.9, 5.05], [0.0, 0.1, -0.1, 0.05], +1)
    marginal = run_verdict([1.0, 1.6, 0.4, 1.2], [0.0, 0.7, -0.3, 0.3], +1)
    other = run_verdict([1.0, 1.6, 0.4, 1.2], [0.2, 0.7, -0.3, 0.3], +1)
    for gap in (marginal, other):
        assert gap["verdict"] == REPRODUCES and 0.025 < gap["welch"]["p_value"] < 0.05
    one_run = run_verdict([1.0], [0.0], +1)
    decided = family_verdicts([marginal, other, one_run])
    assert [gap["verdict"] for gap in decided] == [NOT_SEPARATED, NOT_SEPARATED, UNDECIDABLE]
    assert decided[0]["unadjusted_verdict"] == REPRODUCES and decided[2]["holm_p"] is None
    assert decided[0]["holm_p"] == pytest.approx(2 * marginal["welch"]["p_value"])
    kept = family_verdicts([clear, marginal])
    assert [gap["verdict"] for gap in kept] == [REPRODUCES, REPRODUCES]  # the second compared with 0.05 / 1
