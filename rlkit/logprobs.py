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
import torch.nn.functional as F

from rlkit.models import AdaptersOff
from rlkit.parallel import is_sharded
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


def completion_width(completion_mask: torch.Tensor) -> int:
    """Columns up to the last completion token any row has (at least 1).  [n, Tc] -> int"""
    used = completion_mask.any(0).nonzero()  # [k, 1]
    return int(used.max()) + 1 if len(used) else 1


def trimmed_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask):
    """Prompt + completion without the padding columns that every row shares (leading prompt
    columns, trailing completion columns), so no compute is spent on them. Positions come from
    the mask, so trimming changes no row's numbers.  -> ids, mask, position ids [n, S'] and tc, the
    completion columns kept"""
    tc = completion_width(completion_mask)
    p0 = int(prompt_mask.any(0).int().argmax()) if prompt_mask.any() else prompt_mask.shape[1] - 1
    ids = torch.cat([prompt_ids[:, p0:], completion_ids[:, :tc]], 1)  # [n, S']
    mask = torch.cat([prompt_mask[:, p0:], completion_mask[:, :tc]], 1)  # [n, S']
    return ids, mask, positions(mask), tc


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the completion tokens. No compute is spent on padding: Llama-family models
    run on packed rows (`packed_hidden`), others on the micro-batch trimmed to its longest row
    (`trimmed_inputs`); logits are computed only where a completion token is predicted and never
    as a full-vocabulary log-softmax over the sequence. `entropy`: "none", "metric" (no gradient)
    or "grad" (for an entropy bonus). Returns logp [N, Tc] and entropy [N, Tc] or None (zeros on
    padding)."""
    parts = causal_parts(model) if packed else None
    shared = shares_prefix(model, prompt_ids, prompt_mask, completion_mask, share)
    if parts is not None:
        forward = shared_hidden if shared else packed_hidden
        hidden, where = forward(*parts, prompt_ids, prompt_mask, completion_ids, completion_mask)  # [K, H]
        logits = parts[1](hidden).float()  # [K, V]
    else:
        ids, mask, pos, tc = trimmed_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask)
        logits = (
            model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=tc + 1).logits[:, :-1].float()
        )  # [N, tc, V]
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


def shared_hidden(body, lm_head, context, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """`packed_hidden` with each distinct prompt of the rows computed once: the decoder runs over
    the U distinct prompts and, beside them, over the n completions, whose attention reads the keys
    and values of their own prompt (copied per row, so its gradient gathers from every completion)
    and of their own earlier tokens; position ids continue from the prompt. A group of G
    completions costs prompt + G x completion tokens instead of G x (prompt + completion), and no
    attention score between two completions of a group is computed. Same hidden states as the
    unshared forward (to float rounding).  -> hidden [K, H] and `where` of the K completion tokens"""
    distinct, owner = torch.unique(prompt_ids, dim=0, return_inverse=True)  # [U, Tp], [n]
    first = torch.zeros(len(distinct), dtype=torch.long, device=owner.device).scatter_(
        0, owner, torch.arange(len(owner), device=owner.device)
    )  # [U] a row with each prompt (any: they are equal)
    p_mask = prompt_mask[first].bool()  # [U, Tp]
    tc = completion_width(completion_mask)
    c_ids, c_mask = completion_ids[:, :tc], completion_mask[:, :tc].bool()  # [n, tc]
    Tp, dev = distinct.shape[1], distinct.device
    p_pos = positions(p_mask.long())  # [U, Tp]
    c_pos = p_mask.sum(-1)[owner][:, None] + torch.arange(tc, device=dev)  # [n, tc]
    causal_p = torch.ones(Tp, Tp, dtype=torch.bool, device=dev).tril()
    p_attn = ((causal_p & p_mask[:, None, :]) | torch.eye(Tp, dtype=torch.bool, device=dev))[:, None]  # [U, 1, Tp, Tp]
    causal_c = torch.ones(tc, tc, dtype=torch.bool, device=dev).tril()
    c_attn = torch.cat([p_mask[owner][:, None, :].expand(-1, tc, -1), causal_c & c_mask[:, None, :]], -1)[
        :, None
    ]  # [n, 1, tc, Tp + tc]
    with context:
        xp, xc = body.embed_tokens(distinct), body.embed_tokens(c_ids)  # [U, Tp, H], [n, tc, H]
        rope_p, rope_c = body.rotary_emb(xp, p_pos), body.rotary_emb(xc, c_pos)  # (cos, sin) [., ., hd] each
        for layer in body.layers:
            qp, kp, vp = _qkv(layer, xp, rope_p)  # [U, h, Tp, hd], [U, kvh, Tp, hd] x 2
            qc, kc, vc = _qkv(layer, xc, rope_c)  # [n, h, tc, hd], [n, kvh, tc, hd] x 2
            xp = _finish(layer, xp, _attend(layer, qp, kp, vp, p_attn))
            xc = _finish(
                layer, xc, _attend(layer, qc, torch.cat([kp[owner], kc], 2), torch.cat([vp[owner], vc], 2), c_attn)
            )
        xp, xc = body.norm(xp), body.norm(xc)
    where = completion_mask.bool().nonzero(as_tuple=True)  # [K] each
    r, t = where
    hidden = torch.where((t == 0)[:, None], xp[owner[r], -1], xc[r, (t - 1).clamp(min=0)])  # [K, H]
    return hidden, where


def _qkv(layer, x: torch.Tensor, rope: tuple) -> tuple:
    """The layer's normed projections of x [B, T, H], rotated.  -> q [B, h, T, hd], k and v [B, kvh, T, hd]"""
    a = layer.self_attn
    B, T, _ = x.shape
    h = layer.input_layernorm(x)
    q, k = a.q_proj(h).view(B, T, -1, a.head_dim), a.k_proj(h).view(B, T, -1, a.head_dim)
    if hasattr(a, "q_norm"):  # qwen3
        q, k = a.q_norm(q), a.k_norm(k)
    q, k = sys.modules[type(a).__module__].apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), *rope)
    return q, k, a.v_proj(h).view(B, T, -1, a.head_dim).transpose(1, 2)


