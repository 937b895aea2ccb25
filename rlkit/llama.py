"""The Llama-family fast path, the one module that reaches into transformers' model internals
(llama, qwen2, qwen3, mistral without a sliding window): which models it applies to and their
parts (`llama_family`, `causal_parts`), the layer pieces run outside the model's own forward
(normed projections with the model's rotary function, attention, residual adds), the training
forward with each distinct prompt computed once (`shared_hidden`), and the decoder with
pre-allocated KV buffers and fused projections (`LlamaDecoder`). Every other model goes through its own
forward (`rlkit.tensors.trimmed_inputs`, `rlkit.engines.decoders.HFForward`)."""

from __future__ import annotations

import sys
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from rlkit.models import AdaptersOff
from rlkit.parallel import is_sharded
from rlkit.projections import fused, head, lora_adapters
from rlkit.tensors import completion_width, pack, positions


def rotary(attn):
    """The rotary function of the attention module's own transformers model file."""
    return sys.modules[type(attn).__module__].apply_rotary_pos_emb


LEAN_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def base_model(model):
    """The causal LM under a peft wrapper (its LoRA layers stay in place)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def llama_family(model) -> bool:
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
    if not llama_family(model) or is_sharded(model):  # a sharded model runs through its own forward
        return None
    m = base_model(model)
    return m.model, m.lm_head, context


def shared_hidden(body, lm_head, context, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """`packed_hidden` with each distinct prompt of the rows computed once: the decoder runs over
    the U distinct prompts and, beside them, over the completions packed side by side within their
    group (`SharedLayout`), whose attention reads the keys and values of their own prompt (copied
    per packed row, so its gradient gathers from every completion) and of their own earlier tokens;
    position ids continue from the prompt. A group of G completions costs its prompt plus the packed
    rows of its completions instead of G x (prompt + completion), and no attention score between two
    completions is computed. Same hidden states as the unshared forward (to float rounding).
    -> hidden [K, H] and `where` of the K completion tokens"""
    s = SharedLayout(prompt_ids, prompt_mask, completion_ids, completion_mask)
    Tp, W, dev = s.prompts.shape[1], s.ids.shape[1], prompt_ids.device
    causal_p = torch.ones(Tp, Tp, dtype=torch.bool, device=dev).tril()
    p_attn = ((causal_p & s.p_mask[:, None, :]) | torch.eye(Tp, dtype=torch.bool, device=dev))[
        :, None
    ]  # [U, 1, Tp, Tp]
    causal_c = torch.ones(W, W, dtype=torch.bool, device=dev).tril()
    own = causal_c & (s.seq[:, :, None] == s.seq[:, None, :]) & (s.seq[:, None, :] >= 0)  # [B, W, W]
    c_attn = torch.cat([s.p_mask[s.bin_owner][:, None, :].expand(-1, W, -1), own], -1)[:, None]  # [B, 1, W, Tp + W]
    with context:
        xp, xc = body.embed_tokens(s.prompts), body.embed_tokens(s.ids)  # [U, Tp, H], [B, W, H]
        rope_p, rope_c = body.rotary_emb(xp, s.p_pos), body.rotary_emb(xc, s.pos)  # (cos, sin) [., ., hd] each
        for layer in body.layers:
            qp, kp, vp = _qkv(layer, xp, rope_p)  # [U, h, Tp, hd], [U, kvh, Tp, hd] x 2
            qc, kc, vc = _qkv(layer, xc, rope_c)  # [B, h, W, hd], [B, kvh, W, hd] x 2
            xp = _finish(layer, xp, _attend(layer, qp, kp, vp, p_attn))
            k, v = torch.cat([kp[s.bin_owner], kc], 2), torch.cat([vp[s.bin_owner], vc], 2)  # [B, kvh, Tp + W, hd]
            xc = _finish(layer, xc, _attend(layer, qc, k, v, c_attn))
        xp, xc = norm(body.norm, xp), norm(body.norm, xc)
    where = completion_mask.bool().nonzero(as_tuple=True)  # [K] each
    r, t = where
    before = xc[s.bins[r], (s.offset[r] + t - 1).clamp(min=0)]  # [K, H] the completion's own previous token
    return torch.where((t == 0)[:, None], xp[s.owner[r], -1], before), where  # [K, H]


class SharedLayout:
    """The inputs of `shared_hidden`: the U distinct prompts (`prompts` [U, Tp], `p_mask`, `p_pos`),
    each row's `owner` among them [n], and the completions packed into B rows of the longest one's
    width W, each packed row holding completions of one prompt only (`bin_owner` [B]): `ids`, `pos`
    (continuing from the prompt) and `seq` (the row each column holds, -1 for none) [B, W]; each
    row's packed row and first column, `bins` and `offset` [n]."""

    def __init__(self, prompt_ids, prompt_mask, completion_ids, completion_mask):
        self.prompts, self.owner = torch.unique(prompt_ids, dim=0, return_inverse=True)  # [U, Tp], [n]
        dev, n = prompt_ids.device, len(prompt_ids)
        first = torch.zeros(len(self.prompts), dtype=torch.long, device=dev).scatter_(
            0, self.owner, torch.arange(n, device=dev)
        )
        self.p_mask = prompt_mask[first].bool()  # [U, Tp] (any row of each prompt: they are equal)
        self.p_pos = positions(self.p_mask.long())  # [U, Tp]
        W = completion_width(completion_mask)
        col = torch.arange(W, device=dev)  # [W]
        span = torch.where(completion_mask[:, :W].bool(), col + 1, 0).amax(-1)  # [n] columns up to its last token
        bins, offset, owners = [0] * n, [0] * n, []
        for u in range(len(self.prompts)):
            rows = (self.owner == u).nonzero().flatten().tolist()
            b, o, count = pack(span[rows].tolist(), W)
            for i, bi, oi in zip(rows, b, o):
                bins[i], offset[i] = len(owners) + bi, oi
            owners += [u] * count
        self.bins, self.offset = torch.tensor(bins, device=dev), torch.tensor(offset, device=dev)  # [n] each
        self.bin_owner = torch.tensor(owners, dtype=torch.long, device=dev)  # [B]
        r, c = (col[None] < span[:, None]).nonzero(as_tuple=True)  # [R] each: every column a row uses
        self.ids = torch.zeros(len(owners), W, dtype=completion_ids.dtype, device=dev)  # [B, W]
        self.pos = torch.zeros(len(owners), W, dtype=torch.long, device=dev)  # [B, W]
        self.seq = torch.full((len(owners), W), -1, dtype=torch.long, device=dev)  # [B, W]
        at = (self.bins[r], self.offset[r] + c)
        self.ids[at], self.pos[at] = completion_ids[r, c], self.p_mask.sum(-1)[self.owner[r]] + c
        self.seq[at] = torch.where(completion_mask[r, c].bool(), r, -1)


