"""The built-in engine: the trainer's own model, sampled with a batched KV-cache loop. Prompt
encoding, sampling (temperature, top-p) and the decode loop live here; the decoders (the
Llama-family path, or the model's own forward) in `rlkit.engines.decoders`."""

from __future__ import annotations

import torch

from rlkit import parallel
from rlkit.components import Engine
from rlkit.draws import RowDraws
from rlkit.engines.decoders import HFForward, decoder
from rlkit.engines.sampling import sample, support_logp
from rlkit.engines.turns import Turns
from rlkit.llama import LlamaDecoder
from rlkit.types import Episodes, Generation


class KVCache(Engine):
    """The trainer's own model, sampled with rlkit's batched KV-cache loop (`generate` below).
    It generates from the very weights being trained, so its log-probs are the trainer's and
    `load_weights` has nothing to copy. `min_new_tokens` suppresses EOS before that many tokens
    (`+engine.min_new_tokens=N`; the benchmarks' fixed-length mode). `+engine.replay_support=true` (with
    `rollout.top_p` < 1): each sampled token's nucleus comes with the rollout, and the trainer's
    log-probs of the policy are taken on it, renormalised, as the sampling distribution was
    (`Generation.support`); without it they are the full softmax's. An engine on other hardware
    or software (vLLM, SGLang) sets `exact_logprobs = False` and copies the weights in
    `load_weights`."""

    exact_logprobs = True
    multi_turn = True

    def __init__(self, policy: torch.nn.Module, tokenizer, min_new_tokens: int = 0, replay_support: bool = False):
        self.policy, self.tokenizer, self.min_new_tokens = policy, tokenizer, min_new_tokens
        self.replay_support = replay_support

    def generate(
        self,
        prompts: list[str],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        episodes: Episodes | None = None,
        draws: RowDraws | None = None,
        forced: tuple | None = None,
    ) -> Generation:
        was_training = self.policy.training
        self.policy.eval()
        try:
            with parallel.full_weights(self.policy):  # a sharded policy is gathered once for the whole call
                return generate(
                    self.policy,
                    self.tokenizer,
                    prompts,
                    max_new_tokens,
                    temperature,
                    top_p,
                    self.min_new_tokens,
                    episodes=episodes,
                    draws=draws,
                    forced=forced,
                    support=self.replay_support,
                )
        finally:
            self.policy.train(was_training)

    def load_weights(self, policy: torch.nn.Module) -> None:
        pass  # generates from `policy` itself


