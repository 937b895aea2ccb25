"""Coupled against uncoupled arms on the graded SmolLM2 testbed: how much `rollout.coupled=true`
shrinks the paired spread between two arms that differ in one mechanism (advantage=grpo against
advantage=dr_grpo) at the same seeds. Not a study of a variant: a measurement of the instrument.

    python experiments/coupled_arms_smollm2/measure.py run --jobs 2   # 4 conditions x SEEDS, resumable
    python experiments/coupled_arms_smollm2/measure.py analyse        # results/ -> results/analysis.json

Each run is `python -m rlkit.train` on one thread (the studies' setting), its metrics and samples
kept gzipped under results/<condition>/seed_<n>.*.jsonl.gz; `analyse` reads only those."""

from __future__ import annotations

import argparse
import gzip
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from scipy.stats import f as f_dist

from rlkit.analysis.stats import seeds_for_power

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TESTBED = ["+experiment=graded", "steps=20", "eval.every=10", "checkpoint.every=10", "samples_every=1"]
ARMS = {"grpo": ["advantage=grpo"], "dr_grpo": ["advantage=dr_grpo"]}
COUPLING = {"uncoupled": ["rollout.coupled=false"], "coupled": ["rollout.coupled=true"]}
SEEDS = range(5)
# the study primaries whose paired spread is measured: (metric, aggregate, smallest effect of interest)
PRIMARIES = [
    ("eval/accuracy", "final", 0.05),
    ("train/reward", "last:10", 0.05),
    ("train/len_incorrect", "last:10", 2.0),
]


def conditions() -> list[tuple[str, list[str]]]:
    return [(f"{a}_{c}", [*TESTBED, *ao, *co]) for c, co in COUPLING.items() for a, ao in ARMS.items()]


def kept(name: str, seed: int, what: str) -> Path:
    return RESULTS / name / f"seed_{seed}.{what}.jsonl.gz"


def launch(name: str, overrides: list[str], seed: int, runs: Path) -> tuple[subprocess.Popen, Path]:
    run_dir = runs / name / f"seed_{seed}"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "rlkit.train", *overrides, f"seed={seed}", "threads=1", f"hydra.run.dir={run_dir}"]
    log = open(f"{run_dir}.log", "a")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), run_dir


def keep(name: str, seed: int, run_dir: Path) -> None:
    for what in ("metrics", "samples"):
        target = kept(name, seed, what)
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(run_dir / f"{what}.jsonl", "rb") as src, gzip.GzipFile(target, "wb", mtime=0) as dst:
            shutil.copyfileobj(src, dst)


def run(jobs: int, runs: Path) -> None:
    """Every condition at every seed not kept yet, seed by seed, `jobs` at a time."""
    todo = [(n, o, s) for s in SEEDS for n, o in conditions() if not kept(n, s, "samples").exists()]
    for name, _, seed in [t for t in todo if (runs / t[0] / f"seed_{t[2]}" / "summary.json").exists()]:
        keep(name, seed, runs / name / f"seed_{seed}")  # finished before the last call could keep it
    todo = [(n, o, s) for n, o, s in todo if not kept(n, s, "samples").exists()]
    running: dict = {}
    while todo or running:
        while todo and len(running) < jobs:
            name, overrides, seed = todo.pop(0)
            proc, _ = launch(name, overrides, seed, runs)
            running[proc] = (name, seed)
        while (proc := next((p for p in running if p.poll() is not None), None)) is None:
            time.sleep(1)
        name, seed = running.pop(proc)
        run_dir = runs / name / f"seed_{seed}"
        if proc.returncode != 0:
            raise SystemExit(f"{name} seed {seed} failed (exit {proc.returncode}): see {run_dir}.log")
        keep(name, seed, run_dir)
        print(f"kept {name} seed {seed}", file=sys.stderr)


def lines(name: str, seed: int, what: str) -> list[dict]:
    """A kept file's records in step order, the last record of a step replacing earlier ones."""
    with gzip.open(kept(name, seed, what), "rt") as f:
        by_step = {row["step"]: row for row in map(json.loads, f)}
    return [by_step[n] for n in sorted(by_step)]


def value(rows: list[dict], metric: str, how: str) -> float:
    """A run's one number: `final` (the last logged value) or `last:K` (the mean of the last K)."""
    series = [r[metric] for r in rows if isinstance(r.get(metric), (int, float))]
    k = 1 if how == "final" else int(how.split(":")[1])
    return statistics.fmean(series[-k:])