def packed_body(body, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The decoder stack over packed rows (sequences side by side, position ids restarting at 0 at
    each), every token attending to the earlier tokens of its own sequence; the layers run as
    `shared_hidden` runs them.  ids, pos [B, W] -> final hidden [B, W, H]"""
    seq = (pos == 0).cumsum(-1)  # [B, W] each token's sequence within its packed row
    causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=ids.device).tril()  # [W, W]
    attn = (causal & (seq[:, :, None] == seq[:, None, :]))[:, None]  # [B, 1, W, W]
    x = body.embed_tokens(ids)  # [B, W, H]
    rope = body.rotary_emb(x, pos)  # (cos, sin) [B, W, hd] each
    for layer in body.layers:
        x = _finish(layer, x, _attend(layer, *_qkv(layer, x, rope), attn))
    return norm(body.norm, x)  # [B, W, H]


@torch.no_grad()
def decoded_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """`packed_hidden` through the decoder (`LlamaDecoder.hidden`), without gradients: prompt and
    completion left-aligned into one sequence per row, the prefix every row shares computed once,
    a LoRA policy's adapters folded into the weights.  -> hidden [K, H] and `where` of the K
    completion tokens"""
    ids = torch.cat([prompt_ids, completion_ids], 1)  # [n, S]
    mask = torch.cat([prompt_mask, completion_mask], 1).long()  # [n, S]
    order = mask.sort(dim=1, stable=True).indices  # [n, S] padding first, then each row's tokens in order
    ids, mask = ids.gather(1, order), mask.gather(1, order)
    hidden = LlamaDecoder(model, ids, mask, 0).hidden()  # [n, S, H]
    where = completion_mask.bool().nonzero(as_tuple=True)  # [K] each
    index = positions(completion_mask.long())[where]  # [K] each token's index in its completion
    before = ids.shape[1] - completion_mask.sum(-1)[where[0]] + index - 1  # [K] the column before it
    return hidden[where[0], before], where


def _qkv(layer, x: torch.Tensor, rope: tuple) -> tuple:
    """The layer's normed projections of x [B, T, H], rotated.  -> q [B, h, T, hd], k and v [B, kvh, T, hd]"""
    a = layer.self_attn
    B, T, _ = x.shape
    h = norm(layer.input_layernorm, x)
    q, k = linear(a.q_proj, h).view(B, T, -1, a.head_dim), linear(a.k_proj, h).view(B, T, -1, a.head_dim)
    if hasattr(a, "q_norm"):  # qwen3
        q, k = a.q_norm(q), a.k_norm(k)
    q, k = rotary(a)(q.transpose(1, 2), k.transpose(1, 2), *rope)
    return q, k, linear(a.v_proj, h).view(B, T, -1, a.head_dim).transpose(1, 2)


def _attend(layer, q, k, v, mask) -> torch.Tensor:
    """SDPA with the layer's scale and grouped keys.  -> [B, T, h * hd]"""
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.self_attn.scaling, enable_gqa=True)
    return o.transpose(1, 2).flatten(2)


