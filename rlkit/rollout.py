"""Generation and log-probs: the one place where the policy is run forward.

A `Rollout` holds P prompt groups of G completions each (N = P*G rows, group i is rows
i*G..(i+1)*G-1): left-padded prompts, right-padded completions and their masks.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from rlkit.decode import HFForward, causal_parts, decoder, pack, positions


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


def _sample(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """One token per row from softmax(logits / temperature), restricted to the top-p nucleus."""
    if temperature == 0:
        return logits.argmax(-1)  # [N]
    probs = torch.softmax(logits / temperature, -1)  # [N, V]
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)  # [N, V]
        drop = sorted_p.cumsum(-1) - sorted_p > top_p  # [N, V] keep the smallest prefix with mass >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    # exponential race: argmax p_i / E_i with E_i ~ Exp(1) picks i with probability p_i (no sort, no cumsum)
    return (probs / torch.empty_like(probs).exponential_().clamp_(min=1e-30)).argmax(-1)  # [N]


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float = 1.0,
             top_p: float = 1.0, min_new_tokens: int = 0, lean: bool = True) -> Generation:
    """Sample one completion per prompt with a KV cache; each row stops at its EOS (never before
    `min_new_tokens`) and leaves the batch soon after (once an eighth of the rows present have
    finished). temperature 0 is greedy. `lean=False` forces the model's own forward
    (`rlkit.decode.HFForward`) for architectures the lean decoder supports."""
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = (t.to(device) for t in encode_prompts(tokenizer, prompts))  # [N, Tp]
    N = prompt_ids.shape[0]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    dec = (decoder if lean else HFForward)(model, prompt_ids, prompt_mask, max_new_tokens)
    logits = dec.prefill()  # [N, V]
    tokens = torch.full((N, max_new_tokens), pad, dtype=prompt_ids.dtype, device=device)  # [N, Tmax]
    alive = torch.zeros(N, max_new_tokens, dtype=torch.long, device=device)  # [N, Tmax]
    done = torch.zeros(N, dtype=torch.bool, device=device)  # [N]
    rows = torch.arange(N, device=device)  # [n] the original rows still in the batch
    fin = torch.zeros_like(done)  # [n] finished rows still in the batch
    T = 0
    for t in range(max_new_tokens):
        if t < min_new_tokens:
            logits[:, eos] = float("-inf")
        tok = torch.where(fin, pad, _sample(logits, temperature, top_p))  # [n]
        tokens[rows, t], alive[rows, t] = tok, (~fin).long()
        fin, T = fin | (tok == eos), t + 1
        n_fin = int(fin.sum())
        if n_fin == len(rows):
            break
        if n_fin and n_fin * 8 >= len(rows):  # drop the finished rows from the batch
            done[rows[fin]] = True
            keep = (~fin).nonzero().squeeze(-1)  # [n']
            dec.keep(keep)
            rows, tok, fin = rows[keep], tok[keep], fin[keep]
        logits = dec.step(tok)  # [n, V]
    done[rows[fin]] = True
    return Generation(prompt_ids, prompt_mask, tokens[:, :T], alive[:, :T], ~done)


def trimmed_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask):
    """Prompt + completion without the padding columns that every row shares (leading prompt
    columns, trailing completion columns), so no compute is spent on them. Positions come from
    the mask, so trimming changes no row's numbers.  -> ids, mask, position ids [n, S'] and tc, the
    completion columns kept"""
    used = completion_mask.any(0).nonzero()  # [k, 1]
    tc = int(used.max()) + 1 if len(used) else 1
    p0 = int(prompt_mask.any(0).int().argmax()) if prompt_mask.any() else prompt_mask.shape[1] - 1
    ids = torch.cat([prompt_ids[:, p0:], completion_ids[:, :tc]], 1)  # [n, S']
    mask = torch.cat([prompt_mask[:, p0:], completion_mask[:, :tc]], 1)  # [n, S']
    return ids, mask, positions(mask), tc


def token_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature: float = 1.0,
                   entropy: str = "none", packed: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the completion tokens. No compute is spent on padding: Llama-family models
    run on packed rows (`packed_hidden`), others on the micro-batch trimmed to its longest row
    (`trimmed_inputs`); logits are computed only where a completion token is predicted and never
    as a full-vocabulary log-softmax over the sequence. `entropy`: "none", "metric" (no gradient)
    or "grad" (for an entropy bonus). Returns logp [N, Tc] and entropy [N, Tc] or None (zeros on
    padding)."""
    parts = causal_parts(model) if packed else None
    if parts is not None:
        hidden, where = packed_hidden(*parts, prompt_ids, prompt_mask, completion_ids, completion_mask)  # [K, H]
        logits = parts[1](hidden).float()  # [K, V]
    else:
        ids, mask, pos, tc = trimmed_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                       logits_to_keep=tc + 1).logits[:, :-1].float()  # [N, tc, V]
        where = (slice(None), slice(0, tc))
    if temperature not in (0, 1):
        logits = logits / temperature
    lse = logits.logsumexp(-1)  # [K] or [N, tc]
    logp = logits.gather(-1, completion_ids[where].unsqueeze(-1)).squeeze(-1) - lse  # [K] or [N, tc]
    if entropy == "none":
        return unpack(logp, where, completion_mask), None
    with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
        ent = lse - (torch.softmax(logits, -1) * logits).sum(-1)  # [K] or [N, tc]
    return unpack(logp, where, completion_mask), unpack(ent, where, completion_mask)


