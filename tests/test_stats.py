"""The statistics of the demo's comparison and the claims study (:mod:`mmoe.stats`) against published tables, worked
examples and the definitions: Student's t quantiles, Welch's and the one-sample t test, the detectable effect, Holm's
correction, the bootstrap's percentile interval, an interval's side of zero and the seed intervals."""

from __future__ import annotations

import numpy as np
import pytest

from mmoe.stats import (
    NOT_SEPARATED,
    T_975,
    bootstrap,
    detectable_effect,
    holm,
    holm_adjusted,
    one_sample,
    percentile_interval,
    pooled_std,
    seed_interval,
    side_of_zero,
    t_975,
    t_quantile,
    welch,
    welch_degrees,
)

# Student's t quantiles from the published tables (e.g. NIST/SEMATECH e-Handbook, Table 1.3.6.7.2): 0.80, and the
# two-sided 0.002 and 0.001 columns (the probabilities a plan's level 0.999 and alpha 0.001 ask for).
T_80 = {1: 1.376, 2: 1.061, 5: 0.920, 10: 0.879, 30: 0.854}
T_TAIL = [(0.999, 10, 4.144), (0.999, 30, 3.385), (0.9995, 11, 4.437), (0.9995, 12, 4.318), (0.9995, 16, 4.015)]


@pytest.mark.parametrize("degrees", range(1, 31))
def test_the_975_table_is_the_t_quantile_rounded(degrees):
    assert t_quantile(0.975, degrees) == pytest.approx(T_975[degrees - 1], abs=6e-4)
    assert t_quantile(0.025, degrees) == pytest.approx(-T_975[degrees - 1], abs=6e-4)
    assert t_975(degrees) == T_975[degrees - 1]


@pytest.mark.parametrize(("probability", "degrees", "value"), [(0.8, d, v) for d, v in T_80.items()] + T_TAIL)
def test_t_quantile_matches_the_published_tables(probability, degrees, value):
    assert t_quantile(probability, degrees) == pytest.approx(value, abs=6e-4)
    assert t_quantile(1 - probability, degrees) == pytest.approx(-value, abs=6e-4)


def test_t_quantile_has_the_closed_forms_of_one_and_two_degrees_and_refuses_bad_arguments():
    """Cauchy (1 degree): tan(pi (p - 1/2)); 2 degrees: (2p - 1) / sqrt(2 p (1 - p))."""
    for probability in (0.8, 0.975, 0.9995, 0.9999):
        assert t_quantile(probability, 1) == pytest.approx(np.tan(np.pi * (probability - 0.5)), rel=1e-9)
        two = (2 * probability - 1) / np.sqrt(2 * probability * (1 - probability))
        assert t_quantile(probability, 2) == pytest.approx(two, rel=1e-9)
    assert t_quantile(0.5, 3.5) == 0.0 and t_975(1000) == pytest.approx(1.96, abs=1e-3)
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        t_quantile(1.0, 3)
    with pytest.raises(ValueError, match="positive degrees of freedom"):
        t_quantile(0.9, 0)


def test_welch_reproduces_the_textbook_example_and_the_definitions():
    """Welch's t-test, worked example 1 of its Wikipedia article (two samples of 15): t = -2.46, df = 25.0,
    p = 0.021; the interval is the difference +- t(0.975, df) x SE with the Welch-Satterthwaite df."""
    a1 = [27.5, 21.0, 19.0, 23.6, 17.0, 17.9, 16.9, 20.1, 21.9, 22.6, 23.1, 19.6, 19.0, 21.7, 21.4]
    a2 = [27.1, 22.0, 20.8, 23.4, 23.4, 23.5, 25.8, 22.0, 24.8, 20.2, 21.9, 22.1, 22.9, 20.5, 24.4]
    result = welch(a1, a2)
    assert result.difference / result.standard_error == pytest.approx(-2.46, abs=0.005)
    assert result.degrees == pytest.approx(25.0, abs=0.05)
    assert result.p_value == pytest.approx(0.021, abs=0.0005)
    variances = [np.var(a1, ddof=1), np.var(a2, ddof=1)]
    assert result.degrees == pytest.approx(welch_degrees(variances, [15, 15]), rel=1e-12)
    se = np.sqrt(sum(variances) / 15)
    half = t_quantile(0.975, result.degrees) * se
    assert result.standard_error == pytest.approx(se, rel=1e-12)
    assert result.interval == pytest.approx([np.mean(a1) - np.mean(a2) - half, np.mean(a1) - np.mean(a2) + half])
    assert result.runs == [15, 15] and result.std == pytest.approx(np.sqrt(variances))
    wide = welch(a1, a2, level=0.99)
    assert wide.interval[0] < result.interval[0] and wide.interval[1] > result.interval[1]
    assert welch([1.0], [2.0, 3.0]) is None


def test_one_sample_is_students_t_against_zero():
    values = [0.2, 0.4, 0.3, 0.5, 0.1]
    result = one_sample(values)
    se = np.std(values, ddof=1) / np.sqrt(5)
    half = 2.776 * se  # t_{0.975, 4} of the published table
    assert result.interval == pytest.approx([0.3 - half, 0.3 + half], rel=1e-3)
    assert result.degrees == 4 and result.runs == [5] and result.standard_error == pytest.approx(se, rel=1e-12)
    # p: twice the upper tail of t = mean / SE, here from the 4-degree closed form of the CDF
    t = 0.3 / se
    upper = 0.5 - 0.5 * t * (6 + t * t) / (4 + t * t) ** 1.5
    assert result.p_value == pytest.approx(2 * upper, rel=1e-9)
    assert one_sample([0.2]) is None


