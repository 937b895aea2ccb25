"""Training log-probs: the policy (or reference) run forward over prompt + completion with no
compute spent on padding. Llama-family models run on packed rows (`pack`, `packed_hidden`: the
rows' real tokens side by side, positions restarting at each sequence), or with each distinct
prompt computed once and its completions attending to it (`shared_hidden`); others on the
micro-batch trimmed to its longest row (`trimmed_inputs`); logits are computed only where a
completion token is predicted."""

from __future__ import annotations

import random
import sys

import torch

from rlkit.engines.kv_cache import encode_prompts
from rlkit.engines.sampling import support_logp
from rlkit.llama import SharedLayout, base_model, causal_parts, decoded_hidden, packed_body, shared_hidden
from rlkit.models import AdaptersOff
from rlkit.tensors import pack, positions, trimmed_inputs
from rlkit.types import Rollout


def demonstration_batch(tokenizer, task, rows: list[dict], rng: random.Random):
    """Each row's prompt followed by one of the task's right completions (`task.demonstration`,
    drawn with `rng`) and EOS: the teacher-forced inputs of `token_logprobs`."""
    prompt_ids, prompt_mask = encode_prompts(tokenizer, [r["prompt"] for r in rows])  # [B, Tp]
    return prompt_ids, prompt_mask, *demonstrations(tokenizer, task, rows, rng)  # [B, Tp] x2, [B, Tc] x2