def unpack(values: torch.Tensor, where, mask: torch.Tensor) -> torch.Tensor:
    """`values` at the positions `where` of a [N, Tc] matrix, 0 wherever `mask` is 0."""
    out = values.new_zeros(mask.shape)  # [N, Tc]
    out[where] = values
    return out.masked_fill(mask == 0, 0.0)


def packed_hidden(body, lm_head, context, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """The decoder's last hidden state before every completion token, with the rows' real tokens
    packed side by side into rows as wide as the longest sequence (`pack`); position ids restart
    at each sequence, from which the model's mask keeps sequences apart. Fillers at the end of a
    packed row are sequences of their own.  -> hidden [K, H] and `where`, the (row, column)
    indices of the K completion tokens"""
    ids = torch.cat([prompt_ids, completion_ids], 1)  # [n, S]
    mask = torch.cat([prompt_mask, completion_mask], 1).bool()  # [n, S]
    lengths, plen = mask.sum(-1), prompt_mask.sum(-1)  # [n] each
    width = int(lengths.max())
    bins, offset, B = pack(lengths.tolist(), width)
    bins, offset = torch.tensor(bins, device=ids.device), torch.tensor(offset, device=ids.device)  # [n] each
    within = positions(mask.long())  # [n, S]
    r, c = mask.nonzero(as_tuple=True)  # [R] each: every real token
    row, col = bins[r], offset[r] + within[r, c]  # [R] each: its packed place
    used = torch.zeros(B, dtype=torch.long, device=ids.device).index_add_(0, bins, lengths)  # [B]
    packed_pos = (torch.arange(width, device=ids.device)[None] - used[:, None]).clamp(min=0)  # [B, W] fillers
    packed_pos[row, col] = within[r, c]
    packed_ids = torch.zeros(B, width, dtype=ids.dtype, device=ids.device)  # [B, W]
    packed_ids[row, col] = ids[r, c]
    with context:
        hidden = body(input_ids=packed_ids, position_ids=packed_pos, use_cache=False).last_hidden_state  # [B, W, H]
    where = completion_mask.bool().nonzero(as_tuple=True)  # [K] each: (row, column) of each completion token
    before = offset[where[0]] + plen[where[0]] + where[1] - 1  # [K] packed column predicting it
    return hidden[bins[where[0]], before], where


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
