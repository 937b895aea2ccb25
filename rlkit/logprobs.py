"""Training log-probs: the policy (or reference) run forward over prompt + completion with no
compute spent on padding. Llama-family models run on packed rows (`pack`, `packed_hidden`: the
rows' real tokens side by side, positions restarting at each sequence), or with each distinct
prompt computed once and its completions attending to it (`shared_hidden`); others on the
micro-batch trimmed to its longest row (`trimmed_inputs`); logits are computed only where a
completion token is predicted."""
from __future__ import annotations

import heapq
import sys
from contextlib import nullcontext

import torch

from rlkit.parallel import is_sharded
from rlkit.models import AdaptersOff
from rlkit.types import Rollout

LEAN_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)  # [N, S]


def base_model(model):
    """The causal LM under a peft wrapper (its LoRA layers stay in place)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def lean_supported(model) -> bool:
    m = base_model(model)
    cfg = m.config
    if getattr(cfg, "model_type", None) not in LEAN_TYPES or not hasattr(m, "lm_head"):
        return False
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
        return False
    return not (cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None))


def causal_parts(model):
    """(decoder stack, lm_head, context to run them in) of a Llama-family causal LM, under peft or
    as rlkit's adapters-off reference (`rlkit.models.AdaptersOff`); None for any other model.
    For these models logits are exactly lm_head(decoder(...)), so hidden states can be gathered
    before the head."""
    context = nullcontext()
    if isinstance(model, AdaptersOff):
        model, context = model.policy[0], model.policy[0].disable_adapter()
    if not lean_supported(model) or is_sharded(model):  # a sharded model runs through its own forward
        return None
    m = base_model(model)
    return m.model, m.lm_head, context


def pack(lengths: list[int], width: int) -> tuple[list[int], list[int], int]:
    """Rows of these lengths placed into as few rows of `width` as worst-fit decreasing finds.
    -> (packed row, offset) of each row and the number of packed rows"""
    bins, offset = [0] * len(lengths), [0] * len(lengths)
    room = []  # heap of (-free columns, packed row)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if room and -room[0][0] >= lengths[i]:
            free, b = heapq.heappop(room)
            bins[i], offset[i] = b, width + free
            heapq.heappush(room, (free + lengths[i], b))
        else:
            bins[i] = len(room)
            heapq.heappush(room, (lengths[i] - width, len(room)))
    return bins, offset, len(room)


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
                   entropy: str = "none", packed: bool = True, share: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the completion tokens. No compute is spent on padding: Llama-family models
    run on packed rows (`packed_hidden`), others on the micro-batch trimmed to its longest row
    (`trimmed_inputs`); logits are computed only where a completion token is predicted and never
    as a full-vocabulary log-softmax over the sequence. `entropy`: "none", "metric" (no gradient)
    or "grad" (for an entropy bonus). Returns logp [N, Tc] and entropy [N, Tc] or None (zeros on
    padding)."""
    parts = causal_parts(model) if packed else None
    shared = share and shares_prefix(model, prompt_ids)
    if parts is not None:
        forward = shared_hidden if shared else packed_hidden
        hidden, where = forward(*parts, prompt_ids, prompt_mask, completion_ids, completion_mask)  # [K, H]
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


def shared_layout(prompt_ids, prompt_mask, completion_mask):
    """Where each token goes when every distinct prompt of the rows is computed once: a segment per
    prompt, [prompt | completion of each row that has it], segments packed into rows (`pack`).
    -> (B, W, per row: packed row, segment start, start of its completion in the segment, prompt
    length) as lists"""
    _, owner = torch.unique(prompt_ids, dim=0, return_inverse=True)  # [n] which distinct prompt each row has
    owner, plen, clen = owner.tolist(), prompt_mask.sum(-1).tolist(), completion_mask.sum(-1).tolist()
    seg_len, start = {}, [0] * len(owner)
    for i, u in enumerate(owner):  # rows in order; a segment grows by each of its rows' completion
        seg_len.setdefault(u, plen[i])
        start[i], seg_len[u] = seg_len[u], seg_len[u] + clen[i]
    segs = sorted(seg_len)
    bins, offset, B = pack([seg_len[u] for u in segs], max(seg_len.values()))
    where = {u: (bins[j], offset[j]) for j, u in enumerate(segs)}
    return B, max(seg_len.values()), [where[u][0] for u in owner], [where[u][1] for u in owner], start, plen, owner


