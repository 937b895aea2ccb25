"""Average loss-weight share and sampled accuracy per difficulty over all steps of each run, and the
paired grpo - dr_grpo difference per difficulty (the per-step shares are too noisy at 8 prompts a
step for a final-value comparison).

    python experiments/difficulty_bias/analyse.py multirun/.../difficulty_bias
"""
import json
import sys
from collections import defaultdict
from pathlib import Path

from rlkit.stats import compare


def per_run(root: Path) -> dict:
    """advantage -> seed -> {metric: mean over steps}"""
    out = defaultdict(dict)
    for info in sorted(root.rglob("run.json")):
        meta = json.loads(info.read_text())
        rows = [json.loads(l) for l in (info.parent / "metrics.jsonl").read_text().splitlines()]
        sums, counts = defaultdict(float), defaultdict(int)
        for r in rows:
            for k, v in r.items():
                if k.startswith(("weight/share_d", "train/acc_d")):
                    sums[k] += v
                    counts[k] += 1
        out[meta["choices"]["advantage"]][meta["config"]["seed"]] = {k: sums[k] / counts[k] for k in sums}
    return out


def main(root: str) -> None:
    runs = per_run(Path(root))
    keys = sorted({k for seeds in runs.values() for m in seeds.values() for k in m},
                  key=lambda k: (k.split("_d")[0], int(k.split("_d")[1])))
    print("| metric (mean over steps) | dr_grpo | grpo | grpo - dr_grpo (95% CI, paired by seed) |")
    print("|---|---|---|---|")
    for k in keys:
        a = [(s, m[k]) for s, m in runs["dr_grpo"].items() if k in m]
        b = [(s, m[k]) for s, m in runs["grpo"].items() if k in m]
        d = compare(a, b)
        mean = lambda xs: sum(v for _, v in xs) / len(xs)  # noqa: E731
        print(f"| {k} | {mean(a):.3f} | {mean(b):.3f} | {d.diff:+.3f} ± {d.half_ci:.3f}, p = {d.p:.2g} |")


if __name__ == "__main__":
    main(sys.argv[1])
