"""Same numbers before and after a refactor: train a set of configurations for a few steps on the
tiny testbed and write every logged metric (timing keys left out) to one JSON file; run it on two
checkouts and compare the files (`--compare A B` prints the keys that differ; exit 1 if any).

    python benchmarks/equivalence.py --out before.json      # on the old checkout
    python benchmarks/equivalence.py --out after.json       # on the new one
    python benchmarks/equivalence.py --compare before.json after.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

CONFIGS = {  # name -> overrides over the tiny FAST sizes; together they reach every phase and most components
    "grpo": [],
    "dr_grpo": ["algo=dr_grpo"],
    "rloo": ["algo=rloo"],
    "dapo": ["algo=dapo"],
    "ppo_gae": ["algo=ppo"],
    "luspo": ["algo=luspo"],
    "token_mean": ["aggregator=token_mean"],
    "token_sum_norm": ["aggregator=seq_mean_token_sum_norm"],
    "cispo": ["loss=cispo"],
    "gspo": ["loss=gspo"],
    "sapo": ["loss=sapo"],
    "clip_cov": ["loss=clip_cov"],
    "off_policy_seq_mis": ["correction=seq_mis", "engine=off_policy", "engine.staleness=1", "optim.mini_batches=2"],
    "epochs_minibatches": ["optim.epochs=2", "optim.mini_batches=2", "loss.beta=0.04"],
    "shared_prefix_kl_reward": ["optim.share_prefix=always", "loss.kl_placement=reward", "loss.beta=0.04"],
    "top_entropy_dual_clip": ["loss.top_entropy_quantile=0.5", "loss.dual_clip=3.0", "rewards=length_bonus"],
    "process_overlong": ["advantage=process", "reward.overlong_cache=4"],
    "ppo_micro_batches": ["algo=ppo", "optim.micro_batch_size=3", "optim.mini_batches=2"],
}
FAST = [
    "steps=3", "threads=1", "logger=jsonl", "rollout.prompts_per_step=4", "rollout.group_size=4",
    "rollout.max_new_tokens=12", "model.hidden_size=64", "model.num_layers=1", "model.num_heads=2",
    "model.num_kv_heads=1", "model.intermediate_size=64", "task.n_train=64", "task.n_eval=8", "task.max_terms=2",
    "warm_start.steps=150", "warm_start.batch_size=32", "warm_start.lr=5e-3", "eval.every=1", "checkpoint.every=0",
]  # fmt: skip


def measure(out: Path) -> None:
    from hydra import compose, initialize_config_module

    from rlkit.session import run

    results, work = {}, Path(tempfile.mkdtemp())
    for name, overrides in CONFIGS.items():
        with initialize_config_module(config_module="rlkit.conf", version_base=None):
            cfg = compose(config_name="config", overrides=[*FAST, f"warm_start.cache_dir={work / 'cache'}", *overrides])
        run(cfg, str(work / name))
        rows = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
        results[name] = [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]
        print(f"{name}: {len(rows)} rows", file=sys.stderr)
    out.write_text(json.dumps(results, indent=1, sort_keys=True))


def compare(a: Path, b: Path) -> int:
    before, after = json.loads(a.read_text()), json.loads(b.read_text())
    differ = [
        f"{name} step {i}: {k} {x.get(k)!r} -> {y.get(k)!r}"
        for name in sorted(set(before) | set(after))
        for i, (x, y) in enumerate(zip(before.get(name, []), after.get(name, [])))
        for k in sorted(set(x) | set(y))
        if x.get(k) != y.get(k)
    ]
    differ += [
        f"{n}: rows {len(before.get(n, []))} -> {len(after.get(n, []))}"
        for n in before
        if len(before.get(n, [])) != len(after.get(n, []))
    ]
    print("\n".join(differ) or f"identical: {len(before)} configurations, every metric of every step")
    return 1 if differ else 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--compare", nargs=2, type=Path)
    args = p.parse_args()
    sys.exit(compare(*args.compare) if args.compare else measure(args.out))