def shared_hidden(body, lm_head, context, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """`packed_hidden` with each distinct prompt computed once: its rows' completions follow it in
    one segment and attend to it through a shared-prefix mask (a completion sees the prompt and its
    own earlier tokens; position ids continue from the prompt), so a group of G completions costs
    prompt + G x completion tokens instead of G x (prompt + completion). Same hidden states as the
    unshared forward (to float rounding).  -> hidden [K, H] and `where` of the K completion tokens"""
    dev, Tp = prompt_ids.device, prompt_ids.shape[1]
    B, W, row, seg0, start, plen, owner = shared_layout(prompt_ids, prompt_mask, completion_mask)
    ids = torch.zeros(B, W, dtype=prompt_ids.dtype, device=dev)  # [B, W]
    pos = torch.zeros(B, W, dtype=torch.long, device=dev)  # [B, W]
    seg = -1 - torch.arange(B * W, device=dev).view(B, W)  # [B, W] fillers: a segment each
    branch = torch.zeros(B, W, dtype=torch.long, device=dev)  # [B, W] 0: prompt, i + 1: row i's completion
    first = {}
    for i, u in enumerate(owner):
        b, o, p = row[i], seg0[i], plen[i]
        if u not in first:  # the prompt, once
            first[u] = i
            ids[b, o:o + p], pos[b, o:o + p], seg[b, o:o + p] = prompt_ids[i, Tp - p:], torch.arange(p, device=dev), u
        c = int(completion_mask[i].sum())
        span = slice(o + start[i], o + start[i] + c)
        ids[b, span], pos[b, span] = completion_ids[i, :c], torch.arange(p, p + c, device=dev)
        seg[b, span], branch[b, span] = u, i + 1
    col = torch.arange(W, device=dev)
    allowed = ((seg[:, :, None] == seg[:, None, :]) & (col[None, None, :] <= col[None, :, None])
               & ((branch[:, None, :] == 0) | (branch[:, None, :] == branch[:, :, None])))  # [B, W(query), W(key)]
    with context:
        hidden = body(input_ids=ids, position_ids=pos, attention_mask=attention_mask(body, allowed),
                      use_cache=False).last_hidden_state  # [B, W, H]
    where = completion_mask.bool().nonzero(as_tuple=True)  # [K] each
    r, t = where
    rows, seg0_t, start_t, plen_t = (torch.tensor(x, device=dev)[r] for x in (row, seg0, start, plen))  # [K] each
    before = torch.where(t == 0, seg0_t + plen_t - 1, seg0_t + start_t + t - 1)  # [K] the column predicting it
    return hidden[rows, before], where


def attention_mask(body, allowed: torch.Tensor) -> torch.Tensor:
    """A prepared 4D mask from `allowed` [B, W, W] in the form the model's attention takes: boolean
    for SDPA, additive for the eager implementation.  -> [B, 1, W, W]"""
    if body.config._attn_implementation == "sdpa":
        return allowed[:, None]
    dtype = body.embed_tokens.weight.dtype
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)[:, None]


_UNSHARED: set = set()  # model classes already reported as running without a shared prefix


def shares_prefix(model, prompt_ids) -> bool:
    """Whether the shared-prefix forward applies: a Llama-family model with SDPA or eager attention
    (not sharded), and rows that repeat a prompt. A model it cannot apply to runs every row in
    full, and says so once."""
    parts = causal_parts(model)
    if parts is None or parts[0].config._attn_implementation not in ("sdpa", "eager"):
        name = type(base_model(model)).__name__
        if name not in _UNSHARED:
            _UNSHARED.add(name)
            print(f"rlkit: optim.share_prefix: {name} runs every row's prompt in full (the shared prefix needs a "
                  "Llama-family model with SDPA or eager attention, not sharded)", file=sys.stderr)
        return False
    return len(prompt_ids) > 1 and len(torch.unique(prompt_ids, dim=0)) < len(prompt_ids)


def rollout_logprobs(model, r: Rollout, temperature: float = 1.0, entropy: str = "none", share: bool = False):
    """Log-probs (and entropies) of a rollout's completions; `share`: each distinct prompt
    computed once where the model allows it (`shared_hidden`), otherwise the packed forward."""
    return token_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                          temperature, entropy, share=share)
