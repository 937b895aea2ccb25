"""Generation and log-probs: the one place where the policy is run forward.

A `Rollout` holds P prompt groups of G completions each (N = P*G rows, group i is rows
i*G..(i+1)*G-1): left-padded prompts, right-padded completions and their masks.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field, fields, replace
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from transformers import DynamicCache


class Generation(NamedTuple):
    """What an engine returns for N prompts."""

    prompt_ids: torch.Tensor       # [N, Tp] left-padded
    prompt_mask: torch.Tensor      # [N, Tp]
    completion_ids: torch.Tensor   # [N, Tc] right-padded with the pad id
    completion_mask: torch.Tensor  # [N, Tc] 1 on completion tokens, EOS included
    truncated: torch.Tensor        # [N] bool, no EOS within the budget


@dataclass
class Rollout:
    prompt_ids: torch.Tensor       # [N, Tp] left-padded
    prompt_mask: torch.Tensor      # [N, Tp] 1 on prompt tokens
    completion_ids: torch.Tensor   # [N, Tc] right-padded
    completion_mask: torch.Tensor  # [N, Tc] 1 on completion tokens, EOS included
    truncated: torch.Tensor        # [N] bool, no EOS within the budget
    group_size: int                # G
    rows: list = field(default_factory=list)   # N dataset rows (row i belongs to completion i)
    texts: list = field(default_factory=list)  # N decoded completions
    rewards: torch.Tensor | None = None        # [N]
    shaping: torch.Tensor | None = None        # [N] reward shaping (e.g. overlong penalty), added to rewards
    kl_penalty: torch.Tensor | None = None     # [N, Tc] beta * KL when the KL is placed in the reward
    step_rewards: torch.Tensor | None = None   # [N, Tc] reward of the step ending at each token (process)
    step_mask: torch.Tensor | None = None      # [N, Tc] 1 where a step ends
    reward_parts: torch.Tensor | None = None   # [N, K] each reward function's score, before combining

    def __post_init__(self):
        if self.shaping is None and self.rewards is not None:
            self.shaping = torch.zeros_like(self.rewards)

    @property
    def num_rows(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def num_groups(self) -> int:
        return self.prompt_ids.shape[0] // self.group_size

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(-1)  # [N]

    def select_rows(self, idx: torch.Tensor) -> "Rollout":
        """The rows `idx` (tensors indexed, lists picked); whole groups keep group bookkeeping valid."""
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                kw[f.name] = v[idx]
            elif isinstance(v, list) and v:
                kw[f.name] = [v[i] for i in idx.tolist()]
        return replace(self, **kw)

    def group_rows(self, groups: torch.Tensor) -> torch.Tensor:
        """Row indices of the given groups.  [k] -> [k*G]"""
        return (groups[:, None] * self.group_size + torch.arange(self.group_size)).reshape(-1)

    def select_groups(self, groups: torch.Tensor) -> "Rollout":
        """Keep whole groups, by group index."""
        return self.select_rows(self.group_rows(groups))

    @staticmethod
    def cat(parts: list["Rollout"]) -> "Rollout":
        """Concatenate rollouts of the same group size, re-padding prompts left and completions right."""
        if len(parts) == 1:
            return parts[0]
        first, kw = parts[0], {}
        for f in fields(first):
            vals = [getattr(p, f.name) for p in parts]
            if f.name in ("prompt_ids", "prompt_mask"):
                kw[f.name] = pad_cat(vals, left=True)
            elif isinstance(vals[0], torch.Tensor) and vals[0].dim() == 2:
                kw[f.name] = pad_cat(vals, left=False)
            elif isinstance(vals[0], torch.Tensor):
                kw[f.name] = torch.cat(vals)
            elif isinstance(vals[0], list):
                kw[f.name] = [x for v in vals for x in v]
        return replace(first, **kw)


def pad_cat(tensors: list[torch.Tensor], left: bool, value: int = 0) -> torch.Tensor:
    width = max(t.shape[1] for t in tensors)
    padded = [F.pad(t, (width - t.shape[1], 0) if left else (0, width - t.shape[1]), value=value) for t in tensors]
    return torch.cat(padded)  # [sum N, width]


def encode_prompts(tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    return enc["input_ids"], enc["attention_mask"]  # [n, Tp] each


def positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)  # [N, S]


def _sample(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(-1)  # [N]
    probs = torch.softmax(logits / temperature, -1)  # [N, V]
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)  # [N, V]
        drop = sorted_p.cumsum(-1) - sorted_p > top_p  # [N, V] keep the smallest prefix with mass >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1).squeeze(-1)  # [N]


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float = 1.0,
             top_p: float = 1.0, min_new_tokens: int = 0) -> Generation:
    """Sample one completion per prompt with a KV cache; each row stops at its EOS (never before
    `min_new_tokens`). temperature 0 is greedy."""
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = (t.to(device) for t in encode_prompts(tokenizer, prompts))  # [N, Tp]
    N = prompt_ids.shape[0]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    cache = DynamicCache()
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    mask = prompt_mask
    pos = positions(mask)  # [N, Tp]
    out = model(input_ids=prompt_ids, attention_mask=mask, position_ids=pos, use_cache=True,
                logits_to_keep=1, **{cache_kw: cache})
    next_pos = pos[:, -1:] + 1  # [N, 1]
    done = torch.zeros(N, dtype=torch.bool, device=device)  # [N]
    tokens, alive = [], []
    for t in range(max_new_tokens):
        logits = out.logits[:, -1].float()  # [N, V]
        if t < min_new_tokens:
            logits[:, eos] = float("-inf")
        tok = _sample(logits, temperature, top_p)  # [N]
        alive.append(~done)
        tokens.append(torch.where(done, pad, tok))
        done = done | (tok == eos)
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)  # [N, S+1]
        out = model(input_ids=tokens[-1][:, None], attention_mask=mask, position_ids=next_pos,
                    use_cache=True, **{cache_kw: cache})
        next_pos = next_pos + 1
    completion_ids = torch.stack(tokens, 1)  # [N, Tc]
    completion_mask = torch.stack(alive, 1).long()  # [N, Tc]
    return Generation(prompt_ids, prompt_mask, completion_ids, completion_mask, ~done)


def token_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature: float = 1.0,
                   entropy: str = "none") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the completion tokens, computing logits only at completion positions and
    never materialising a full-vocabulary log-softmax. `entropy`: "none", "metric" (no gradient)
    or "grad" (for an entropy bonus). Returns logp [N, Tc] and entropy [N, Tc] or None."""
    ids = torch.cat([prompt_ids, completion_ids], 1)  # [N, S]
    mask = torch.cat([prompt_mask, completion_mask], 1)  # [N, S]
    Tc = completion_ids.shape[1]
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                   logits_to_keep=Tc + 1).logits[:, :-1].float()  # [N, Tc, V]
    if temperature not in (0, 1):
        logits = logits / temperature
    lse = logits.logsumexp(-1)  # [N, Tc]
    logp = logits.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1) - lse  # [N, Tc]
    if entropy == "none":
        return logp, None
    with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
        return logp, lse - (torch.softmax(logits, -1) * logits).sum(-1)  # [N, Tc]


def rollout_logprobs(model, r: Rollout, temperature: float = 1.0, entropy: str = "none"):
    return token_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                          temperature, entropy)


def step_reward_matrix(step_rewards: list[list[tuple[int, float]]], completion_ids: torch.Tensor,
                       completion_mask: torch.Tensor, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Place each step's reward on the token where the step's text ends.
    Returns rewards [N, Tc] and a step mask [N, Tc]."""
    N, T = completion_ids.shape
    rewards, mask = torch.zeros(N, T), torch.zeros(N, T, dtype=torch.bool)
    lengths = completion_mask.sum(-1).tolist()
    for i, (steps, ids) in enumerate(zip(step_rewards, completion_ids.tolist())):
        pieces = tokenizer.batch_decode([[t] for t in ids[: lengths[i]]], skip_special_tokens=True)
        ends = np.cumsum([len(p) for p in pieces])  # characters decoded up to each token
        for end, reward in steps:
            t = min(int(np.searchsorted(ends, end)), lengths[i] - 1)  # token holding the step's last character
            rewards[i, t] += reward
            mask[i, t] = True
    return rewards.to(completion_ids.device), mask.to(completion_ids.device)