def demonstrations(tokenizer, task, rows: list[dict], rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """One of the task's right completions of each row (`task.demonstration`, drawn with `rng`) and
    EOS, right-padded.  -> ids, mask [B, Tc]"""
    demos = [task.demonstration(r, rng) + tokenizer.eos_token for r in rows]
    enc = tokenizer(demos, return_tensors="pt", padding=True, padding_side="right")
    return enc["input_ids"], enc["attention_mask"]  # [B, Tc] each


def token_logprobs(
    model,
    prompt_ids,
    prompt_mask,
    completion_ids,
    completion_mask,
    temperature: float = 1.0,
    entropy: str = "none",
    packed: bool = True,
    share: str = "never",
    decoded: bool = False,
    support: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the completion tokens. No compute is spent on padding: Llama-family models
    run on packed rows (`packed_hidden`), others on the micro-batch trimmed to its longest row
    (`trimmed_inputs`); logits are computed only where a completion token is predicted (for the
    Llama family from the hidden state divided by the temperature, a [K, H] division instead of a
    [K, V] one) and go through one log-softmax. `entropy`: "none", "metric" (no gradient)
    or "grad" (for an entropy bonus); "sum_pi_squared": sum_v pi_v^2 in its place (no gradient).
    `decoded` (no gradients): a Llama-family model runs through the decoder (`decoded_hidden`: the
    prefix every row shares once, LoRA adapters folded). `support` [N, Tc, k]: each token's
    log-prob renormalised on its sampling support (`support_logp`; the entropy stays the full
    softmax's). Returns logp [N, Tc] and entropy [N, Tc] or None (zeros on padding)."""
    batch = (prompt_ids, prompt_mask, completion_ids, completion_mask)
    logits, where = completion_logits(model, batch, temperature, packed, share, decoded)  # [K, V] or [N, tc, V]
    logp_all = logits.log_softmax(-1)  # [K, V] or [N, tc, V] one fused pass, and one back
    logp = logp_all.gather(-1, completion_ids[where].unsqueeze(-1)).squeeze(-1)  # [K] or [N, tc]
    if support is not None:
        logp = support_logp(logp_all, logp, support[where])  # [K] or [N, tc]
    if entropy == "none":
        return unpack(logp, where, completion_mask), None
    with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
        if entropy == "sum_pi_squared":
            ent = (2 * logp_all).logsumexp(-1).exp()  # [K] or [N, tc] sum_v pi_v^2, in its place
        else:
            ent = -(logp_all.exp() * logp_all).sum(-1)  # [K] or [N, tc]
    return unpack(logp, where, completion_mask), unpack(ent, where, completion_mask)


def completion_logits(model, batch: tuple, temperature: float, packed: bool, share: str, decoded: bool):
    """The logits (at the temperature) before each completion token of `batch` (prompt ids and
    mask, completion ids and mask), as `token_logprobs` describes.  -> [K, V] and the K tokens'
    `where`, or [N, tc, V] and (all rows, first tc columns)"""
    parts = causal_parts(model) if packed else None
    shared = shares_prefix(model, batch[0], batch[1], batch[3], share)
    scale = 1.0 if temperature in (0, 1) else 1.0 / temperature
    if parts is not None:
        hidden, where = llama_hidden(model, parts, shared, decoded, batch)  # [K, H]
        return parts[1](hidden * scale if scale != 1 else hidden).float(), where  # [K, V] z/T = (h/T) W^T: no bias
    ids, mask, pos, tc = trimmed_inputs(*batch)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=tc + 1).logits
    logits = logits[:, :-1].float()  # [N, tc, V]
    return (logits * scale if scale != 1 else logits), (slice(None), slice(0, tc))


def llama_hidden(model, parts, shared: bool, decoded: bool, batch: tuple):
    """A Llama-family model's hidden states before the completion tokens of `batch` (prompt ids
    and mask, completion ids and mask): through the decoder (`decoded`, the policy only), with each
    distinct prompt computed once (`shared`) or packed.  -> hidden [K, H] and `where`"""
    if decoded and not isinstance(model, AdaptersOff):
        return decoded_hidden(model, *batch)
    return (shared_hidden if shared else packed_hidden)(*parts, *batch)


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
        hidden = packed_body(body, packed_ids, packed_pos)  # [B, W, H]
    where = completion_mask.bool().nonzero(as_tuple=True)  # [K] each: (row, column) of each completion token
    before = offset[where[0]] + plen[where[0]] + where[1] - 1  # [K] packed column predicting it
    return hidden[bins[where[0]], before], where


_UNSHARED: set = set()  # model classes already reported as running without a shared prefix


def shares_prefix(model, prompt_ids, prompt_mask, completion_mask, mode: str = "auto") -> bool:
    """Whether the shared-prefix forward runs: never with `mode` never; otherwise on a Llama-family
    model (not sharded), and with `mode` auto only where it sends fewer tokens through the decoder
    than packing: distinct prompts x prompt width + the completions' packed rows x longest
    completion (`SharedLayout`) against every real token, so short prompts under long completions
    keep the packed forward. A model it cannot apply to runs every row in full, and says so once."""
    if mode == "never":
        return False
    parts = causal_parts(model)
    if parts is None:
        name = type(base_model(model)).__name__
        if name not in _UNSHARED:
            _UNSHARED.add(name)
            print(
                f"rlkit: optim.share_prefix: {name} runs every row's prompt in full (the shared prefix needs a "
                "Llama-family model, not sharded)",
                file=sys.stderr,
            )
        return False
    if mode == "always":
        return True
    layout = SharedLayout(prompt_ids, prompt_mask, completion_mask, completion_mask)  # (its shape: any ids)
    shared = len(layout.prompts) * prompt_ids.shape[1] + layout.ids.numel()
    return shared < int(prompt_mask.sum() + completion_mask.sum())


def rollout_logprobs(
    model, r: Rollout, temperature: float = 1.0, entropy: str = "none", share: str = "never", replay: bool = False
):
    """Log-probs (and entropies) of a rollout's completions; `share` (auto, always, never): each
    distinct prompt computed once (`shared_hidden`, see `shares_prefix`), else the packed forward;
    `replay`: on each token's sampling support where the rollout has it (`Rollout.support`)."""
    batch = (r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
    return token_logprobs(model, *batch, temperature, entropy, share=share, support=r.support if replay else None)
