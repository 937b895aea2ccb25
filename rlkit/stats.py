"""Statistics for comparing groups of runs: the difference of means with its 95% confidence
interval and p-value (paired by seed when both groups have the same seeds, Welch otherwise), and
the number of seeds a difference of that size needs for 80% power."""
from __future__ import annotations

import math
from dataclasses import dataclass

from scipy import stats as sps


@dataclass
class Difference:
    diff: float        # mean of b - mean of a (paired: mean of the per-seed differences)
    half_ci: float     # half-width of its 95% confidence interval
    p: float           # two-sided p-value of "no difference"
    df: float          # degrees of freedom of the t distribution
    paired: bool
    n: int             # pairs, or the smaller group's size
    seeds_for_power: int | None  # seeds per arm for 80% power at this effect size; None if no effect or n < 2

    def verdict(self, name: str, alpha: float = 0.05) -> str:
        if math.isnan(self.p):
            return f"{name}: {self.diff:+.3f} (too few runs for an interval)"
        word = "significant" if self.p < alpha else "not significant"
        need = "" if self.seeds_for_power is None else \
            f"; ~{self.seeds_for_power if self.seeds_for_power < 1000 else '>1000'} seeds per arm for 80% power"
        return (f"{name}: {self.diff:+.3f} ± {self.half_ci:.3f}, p = {self.p:.2g}, {word} "
                f"({'paired' if self.paired else 'Welch'}, n = {self.n}{need})")


def _mean_var(x: list[float]) -> tuple[float, float]:
    m = sum(x) / len(x)
    return m, sum((v - m) ** 2 for v in x) / (len(x) - 1) if len(x) > 1 else float("nan")


def paired(a: list[float], b: list[float]) -> Difference:
    """b - a over matched pairs (same seed): a one-sample t-test on the differences."""
    d = [y - x for x, y in zip(a, b)]
    n = len(d)
    mean, var = _mean_var(d)
    if n < 2:
        return Difference(mean, float("nan"), float("nan"), float("nan"), True, n, None)
    se, df = math.sqrt(var / n), n - 1
    return Difference(mean, sps.t.ppf(0.975, df) * se, _p(mean, se, df), df, True, n,
                      seeds_for_power(mean, math.sqrt(var), paired=True))


def welch(a: list[float], b: list[float]) -> Difference:
    """b - a for independent groups with unequal variances (Welch-Satterthwaite degrees of freedom)."""
    (ma, va), (mb, vb) = _mean_var(a), _mean_var(b)
    na, nb = len(a), len(b)
    if min(na, nb) < 2:
        return Difference(mb - ma, float("nan"), float("nan"), float("nan"), False, min(na, nb), None)
    qa, qb = va / na, vb / nb
    se = math.sqrt(qa + qb)
    df = (qa + qb) ** 2 / (qa ** 2 / (na - 1) + qb ** 2 / (nb - 1)) if se > 0 else float(na + nb - 2)
    return Difference(mb - ma, sps.t.ppf(0.975, df) * se, _p(mb - ma, se, df), df, False, min(na, nb),
                      seeds_for_power(mb - ma, math.sqrt((va + vb) / 2), paired=False))


def _p(diff: float, se: float, df: float) -> float:
    if se == 0:
        return 0.0 if diff != 0 else 1.0
    return float(2 * sps.t.sf(abs(diff / se), df))


def seeds_for_power(diff: float, sd: float, paired: bool, power: float = 0.8, alpha: float = 0.05,
                    limit: int = 1000) -> int | None:
    """Smallest n (pairs, or runs per arm) at which a two-sided t-test at `alpha` detects a true
    difference `diff` with probability `power`, given the standard deviation `sd` (of the paired
    differences, or pooled); from the noncentral t distribution."""
    if diff == 0 or not sd > 0:
        return None
    for n in range(2, limit + 1):
        df = n - 1 if paired else 2 * n - 2
        nc = abs(diff) / sd * (math.sqrt(n) if paired else math.sqrt(n / 2))
        crit = sps.t.ppf(1 - alpha / 2, df)
        if sps.nct.sf(crit, df, nc) + sps.nct.cdf(-crit, df, nc) >= power:
            return n
    return limit


def compare(a: list[tuple], b: list[tuple]) -> Difference:
    """b - a where `a` and `b` hold (seed, value) per run; paired when both hold the same seeds, once each."""
    sa, sb = dict(a), dict(b)
    if len(sa) == len(a) and len(sb) == len(b) and set(sa) == set(sb):
        seeds = sorted(sa)
        return paired([sa[s] for s in seeds], [sb[s] for s in seeds])
    return welch([v for _, v in a], [v for _, v in b])
