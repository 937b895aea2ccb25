"""Statistics for comparing arms of runs, one number per run (a per-run aggregate): the difference
with its confidence interval and p-value (paired by seed when both arms hold the same seeds, Welch
otherwise), the effect size d_z with its interval, Holm's correction across lines, equivalence by
two one-sided tests (TOST), and from 10 runs per arm the interquartile mean with a stratified
bootstrap interval and the probability of improvement (Agarwal et al. 2021, arXiv 2108.13264,
through their `rliable` package). Seed counts come from a declared smallest effect and a pilot's
spread, never from the observed difference."""

from __future__ import annotations

import math
from dataclasses import dataclass

from scipy import optimize
from scipy import stats as sps

BOOTSTRAP_FROM = 10  # runs per arm from which the IQM, bootstrap interval and P(improvement) are reported
BOOTSTRAP_REPS = 2000


@dataclass
class Difference:
    diff: float  # mean of b - mean of a (paired: mean of the per-seed differences)
    se: float  # its standard error
    p: float  # two-sided p-value of "no difference"; nan with fewer than 2 runs; without spread the
    # t-test's limit: 0 for a nonzero difference, 1 for none (`_p`)
    df: float  # degrees of freedom of the t distribution
    paired: bool
    n: int  # pairs, or the smaller arm's size
    sd: float  # sd of the paired differences, or the pooled sd
    alpha: float = 0.05

    @property
    def zero_variance(self) -> bool:
        return self.n >= 2 and self.sd == 0

    @property
    def half_ci(self) -> float:
        """Half-width of the (1 - alpha) confidence interval."""
        return float(sps.t.ppf(1 - self.alpha / 2, self.df) * self.se) if self.n >= 2 else float("nan")

    @property
    def interval(self) -> tuple[float, float]:
        return self.diff - self.half_ci, self.diff + self.half_ci

    def dz(self) -> tuple[float, float, float]:
        """Standardised effect (d_z for pairs, d for Welch) and its (1 - alpha) interval."""
        return effect_size(self.diff, self.sd, self.n, self.paired, self.alpha)

    def tost(self, margin: float) -> float:
        """p-value of "the difference lies inside (-margin, margin)" by two one-sided t-tests."""
        if self.n < 2:
            return float("nan")
        if self.se == 0:
            return 0.0 if abs(self.diff) < margin else 1.0
        return float(
            max(sps.t.sf((self.diff + margin) / self.se, self.df), sps.t.cdf((self.diff - margin) / self.se, self.df))
        )

    def beyond(self, margin: float) -> float:
        """p-value of "the difference lies inside [-margin, margin]" against its lying beyond it (the
        interval wholly outside the margin: two one-sided t-tests at alpha / 2, as the interval is)."""
        if self.n < 2:
            return float("nan")
        if self.se == 0:
            return 0.0 if abs(self.diff) > margin else 1.0
        return float(min(1.0, 2 * sps.t.sf((abs(self.diff) - margin) / self.se, self.df)))

    def brief(self) -> str:
        """The difference and its interval alone, for tables: `+0.100 [-0.148, +0.348] (n = 3)`."""
        if math.isnan(self.diff) or self.n < 2 or self.zero_variance:
            return self.describe()
        lo, hi = self.interval
        return f"{self.diff:+.3f} [{lo:+.3f}, {hi:+.3f}] (n = {self.n})"

    def describe(self) -> str:
        """The numbers in words: `+0.100 [-0.148, +0.348], d_z = +1.00 [...], p = 0.3 (paired t, n = 3)`."""
        if math.isnan(self.diff):
            return f"missing (n = {self.n}: an arm has no run with a value)"
        if self.n < 2:
            return f"{self.diff:+.3f} (n = {self.n}: too few runs for an interval)"
        if self.zero_variance:
            return (
                f"{self.diff:+.3f} in every one of {self.n} {'pairs' if self.paired else 'runs'} "
                f"(no spread: p = {self.p:g}, the t-test's limit, n = {self.n})"
            )
        lo, hi = self.interval
        d, dlo, dhi = self.dz()
        name = "d_z" if self.paired else "d"
        return (
            f"{self.diff:+.3f} [{lo:+.3f}, {hi:+.3f}], {name} = {d:+.2f} [{dlo:+.2f}, {dhi:+.2f}], "
            f"p = {self.p:.2g} ({'paired t' if self.paired else 'Welch t'}, n = {self.n})"
        )


@dataclass(frozen=True)
class Row:
    """One compared line of rlkit-compare or of a study's secondary metrics: `arm` against a
    baseline on `metric`. `diff` is None for a line declared with a withdrawn aggregate (`withdrawn`
    says why); it stays in Holm's family as a missing p."""

    label: str
    diff: Difference | None
    robust: Robust | None
    arm: str
    metric: str
    lower: bool
    withdrawn: str = ""

    @property
    def p(self) -> float:
        return self.diff.p if self.diff is not None else float("nan")


