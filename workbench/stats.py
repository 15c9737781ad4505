"""Means with 95% intervals over seeds, differences between variants, and how to say them.

    iv = t_interval([2.31, 2.25, 2.40])            # Interval(mean, low, high, n): Student t, n - 1 df
    summarize(results, by="variant", values="final_val_loss")     # one row per variant: n, mean, low, high
    compare(results, "variant", "final_val_loss", baseline="baseline")   # each variant minus the baseline
    format_difference(iv)                           # "no difference detected (-0.03 [-0.10, +0.04])"

A single run is an anecdote: every experiment runs each cell with several seeds and reports
the mean and a 95% t-interval. A difference whose interval covers zero is reported as "no
difference detected", never as a ranking. Differences are paired by seed when both sides ran
the same seeds (the seed fixes the data order and the initialisation stream, so pairing
removes that shared noise), and Welch's unpaired interval otherwise.

The t quantile is computed here (regularised incomplete beta, then bisection) so the library
needs no SciPy; the tests check it against published t-table values and mpmath.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

import numpy as np
import pandas as pd

CONFIDENCE = 0.95
Number = Union[int, float]  # the runtime type checks of the tests take 4 for a float only if told


@dataclass(frozen=True)
class Interval:
    """A mean and its confidence interval over ``n`` values (``low``/``high`` NaN when n < 2)."""

    mean: float
    low: float
    high: float
    n: int
    confidence: Number = CONFIDENCE

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def covers(self, value: Number = 0.0) -> bool:
        """True when ``value`` lies in the interval (and when there is no interval: nothing was detected)."""
        if math.isnan(self.low) or math.isnan(self.high):
            return True
        return bool(self.low <= value <= self.high)

    def __str__(self) -> str:
        return format_interval(self)


# ---- the t distribution -----------------------------------------------------------------------
def _betainc(a: Number, b: Number, x: Number) -> float:
    """The regularised incomplete beta function I_x(a, b) (continued fraction, modified Lentz)."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast only below the mean; use the symmetry
        return 1.0 - _betainc(b, a, 1.0 - x)
    log_front = a * math.log(x) + b * math.log1p(-x) - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return math.exp(log_front) * f / a


def t_cdf(t: Number, df: Number) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"df must be > 0, got {df}")
    t2 = t * t
    if t2 < df:  # near the centre df / (df + t^2) rounds towards 1: use P(|T| < |t|) = I_{t^2/(df+t^2)}(1/2, df/2)
        tail = 0.5 * (1.0 - _betainc(0.5, df / 2, t2 / (df + t2)))
    else:
        tail = 0.5 * _betainc(df / 2, 0.5, df / (df + t2))  # P(T > |t|)
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: Number, df: Number) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (e.g. 0.975, 4 -> 2.776)."""
    if not 0 < p < 1:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if df <= 0:
        raise ValueError(f"df must be > 0, got {df}")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    return _upper_t_quantile(float(p), float(df))


@functools.lru_cache(maxsize=4096)  # a grid's intervals ask for the same few (p, n - 1) again and again
def _upper_t_quantile(p: float, df: float) -> float:
    """Newton's method on the cdf, kept inside a bracket that bisection would also keep: each step that
    would leave the bracket is a halving instead, so it converges whenever bisection does, in about
    five cdf evaluations instead of bisection's forty-five."""
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        low, high = high, high * 2
    log_density_at_0 = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    t = (low + high) / 2
    for _ in range(200):
        excess = t_cdf(t, df) - p
        if excess == 0:
            return t
        if excess < 0:
            low = t
        else:
            high = t
        density = math.exp(log_density_at_0 - (df + 1) / 2 * math.log1p(t * t / df))
        step = t - excess / density
        step = step if low < step < high else (low + high) / 2
        if abs(step - t) <= 1e-14 * max(1.0, t) or high - low <= 1e-13 * max(1.0, high):
            return step
        t = step
    return t


# ---- intervals --------------------------------------------------------------------------------
def _values(values: Iterable[Number]) -> np.ndarray:
    array = np.asarray(list(values), dtype=float)
    if array.ndim != 1:
        raise ValueError(f"values must be a flat sequence of numbers, got shape {array.shape}")
    return array


def _check_confidence(confidence: Number) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")


def t_interval(values: Iterable[Number], confidence: Number = CONFIDENCE) -> Interval:
    """Mean and the Student-t interval of the mean of ``values`` (NaNs dropped; bounds NaN when n < 2)."""
    _check_confidence(confidence)
    array = _values(values)
    array = array[~np.isnan(array)]
    n = len(array)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0, confidence)
    mean = float(array.mean())
    if n < 2:
        return Interval(mean, math.nan, math.nan, n, confidence)
    half = t_quantile(0.5 + confidence / 2, n - 1) * float(array.std(ddof=1)) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n, confidence)


def difference(a: Iterable[Number], b: Iterable[Number], confidence: Number = CONFIDENCE,
               paired: bool = False) -> Interval:
    """The interval of mean(a) - mean(b): paired (a[i] with b[i]) or Welch's unpaired interval."""
    _check_confidence(confidence)
    x, y = _values(a), _values(b)
    if paired:
        if len(x) != len(y):
            raise ValueError(f"a paired difference needs equal lengths, got {len(x)} and {len(y)}")
        return t_interval(x - y, confidence)
    x, y = x[~np.isnan(x)], y[~np.isnan(y)]
    n = min(len(x), len(y))
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0, confidence)
    mean = float(x.mean() - y.mean())
    if len(x) < 2 or len(y) < 2:
        return Interval(mean, math.nan, math.nan, n, confidence)
    vx, vy = x.var(ddof=1) / len(x), y.var(ddof=1) / len(y)
    se = math.sqrt(vx + vy)
    if se == 0:
        return Interval(mean, mean, mean, n, confidence)
    df = (vx + vy) ** 2 / (vx**2 / (len(x) - 1) + vy**2 / (len(y) - 1))  # Welch-Satterthwaite
    half = t_quantile(0.5 + confidence / 2, df) * se
    return Interval(mean, mean - half, mean + half, n, confidence)


