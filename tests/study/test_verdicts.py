"""The study's noise rule (:mod:`mmoe.study.verdicts`) on hand-made numbers: an interval on the paper's side
reproduces, on the other side is opposite, across zero is not separated; ceilings and no-learning levels override;
several comparisons combine; seeds and bootstrap give intervals of the right width."""

from __future__ import annotations

import numpy as np
import pytest

from mmoe.study.verdicts import (
    NOT_SEPARATED,
    OPPOSITE,
    REPRODUCES,
    SATURATED,
    UNINFORMATIVE,
    bootstrap,
    combined,
    direction_verdict,
    gated,
    keys_of,
    log_mean,
    percentile_interval,
    pooled_std,
    seed_interval,
    t_975,
)


@pytest.mark.parametrize(
    ("interval", "sign", "verdict"),
    [
        ([0.1, 0.3], +1, REPRODUCES),
        ([-0.3, -0.1], +1, OPPOSITE),
        ([-0.1, 0.2], +1, NOT_SEPARATED),  # overlap: not separated
        ([-0.3, -0.1], -1, REPRODUCES),  # the paper predicts a smaller value (fluctuation)
        ([0.1, 0.3], -1, OPPOSITE),
        (None, +1, NOT_SEPARATED),  # unknown noise
    ],
)
def test_direction_verdict_reads_the_interval_against_the_papers_sign(interval, sign, verdict):
    assert direction_verdict(interval, sign) == verdict


def test_ceiling_and_chance_override_the_interval():
    assert gated(REPRODUCES, saturated=True) == SATURATED
    assert gated(OPPOSITE, uninformative=True) == UNINFORMATIVE
    assert gated(NOT_SEPARATED, saturated=True, uninformative=True) == UNINFORMATIVE
    assert gated(REPRODUCES) == REPRODUCES


@pytest.mark.parametrize(
    ("verdicts", "result"),
    [
        ([REPRODUCES, REPRODUCES], REPRODUCES),
        ([REPRODUCES, NOT_SEPARATED], NOT_SEPARATED),
        ([REPRODUCES, OPPOSITE], NOT_SEPARATED),  # the comparisons disagree
        ([OPPOSITE, NOT_SEPARATED], OPPOSITE),
        ([REPRODUCES, SATURATED], REPRODUCES),  # a saturated run shows nothing either way
        ([SATURATED, SATURATED], SATURATED),
        ([UNINFORMATIVE, SATURATED], UNINFORMATIVE),
        ([], NOT_SEPARATED),
    ],
)
def test_combined_lets_the_telling_comparisons_decide(verdicts, result):
    assert combined(verdicts) == result


def test_seed_interval_uses_the_pooled_spread_of_the_difference_and_students_t():
    # cells (1, 3) and (10, 12, 14): squares 2 + 8 over 1 + 2 degrees of freedom
    noise = pooled_std([[1.0, 3.0], [10.0, 12.0, 14.0], [7.0]])
    assert noise == pytest.approx((np.sqrt(10 / 3), 3))
    low, high = seed_interval([10.0, 12.0, 14.0], [7.0], noise)
    half = 3.182 * np.sqrt(10 / 3) * np.sqrt(1 / 3 + 1)  # t(3) = 3.182: three degrees of freedom are few
    assert (low, high) == pytest.approx((5 - half, 5 + half))
    assert t_975(1) == pytest.approx(12.706) and t_975(1000) == pytest.approx(1.96, abs=1e-3)
    assert pooled_std([[1.0], [2.0]]) is None and seed_interval([1.0], [2.0], None) is None


def test_bootstrap_interval_covers_the_mean_and_narrows_with_more_units():
    generator = np.random.default_rng(3)
    widths = []
    for units in (20, 2000):
        samples = generator.normal(1.0, 1.0, units)
        interval = percentile_interval(bootstrap(lambda index, s=samples: s[index].mean(), units, resamples=400))
        assert interval[0] < samples.mean() < interval[1]
        widths.append(interval[1] - interval[0])
        # the standard error of a mean of n unit-variance samples: the 95% interval spans about 3.9 of them
        assert widths[-1] == pytest.approx(3.92 / np.sqrt(units), rel=0.3)
    assert widths[1] < widths[0] / 5
    assert percentile_interval(np.asarray([])) is None


def test_modalities_are_selected_not_averaged():
    keys = ["layer1/language", "layer1/vision", "layer3/language", "layer3/vision"]
    assert keys_of(keys, "language") == ["layer1/language", "layer3/language"]
    assert keys_of(keys, "vision") == ["layer1/vision", "layer3/vision"]
    from mmoe.study.plan_design import shipped_rules

    assert shipped_rules("collapse").paper_modality == "language"
    assert shipped_rules("diversity").paper_modality == "vision"


def test_log_mean_is_geometric_and_refuses_undefined_values():
    assert log_mean([1.0, 100.0]) == pytest.approx(10.0)  # the arithmetic mean would be 50.5
    assert log_mean([1.0, None]) is None and log_mean([0.0, 2.0]) is None and log_mean([]) is None
