"""Is the shuffled control's loss of accuracy a random walk of the weights? Adds isotropic Gaussian
noise of scale sigma to every weight of a warm start and evaluates it on the first 256 held-out
prompts (greedy, and 2 samples per prompt at temperature 1). An RL step of Adam moves each weight
by about lr; the W30 probes' shuffled control moved its weights 2.0e-4 RMS in 400 steps at lr 1e-5.

    python experiments/study_testbed/perturb.py [OVERRIDES...]   # default: the W30 probes' warm start
    python experiments/study_testbed/perturb.py --moved RUN_DIR...  # how far each run moved its weights

`--moved` compares a run's last checkpoint with the warm start it began from (RMS and largest
change over every weight), to set the sigmas above beside what RL actually did.
"""

import json
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_module

from rlkit.evaluate import evaluate
from rlkit.setup import setup

W30 = ["task.worked_fraction=0.3", "warm_start.steps=1000", "rollout.max_new_tokens=96"]
KEYS = ("eval/accuracy", "eval/acc_hard", "eval/mean@2", "eval/mean@2_hard")


def main(overrides: list[str]) -> None:
    torch.set_num_threads(1)
    with initialize_config_module(config_module="rlkit.conf", version_base=None):
        cfg = compose(
            config_name="config",
            overrides=[
                "+experiment=wide_testbed",
                "logger=jsonl",
                "threads=1",
                "eval.every=0",
                "checkpoint.every=0",
                *(overrides or W30),
            ],
        )
    parts = setup(cfg, "outputs/perturb", {}).parts
    parts.task.eval = parts.task.eval.select(range(256))
    base = {k: v.clone() for k, v in parts.policy.named_parameters()}
    print("| sigma | " + " | ".join(KEYS) + " |\n" + "|---" * (len(KEYS) + 1) + "|")
    for sigma in (0.0, 1e-4, 3e-4, 1e-3, 3e-3):
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for k, p in parts.policy.named_parameters():
                p.copy_(base[k] + sigma * torch.randn(p.shape, generator=g))
        parts.engine.load_weights(parts.policy)
        r = evaluate(parts.engine, parts.tokenizer, parts.task, 256, cfg.rollout.max_new_tokens, samples=2)
        print(f"| {sigma:g} | " + " | ".join(f"{r[k]:.3f}" for k in KEYS) + " |", flush=True)


def moved(run_dir: Path) -> str:
    from safetensors.torch import load_file

    start = torch.load(
        Path(json.loads((run_dir / "run.json").read_text())["warm_start"]["cache"]) / "weights.pt", weights_only=True
    )
    last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    end = load_file(str(last / "policy" / "model.safetensors"))
    d = torch.cat([(end[k] - start[k]).flatten() for k in end])  # [weights]
    return f"| {run_dir.name} | {last.name} | {d.pow(2).mean().sqrt():.2e} | {d.abs().max():.2e} |"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--moved"]:
        print("| run | checkpoint | RMS change | largest change |\n|---|---|---|---|")
        print("\n".join(moved(Path(d)) for d in sys.argv[2:]))
    else:
        main(sys.argv[1:])