def _attend(layer, q, k, v, mask) -> torch.Tensor:
    """SDPA with the layer's scale and grouped keys.  -> [B, T, h * hd]"""
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.self_attn.scaling, enable_gqa=True)
    return o.transpose(1, 2).flatten(2)


def _finish(layer, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """The residual adds of the attention output and the MLP.  -> [B, T, H]"""
    x = x + layer.self_attn.o_proj(attended)
    return x + layer.mlp(layer.post_attention_layernorm(x))


_UNSHARED: set = set()  # model classes already reported as running without a shared prefix


def shares_prefix(model, prompt_ids, prompt_mask, completion_mask, mode: str = "auto") -> bool:
    """Whether the shared-prefix forward runs: never with `mode` never; otherwise on a Llama-family
    model (not sharded), and with `mode` auto only where it sends fewer tokens through the decoder
    than packing: distinct prompts x prompt width + rows x longest completion (completions are not
    packed there) against every real token, so short prompts under long, uneven completions keep
    the packed forward. A model it cannot apply to runs every row in full, and says so once."""
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
    tc = completion_width(completion_mask)
    shared = len(torch.unique(prompt_ids, dim=0)) * prompt_ids.shape[1] + len(prompt_ids) * tc
    return shared < int(prompt_mask.sum() + completion_mask.sum())


def rollout_logprobs(model, r: Rollout, temperature: float = 1.0, entropy: str = "none", share: str = "never"):
    """Log-probs (and entropies) of a rollout's completions; `share` (auto, always, never): each
    distinct prompt computed once (`shared_hidden`, see `shares_prefix`), else the packed forward."""
    return token_logprobs(
        model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, temperature, entropy, share=share
    )
