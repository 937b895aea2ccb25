"""Anytime-valid inference for sequential studies (`sequential:` in a study file): a look after every
completed seed, each decision valid at whatever seed the study stops.

The statistic is the scale-invariant Gaussian-mixture e-value of the one-sample t-test (the
intercept-only case of Lindon, Ham, Tingley and Bojinov 2024, "Anytime-valid linear models and
regression adjusted causal inference", arXiv 2210.08589; the `savvi` package's LinearRegression,
which the tests check it against): for n paired differences with mean m_n, standard error se_n,
nu = n - 2 degrees of freedom and r = phi / (phi + n),

    E_n(mu) = sqrt(r) * ((1 + t^2 / nu) / (1 + r t^2 / nu)) ** ((nu + 1) / 2),   t = (m_n - mu) / se_n

is an e-process under "the mean difference is mu" (Gaussian differences, any variance), so by
Ville's inequality P(some n has E_n(mu) >= 1/alpha) <= alpha. Inverting it at every mu gives a
confidence sequence, kept as the running intersection of the looks' intervals; the anytime-valid
p-value of mu is the running minimum of 1/E_n(mu). Equivalence within +-margin is shown when the
sequence lies inside the margin: its p-value, 1 / min(E_n(-margin), E_n(margin)) while m_n is
inside, is valid because E_n rises with |m_n - mu| (a true mean beyond the margin is further from m_n
than the margin is). `phi` is the prior's precision on the standardised effect: 1 puts the mixture's
weight on effects about one standard deviation of the differences in size."""

from __future__ import annotations

import math
from dataclasses import dataclass

FIRST_LOOK = 3  # nu = n - 2 needs at least 3 pairs


def log_e(d: list[float], mu: float, phi: float = 1.0) -> float:
    """log E_n(mu) over the differences `d` (0 before the first look: no evidence yet). Without any
    spread the t statistic's limit: infinite evidence against every mu but the mean, none for it."""
    n = len(d)
    if n < FIRST_LOOK:
        return 0.0
    mean = sum(d) / n
    sse = sum((x - mean) ** 2 for x in d)
    if sse == 0:
        return 0.0 if mean == mu else math.inf
    nu, se2 = n - 2, sse / (n - 1) / n
    t2, r = (mean - mu) ** 2 / se2, phi / (phi + n)
    return 0.5 * math.log(r) + 0.5 * (nu + 1) * (math.log1p(t2 / nu) - math.log1p(r * t2 / nu))


def first_decisive(alpha: float, phi: float = 1.0, most: int = 10_000) -> int | None:
    """The fewest pairs at which any differences can reject at `alpha`: E_n rises with |t| towards
    r^(-nu/2) = (1 + n / phi)^((n - 2) / 2), so no look before this n rejects however large the effect
    (at phi 1 and alpha 0.05: 6 pairs; at phi 0.25: 5). None if not within `most` pairs."""
    for n in range(FIRST_LOOK, most + 1):
        if 0.5 * (n - 2) * math.log1p(n / phi) >= -math.log(alpha):
            return n
    return None


def radius(d: list[float], alpha: float, phi: float = 1.0) -> float:
    """Half-width of {mu : E_n(mu) < 1/alpha} around the mean of `d` (inf before the first look; 0
    without spread, as `log_e` has it)."""
    n = len(d)
    if n < FIRST_LOOK:
        return math.inf
    mean = sum(d) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n)
    if se == 0:
        return 0.0
    nu, r = n - 2, phi / (phi + n)
    c = (r * alpha**2) ** (1 / (nu + 1))
    return se * math.sqrt(nu * (1 - c) / (c - r)) if c > r else math.inf


@dataclass(frozen=True)
class Sequence:
    """The state after the last look at differences in seed order: the mean, the running
    intersection of the confidence intervals, and the anytime-valid p-values of no difference and of
    a difference outside +-margin (nan without a margin)."""

    n: int
    mean: float
    interval: tuple[float, float]
    p: float
    p_inside: float
    alpha: float
    p_outside: float = math.nan  # anytime-valid p of "inside +-margin": evidence of a difference beyond it

    def describe(self) -> str:
        lo, hi = self.interval
        if self.n < FIRST_LOOK:
            return f"{self.mean:+.3f} (n = {self.n}: the first look needs {FIRST_LOOK} pairs)"
        return (
            f"{self.mean:+.3f}, {1 - self.alpha:.0%} confidence sequence [{lo:+.3f}, {hi:+.3f}], "
            f"anytime-valid p = {self.p:.2g} (n = {self.n})"
        )


def track(d: list[float], alpha: float, phi: float = 1.0, margin: float | None = None) -> Sequence:
    """Look after each of the differences `d` (in seed order) and return the state after the last."""
    lo, hi, p, p_inside, p_outside = -math.inf, math.inf, 1.0, 1.0, 1.0
    for n in range(FIRST_LOOK, len(d) + 1):
        seen = d[:n]
        mean, half = sum(seen) / n, radius(seen, alpha, phi)
        lo, hi = max(lo, mean - half), min(hi, mean + half)
        p = min(p, math.exp(-log_e(seen, 0.0, phi)))
        if margin is not None and abs(mean) != margin:  # the least evidence against the side the mean is not on
            p_margin = math.exp(-min(log_e(seen, -margin, phi), log_e(seen, margin, phi)))
            if abs(mean) < margin:
                p_inside = min(p_inside, p_margin)
            else:
                p_outside = min(p_outside, p_margin)
    mean = sum(d) / len(d) if d else math.nan
    if margin is None:
        p_inside = p_outside = math.nan
    return Sequence(len(d), mean, (lo, hi), p, p_inside, alpha, p_outside)
