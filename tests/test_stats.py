"""Intervals over seeds: the t quantile against published tables and mpmath, coverage by simulation,
paired and Welch differences, and the words a difference is reported in."""

import math

import mpmath
import numpy as np
import pandas as pd
import pytest

from workbench.stats import (
    Interval,
    compare,
    difference,
    format_difference,
    format_interval,
    interval_cells,
    summarize,
    t_cdf,
    t_interval,
    t_quantile,
)

# Two-sided 95% critical values from any t table (Student 1908 / Fisher & Yates).
T_TABLE_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 9: 2.262, 10: 2.228, 29: 2.045, 120: 1.980}


@pytest.mark.parametrize("df, expected", sorted(T_TABLE_975.items()))
def test_t_quantile_matches_the_published_table(df, expected):
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=6e-4)
    assert t_quantile(0.025, df) == pytest.approx(-expected, abs=6e-4)


def test_t_cdf_matches_mpmath_incomplete_beta():
    rng = np.random.default_rng(0)
    for df, t in zip(rng.uniform(0.5, 60, 30), rng.normal(0, 3, 30)):
        reference = 1 - 0.5 * float(mpmath.betainc(df / 2, 0.5, 0, df / (df + t * t), regularized=True))
        reference = reference if t >= 0 else 1 - reference
        assert t_cdf(float(t), float(df)) == pytest.approx(reference, abs=1e-12)
    assert t_quantile(0.975, 1e6) == pytest.approx(1.959964, abs=1e-5)  # the normal limit


def test_t_quantile_inverts_mpmaths_cdf_at_fractional_df():
    """Welch's df is fractional: the quantile's cdf, by mpmath's incomplete beta, gives p back."""
    for p in (0.5 + 1e-7, 0.6, 0.9, 0.975, 0.995, 0.9999):
        for df in (0.5, 1.0, 2.0, 3.7, 9.0, 29.5, 120.0, 1e5):
            t = mpmath.mpf(t_quantile(p, df))
            with mpmath.workdps(40):
                tail = mpmath.betainc(df / 2, 0.5, 0, df / (df + t * t), regularized=True) / 2
                # at df 1e5 the log-gammas of the prefactor (about 5e5) leave ~1e-11 of rounding
                assert float(1 - tail) == pytest.approx(p, abs=1e-12 if df <= 120 else 1e-10), (p, df)


def test_t_interval_by_hand_and_its_coverage_by_simulation():
    iv = t_interval([1, 2, 3, 4, 5])
    half = 2.776445 * np.std([1, 2, 3, 4, 5], ddof=1) / math.sqrt(5)
    assert (iv.mean, iv.n) == (3.0, 5) and iv.low == pytest.approx(3 - half) and iv.high == pytest.approx(3 + half)
    single = t_interval([2.5, float("nan")])
    assert single.n == 1 and math.isnan(single.low) and format_interval(single) == "2.5 (n=1, no interval)"
    rng = np.random.default_rng(1)
    covered = [t_interval(rng.normal(10, 3, 4)).covers(10) for _ in range(3000)]
    assert abs(np.mean(covered) - 0.95) < 0.015  # 95% intervals cover the true mean 95% of the time


def test_paired_and_welch_differences():
    a, b = np.array([1.0, 2.0, 3.0, 4.0]), np.array([1.1, 2.2, 3.1, 4.3])
    paired = difference(a, b, paired=True)
    assert paired == t_interval(a - b)  # the paired interval is the interval of the differences
    assert not paired.covers(0)  # b is higher in every pair: detected although the means are close
    welch = difference(a, b)
    assert welch.covers(0) and welch.mean == pytest.approx(a.mean() - b.mean())
    rng = np.random.default_rng(2)
    covered = [difference(rng.normal(0, 1, 5), rng.normal(0, 4, 9)).covers(0) for _ in range(3000)]
    assert abs(np.mean(covered) - 0.95) < 0.015  # Welch's interval holds with unequal variances and sizes
    with pytest.raises(ValueError, match="paired difference needs equal lengths"):
        difference([1, 2], [1, 2, 3], paired=True)


def test_a_difference_covering_zero_is_reported_as_none_detected():
    assert format_difference(Interval(-0.03, -0.10, 0.04, 3)) == "no difference detected (-0.03 [-0.1, +0.04])"
    assert format_difference(Interval(0.12, 0.05, 0.19, 3)) == "+0.12 [+0.05, +0.19]"
    assert format_difference(Interval(0.5, math.nan, math.nan, 1)).startswith("no difference detected")


def test_summarize_and_compare_over_a_seeds_grid():
    frame = pd.DataFrame({
        "variant": ["base"] * 3 + ["b"] * 3 + ["c"] * 3,
        "seed": [0, 1, 2] * 3,
        "loss": [2.0, 2.1, 2.2, 1.5, 1.6, 1.7, 2.05, 2.0, 2.3],
    })
    summary = summarize(frame, "variant", "loss")
    assert summary["variant"].tolist() == ["base", "b", "c"] and summary["n"].tolist() == [3, 3, 3]
    assert summary.loc[0, "loss_mean"] == pytest.approx(2.1)
    assert summary.loc[0, "loss_low"] == pytest.approx(t_interval([2.0, 2.1, 2.2]).low)
    cells = interval_cells(summary, "loss")
    assert cells.loc[1, "loss"] == format_interval(t_interval([1.5, 1.6, 1.7]))
    diffs = compare(frame, "variant", "loss", baseline="base").set_index("variant")
    assert diffs.loc["b", "paired"] and diffs.loc["b", "detected"]  # 0.5 lower in every seed
    assert diffs.loc["b", "diff_mean"] == pytest.approx(-0.5)
    assert not diffs.loc["c", "detected"]  # +0.05, -0.1, +0.1: the interval covers zero
    with pytest.raises(ValueError, match="baseline 'nope'"):
        compare(frame, "variant", "loss", baseline="nope")
    with pytest.raises(ValueError, match="confidence"):
        t_interval([1, 2], confidence=1.5)
    with pytest.raises(ValueError, match="value column"):
        summarize(frame, "variant", "accuracy")
