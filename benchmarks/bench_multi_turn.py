"""What a multi-turn episode costs in the engine: the same decode loop, the same rows and the same
number of tokens, once single-turn (every row runs to the budget) and once as episodes whose turns
end at every "." and are each answered by a short tool message (rendered through the chat template
and fed through the KV cache), on SmolLM2-135M-Instruct. Prints completion tokens per second of
each and their ratio (multi-turn / single-turn throughput: 1 means the turns cost nothing). An
episode whose next reply no longer fits ends there, so the multi-turn run writes a few tokens less.

    python benchmarks/bench_multi_turn.py [--rows 32] [--budget 96] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch
from hydra import compose, initialize_config_module

from rlkit.config import build
from rlkit.engines.kv_cache import generate
from rlkit.types import Episodes


class Answering:
    """An episode that answers every turn with the same tool message and never ends on its own."""

    turns = 0

    def reply(self, text: str) -> dict:
        self.turns += 1
        return {"role": "tool", "content": "579"}


def timed(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        torch.manual_seed(0)
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--budget", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    with initialize_config_module(config_module="rlkit.conf", version_base=None):
        model = build(compose("config", ["model=smollm2"]), "model")
    policy, tok = model.build("", 0)
    policy.eval()
    questions = [f"Explain step by step what {i} + {3 * i + 7} is." for i in range(a.rows)]
    prompts = [model.format_prompt(tok, q) for q in questions]

    def single():  # no EOS before the budget: every row writes `budget` tokens
        return generate(policy, tok, prompts, a.budget, 1.0, min_new_tokens=a.budget)

    def multi():
        episodes = Episodes([Answering() for _ in prompts], a.budget, (".",))
        return generate(policy, tok, prompts, a.budget, 1.0, min_new_tokens=a.budget, episodes=episodes)

    t_single, g_single = timed(single, a.repeats)
    t_multi, g_multi = timed(multi, a.repeats)
    n_single, n_multi = int(g_single.completion_mask.sum()), int(g_multi.completion_mask.sum())
    model_tokens = int((g_multi.completion_mask * g_multi.model_mask).sum())
    print(f"threads {torch.get_num_threads()}, {a.rows} rows x {a.budget} tokens, best of {a.repeats}")
    print(f"single-turn: {n_single} tokens in {t_single:.2f} s = {n_single / t_single:.0f} tokens/s")
    print(
        f"multi-turn:  {n_multi} tokens ({model_tokens} the model's, {n_multi - model_tokens} the tool's) "
        f"in {t_multi:.2f} s = {n_multi / t_multi:.0f} tokens/s"
    )
    print(f"ratio (multi-turn / single-turn tokens per second): {(n_multi / t_multi) / (n_single / t_single):.2f}")


if __name__ == "__main__":
    main()
