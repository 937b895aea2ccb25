"""How rlkit's GRPO step scales: step time and phase split against the group size G, the token
budget and the model size (the testbed's Qwen2 architecture, random weights, fp32).

By default rollouts are fixed length (EOS suppressed), so every row generates exactly `budget`
tokens and the cost should grow linearly in G and in the budget; `--natural` lets rows stop at
EOS. Settings otherwise as in `bench_vs_trl.py` (beta 0.04, one update per rollout).

    python benchmarks/bench_scaling.py [--sizes 1m 10m 50m] [--groups 4 8 16 32] [--budgets 16 64 256]
                                       [--prompts 4] [--steps 3] [--natural]

Prints one markdown row per configuration: the G sweep at the middle budget and the budget
sweep at G = 8, for each size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from bench_vs_trl import SIZES, rlkit_state

from rlkit.loop import collect, prepare_and_update

SIZES = {
    **SIZES,
    "50m": [
        "model.hidden_size=512",
        "model.num_layers=12",
        "model.num_heads=8",
        "model.num_kv_heads=4",
        "model.intermediate_size=2048",
    ],
}
PHASES = ("generate", "logprob", "update")


def measure(size: str, group: int, budget: int, prompts: int, steps: int, natural: bool, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        state = rlkit_state(
            [*SIZES[size], f"threads={threads}", "+model.max_position_embeddings=512"],
            os.path.join(tmp, "run"),
            prompts,
            group,
            budget,
            fixed=not natural,
        )
        times, splits, tokens = [], [], []
        for _ in range(steps + 1):  # the first step is a warm-up
            state.runtime.timer.clear()
            t0 = time.perf_counter()
            rollout, _ = collect(state)
            prepare_and_update(state, rollout)
            times.append(time.perf_counter() - t0)
            splits.append(dict(state.runtime.timer))
            tokens.append(int(rollout.completion_mask.sum()))
        params = sum(p.numel() for p in state.parts.policy.parameters())
    step = statistics.median(times[1:])
    split = {k: statistics.median(s.get(k, 0.0) for s in splits[1:]) / step for k in PHASES}
    return {
        "size": size,
        "params": params,
        "G": group,
        "budget": budget,
        "rows": prompts * group,
        "tokens": statistics.mean(tokens[1:]),
        "step": step,
        "split": split,
    }


def row(r: dict) -> str:
    split = " | ".join(f"{r['split'][k]:.0%}" for k in PHASES)
    per_k = r["step"] / r["tokens"] * 1000
    return (
        f"| {r['size']} ({r['params'] / 1e6:.1f}M) | {r['G']} | {r['budget']} | {r['rows']} | {r['tokens']:.0f} | "
        f"{r['step']:.2f} | {split} | {per_k:.2f} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["1m", "10m", "50m"], choices=sorted(SIZES))
    p.add_argument("--groups", nargs="+", type=int, default=[4, 8, 16, 32])
    p.add_argument("--budgets", nargs="+", type=int, default=[16, 64, 256])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--natural", action="store_true", help="rows stop at EOS instead of a fixed length")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    with open("/proc/loadavg") as f:
        print(
            f"load average before: {' '.join(f.read().split()[:3])}; threads {a.threads}; "
            f"{'natural' if a.natural else 'fixed'} length; {a.prompts} prompts per step"
        )
    print(
        "| model | G | budget | rows | generated tokens/step | step (s) | generate | logprob | update "
        "| s per 1k tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    middle = sorted(a.budgets)[len(a.budgets) // 2]
    for size in a.sizes:
        configs = [(g, middle) for g in a.groups] + [(8, b) for b in a.budgets if b != middle]
        for group, budget in configs:
            print(row(measure(size, group, budget, a.prompts, a.steps, a.natural, a.threads)), flush=True)


if __name__ == "__main__":
    main()