def encode_prompts(tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    return enc["input_ids"], enc["attention_mask"]  # [n, Tp] each


def prefill(model, tokenizer, prompts: list[str], max_new_tokens: int, fast: bool = True):
    """The decoder after its prefill: each distinct prompt is prefilled once and its KV cache copied
    to its rows.  -> decoder, logits [N, V], prompt_ids [N, Tp], prompt_mask [N, Tp]"""
    device = next(model.parameters()).device
    distinct = list(dict.fromkeys(prompts))
    prompt_ids, prompt_mask = (t.to(device) for t in encode_prompts(tokenizer, distinct))  # [U, Tp]
    dec = (decoder if fast else HFForward)(model, prompt_ids, prompt_mask, max_new_tokens)
    logits = dec.prefill()  # [U, V]
    if len(distinct) < len(prompts):
        index = {p: i for i, p in enumerate(distinct)}
        copies = torch.tensor([index[p] for p in prompts], device=device)  # [N]
        dec.keep(copies)
        logits, prompt_ids, prompt_mask = logits[copies], prompt_ids[copies], prompt_mask[copies]  # [N, ...]
    return dec, logits, prompt_ids, prompt_mask


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    min_new_tokens: int = 0,
    fast: bool = True,
    logprobs: bool = False,
    episodes: Episodes | None = None,
    draws: RowDraws | None = None,
    forced: tuple | None = None,
    support: bool = False,
) -> Generation:
    """One completion per prompt with a KV cache (`prefill`); a row stops at its EOS (not before
    `min_new_tokens`), leaving the batch once an eighth have finished. temperature 0: greedy; `fast=False`:
    the model's own forward (`HFForward`); `logprobs`: each token's under softmax(logits / temperature)
    (on its top-p support with `support`, which also returns it); `episodes`: multi-turn (`Turns`);
    `draws`: keyed uniforms (`rlkit.draws`); `forced`: `forced_entropy`."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    dec, logits, prompt_ids, prompt_mask = prefill(model, tokenizer, prompts, max_new_tokens, fast)  # [N, V], [N, Tp]
    out = Sampled(prompt_ids, max_new_tokens, pad, logprobs, forced and forced_entropy(dec, logits, *forced), support)
    turns = None if episodes is None else Turns(tokenizer, episodes, out.tokens)
    rows = torch.arange(prompt_ids.shape[0], device=prompt_ids.device)  # [n] the original rows still in the batch
    fin = torch.zeros_like(rows, dtype=torch.bool)  # [n] finished rows still in the batch
    for t in range(max_new_tokens):
        if t < min_new_tokens:
            logits[:, eos] = float("-inf")
        tok = torch.where(fin, pad, sample(logits, temperature, top_p, draws and draws.at(rows, t), out.step_support))
        if turns is not None:
            tok = turns.force(t, rows, tok, fin)  # [n] the environment's queued tokens replace samples
        out.record(t, rows, tok, fin, logits, temperature)
        fin = fin | (tok == eos) if turns is None else turns.advance(t, rows, tok, fin, eos)  # [n]
        if bool(fin.all()):
            break
        rows, tok, fin = out.drop_finished(dec, rows, tok, fin)  # [n'] each
        logits = dec.step(tok)  # [n, V]
    out.done[rows[fin]] = True
    return out.generation(prompt_ids, prompt_mask, turns)


def forced_entropy(dec, logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
    """The entropy (nats, temperature 1) before each teacher-forced token: the prefill's `logits`
    [N, V] before the first, the forced tokens' own hidden states before the rest (`LlamaDecoder.
    force`).  ids, mask [N, Tf] -> [N, Tf], 0 on padding; None for a decoder that cannot force"""
    if not isinstance(dec, LlamaDecoder) or ids.shape[1] > dec.k[0].shape[2] - dec.len:
        return None
    ids, mask = ids.to(logits.device), mask.to(logits.device)
    hidden = dec.force(ids[:, :-1], mask[:, :-1])  # [N, Tf - 1, H]
    logits = torch.cat([logits[:, None], dec.lm_head(hidden).float()], 1)  # [N, Tf, V]
    logp = logits.log_softmax(-1)  # [N, Tf, V]
    return -(logp.exp() * logp).sum(-1) * mask  # [N, Tf]


class Sampled:
    """What the decode loop has sampled so far, in the original row order: tokens, which of them
    count (before and at each row's EOS), their log-probs when asked, each token's top-p support
    when asked (`support`), and which rows finished."""

    def __init__(self, prompt_ids, max_new_tokens: int, pad: int, logprobs: bool, forced=None, support=False):
        N, device = prompt_ids.shape[0], prompt_ids.device
        self.forced = forced  # [N, Tf] the entropies before teacher-forced tokens (`forced_entropy`) or None
        self.tokens = torch.full((N, max_new_tokens), pad, dtype=prompt_ids.dtype, device=device)  # [N, Tmax]
        self.alive = torch.zeros(N, max_new_tokens, dtype=torch.long, device=device)  # [N, Tmax]
        self.lp = torch.zeros(N, max_new_tokens, device=device) if logprobs else None  # [N, Tmax]
        self.done = torch.zeros(N, dtype=torch.bool, device=device)  # [N]
        self.T = 0  # decode steps taken
        self.supports = [] if support else None  # (step, rows [n], ids [n, k]) of each step that sampled top-p
        self.step_support = [] if support else None  # what `sample` appends this step's support to

    def record(self, t: int, rows, tok, fin, logits: torch.Tensor, temperature: float) -> None:
        """Step t's tokens `tok` [n] of the batch's `rows` [n]; `fin` [n]: rows that had finished."""
        self.tokens[rows, t], self.alive[rows, t], self.T = tok, (~fin).long(), t + 1
        ids = self.step_support.pop() if self.step_support else None  # [n, k] this step's supports
        if ids is not None:
            self.supports.append((t, rows, ids))
        if self.lp is not None:
            logp_all = torch.log_softmax(logits / temperature, -1)  # [n, V]
            picked = logp_all.gather(-1, tok[:, None])[:, 0]  # [n]
            picked = picked if ids is None else support_logp(logp_all, picked, ids)  # [n]
            self.lp[rows, t] = torch.where(fin, 0.0, picked)

    def drop_finished(self, dec, rows: torch.Tensor, tok: torch.Tensor, fin: torch.Tensor) -> tuple:
        """Once an eighth of the rows have finished, mark them done and take them out of the decoder's
        batch.  -> rows, tok, fin [n']"""
        n_fin = int(fin.sum())
        if not n_fin or n_fin * 8 < len(rows):
            return rows, tok, fin
        self.done[rows[fin]] = True
        keep = (~fin).nonzero().squeeze(-1)  # [n']
        dec.keep(keep)
        return rows[keep], tok[keep], fin[keep]

    def generation(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, turns: Turns | None) -> Generation:
        """What was sampled, cut to the steps taken; with `turns`, the model's tokens marked and the
        episodes that the turn or token budget cut told so (`Turns.close`) and reported as truncated."""
        T, lp = self.T, self.lp
        if turns is not None:
            turns.close(T)
        model = None if turns is None else turns.model[:, :T]  # [N, T]
        if lp is not None:
            lp = lp[:, :T] if model is None else lp[:, :T] * model  # [N, T] 0 on the environment's tokens
        truncated = ~self.done if turns is None else ~self.done | turns.cut  # [N]
        tokens, alive = self.tokens[:, :T], self.alive[:, :T]  # [N, T] each
        return Generation(prompt_ids, prompt_mask, tokens, alive, truncated, lp, model, self.forced, self.support())

    def support(self) -> torch.Tensor | None:
        """Each token's top-p support as sampled, [N, T, k] vocabulary ids (-1 past each support's end,
        and where nothing was sampled top-p); None where none was asked or none sampled top-p."""
        if not self.supports:
            return None
        k = max(ids.shape[1] for _, _, ids in self.supports)
        out = torch.full((*self.tokens.shape[:1], self.T, k), -1, dtype=torch.long, device=self.tokens.device)
        for t, rows, ids in self.supports:
            out[rows, t, : ids.shape[1]] = ids
        return out  # [N, T, k]
