"""Simulated studies for the sequential design (rlkit.analysis.sequential): Gaussian paired
differences, a look after every seed from 3 to 50, alpha 0.05. Prints the rejection rates under the
null (anytime-valid against a t-test that peeks at every look) and, at true effects of the smallest
size, the sequential study's stopping seed (mean, 90th percentile) beside the fixed design's n:
planned by rlkit from a 3-seed pilot (its sd raised to the 80% upper limit, power 0.8, cap 50), and
the n it would need with the true sd known.

    python experiments/sequential_designs/simulate.py          # the table in this folder's README
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats as sps

from rlkit.analysis import stats
from rlkit.analysis.sequential import log_e

ALPHA, LOOKS = 0.05, 50


def first_rejection(d: list[float], phi: float = 1.0) -> int | None:
    """The first look (pairs) at which the anytime-valid p of no difference falls under alpha."""
    return next((n for n in range(3, len(d) + 1) if log_e(d[:n], 0.0, phi) >= math.log(1 / ALPHA)), None)


def peeking_t_rejects(d: np.ndarray) -> bool:
    """A fixed-n paired t-test applied at every look from 3 pairs: rejects if any look has p < alpha."""
    n = np.arange(1, len(d) + 1)
    m = np.cumsum(d) / n
    var = (np.cumsum(d**2) - n * m**2) / np.maximum(n - 1, 1)
    t = m[2:] / np.sqrt(var[2:] / n[2:])
    return bool((2 * sps.t.sf(np.abs(t), n[2:] - 1) < ALPHA).any())


def fixed_n_as_planned(rng, effect: float) -> int:
    """The seeds rlkit's fixed design plans for a smallest effect of `effect` sd: a 3-seed pilot's sd
    raised to its 80% upper confidence limit, then the t-test's n at power 0.8, up to a cap of 50."""
    pilot = rng.normal(effect, 1.0, 3)
    sd = stats.inflated_sd(float(np.std(pilot, ddof=1)), 3, 0.8)
    return min(LOOKS, stats.seeds_for_power(effect, sd, True, 0.8, ALPHA))


def stopping(effect: float, studies: int, seed: int) -> tuple[np.ndarray, float, np.ndarray]:
    """(each study's stopping seed, the share that rejected, the fixed design's planned n per study)."""
    rng = np.random.default_rng(seed)
    stops = [first_rejection(list(map(float, rng.normal(effect, 1.0, LOOKS)))) for _ in range(studies)]
    planned = np.array([fixed_n_as_planned(rng, effect) for _ in range(studies)])
    return np.array([s or LOOKS for s in stops]), float(np.mean([s is not None for s in stops])), planned


def main() -> None:
    sims = np.random.default_rng(0).normal(0.0, 1.0, (2000, LOOKS))
    seq = np.mean([first_rejection(list(map(float, d))) is not None for d in sims])
    peek = np.mean([peeking_t_rejects(d) for d in sims])
    print(f"null, 2000 studies, looks at 3..{LOOKS} seeds: anytime-valid rejects {seq:.4f}, peeking t-test {peek:.4f}")
    print("| effect (sd) | sequential: rejects | mean stop | 90th pct | fixed, planned: mean n | known sd: n |")
    print("|---|---|---|---|---|---|")
    for effect in (0.5, 0.8, 1.0, 1.5):
        n_stop, power, planned = stopping(effect, 500, 1)
        oracle = stats.seeds_for_power(effect, 1.0, True, 0.8, ALPHA)
        print(
            f"| {effect:g} | {power:.3f} | {n_stop.mean():.1f} | {np.percentile(n_stop, 90):.0f} | "
            f"{planned.mean():.1f} | {oracle} |"
        )


if __name__ == "__main__":
    main()
