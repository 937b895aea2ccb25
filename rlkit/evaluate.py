"""Greedy evaluation on the held-out split, through the run's generation engine."""
from __future__ import annotations

import sys

import torch
from tqdm import tqdm

from rlkit.metrics import by_difficulty, mean_or_zero as mean


@torch.no_grad()
def evaluate(engine, tokenizer, task, batch_size: int, max_new_tokens: int) -> dict:
    """Greedy accuracy (reward > 0) and mean completion length (tokens) of correct and incorrect answers."""
    correct, lengths = [], []
    split = task.eval
    rows_all = split.to_list()
    for start in tqdm(range(0, len(split), batch_size), desc="rlkit eval", file=sys.stderr, leave=False):
        rows = rows_all[start:start + batch_size]
        gen = engine.generate([r["prompt"] for r in rows], max_new_tokens, temperature=0)
        texts = tokenizer.batch_decode(gen.completion_ids, skip_special_tokens=True)
        correct.append(task.score(rows, texts) > 0)  # [n]
        lengths.append(gen.completion_mask.sum(-1).float())  # [n]
    ok, lens = torch.cat(correct), torch.cat(lengths)  # [E]
    return {"eval/accuracy": mean(ok.float()), "eval/len_correct": mean(lens[ok]), "eval/len_incorrect": mean(lens[~ok]),
            **by_difficulty(rows_all, ok.float(), "eval/acc")}
