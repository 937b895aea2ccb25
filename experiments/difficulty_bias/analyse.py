"""Loss-weight share and sampled accuracy per difficulty, grpo against dr_grpo paired by seed: at
step 1, where both arms of a seed score the very same rollout (the estimator's effect alone), and
averaged over all steps of each run (the per-step shares are too noisy at 8 prompts a step for a
final-value comparison).

    python experiments/difficulty_bias/analyse.py multirun/.../difficulty_bias
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

from rlkit.stats import compare


def per_run(root: Path, only_step: int | None = None) -> dict:
    """advantage -> seed -> {metric: mean over steps} (or its value at `only_step`)"""
    out = defaultdict(dict)
    for info in sorted(root.rglob("run.json")):
        meta = json.loads(info.read_text())
        rows = [json.loads(l) for l in (info.parent / "metrics.jsonl").read_text().splitlines()]
        sums, counts = defaultdict(float), defaultdict(int)
        for r in rows if only_step is None else [r for r in rows if r["step"] == only_step]:
            for k, v in r.items():
                if k.startswith(("weight/share_d", "train/acc_d")):
                    sums[k] += v
                    counts[k] += 1
        out[meta["choices"]["advantage"]][meta["config"]["seed"]] = {k: sums[k] / counts[k] for k in sums}
    return out


def table(runs: dict, title: str) -> None:
    keys = sorted(
        {k for seeds in runs.values() for m in seeds.values() for k in m},
        key=lambda k: (k.split("_d")[0], int(k.split("_d")[1])),
    )
    print(f"| {title} | dr_grpo | grpo | grpo - dr_grpo (95% CI, paired by seed) |")
    print("|---|---|---|---|")
    for k in keys:
        a = [(s, m[k]) for s, m in runs["dr_grpo"].items() if k in m]
        b = [(s, m[k]) for s, m in runs["grpo"].items() if k in m]
        if len(a) < 2:
            continue
        d = compare(a, b)
        mean = lambda xs: sum(v for _, v in xs) / len(xs)  # noqa: E731
        print(f"| {k} | {mean(a):.3f} | {mean(b):.3f} | {d.diff:+.3f} ± {d.half_ci:.3f}, p = {d.p:.2g} |")


def main(root: str) -> None:
    table(per_run(Path(root), only_step=1), "step 1 (the same rollout in both arms)")
    print()
    table(per_run(Path(root)), "mean over the steps of each run")


if __name__ == "__main__":
    main(sys.argv[1])
