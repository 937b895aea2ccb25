"""Decoders: prompt prefill and one-token steps over a KV cache, with rows that can leave the batch.

`rlkit.llama.LlamaDecoder` runs Llama-family decoder stacks (llama, qwen2, qwen3, mistral without a
sliding window) through their own modules (norms, projections, MLPs, rotary table) but with its
own attention glue: one pre-allocated KV buffer per layer, a pre-built padding mask that is
sliced rather than rebuilt, rotary angles looked up from a table, fused projections (a LoRA
policy's adapters folded into their weights for the call). That is
about 30 operations per layer and step instead of the ~230 of the generic forward. Every other
model goes through `HFForward`, the model's own forward with a `DynamicCache`. Both give the
model's logits (tested against `model.generate`); `rlkit.engines.kv_cache.generate` drives either.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

from rlkit.llama import LlamaDecoder, llama_family
from rlkit.tensors import positions


def decoder(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int):
    cls = LlamaDecoder if llama_family(model) else HFForward
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