def mean_ci(values: list[float], alpha: float = 0.05) -> tuple[float, float]:
    """Mean and half-width of the (1 - alpha) confidence interval (Student t) over runs; nan for n < 2."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, float(sps.t.ppf(1 - alpha / 2, n - 1)) * sd / math.sqrt(n)


def _mean_var(x: list[float]) -> tuple[float, float]:
    """Mean and sample variance; a variance at the level of float rounding (differences such as
    0.7 - 0.6 against 0.8 - 0.7) is exactly 0, so it reads as "no spread", not as a huge t. Of no
    values: both missing (nan)."""
    if not x:
        return float("nan"), float("nan")
    m = sum(x) / len(x)
    if len(x) < 2:
        return m, float("nan")
    var = sum((v - m) ** 2 for v in x) / (len(x) - 1)
    return m, 0.0 if math.sqrt(var) <= 1e-9 * max(1.0, *(abs(v) for v in x)) else var


def paired(a: list[float], b: list[float], alpha: float = 0.05) -> Difference:
    """b - a over matched pairs (same seed): a one-sample t-test on the differences."""
    d = [y - x for x, y in zip(a, b)]
    n = len(d)
    mean, var = _mean_var(d)
    if n < 2:
        return Difference(mean, float("nan"), float("nan"), float("nan"), True, n, float("nan"), alpha)
    se, df = math.sqrt(var / n), n - 1
    return Difference(mean, se, _p(mean, se, df), df, True, n, math.sqrt(var), alpha)


def welch(a: list[float], b: list[float], alpha: float = 0.05) -> Difference:
    """b - a for independent arms with unequal variances (Welch-Satterthwaite degrees of freedom)."""
    (ma, va), (mb, vb) = _mean_var(a), _mean_var(b)
    na, nb = len(a), len(b)
    if min(na, nb) < 2:
        return Difference(mb - ma, float("nan"), float("nan"), float("nan"), False, min(na, nb), float("nan"), alpha)
    qa, qb = va / na, vb / nb
    se = math.sqrt(qa + qb)
    df = (qa + qb) ** 2 / (qa**2 / (na - 1) + qb**2 / (nb - 1)) if se > 0 else float(na + nb - 2)
    return Difference(mb - ma, se, _p(mb - ma, se, df), df, False, min(na, nb), math.sqrt((va + vb) / 2), alpha)


def _p(diff: float, se: float, df: float) -> float:
    """Two-sided p of t = diff / se. Without spread (se 0) the limit of the t-test as the spread
    shrinks: 0 for a nonzero difference, 1 for none, so that a larger and more consistent effect
    never gets a larger p than a weaker one (an undefined p would rank the strongest result last)."""
    if se > 0:
        return float(2 * sps.t.sf(abs(diff / se), df))
    return float("nan") if math.isnan(se) else (0.0 if abs(diff) > 1e-9 else 1.0)  # 1e-9: float rounding


def matched(a: list[tuple], b: list[tuple]) -> tuple[list[float], list[float]] | None:
    """The values of `a` and `b` ((seed, value) per run) in matching seed order when both hold the
    same seeds, once each; None when they cannot be paired."""
    sa, sb = dict(a), dict(b)
    if len(sa) == len(a) and len(sb) == len(b) and set(sa) == set(sb):
        seeds = sorted(sa, key=str)
        return [sa[s] for s in seeds], [sb[s] for s in seeds]
    return None


def compare(a: list[tuple], b: list[tuple], alpha: float = 0.05) -> Difference:
    """b - a where `a` and `b` hold (seed, value) per run; paired when both hold the same seeds, once each."""
    pairs = matched(a, b)
    return paired(*pairs, alpha) if pairs else welch([v for _, v in a], [v for _, v in b], alpha)


def nct_cdf(x: float, df: float, nc: float) -> float:
    """The noncentral t distribution's cdf at x. Far in its tails scipy gives nan, where the cdf is
    0 (x far below the noncentrality) or 1 (far above): those limits instead, so that a power or an
    interval read from it never turns on a nan."""
    v = float(sps.nct.cdf(x, df, nc))
    return v if not math.isnan(v) else (0.0 if nc > x else 1.0)


def effect_size(diff: float, sd: float, n: int, paired: bool, alpha: float = 0.05) -> tuple[float, float, float]:
    """d = diff / sd with the (1 - alpha) interval from inverting the noncentral t distribution of
    t = d * sqrt(n) (pairs) or d * sqrt(n / 2) (two arms of n)."""
    if n < 2 or not sd > 0:
        return float("nan"), float("nan"), float("nan")
    scale = math.sqrt(n) if paired else math.sqrt(n / 2)
    df, t = (n - 1) if paired else (2 * n - 2), diff / sd * scale

    def cdf(nc: float) -> float:
        return nct_cdf(t, df, nc)

    def nc_at(q: float) -> float:  # the noncentrality whose distribution puts t at quantile q
        width = 10 + abs(t)
        for _ in range(60):  # cdf falls in nc; few pairs: heavy tails, a wide bracket
            if cdf(t + width) <= q <= cdf(t - width):
                return optimize.brentq(lambda nc: cdf(nc) - q, t - width, t + width)
            width *= 2
        return float("nan")  # no bracket within 2^60 times the start: not a number to print

    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    return diff / sd, nc_at(1 - alpha / 2) / scale, nc_at(alpha / 2) / scale


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjustment of a family of p-values. A missing p (nan: a line with too few
    runs) stays missing but stays in the family: it counts in m, as a test that could not reject."""
    order = sorted((p, i) for i, p in enumerate(pvalues) if not math.isnan(p))
    m, out, running = len(pvalues), [float("nan")] * len(pvalues), 0.0
    for rank, (p, i) in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out