def spread(coupling: str, metric: str, how: str) -> dict:
    """dr_grpo - grpo at each seed, and the sd of those differences."""
    diffs = [
        value(lines(f"dr_grpo_{coupling}", s, "metrics"), metric, how)
        - value(lines(f"grpo_{coupling}", s, "metrics"), metric, how)
        for s in SEEDS
    ]
    return {"differences": diffs, "mean": statistics.fmean(diffs), "sd": statistics.stdev(diffs)}


def ratio_interval(ratio: float, n: int) -> list[float]:
    """A 95% interval for a ratio of two sds from n values each, by the F distribution (as if the
    two sets of differences were independent samples; they share seeds, so it is approximate)."""
    lo, hi = f_dist.ppf([0.975, 0.025], n - 1, n - 1)
    return [ratio / math.sqrt(lo), ratio / math.sqrt(hi)]


def curve_sd(coupling: str, metric: str = "train/reward") -> float:
    """The per-step difference curve's spread: the sd across seeds of each step's difference,
    averaged over steps 1-20."""
    per_step = []
    for s in SEEDS:
        a = {r["step"]: r.get(metric) for r in lines(f"grpo_{coupling}", s, "metrics")}
        b = {r["step"]: r.get(metric) for r in lines(f"dr_grpo_{coupling}", s, "metrics")}
        per_step.append({n: b[n] - a[n] for n in a if n in b and a[n] is not None and b[n] is not None})
    steps = sorted(set.intersection(*(set(d) for d in per_step)))
    return statistics.fmean(statistics.stdev(d[n] for d in per_step) for n in steps)


def shared(coupling: str) -> list[float]:
    """Per step, the share of logged completions (the first 2 of each group: 8 of 32) that the two
    arms generated identically, averaged over seeds."""
    share: dict[int, list[float]] = {}
    for s in SEEDS:
        a = {r["step"]: r["samples"] for r in lines(f"grpo_{coupling}", s, "samples")}
        b = {r["step"]: r["samples"] for r in lines(f"dr_grpo_{coupling}", s, "samples")}
        for n in sorted(set(a) & set(b)):
            same = [x["prompt"] == y["prompt"] and x["completion"] == y["completion"] for x, y in zip(a[n], b[n])]
            share.setdefault(n, []).append(sum(same) / len(same))
    return [statistics.fmean(share[n]) for n in sorted(share)]


def analyse() -> dict:
    out = {"seeds": list(SEEDS), "conditions": {n: o for n, o in conditions()}, "primaries": {}}
    for metric, how, delta in PRIMARIES:
        row = {c: spread(c, metric, how) for c in COUPLING}
        for c in COUPLING:
            row[c]["seeds_needed"] = seeds_for_power(delta, row[c]["sd"], True) if row[c]["sd"] > 0 else None
        u, k = row["uncoupled"]["sd"], row["coupled"]["sd"]
        row["sd_ratio"] = k / u if u > 0 else math.nan
        row["sd_ratio_95"] = ratio_interval(row["sd_ratio"], len(SEEDS))
        row["smallest_effect"] = delta
        out["primaries"][f"{how} {metric}"] = row
    out["curve_sd_train_reward"] = {c: curve_sd(c) for c in COUPLING}
    out["shared_completions_by_step"] = {c: shared(c) for c in COUPLING}
    (RESULTS / "analysis.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


def table(out: dict) -> str:
    """The README's table: per primary, the paired spread each way, their ratio and the seeds a
    paired t-test needs at the smallest effect (alpha 0.05, power 0.8)."""
    lines = [
        "| primary (dr_grpo - grpo) | smallest effect | sd uncoupled | sd coupled | ratio [95%] | seeds uncoupled"
        " | seeds coupled |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in out["primaries"].items():
        u, c = row["uncoupled"], row["coupled"]
        lines.append(
            f"| {name} | {row['smallest_effect']:g} | {u['sd']:.4f} | {c['sd']:.4f} | {row['sd_ratio']:.2f} "
            f"[{row['sd_ratio_95'][0]:.2f}, {row['sd_ratio_95'][1]:.2f}] | "
            f"{u['seeds_needed']} | {c['seeds_needed']} |"
        )
    curve = out["curve_sd_train_reward"]
    lines.append(
        f"| per-step train/reward difference (sd, mean over steps) | | {curve['uncoupled']:.4f} | "
        f"{curve['coupled']:.4f} | {curve['coupled'] / curve['uncoupled']:.2f} | | |"
    )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["run", "analyse"])
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--runs", type=Path, default=Path("outputs/coupled_arms_smollm2"))
    args = p.parse_args()
    if args.what == "run":
        run(args.jobs, args.runs)
    else:
        out = analyse()
        print(table(out))
        print(
            "shared completions by step:",
            {c: [round(x, 2) for x in v] for c, v in out["shared_completions_by_step"].items()},
        )


if __name__ == "__main__":
    main()
