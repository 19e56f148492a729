"""The study's noise rule (:mod:`mmoe.study.verdicts`) on hand-made numbers: an interval on the paper's side
reproduces, on the other side is opposite, across zero is not separated; ceilings and no-learning levels override;
several comparisons combine (the intervals themselves: tests/test_stats.py)."""

from __future__ import annotations

import pytest

from mmoe.study.verdicts import (
    NOT_SEPARATED,
    OPPOSITE,
    REPRODUCES,
    SATURATED,
    UNINFORMATIVE,
    combined,
    direction_verdict,
    gated,
    keys_of,
    log_mean,
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