def seeds_for_power(
    diff: float, sd: float, paired: bool, power: float = 0.8, alpha: float = 0.05, limit: int = 1000
) -> int | None:
    """Smallest n (pairs, or runs per arm) at which a two-sided t-test at `alpha` detects a true
    difference `diff` with probability `power`, given the standard deviation `sd` (of the paired
    differences, or pooled); from the noncentral t distribution."""
    if diff == 0 or not sd > 0:
        return None
    for n in range(2, limit + 1):
        df = n - 1 if paired else 2 * n - 2
        nc = abs(diff) / sd * (math.sqrt(n) if paired else math.sqrt(n / 2))
        crit = sps.t.ppf(1 - alpha / 2, df)
        if 1 - nct_cdf(crit, df, nc) + nct_cdf(-crit, df, nc) >= power:
            return n
    return limit


def seeds_for_equivalence(
    margin: float, sd: float, power: float = 0.8, alpha: float = 0.05, limit: int = 1000
) -> int | None:
    """Smallest number of pairs at which TOST at `alpha` shows equivalence within ±margin with
    probability at least `power` when the true difference is 0 (a lower bound on TOST's power:
    1 - 2 P(T <= t_crit) with T noncentral t at margin / (sd / sqrt(n)))."""
    if not margin > 0 or not sd > 0:
        return None
    for n in range(2, limit + 1):
        df, nc = n - 1, margin / sd * math.sqrt(n)
        if 1 - 2 * nct_cdf(sps.t.ppf(1 - alpha, df), df, nc) >= power:
            return n
    return limit


def inflated_sd(sd: float, n: int, confidence: float = 0.8) -> float:
    """An upper `confidence` limit of a standard deviation estimated from n pilot values
    (chi-square with n - 1 degrees of freedom), so that seeds planned from a small pilot's spread
    are not too few when the pilot happened to see little noise."""
    return sd * math.sqrt((n - 1) / sps.chi2.ppf(1 - confidence, n - 1)) if n >= 2 else float("nan")


@dataclass
class Robust:
    """From BOOTSTRAP_FROM runs per arm: interquartile means with stratified-bootstrap intervals, and
    the probability that a run of b beats a run of a, with its interval (Agarwal et al. 2021)."""

    iqm_a: tuple[float, float, float]  # estimate, low, high
    iqm_b: tuple[float, float, float]
    p_improve: tuple[float, float, float]

    def describe(self, a: str, b: str, lower: bool) -> str:
        def f(e: tuple) -> str:
            return f"{e[0]:.3f} [{e[1]:.3f}, {e[2]:.3f}]"

        return (
            f"IQM {b} {f(self.iqm_b)} vs {a} {f(self.iqm_a)}; P({b} {'<' if lower else '>'} {a}) = {f(self.p_improve)}"
        )


def robust(
    a: list[float], b: list[float], lower: bool = False, alpha: float = 0.05, seed: int = 0, paired: bool = False
) -> Robust | None:
    """`Robust` for arms a and b (None below BOOTSTRAP_FROM runs per arm); `lower`: lower is better.
    IQM and P(improvement) are rliable's own functions; their intervals are percentile bootstraps,
    run by scipy with a fixed random state so the same runs always print the same numbers. Each
    IQM resamples its own arm (rliable's stratified bootstrap, with one task); P(improvement)
    resamples the two arms on their own, or with `paired` (a[i] and b[i] share a seed) the pairs
    together, so that the seed's shared randomness stays in each resample. (rliable's bootstrap
    module needs `arch` < 8, which fails to import beside pandas 3.)"""
    if min(len(a), len(b)) < BOOTSTRAP_FROM:
        return None
    import numpy as np
    from rliable import metrics

    sign = -1.0 if lower else 1.0  # rliable counts b beating a as b scoring higher
    xa, xb = np.array(a, dtype=float), np.array(b, dtype=float)  # [runs] each

    def estimate(statistic, *samples, together: bool = False) -> tuple[float, float, float]:
        ci = sps.bootstrap(
            samples,
            statistic,
            vectorized=False,
            paired=together,
            n_resamples=BOOTSTRAP_REPS,
            confidence_level=1 - alpha,
            method="percentile",
            random_state=np.random.default_rng(seed),
        )
        return float(statistic(*samples)), float(ci.confidence_interval.low), float(ci.confidence_interval.high)

    iqm = lambda x: metrics.aggregate_iqm(x[:, None])  # noqa: E731  [runs, 1 task]
    improve = lambda x, y: metrics.probability_of_improvement(sign * x[:, None], sign * y[:, None])  # noqa: E731
    return Robust(estimate(iqm, xa), estimate(iqm, xb), estimate(improve, xb, xa, together=paired))
