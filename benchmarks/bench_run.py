"""One whole study run, timed phase by phase, of this checkout against a revision measured in the
same invocation: by default a graded-testbed run as the studies run it (SmolLM2 with LoRA rank 8,
20 steps, greedy held-out evaluation every 2 steps, one thread).

    python benchmarks/bench_run.py --against 0eb0d2e
    python benchmarks/bench_run.py --against 0eb0d2e --steps 6      # a shorter run, same phases

Each side is `python -m rlkit.train` in its own process, one after the other (REV from a temporary
git worktree), with the same config and seed. The table gives each side's wall time (process start
to exit), the sums of the steps' logged phases (`time/generate`, `time/score`, `time/logprob`,
`time/update`) and of the evaluations (`time/eval`, where the revision logs it), the rest of the
wall time (start-up, model build, checkpoints, and on a revision without `time/eval` its
evaluations), and the rate of each step phase in GFLOPS from the FLOPs of its matrix products
(`bench_step.flops`, with the run's mean completion length and `--prompt-tokens`) beside the
machine's fp32 matmul rate. Before the table it says whether both sides logged the same values at
the first evaluation (same weights: the same greedy tokens give the same accuracies and lengths) and
at how many steps all their logged training values agree (the sampled tokens equal), equal or within
1e-5 relative (the float rounding of a changed kernel). Time it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_step import fp32_rate, worktree  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STEP_PHASES = ("generate", "score", "logprob", "update")


def run_side(root: str | None, overrides: list[str], threads: int, log) -> dict:
    """One training run in its own process.  -> wall seconds, its metrics lines, its resolved config"""
    run_dir = tempfile.mkdtemp(prefix="bench_run-")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), WANDB_MODE="offline", WANDB_SILENT="true")
    if root is not None:
        env["PYTHONPATH"] = root
    cmd = [sys.executable, "-m", "rlkit.train", *overrides, f"threads={threads}", f"hydra.run.dir={run_dir}"]
    t = time.perf_counter()
    subprocess.run(cmd, env=env, stdout=log, stderr=log, check=True, cwd=root or REPO)
    wall = time.perf_counter() - t
    lines = [json.loads(x) for x in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    config = json.loads(Path(run_dir, "run.json").read_text())["config"]
    return {"wall": wall, "lines": lines, "config": config}


def phases(side: dict) -> dict:
    """Seconds by phase summed over the run, `eval` None where no evaluation logged its time."""
    lines = side["lines"]
    out = {k: sum(x.get(f"time/{k}", 0.0) for x in lines) for k in STEP_PHASES}
    timed = [x["time/eval"] for x in lines if "time/eval" in x]
    out["eval"] = sum(timed) if timed else None
    out["other"] = side["wall"] - sum(v for v in out.values() if v is not None)
    return out


def agreement(a: dict, b: dict, rel: float = 1e-5) -> tuple[bool, int, int]:
    """(the first evaluation's values agree, steps whose training values all agree, steps compared):
    equal, or numbers within `rel` of each other (relative; float rounding of a changed kernel)."""

    def close(x: dict, y: dict) -> bool:
        if x.keys() != y.keys():
            return False
        nums = [(u, v) for u, v in zip(x.values(), (y[k] for k in x)) if isinstance(u, float) and isinstance(v, float)]
        return all(abs(u - v) <= rel * max(1.0, abs(u)) for u, v in nums) and all(
            x[k] == y[k] for k in x if not isinstance(x[k], float)
        )

    def values(line: dict, prefix: str) -> dict:
        return {k: v for k, v in line.items() if k.startswith(prefix)}

    first = close(values(a["lines"][0], "eval/"), values(b["lines"][0], "eval/"))
    steps = [(x, y) for x, y in zip(a["lines"], b["lines"]) if "train/loss" in x and "train/loss" in y]
    same = sum(close(values(x, "train/"), values(y, "train/")) for x, y in steps)
    return first, same, len(steps)


def model_config(run_config: dict):
    """The transformers config of the run's model (from its run.json) where it is a pretrained one
    (a folder or a cached conversion), and whether it trains LoRA adapters; None for a model built
    from a config (no FLOP count here)."""
    from hydra.utils import instantiate
    from transformers import AutoConfig

    model = instantiate(run_config["model"], _recursive_=False)
    lora = bool(run_config["model"].get("lora_r"))
    return (AutoConfig.from_pretrained(model.source()), lora) if hasattr(model, "source") else None


def step_flops(side: dict, config, lora: bool, prompt_tokens: float) -> dict:
    """FLOPs of each step phase summed over the run (each step at its own mean completion length)."""
    from bench_step import flops

    total = dict.fromkeys(("generate", "logprob", "update"), 0.0)
    for x in side["lines"]:
        if "train/completion_len" in x:
            for k, v in flops(config, prompt_tokens, max(1, round(x["train/completion_len"])), lora).items():
                total[k] += v
    return total


def table(names: list[str], sides: list[dict], flops: dict | None) -> None:
    cols = (*STEP_PHASES, "eval", "other")
    print("| side | wall | " + " | ".join(cols) + " | GFLOPS (generate / logprob / update) |")
    print("|---|---|" + "---|" * len(cols) + "---|")
    for name, side in zip(names, sides):
        p = phases(side)
        cells = " | ".join("untimed" if p[k] is None else f"{p[k]:.1f}" for k in cols)
        rate = (
            "-"
            if flops is None
            else " / ".join(f"{flops[k] / p[k] / 1e9:.0f}" for k in ("generate", "logprob", "update"))
        )
        print(f"| {name} | {side['wall']:.1f} s | {cells} | {rate} |")
    if len(sides) == 2:
        print(f"\nwall time {names[0]} / {names[1]}: {sides[0]['wall'] / sides[1]['wall']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", help="a git revision to time after this checkout")
    ap.add_argument("--config", nargs="*", default=["+experiment=graded"], help="the run's config overrides")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=float, default=51.3, help="mean prompt length (graded testbed: 51.3)")
    a = ap.parse_args()
    overrides = [*a.config, f"steps={a.steps}", f"eval.every={a.eval_every}", f"seed={a.seed}"]
    root = worktree(a.against) if a.against else None
    log = tempfile.NamedTemporaryFile("w", prefix="bench_run-", suffix=".log", delete=False)
    print(f"{' '.join(overrides)}; runs' output in {log.name}; load average {open('/proc/loadavg').read().strip()}")
    try:
        names = ["this checkout"] + ([a.against] if root else [])
        sides = [run_side(r, overrides, a.threads, log) for r in [None] + ([root] if root else [])]
    finally:
        if root:
            subprocess.run(["git", "worktree", "remove", "--force", root], check=False, cwd=REPO)
    if len(sides) == 2:
        first, same, n = agreement(*sides)
        print(f"first evaluation's values agree: {first}; steps with every training value agreeing: {same} of {n}")
    described = model_config(sides[0]["config"])
    flops = None if described is None else step_flops(sides[0], *described, a.prompt_tokens)
    table(names, sides, flops)
    print(f"fp32 matmul [1536, 576] x [576, 1536] on this machine: {fp32_rate():.0f} GFLOPS at 2 threads")
    print(f"load average after: {open('/proc/loadavg').read().strip()}")


if __name__ == "__main__":
    main()
