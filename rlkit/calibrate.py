"""`rlkit-calibrate` (and `python -m rlkit.calibrate`): what a starting policy can do on a task,
measured before a study is declared, so that its premises cite numbers. It builds the run's task
and model from the same config overrides as `rlkit-train` (warm start included), samples n
completions per prompt at the rollout's temperature and budget, and reports per difficulty level:
pass@1 and pass@k (unbiased), greedy accuracy, the share of groups of the rollout's size G that
carry no reward signal (all right or all wrong), the share of completions that hit the budget, the
lengths of right and wrong answers, and how often the right answer is present (the task's lenient
`present` score) but not where the reward reads it; with a multi-turn environment each sample is an
episode and the environment's metrics of them come too (the calculator's `tool_use`, `tool_errors`,
...). Writes nothing but the `--out` file.

    rlkit-calibrate +experiment=graded --samples 32 --out experiments/graded/calibration.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_module
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from rlkit import atomic
from rlkit.components import Engine
from rlkit.config import build, check_values, eval_seed
from rlkit.evaluate import Sampling, answers, pass_at_k, presence, sampled_answers
from rlkit.metrics import difficulties
from rlkit.metrics import mean_or_none as mean
from rlkit.refusals import ConfigError
from rlkit.setup import build_task_and_model, check_episodes, checked_environment, seed_everything
from rlkit.tasks.base import TaskError


def level_stats(task, n: int, group: int, budget: int, sampled, greedy, present: torch.Tensor) -> dict:
    """The calibration of E prompts from n samples each (`sampled`, E * n rows, each prompt's n
    together), their greedy answers and whether each sample holds the right answer (`present`,
    [E * n]); the task's own features (e.g. `formatted`) as their mean over the samples."""
    right = sampled.correct.view(-1, n)  # [E, n]
    c = right.sum(-1)  # [E] right samples per prompt
    ks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64, 128, n) if k <= n})
    # a group of G carries no signal when all G are right or all G are wrong: unbiased, as pass@k
    silent = (1 - pass_at_k(n, c, group)) + (1 - pass_at_k(n, n - c, group)) if group <= n else None  # [E]
    ok, ended = sampled.correct, sampled.correct & ~sampled.truncated  # [E * n]
    return {
        "prompts": len(c),
        "greedy_accuracy": mean(greedy.correct.float()),
        **{f"pass@{k}": mean(pass_at_k(n, c, k)) for k in ks},
        f"no_signal@{group}": mean(silent) if silent is not None else None,
        "solved_never": mean((c == 0).float()),
        "budget_hit": mean(sampled.truncated.float()),
        "len_correct": mean(sampled.lengths[ok]),
        "len_incorrect": mean(sampled.lengths[~ok]),
        "len_correct_max": float(sampled.lengths[ended].max()) if ended.any() else None,  # of those that ended
        "present": mean(present),
        "present_not_read": mean((present.bool() & ~ok).float()),
        **features(task, sampled.texts),
        "budget": budget,
    }


def features(task, texts: list[str]) -> dict:
    """The mean of each of the task's own features over `texts` ({} for a task without features)."""
    if task.features is None or not texts:
        return {}
    feats = [task.features(t) for t in texts]
    return {name: mean(torch.tensor([float(f[name]) for f in feats])) for name in feats[0]}


def calibrate(cfg: DictConfig, split: str, n: int, prompts: int) -> dict:
    """The starting policy's calibration on `split` (its first `prompts` rows; 0: all), overall and
    per difficulty level ("all", "d1", "d2", ...)."""
    check_values(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    environment = checked_environment(cfg)
    check_episodes(cfg, environment)
    task, _, policy, tokenizer, _ = build_task_and_model(cfg, None, torch.device("cpu"), environment)
    seed_everything(cfg.seed)
    engine = build(cfg, "engine", Engine, policy=policy.eval(), tokenizer=tokenizer)
    rows = getattr(task, split).to_list()[: prompts or None]
    rollout, budget = cfg.rollout, cfg.rollout.max_new_tokens
    with torch.no_grad():
        greedy = answers(engine.latest(), tokenizer, task, rows, cfg.eval.batch_size, budget, environment=environment)
        drawn = rollout.temperature, rollout.top_p, eval_seed(cfg), environment, rollout.coupled
        how = Sampling(cfg.eval.batch_size, budget, *drawn)
        sampled = sampled_answers(engine.latest(), tokenizer, task, rows, n, how)
    present = presence(task, [r for r in rows for _ in range(n)], sampled.texts)  # [E * n]
    d = difficulties(rows)
    levels = {"all": torch.ones(len(rows), dtype=torch.bool)}
    if d is not None:
        levels.update({f"d{k:g}": d == k for k in d.unique().tolist()})
    out = {}
    for name, keep in levels.items():  # keep: [E]
        each = keep.repeat_interleave(n)  # [E * n]
        kept = subset(sampled, each)
        out[name] = {
            **level_stats(task, n, rollout.group_size, budget, kept, subset(greedy, keep), present[each]),
            **environment.metrics(kept.episodes, kept.correct),  # e.g. the calculator's tool_use; {} single-turn
        }
    return out


def subset(a, keep: torch.Tensor):
    """The rows of `a` (evaluate.Answers) where `keep` holds."""
    texts, episodes = [t for t, k in zip(a.texts, keep) if k], [e for e, k in zip(a.episodes, keep) if k]
    return type(a)(a.correct[keep], a.lengths[keep], a.truncated[keep], texts, episodes)


def table(levels: dict) -> str:
    """The calibration as a markdown table, one row a level."""
    keys = list(levels["all"])
    rows = ["| level | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for name, stats in levels.items():
        rows.append(f"| {name} | " + " | ".join(_cell(stats[k]) for k in keys) + " |")
    return "\n".join(rows)


def _cell(v) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlkit-calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="config overrides, as rlkit-train takes them")
    p.add_argument("--samples", type=int, default=16, help="completions per prompt (n)")
    p.add_argument("--split", choices=("train", "eval"), default="eval")
    p.add_argument("--prompts", type=int, default=0, help="the split's first P prompts (0: all)")
    p.add_argument("--out", help="write the calibration here as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        if a.samples < 1 or a.prompts < 0:
            raise ConfigError(f"--samples must be >= 1 and --prompts >= 0, got {a.samples}, {a.prompts}")
        if a.out:
            atomic.check_file_target(a.out, "--out")  # before the calibration spends its minutes
        with initialize_config_module(config_module="rlkit.conf", version_base=None):
            cfg = compose("config", a.overrides)
        levels = calibrate(cfg, a.split, a.samples, a.prompts)
    except (ConfigError, HydraException, OmegaConfBaseException, TaskError) as e:
        print(f"rlkit-calibrate: error: {e}", file=sys.stderr)
        return 2
    print(table(levels))
    if a.out:
        record = {"overrides": a.overrides, "split": a.split, "samples": a.samples, "levels": levels}
        atomic.write_text(Path(a.out), json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
