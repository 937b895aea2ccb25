"""How much a denser held-out evaluation narrows the positive control's paired spread, measured on
the same runs: the control (`double_batch`, twice the groups a step) against `uniform` on the
study's config, evaluated every 2 steps with 4 samples a question (`eval.every=2 eval.samples=4`).
Each run's area is taken twice, over all 11 evaluations and over the study's own 3 (steps 0, 10,
20), for greedy accuracy and for sampled accuracy (mean@4, one fixed sampling seed for every
evaluation of every run); then the seeds a paired t-test needs for 80% power at alpha 0.05, at the
study's smallest effect (0.02) and at the observed difference.

    python experiments/dynamic_sampling_smollm2/calibration/dense_eval.py

A calibration for a next declaration, not a study: it tests no claim."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from rlkit.analysis.runs import aggregate, from_rows
from rlkit.analysis.stats import paired, seeds_for_power

HERE = Path(__file__).parent
ARMS, SEEDS, SPARSE, SMALLEST = ("uniform", "double_batch"), (0, 1, 2), {0, 10, 20}, 0.02
METRICS = {"eval/accuracy": "greedy accuracy", "eval/mean@4": "sampled accuracy (mean@4)"}


def area(arm: str, seed: int, metric: str, steps: set | None) -> float:
    """The run's area (mean over its evaluations) of `metric`, over `steps` only when given."""
    with gzip.open(HERE / f"{arm}_seed{seed}.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    if steps is not None:  # the evaluations the study's eval.every=10 would have made
        rows = [{k: v for k, v in r.items() if not k.startswith("eval/") or r["step"] in steps} for r in rows]
    return aggregate(from_rows(f"{arm}_seed{seed}", {}, rows), metric, "auc")


def table() -> str:
    """The calibration's table, as the study's README shows it."""
    lines = [
        "| metric | evaluations | uniform | double_batch | double_batch - uniform (sd of pairs) | d_z | p |"
        f" seeds for {SMALLEST} | seeds for the observed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for metric, label in METRICS.items():
        for name, steps in (("every 2 steps (11)", None), ("steps 0, 10, 20 (3)", SPARSE)):
            a, b = ([area(arm, s, metric, steps) for s in SEEDS] for arm in ARMS)
            d = paired(a, b)
            cells = [f"{sum(x) / len(x):.3f}" for x in (a, b)]
            cells += [f"{d.diff:+.3f} ({d.sd:.3f})", f"{d.diff / d.sd:+.2f}", f"{d.p:.2g}"]
            cells += [str(seeds_for_power(SMALLEST, d.sd, True)), str(seeds_for_power(d.diff, d.sd, True))]
            lines.append(f"| {label} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
