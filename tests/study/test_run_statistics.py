"""Statistics over training runs (:mod:`mmoe.study.run_statistics`) against published tables and worked examples:
Student's t quantiles, Welch's test, Holm's correction, the detectable effect, and runs as the unit of a verdict."""

from __future__ import annotations

import numpy as np
import pytest

from mmoe.study.run_statistics import (
    UNDECIDABLE,
    detectable_effect,
    family_verdicts,
    holm,
    holm_adjusted,
    run_verdict,
    t_cdf,
    t_quantile,
    welch,
)
from mmoe.study.verdicts import NOT_SEPARATED, OPPOSITE, REPRODUCES, T_975

# Student's t quantiles from the published tables (e.g. NIST/SEMATECH e-Handbook, Table 1.3.6.7.2): 0.975 and 0.80.
T_80 = {1: 1.376, 2: 1.061, 5: 0.920, 10: 0.879, 30: 0.854}


@pytest.mark.parametrize("degrees", range(1, 31))
def test_t_quantile_matches_the_published_975_table(degrees):
    assert t_quantile(0.975, degrees) == pytest.approx(T_975[degrees - 1], abs=6e-4)
    assert t_quantile(0.025, degrees) == pytest.approx(-T_975[degrees - 1], abs=6e-4)


@pytest.mark.parametrize(("degrees", "value"), sorted(T_80.items()))
def test_t_quantile_matches_the_published_80_table_and_inverts_the_cdf(degrees, value):
    assert t_quantile(0.8, degrees) == pytest.approx(value, abs=6e-4)
    assert t_cdf(t_quantile(0.9, degrees + 0.5), degrees + 0.5) == pytest.approx(0.9, abs=1e-9)
    assert t_quantile(0.5, degrees) == 0.0


def test_welch_reproduces_the_textbook_example():
    """Welch's t-test, worked example 1 of its Wikipedia article (two samples of 15): t = -2.46, df = 25.0,
    p = 0.021."""
    a1 = [27.5, 21.0, 19.0, 23.6, 17.0, 17.9, 16.9, 20.1, 21.9, 22.6, 23.1, 19.6, 19.0, 21.7, 21.4]
    a2 = [27.1, 22.0, 20.8, 23.4, 23.4, 23.5, 25.8, 22.0, 24.8, 20.2, 21.9, 22.1, 22.9, 20.5, 24.4]
    result = welch(a1, a2)
    assert result.difference / result.standard_error == pytest.approx(-2.46, abs=0.005)
    assert result.degrees == pytest.approx(25.0, abs=0.05)
    assert result.p_value == pytest.approx(0.021, abs=0.0005)
    # the interval is the difference +- t(0.975, df) x SE, computed here from the definitions
    se = np.sqrt(np.var(a1, ddof=1) / 15 + np.var(a2, ddof=1) / 15)
    half = t_quantile(0.975, result.degrees) * se
    assert result.interval == pytest.approx([np.mean(a1) - np.mean(a2) - half, np.mean(a1) - np.mean(a2) + half])
    assert result.runs == [15, 15]
    assert welch([1.0], [2.0, 3.0]) is None


def test_holm_reproduces_the_worked_example_and_a_direct_loop():
    """Holm (1979), the Wikipedia example: p = 0.01, 0.04, 0.03, 0.005 at alpha 0.05 rejects the first and last."""
    p = [0.01, 0.04, 0.03, 0.005]
    assert holm(p) == [True, False, False, True]
    assert holm_adjusted(p) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    generator = np.random.default_rng(0)
    for _ in range(200):
        values = list(generator.uniform(0, 0.08, generator.integers(1, 7)))
        ordered = sorted(values)
        cut = next((i for i, v in enumerate(ordered) if v > 0.05 / (len(values) - i)), len(values))
        assert holm(values) == [v in ordered[:cut] for v in values]
        assert [a <= 0.05 for a in holm_adjusted(values)] == holm(values)


def test_detectable_effect_follows_the_normal_limit_and_grows_with_few_runs():
    many = detectable_effect([1.0, 1.0], [10_000, 10_000])
    assert many == pytest.approx((1.959964 + 0.841621) * np.sqrt(2 / 10_000), rel=1e-3)
    assert detectable_effect([1.0, 1.0], [3, 3]) > detectable_effect([1.0, 1.0], [8, 8]) * 2


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


# Upper tail quantiles from the published two-sided 0.002 and 0.001 columns (NIST/SEMATECH Table 1.3.6.7.2 and the
# usual 0.0005 one-sided column): the probabilities a plan's level 0.999 and alpha 0.001 ask for.
T_TAIL = [(0.999, 10, 4.144), (0.999, 30, 3.385), (0.9995, 11, 4.437), (0.9995, 12, 4.318), (0.9995, 16, 4.015)]


@pytest.mark.parametrize(("probability", "degrees", "value"), T_TAIL)
def test_t_quantile_matches_the_published_far_tail(probability, degrees, value):
    assert t_quantile(probability, degrees) == pytest.approx(value, abs=6e-4)
    assert t_quantile(1 - probability, degrees) == pytest.approx(-value, abs=6e-4)


@pytest.mark.parametrize("probability", [0.999, 0.9995, 0.9999])
@pytest.mark.parametrize("degrees", [0.3, 1, 2, 10, 11, 12.5, 13, 14, 15, 16, 30, 200, 1e5])
def test_t_quantile_inverts_the_cdf_in_the_far_tail(probability, degrees):
    quantile = t_quantile(probability, degrees)
    assert t_cdf(quantile, degrees) == pytest.approx(probability, abs=1e-12)


def test_t_quantile_has_the_closed_forms_of_one_and_two_degrees():
    """Cauchy (1 degree): tan(pi (p - 1/2)); 2 degrees: (2p - 1) / sqrt(2 p (1 - p))."""
    for probability in (0.8, 0.975, 0.9995, 0.9999):
        assert t_quantile(probability, 1) == pytest.approx(np.tan(np.pi * (probability - 0.5)), rel=1e-9)
        two = (2 * probability - 1) / np.sqrt(2 * probability * (1 - probability))
        assert t_quantile(probability, 2) == pytest.approx(two, rel=1e-9)