def _finish(layer, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """The residual adds of the attention output and the MLP (a gated one as `linear`s).  -> [B, T, H]"""
    x = x + linear(layer.self_attn.o_proj, attended)
    h, mlp = norm(layer.post_attention_layernorm, x), layer.mlp
    if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return x + mlp(h)
    return x + linear(mlp.down_proj, mlp.act_fn(linear(mlp.gate_proj, h)) * linear(mlp.up_proj, h))


def norm(module, x: torch.Tensor) -> torch.Tensor:
    """An fp32 RMSNorm module as one fused op (same formula); any other norm, or a lower precision
    (where the module upcasts), through its own forward."""
    eps = getattr(module, "variance_epsilon", None)
    names = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")
    if eps is None or type(module).__name__ not in names or x.dtype != torch.float32:
        return module(x)
    return F.rms_norm(x, module.weight.shape, module.weight, eps)


def linear(m, x: torch.Tensor) -> torch.Tensor:
    """`m(x)`; for a vanilla LoRA layer (`lora_adapters`) its adapters added onto the base output in
    one addmm each, x W^T + s (x A^T) B^T, instead of peft's separate product, scaling and sum
    (the same map and gradients, to float rounding).  [..., in] -> [..., out]"""
    active = lora_adapters(m)
    if not active:
        return m(x)
    flat = x.flatten(0, -2)  # [n, in]
    y = F.linear(flat, m.base_layer.weight, m.base_layer.bias)  # [n, out]
    for a in active:
        y = torch.addmm(y, m.lora_A[a](flat), m.lora_B[a].weight.t(), alpha=m.scaling[a])  # [n, out]
    return y.view(*x.shape[:-1], -1)


def shared_prefix_layout(ids: torch.Tensor, mask: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Left-padded prompts laid out for a prefill that computes their common prefix once: the
    longest run of first tokens that every row shares (leaving each row at least one token of its
    own; none for a single row) moved to columns 0..L-1, the padding after it, each row's own tokens
    where they were. Position ids from the mask stay each token's position in its prompt.
    [N, Tp] each -> L, ids [N, Tp], mask [N, Tp] (bool)"""
    N, Tp = ids.shape
    lens = mask.sum(-1)  # [N]
    pads = (Tp - lens)[:, None]  # [N, 1]
    col = torch.arange(Tp, device=ids.device)[None]  # [1, Tp]
    aligned = ids.gather(1, (col + pads).clamp(max=Tp - 1))  # [N, Tp] each row's tokens from column 0
    same = ((aligned == aligned[:1]) | (col >= lens[:, None])).all(0)  # [Tp] columns where all rows agree
    L = 0 if N < 2 else min(int(same.long().cumprod(0).sum()), int(lens.min()) - 1)
    if L < 1:
        return 0, ids, mask.bool()
    moved = (col < L) | (col >= L + pads)  # [N, Tp] the new mask
    ids = torch.where(col < L, aligned[:1], torch.where(moved, ids, ids[:, :1]))  # [N, Tp] padding: any token
    return L, ids, moved


class LlamaDecoder:
    """Llama-family decoding with pre-allocated KV buffers [n, kv_heads, Tmax, head_dim] per layer."""

    def __init__(self, model, prompt_ids, prompt_mask, max_new_tokens: int):
        m = base_model(model)
        self.lm_head, self.body = m.lm_head, m.model
        self.head = head(m.lm_head)  # [n, H] -> [n, V]
        cfg = m.config
        self.layers = list(self.body.layers)
        self.qkv = [fused(l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj) for l in self.layers]
        self.gate_up = [fused(l.mlp.gate_proj, l.mlp.up_proj) for l in self.layers]
        self.out = [fused(l.self_attn.o_proj) for l in self.layers]
        self.down = [fused(l.mlp.down_proj) for l in self.layers]
        attn = self.layers[0].self_attn
        self.hd = attn.head_dim
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.rope = rotary(attn)
        N, Tp = prompt_ids.shape
        Tmax = Tp + max_new_tokens
        dev, dt = prompt_ids.device, self.body.embed_tokens.weight.dtype
        pos = torch.arange(Tmax, device=dev)[None]  # [1, Tmax]
        self.cos, self.sin = self.body.rotary_emb(torch.zeros(1, device=dev, dtype=dt), pos)  # [1, Tmax, hd] each
        self.k = [torch.empty(N, self.kv_heads, Tmax, self.hd, device=dev, dtype=dt) for _ in self.layers]
        self.v = [torch.empty_like(k) for k in self.k]
        self.shared, self.ids, prompt_mask = shared_prefix_layout(prompt_ids, prompt_mask)  # [N, Tp] each
        self.mask = torch.ones(N, Tmax, dtype=torch.bool, device=dev)  # [N, Tmax] key positions a row attends
        self.mask[:, :Tp] = prompt_mask
        self.pos = positions(prompt_mask.long())  # [N, Tp]
        self.len = Tp

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, attn_mask: torch.Tensor, every: bool = False):
        """ids, pos [n, s] at cache columns len-s..len-1; attn_mask [n, 1, s, len]. With n = 1 the keys
        and values are written to every row (a prefix they share).  -> last position's hidden [n, H]
        (`every`: every position's, [n, s, H])"""
        n, s = ids.shape
        x = self.body.embed_tokens(ids)  # [n, s, H]
        cos, sin = self.cos[0, pos], self.sin[0, pos]  # [n, s, hd]
        lo, q_end, k_end = self.len - s, self.heads * self.hd, (self.heads + self.kv_heads) * self.hd
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            h = self.qkv[i](norm(layer.input_layernorm, x))  # [n, s, (h + 2 kvh) hd]
            q = h[..., :q_end].view(n, s, self.heads, self.hd)  # [n, s, h, hd]
            k = h[..., q_end:k_end].view(n, s, self.kv_heads, self.hd)  # [n, s, kvh, hd]
            if hasattr(a, "q_norm"):  # qwen3
                q, k = norm(a.q_norm, q), norm(a.k_norm, k)
            q, k = self.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [n, h, s, hd], [n, kvh, s, hd]
            self.k[i][:, :, lo : self.len] = k
            self.v[i][:, :, lo : self.len] = h[..., k_end:].view(n, s, self.kv_heads, self.hd).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q,
                self.k[i][:n, :, : self.len],  # n = 1 for the shared prefix, whose keys every row holds
                self.v[i][:n, :, : self.len],
                attn_mask=attn_mask,
                scale=a.scaling,
                enable_gqa=True,
            )  # [n, h, s, hd]
            x = x + self.out[i](o.transpose(1, 2).reshape(n, s, -1))  # [n, s, H]
            g, u = self.gate_up[i](norm(layer.post_attention_layernorm, x)).chunk(2, -1)  # [n, s, I] each
            x = x + self.down[i](layer.mlp.act_fn(g) * u)
        return norm(self.body.norm, x if every else x[:, -1])  # [n, H] or [n, s, H]

    def prefill(self) -> torch.Tensor:
        """The prompts' keys and values: the prefix all rows share computed once (one row, written
        to every row), then each row's rest.  -> the last position's logits [N, V]"""
        h = self._prefill(every=False)  # [N, H]
        self.pos = self.pos[:, -1]  # [N]
        return self.head(h).float()  # [N, V]

    def hidden(self) -> torch.Tensor:
        """The final hidden state at every token of the (left-padded) rows, each at its column of
        the rows as given; the shared prefix computed once. Padding columns: anything.  -> [N, Tp, H]"""
        N, Tp, L = *self.ids.shape, self.shared
        prefix, rest = self._prefill(every=True)  # [1, L, H], [N, Tp - L, H]
        col = torch.arange(Tp, device=self.ids.device)[None]  # [1, Tp]
        token = col - (Tp - self.mask[:, :Tp].sum(-1, keepdim=True))  # [N, Tp] token index in its row (< 0: padding)
        moved = torch.where((token >= 0) & (token < L), token, col)  # [N, Tp] its column after the layout
        full = torch.cat([prefix.expand(N, -1, -1), rest], 1)  # [N, Tp, H]
        return full.gather(1, moved[..., None].expand_as(full))  # [N, Tp, H]

    def force(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """After `prefill`: the hidden states of tokens teacher-forced after each prompt (`ids`, `mask`
        [N, Tf] right-padded, Tf at most the decode budget), leaving the decoder as it was (their
        keys and values go where decoding writes its own before reading them).  -> [N, Tf, H]"""
        Tp, Tf = self.len, ids.shape[1]
        causal = torch.ones(Tf, Tf, dtype=torch.bool, device=ids.device).tril()  # [Tf, Tf]
        attn = torch.cat([self.mask[:, None, :Tp].expand(-1, Tf, -1), causal & mask[:, None, :].bool()], -1)
        self.len = Tp + Tf
        try:
            pos = self.pos[:, None] + 1 + torch.arange(Tf, device=ids.device)  # [N, Tf]
            return self._forward(ids, pos, attn[:, None], every=True)  # [N, Tf, H]
        finally:
            self.len = Tp

    def _prefill(self, every: bool):
        """The prefix's forward (one row) and the rows' rest, their hidden states as `_forward` gives
        them.  -> rest's [N, H] (`every`: (prefix's [1, L, H], rest's [N, Tp - L, H]))"""
        Tp, L, dev = self.len, self.shared, self.ids.device
        causal = torch.ones(Tp, Tp, dtype=torch.bool, device=dev).tril()  # [Tp, Tp]
        prefix = self.body.embed_tokens.weight.new_zeros(1, 0, self.body.config.hidden_size)  # [1, 0, H]
        if L:
            self.len = L
            prefix = self._forward(self.ids[:1, :L], self.pos[:1, :L], causal[None, None, :L, :L], every)
            self.len = Tp
        eye = torch.eye(Tp, dtype=torch.bool, device=dev)[L:]  # a padding query sees itself (no empty rows)
        attn = (causal[L:] & self.mask[:, None, :Tp]) | eye  # [N, Tp - L, Tp]
        rest = self._forward(self.ids[:, L:], self.pos[:, L:], attn[:, None], every)
        return (prefix, rest) if every else rest

    def step(self, tok: torch.Tensor) -> torch.Tensor:
        self.len, self.pos = self.len + 1, self.pos + 1
        h = self._forward(tok[:, None], self.pos[:, None], self.mask[:, None, None, : self.len])  # [n, H]
        return self.head(h).float()  # [n, V]

    def keep(self, idx: torch.Tensor) -> None:
        L = self.len
        for buf in (self.k, self.v):
            for i, b in enumerate(buf):
                new = torch.empty((len(idx), *b.shape[1:]), dtype=b.dtype, device=b.device)  # [n', kvh, Tmax, hd]
                new[:, :, :L] = b[idx, :, :L]
                buf[i] = new
        self.mask, self.pos = self.mask[idx], self.pos[idx]
