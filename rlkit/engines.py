"""Generation engines: the only way training and evaluation generate text."""
from __future__ import annotations

import torch

from rlkit import fsdp
from rlkit.components import Engine
from rlkit.rollout import Generation, generate


class KVCache(Engine):
    """The trainer's own model, sampled with rlkit's batched KV-cache loop (`rlkit.rollout.generate`).
    It generates from the very weights being trained, so its log-probs are the trainer's and
    `load_weights` has nothing to copy. `min_new_tokens` suppresses EOS before that many tokens
    (`+engine.min_new_tokens=N`; the benchmarks' fixed-length mode). An engine on other hardware
    or software (vLLM, SGLang) sets `exact_logprobs = False` and copies the weights in
    `load_weights`."""

    exact_logprobs = True

    def __init__(self, policy: torch.nn.Module, tokenizer, min_new_tokens: int = 0):
        self.policy, self.tokenizer, self.min_new_tokens = policy, tokenizer, min_new_tokens

    def generate(self, prompts: list[str], max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0) -> Generation:
        was_training = self.policy.training
        self.policy.eval()
        try:
            with fsdp.full_weights(self.policy):  # a sharded policy is gathered once for the whole call
                return generate(self.policy, self.tokenizer, prompts, max_new_tokens, temperature, top_p,
                                self.min_new_tokens)
        finally:
            self.policy.train(was_training)

    def load_weights(self, policy: torch.nn.Module) -> None:
        pass  # generates from `policy` itself