def test_runs_that_agree_to_rounding_are_tested_without_a_warning(recwarn):
    """A spread of a few ulps is a spread: the test runs as on any other values, without a warning in the study's
    output."""
    close = welch([0.1 + 0.2, 0.3, 0.3], [0.25, 0.25 + 1e-17, 0.25 * (1 + 2e-16)])
    assert close.standard_error > 0 and close.p_value < 1e-6
    assert [str(warning.message) for warning in recwarn] == []


def test_no_spread_gives_an_exact_difference():
    same = welch([1.0, 1.0], [0.5, 0.5])
    assert same.interval == [0.5, 0.5] and same.p_value == 0.0 and same.degrees == 2.0
    assert welch([1.0, 1.0], [1.0, 1.0]).p_value == 1.0
    assert one_sample([0.0, 0.0, 0.0]).degrees == 2.0
    assert detectable_effect([0.0], [2]) == 0.0


def test_detectable_effect_follows_the_normal_limit_and_grows_with_few_runs():
    many = detectable_effect([1.0, 1.0], [10_000, 10_000])
    assert many == pytest.approx((1.959964 + 0.841621) * np.sqrt(2 / 10_000), rel=1e-3)
    assert detectable_effect([1.0, 1.0], [3, 3]) > detectable_effect([1.0, 1.0], [8, 8]) * 2
    # one arm against zero: n - 1 degrees of freedom and SE = s / sqrt(n)
    one = (t_quantile(0.975, 4) + t_quantile(0.8, 4)) * 2.0 / np.sqrt(5)
    assert detectable_effect([2.0], [5]) == pytest.approx(one, rel=1e-12)


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


def test_bootstrap_is_the_generator_s_draws_and_leaves_undefined_replicates_out():
    """Each replicate is the statistic of one ``integers(0, units, units)`` draw of ``default_rng(seed)``, in order;
    None, NaN and infinite replicates are dropped."""
    samples = np.arange(10.0)
    draws = np.random.default_rng(5)
    expected = [samples[draws.integers(0, 10, 10)].mean() for _ in range(50)]
    assert bootstrap(lambda index: samples[index].mean(), 10, resamples=50, seed=5).tolist() == expected
    undefined = iter([None, np.nan, np.inf, 1.0, 0.0 / 1.0])
    assert bootstrap(lambda index: next(undefined), 3, resamples=5).tolist() == [1.0, 0.0]


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
    replicates = generator.normal(0, 1, 999)
    assert percentile_interval(replicates, 0.9) == pytest.approx(list(np.percentile(replicates, [5, 95])))


@pytest.mark.parametrize(
    ("interval", "side"), [([0.1, 0.3], 1), ([-0.3, -0.1], -1), ([-0.1, 0.2], 0), ([0.0, 0.2], 0), (None, 0)]
)
def test_side_of_zero_is_where_the_interval_lies_wholly(interval, side):
    assert side_of_zero(interval) == side
    assert NOT_SEPARATED == "not separated"


def test_seed_interval_uses_the_pooled_spread_of_the_difference_and_students_t():
    # cells (1, 3) and (10, 12, 14): squares 2 + 8 over 1 + 2 degrees of freedom
    noise = pooled_std([[1.0, 3.0], [10.0, 12.0, 14.0], [7.0]])
    assert noise == pytest.approx((np.sqrt(10 / 3), 3))
    low, high = seed_interval([10.0, 12.0, 14.0], [7.0], noise)
    half = 3.182 * np.sqrt(10 / 3) * np.sqrt(1 / 3 + 1)  # t(3) = 3.182: three degrees of freedom are few
    assert (low, high) == pytest.approx((5 - half, 5 + half))
    assert pooled_std([[1.0], [2.0]]) is None and seed_interval([1.0], [2.0], None) is None


def test_the_t_tests_equal_scipys():
    """Welch's and the one-sample test, their intervals and the t quantiles equal SciPy's (run where SciPy is
    installed: ``.venv-eval/``, tests/test_eval_extra.py)."""
    stats = pytest.importorskip("scipy.stats", reason="SciPy is the independent reference (the eval extra's)")
    generator = np.random.default_rng(0)
    for runs_a, runs_b in [(2, 2), (3, 5), (8, 4), (20, 30)]:
        a = generator.normal(0.3, 1.0, runs_a)
        b = generator.normal(0.0, 2.0, runs_b)
        ours, theirs = welch(a, b, level=0.9), stats.ttest_ind(a, b, equal_var=False)
        bounds = theirs.confidence_interval(confidence_level=0.9)
        assert ours.p_value == pytest.approx(theirs.pvalue, rel=1e-9)
        assert ours.degrees == pytest.approx(theirs.df, rel=1e-12)
        assert ours.interval == pytest.approx([bounds.low, bounds.high], rel=1e-9)
        alone, reference = one_sample(a), stats.ttest_1samp(a, 0.0)
        assert alone.p_value == pytest.approx(reference.pvalue, rel=1e-9)
        assert alone.interval == pytest.approx(list(reference.confidence_interval(0.95)), rel=1e-9)
    for probability, degrees in [(0.8, 1.5), (0.975, 3.7), (0.9995, 11.0), (0.999, 250.0)]:
        assert t_quantile(probability, degrees) == pytest.approx(stats.t.ppf(probability, degrees), rel=1e-10)
