"""Decoders: prompt prefill and one-token steps over a KV cache, with rows that can leave the batch.

`Lean` runs Llama-family decoder stacks (llama, qwen2, qwen3, mistral without a sliding window)
through their own modules (norms, projections, MLPs, rotary table) but with its own attention
glue: one pre-allocated KV buffer per layer, a pre-built padding mask that is sliced rather
than rebuilt, rotary angles looked up from a table, fused projections. That is about 30
operations per layer and step instead of the ~230 of the generic forward. Every other model
goes through `HFForward`,
the model's own forward with a `DynamicCache`. Both give the model's logits (tested against
`model.generate`); `rlkit.engines.kv_cache.generate` drives either.
"""

from __future__ import annotations

import inspect
import sys

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from rlkit.logprobs import base_model, lean_supported, positions


def decoder(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int):
    cls = Lean if lean_supported(model) else HFForward
    return cls(model, prompt_ids, prompt_mask, max_new_tokens)


class HFForward:
    """The model's own forward and `DynamicCache`; leaving rows are dropped from the cache."""

    def __init__(self, model, prompt_ids, prompt_mask, max_new_tokens: int):
        self.model, self.ids = model, prompt_ids
        N, Tp = prompt_ids.shape
        self.mask = torch.ones(N, Tp + max_new_tokens, dtype=prompt_mask.dtype, device=prompt_ids.device)  # [N, Tmax]
        self.mask[:, :Tp] = prompt_mask
        self.len, self.pos = Tp, positions(prompt_mask)[:, -1:]  # [N, 1] position of the last token
        self.cache = DynamicCache()
        self.cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def prefill(self) -> torch.Tensor:
        mask = self.mask[:, : self.len]  # [N, Tp]
        out = self.model(
            input_ids=self.ids,
            attention_mask=mask,
            position_ids=positions(mask),
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_kw: self.cache},
        )
        return out.logits[:, -1].float()  # [N, V]

    def step(self, tok: torch.Tensor) -> torch.Tensor:
        self.len, self.pos = self.len + 1, self.pos + 1
        out = self.model(
            input_ids=tok[:, None],
            attention_mask=self.mask[:, : self.len],
            position_ids=self.pos,
            use_cache=True,
            **{self.cache_kw: self.cache},
        )
        return out.logits[:, -1].float()  # [n, V]

    def keep(self, idx: torch.Tensor) -> None:
        self.cache.batch_select_indices(idx)
        self.mask, self.pos = self.mask[idx], self.pos[idx]


def norm(module, x: torch.Tensor) -> torch.Tensor:
    """An fp32 RMSNorm module as one fused op (same formula); any other norm, or a lower precision
    (where the module upcasts), through its own forward."""
    eps = getattr(module, "variance_epsilon", None)
    names = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")
    if eps is None or type(module).__name__ not in names or x.dtype != torch.float32:
        return module(x)
    return F.rms_norm(x, module.weight.shape, module.weight, eps)


def fused(*linears):
    """One projection computing several plain `nn.Linear`s side by side (outputs concatenated),
    with the weight copied input-major, which small-batch matmuls on a CPU run faster on. On a GPU
    (where a copy of a large model's weights would not fit and cuBLAS needs none) and for anything
    else (a LoRA layer) each module runs itself."""
    if all(type(m) is torch.nn.Linear for m in linears) and linears[0].weight.device.type == "cpu":
        weight = torch.cat([m.weight for m in linears]).t().contiguous()  # [in, sum out]
        if linears[0].bias is None:
            return lambda x: x @ weight
        bias = torch.cat([m.bias for m in linears])  # [sum out]
        return lambda x: torch.addmm(bias, x.flatten(0, -2), weight).view(*x.shape[:-1], -1)
    return lambda x: torch.cat([m(x) for m in linears], -1)


class Lean:
    """Llama-family decoding with pre-allocated KV buffers [n, kv_heads, Tmax, head_dim] per layer."""

    def __init__(self, model, prompt_ids, prompt_mask, max_new_tokens: int):
        m = base_model(model)
        self.lm_head, self.body = m.lm_head, m.model
        cfg = m.config
        self.layers = list(self.body.layers)
        self.qkv = [fused(l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj) for l in self.layers]
        self.gate_up = [fused(l.mlp.gate_proj, l.mlp.up_proj) for l in self.layers]
        self.out = [fused(l.self_attn.o_proj) for l in self.layers]
        self.down = [fused(l.mlp.down_proj) for l in self.layers]
        attn = self.layers[0].self_attn
        self.hd = attn.head_dim
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        N, Tp = prompt_ids.shape
        Tmax = Tp + max_new_tokens
        dev, dt = prompt_ids.device, self.body.embed_tokens.weight.dtype
        self.ids = prompt_ids
        pos = torch.arange(Tmax, device=dev)[None]  # [1, Tmax]
        self.cos, self.sin = self.body.rotary_emb(torch.zeros(1, device=dev, dtype=dt), pos)  # [1, Tmax, hd] each
        self.k = [torch.empty(N, self.kv_heads, Tmax, self.hd, device=dev, dtype=dt) for _ in self.layers]
        self.v = [torch.empty_like(k) for k in self.k]
        self.mask = torch.ones(N, Tmax, dtype=torch.bool, device=dev)  # [N, Tmax] key positions a row attends
        self.mask[:, :Tp] = prompt_mask.bool()
        self.pos = positions(prompt_mask)  # [N, Tp]
        self.len = Tp

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        """ids, pos [n, s] at cache columns len-s..len-1; attn_mask [n, 1, s, len]. -> last position's hidden [n, H]"""
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
                self.k[i][:, :, : self.len],
                self.v[i][:, :, : self.len],
                attn_mask=attn_mask,
                scale=a.scaling,
                enable_gqa=True,
            )  # [n, h, s, hd]
            x = x + self.out[i](o.transpose(1, 2).reshape(n, s, -1))  # [n, s, H]
            g, u = self.gate_up[i](norm(layer.post_attention_layernorm, x)).chunk(2, -1)  # [n, s, I] each
            x = x + self.down[i](layer.mlp.act_fn(g) * u)
        return norm(self.body.norm, x[:, -1])  # [n, H]

    def prefill(self) -> torch.Tensor:
        Tp = self.len
        causal = torch.ones(Tp, Tp, dtype=torch.bool, device=self.ids.device).tril()  # [Tp, Tp]
        eye = torch.eye(Tp, dtype=torch.bool, device=self.ids.device)  # a padding query sees itself (no empty rows)
        attn = (causal & self.mask[:, None, :Tp]) | eye  # [N, Tp, Tp]
        h = self._forward(self.ids, self.pos, attn[:, None])  # [N, H]
        self.pos = self.pos[:, -1]  # [N]
        return self.lm_head(h).float()  # [N, V]

    def step(self, tok: torch.Tensor) -> torch.Tensor:
        self.len, self.pos = self.len + 1, self.pos + 1
        h = self._forward(tok[:, None], self.pos[:, None], self.mask[:, None, None, : self.len])  # [n, H]
        return self.lm_head(h).float()  # [n, V]

    def keep(self, idx: torch.Tensor) -> None:
        L = self.len
        for buf in (self.k, self.v):
            for i, b in enumerate(buf):
                new = torch.empty((len(idx), *b.shape[1:]), dtype=b.dtype, device=b.device)  # [n', kvh, Tmax, hd]
                new[:, :, :L] = b[idx, :, :L]
                buf[i] = new
        self.mask, self.pos = self.mask[idx], self.pos[idx]
