"""The tables of experiments/smollm2_sums/README.md, from the kept metrics alone:

    python experiments/smollm2_sums/table.py

Each run's `metrics.jsonl` is kept as runs/<arm>_seed<k>.jsonl (`--save RUN_DIR ARM SEED` copies one)."""

from __future__ import annotations

import json
import shutil
import statistics
import sys
from pathlib import Path

RUNS = Path(__file__).resolve().parent / "runs"


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def accuracy(path: Path) -> tuple[float, float]:
    """Held-out greedy accuracy before RL (step 0) and after the last step."""
    evals = [r for r in rows(path) if "eval/accuracy" in r]
    return evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]


def made_of() -> str:
    """What the gain is made of, per run: the share of sampled completions that hit the 24-token
    budget at the first and last step, and the held-out right answers' mean length before and after."""
    lines = [
        "| arm | seed | budget hit, step 1 | last step | right answers' tokens before | after |",
        "|---|---|---|---|---|---|",
    ]
    for path in sorted(RUNS.glob("*.jsonl")):
        arm, seed = path.stem.rsplit("_seed", 1)
        train = [r for r in rows(path) if "train/truncated_frac" in r]
        evals = [r for r in rows(path) if r.get("eval/len_correct") is not None]
        hit = f"{train[0]['train/truncated_frac']:.2f} | {train[-1]['train/truncated_frac']:.2f}"
        lines.append(
            f"| {arm} | {seed} | {hit} | {evals[0]['eval/len_correct']:.1f} | {evals[-1]['eval/len_correct']:.1f} |"
        )
    return "\n".join(lines)


def table() -> str:
    lines = ["| arm | seed | held-out accuracy before | after | gain |", "|---|---|---|---|---|"]
    gains: dict[str, list[float]] = {}
    for path in sorted(RUNS.glob("*.jsonl")):
        arm, seed = path.stem.rsplit("_seed", 1)
        before, after = accuracy(path)
        gains.setdefault(arm, []).append(after - before)
        lines.append(f"| {arm} | {seed} | {before:.3f} | {after:.3f} | {after - before:+.3f} |")
    for arm, g in gains.items():
        spread = f" (sd {statistics.stdev(g):.3f})" if len(g) > 1 else ""
        lines.append(f"| {arm}: mean gain over {len(g)} seed(s) | | | | {statistics.mean(g):+.3f}{spread} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--save"]:
        run_dir, arm, seed = sys.argv[2:5]
        RUNS.mkdir(exist_ok=True)
        shutil.copy(Path(run_dir) / "metrics.jsonl", RUNS / f"{arm}_seed{seed}.jsonl")
    print(table())
    print()
    print(made_of())
