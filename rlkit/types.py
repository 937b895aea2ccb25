"""The data the phases pass along, on the ground floor (no rlkit imports): what an engine returns
(`Generation`), a scored rollout (`Rollout`, with how the update cuts it into mini- and
micro-batches), a rollout prepared for the update (`Batch`), what
a policy loss sees of one micro-batch (`LossInput`) and what the update did (`UpdateStats`).

A `Rollout` holds P prompt groups of G completions each (N = P*G rows, group i is rows
i*G..(i+1)*G-1): left-padded prompts, right-padded completions and their masks. In a multi-turn
episode the completion is the whole trajectory after the prompt, the model's turns and the
environment's replies in order; `model_mask` tells them apart, and `action_mask` (the model's
tokens) is what log-probs, losses and the aggregators' lengths count.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F


class Generation(NamedTuple):
    """What an engine returns for N prompts."""

    prompt_ids: torch.Tensor  # [N, Tp] left-padded
    prompt_mask: torch.Tensor  # [N, Tp]
    completion_ids: torch.Tensor  # [N, Tc] right-padded with the pad id
    completion_mask: torch.Tensor  # [N, Tc] 1 on completion tokens, EOS included
    truncated: torch.Tensor  # [N] bool, no EOS within the budget
    logprobs: torch.Tensor | None = None  # [N, Tc] the engine's own log-probs of the sampled tokens (at the
    # sampling temperature); None: an engine whose numbers are the trainer's
    model_mask: torch.Tensor | None = None  # [N, Tc] 1 on the tokens the model wrote, 0 on an environment's
    # (multi-turn episodes); None: every completion token is the model's
    forced_entropy: torch.Tensor | None = None  # [N, Tf] with `forced`: the entropy (temperature 1) before each
    # teacher-forced token, 0 on padding; None: none asked, or an engine that cannot
    support: torch.Tensor | None = None  # [N, Tc, k] each token's top-p nucleus as sampled (vocabulary ids, -1
    # past its end); None: not replayed (the engine's `replay_support`), or no top-p


class Episodes(NamedTuple):
    """The multi-turn episodes of one generate call: one per prompt, each with `reply(text)` (the
    model's turn, decoded -> the chat message to append, or None to end the episode), and the
    environment's budget and stop strings."""

    each: list  # N episode objects
    max_turns: int  # model turns at most; an episode still going after the last one is truncated
    stop_strings: tuple  # strings that end a model turn besides EOS (e.g. a tool call's closing marker)


@dataclass
class Rollout:
    prompt_ids: torch.Tensor  # [N, Tp] left-padded
    prompt_mask: torch.Tensor  # [N, Tp] 1 on prompt tokens
    completion_ids: torch.Tensor  # [N, Tc] right-padded
    completion_mask: torch.Tensor  # [N, Tc] 1 on completion tokens, EOS included
    truncated: torch.Tensor  # [N] bool, no EOS within the budget
    group_size: int  # G
    rows: list = field(default_factory=list)  # N dataset rows (row i belongs to completion i)
    texts: list = field(default_factory=list)  # N decoded completions
    rewards: torch.Tensor | None = None  # [N]
    shaping: torch.Tensor | None = None  # [N] reward shaping (e.g. overlong penalty), added to rewards
    kl_penalty: torch.Tensor | None = None  # [N, Tc] beta * KL when the KL is placed in the reward
    step_rewards: torch.Tensor | None = None  # [N, Tc] reward of the step ending at each token (process)
    step_mask: torch.Tensor | None = None  # [N, Tc] 1 where a step ends
    reward_parts: torch.Tensor | None = None  # [N, K] each reward function's score, before combining
    correct: torch.Tensor | None = None  # [N] bool, the answer is right (the task's score, not the shaped reward)
    behaviour_logp: torch.Tensor | None = None  # [N, Tc] log-probs the engine sampled with (Generation.logprobs)
    model_mask: torch.Tensor | None = None  # [N, Tc] 1 on the model's own tokens (Generation.model_mask); None: all
    support: torch.Tensor | None = None  # [N, Tc, k] each token's sampling support (Generation.support); None: full
    policy_stats: torch.Tensor | None = None  # [N, Tc, 2] log pi_old and sum_v pi_old(v)^2 at the sampling
    # temperature, for an estimator that `needs_policy_stats` (set by the core's prepare phase); None otherwise
    episodes: list = field(default_factory=list)  # N multi-turn episodes as they ended; [] for a single-turn task

    def __post_init__(self):
        if self.shaping is None and self.rewards is not None:
            self.shaping = torch.zeros_like(self.rewards)

    @classmethod
    def from_generation(cls, gen: Generation, group_size: int, **fields) -> "Rollout":
        """A rollout of an engine's output; the engine's own log-probs become `behaviour_logp`."""
        extra = dict(behaviour_logp=gen.logprobs, model_mask=gen.model_mask, support=gen.support)
        return cls(*gen[:5], group_size, **extra, **fields)

    @property
    def num_rows(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def num_groups(self) -> int:
        return self.prompt_ids.shape[0] // self.group_size

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(-1)  # [N] the whole trajectory, environment tokens included

    @property
    def action_mask(self) -> torch.Tensor:
        """1 on the tokens the model wrote: what log-probs, losses and their lengths count.  [N, Tc]"""
        return self.completion_mask if self.model_mask is None else self.completion_mask * self.model_mask

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

    def mini_batches(self, epochs: int, n: int):
        """Row indices of each mini-batch (one optimizer step each): whole groups, reshuffled every
        epoch when n > 1.  -> [n_rows] each"""
        for _ in range(epochs):
            groups = torch.randperm(self.num_groups) if n > 1 else torch.arange(self.num_groups)
            yield from (self.group_rows(mb) for mb in groups.chunk(n))

    def micro_batches(self, rows: torch.Tensor, max_rows: int, max_tokens: int) -> list[torch.Tensor]:
        """`rows` in micro-batches of similar length, so that trimming each to its own longest row
        (`rlkit.tensors.trimmed_inputs`) leaves little padding: sorted by prompt + completion length
        and cut before a micro-batch passes `max_rows` rows or `max_tokens` padded tokens (0: no
        limit). Returns positions in `rows`.  -> [m] each"""
        if not max_rows and not max_tokens:  # one micro-batch, in the same (stable, by length) order
            lengths = self.prompt_mask[rows].sum(-1) + self.completion_mask[rows].sum(-1)  # [n]
            return [torch.argsort(lengths, stable=True).cpu()] if len(rows) else []
        plen, clen = self.prompt_mask[rows].sum(-1).tolist(), self.completion_mask[rows].sum(-1).tolist()  # [n] each
        out, cur, width = [], [], (0, 0)
        for i in sorted(range(len(plen)), key=lambda i: plen[i] + clen[i]):
            grown = (max(width[0], plen[i]), max(width[1], clen[i]))
            if cur and (len(cur) == max_rows or max_tokens and (len(cur) + 1) * sum(grown) > max_tokens):
                out.append(torch.tensor(cur))
                cur, grown = [], (plen[i], clen[i])
            cur.append(i)
            width = grown
        return out + [torch.tensor(cur)] if cur else out

    @torch.no_grad()
    def over_micro_batches(self, fn, micro: list[torch.Tensor], outputs: int = 1):
        """fn over the micro-batches of rows `micro`, put back in row order; `outputs` > 1: fn
        returns that many tensors (an output it does not compute, None, stays None).  -> [N, Tc] (each)"""
        shape, device = self.completion_ids.shape, self.completion_ids.device
        out = [torch.zeros(shape, device=device) for _ in range(outputs)]  # [N, Tc] each
        for rows in micro:
            res = fn(self.select_rows(rows))
            for i, x in enumerate(res if outputs > 1 else (res,)):
                if x is None:
                    out[i] = None
                elif out[i] is not None:
                    out[i][rows] = x
        return out if outputs > 1 else out[0]

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


@dataclass
class Batch:
    """A scored rollout with everything the update needs, all [N, Tc]."""

    rollout: Rollout
    mask: torch.Tensor  # the loss's training mask
    adv: torch.Tensor
    returns: torch.Tensor | None  # critic targets, when the estimator has them
    old_logp: torch.Tensor | None  # None: the update's own log-probs, detached (one update per rollout)
    ref_logp: torch.Tensor | None  # None: no reference (beta = 0)
    old_values: torch.Tensor | None  # None: no critic
    select: torch.Tensor | None = None  # tokens the policy term acts on (the loss's top-entropy selection); None: all

    def select_rows(self, idx: torch.Tensor) -> "Batch":
        """The rows `idx` of the rollout and of every tensor (None stays None)."""
        picked = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "rollout"}
        picked = {k: None if v is None else v[idx] for k, v in picked.items()}  # [m, Tc] each
        return Batch(self.rollout.select_rows(idx), **picked)


@dataclass
class LossInput:
    """What a policy loss sees of one micro-batch, every tensor [n, Tc]; None: not used in this run."""

    logp: torch.Tensor  # the policy's log-probs of the sampled tokens, with gradient
    old_logp: torch.Tensor  # the log-probs the advantages were computed under (no gradient)
    adv: torch.Tensor  # advantages
    mask: torch.Tensor  # the loss's training mask
    ref_logp: torch.Tensor | None = None  # the frozen reference's log-probs (loss.beta > 0)
    entropy: torch.Tensor | None = None  # the policy's token entropy; with gradient under an entropy bonus
    is_weight: torch.Tensor | None = None  # the off-policy correction's weights (no gradient)
    select: torch.Tensor | None = None  # 0/1: the tokens the policy term acts on (top-entropy selection)
    reward: torch.Tensor | None = None  # [n] each row's outcome reward with shaping (losses that split by it)


@dataclass
class UpdateStats:
    skipped: bool = False  # a NaN or inf advantage, loss or gradient norm
    sums: dict = field(default_factory=dict)  # loss statistics summed over tokens
    tokens: float = 0.0
    counts: dict = field(default_factory=dict)  # the tokens of each statistic given with its own `within`
    losses: list = field(default_factory=list)  # one per optimizer step
    grad_norms: list = field(default_factory=list)
    value_losses: list = field(default_factory=list)

    def add(self, values: dict, mask: torch.Tensor) -> None:
        """Sum each statistic [m, Tc] over the tokens of `mask` [m, Tc]. A statistic given as a pair
        (values, within) [m, Tc] each is summed and counted over the tokens of mask and within only,
        so that its mean is a share of those tokens (e.g. the clipped part of the positive-advantage
        tokens)."""
        for k, v in values.items():
            counted = mask  # [m, Tc]
            if isinstance(v, tuple):
                v, counted = v[0], mask * v[1]  # [m, Tc] each
                self.counts[k] = self.counts.get(k, 0.0) + float(counted.sum())
            self.sums[k] = self.sums.get(k, 0.0) + float((v * counted).sum())
        self.tokens += float(mask.sum())


@dataclass
class StepResult:
    """What one step of the loop hands on: the rollout, the batch trained on (None when nothing was
    kept), the update's statistics and the step's metrics."""

    rollout: Rollout
    batch: Batch | None
    stats: UpdateStats
    metrics: dict