def _columns(frame: pd.DataFrame, names: Union[str, Sequence[str]], what: str) -> list[str]:
    names = [names] if isinstance(names, str) else list(names)
    missing = [n for n in names if n not in frame]
    if missing:
        raise ValueError(f"{what} {missing} not in the table; it has columns {list(frame.columns)}")
    return names


def summarize(frame: pd.DataFrame, by: Union[str, Sequence[str]], values: Union[str, Sequence[str]],
              confidence: Number = CONFIDENCE) -> pd.DataFrame:
    """One row per group of ``by``: ``n`` and, per value column, ``<v>_mean``, ``<v>_low``, ``<v>_high``.

    Groups keep their order of first appearance (the grid's order), not a sorted one.
    """
    by, values = _columns(frame, by, "by column(s)"), _columns(frame, values, "value column(s)")
    rows = []
    for key, part in frame.groupby(by, sort=False, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        row = dict(zip(by, key))
        row["n"] = len(part)
        for v in values:
            iv = t_interval(pd.to_numeric(part[v], errors="coerce"), confidence)
            row.update({f"{v}_mean": iv.mean, f"{v}_low": iv.low, f"{v}_high": iv.high})
        rows.append(row)
    return pd.DataFrame(rows)


def compare(frame: pd.DataFrame, by: str, value: str, baseline: str, pair_on: Optional[str] = "seed",
            confidence: Number = CONFIDENCE) -> pd.DataFrame:
    """Each group of ``by`` minus the ``baseline`` group on ``value``: one row per other group with
    ``diff_mean, diff_low, diff_high, paired, detected`` (False when the interval covers zero).

    Paired by ``pair_on`` when both groups hold the same values of it (each once), else Welch's.
    """
    _columns(frame, [by, value] + ([pair_on] if pair_on and pair_on in frame else []), "column(s)")
    if baseline not in set(frame[by]):
        raise ValueError(f"baseline {baseline!r} is not a value of {by!r}; it has {list(dict.fromkeys(frame[by]))}")
    base = frame[frame[by] == baseline]
    rows = []
    for name, part in frame.groupby(by, sort=False):
        if name == baseline:
            continue
        paired = bool(pair_on and pair_on in frame and part[pair_on].is_unique and base[pair_on].is_unique
                      and set(part[pair_on]) == set(base[pair_on]))
        if paired:
            a = part.set_index(pair_on)[value].astype(float)
            b = base.set_index(pair_on)[value].astype(float).reindex(a.index)
            iv = difference(a.to_numpy(), b.to_numpy(), confidence, paired=True)
        else:
            iv = difference(part[value].astype(float), base[value].astype(float), confidence)
        rows.append({by: name, "baseline": baseline, "n": iv.n, "diff_mean": iv.mean, "diff_low": iv.low,
                     "diff_high": iv.high, "paired": paired, "detected": not iv.covers(0.0)})
    return pd.DataFrame(rows)


# ---- saying it --------------------------------------------------------------------------------
def _number(x: Number, digits: int, sign: bool = False) -> str:
    if math.isnan(x):
        return "nan"
    return f"{x:+.{digits}g}" if sign else f"{x:.{digits}g}"


def format_interval(interval: Interval, digits: int = 3) -> str:
    """``"2.31 [2.25, 2.37]"``; ``"2.31 (n=1, no interval)"`` for a single value."""
    if interval.n < 2 or math.isnan(interval.low):
        return f"{_number(interval.mean, digits)} (n={interval.n}, no interval)"
    return f"{_number(interval.mean, digits)} [{_number(interval.low, digits)}, {_number(interval.high, digits)}]"


def format_difference(interval: Interval, digits: int = 3) -> str:
    """A difference as a finding: ``"+0.12 [+0.05, +0.19]"`` when its interval excludes zero,
    ``"no difference detected (-0.03 [-0.10, +0.04])"`` when it covers zero (or there is none)."""
    if interval.n < 2 or math.isnan(interval.low):
        return f"no difference detected ({_number(interval.mean, digits, True)}, n={interval.n}, no interval)"
    shown = (f"{_number(interval.mean, digits, True)} [{_number(interval.low, digits, True)}, "
             f"{_number(interval.high, digits, True)}]")
    return f"no difference detected ({shown})" if interval.covers(0.0) else shown


def interval_cells(summary: pd.DataFrame, values: Union[str, Sequence[str]], digits: int = 3) -> pd.DataFrame:
    """``summarize``'s table with each value's three columns folded into one readable string."""
    values = [values] if isinstance(values, str) else list(values)
    out = summary.copy()
    for v in values:
        out[v] = [format_interval(Interval(m, lo, hi, n), digits)
                  for m, lo, hi, n in zip(out[f"{v}_mean"], out[f"{v}_low"], out[f"{v}_high"], out["n"])]
        out = out.drop(columns=[f"{v}_mean", f"{v}_low", f"{v}_high"])
    return out
