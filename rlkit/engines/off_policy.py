"""An engine whose numbers are not the trainer's, on one process: the semantics of an asynchronous
pipeline (rollouts from a policy k updates old) and of a lower-precision inference engine (bf16
kernels), exactly, with the log-probs it sampled with carried in the rollout."""

from __future__ import annotations

import copy
from collections import deque

import torch

from rlkit import parallel
from rlkit.engines.kv_cache import KVCache, generate
from rlkit.refusals import require
from rlkit.types import Episodes, Generation

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def snapshot(model: torch.nn.Module, dtype: torch.dtype) -> dict:
    """A detached copy of `model`'s weights, floating-point tensors cast to `dtype`."""
    return {
        k: v.detach().to(dtype if v.is_floating_point() else v.dtype, copy=True) for k, v in model.state_dict().items()
    }


class OffPolicy(KVCache):
    """Samples from its own copy of the policy, held `staleness` updates behind the trainer and
    stored and run in `dtype`; reports the log-probs it sampled with (`Generation.logprobs`, the
    behaviour policy mu), so a `correction` can weigh the loss by pi_old / mu.

    Versions: the copy starts as the policy before the first update; after update u it holds the
    policy after update max(0, u - staleness). The versions in between wait in a queue (k copies of
    the weights in `dtype`), and a checkpoint keeps the copy and the queue, so a resumed run lags
    exactly as the uninterrupted one. staleness 0 with float32 samples the trainer's weights through
    a second copy: its log-probs differ from the trainer's only by the decoder's float rounding.
    Held-out evaluation (`latest()`) samples the trainer's current weights in its own precision."""

    exact_logprobs = False

    def __init__(
        self,
        policy: torch.nn.Module,
        tokenizer,
        staleness: int = 0,
        dtype: str = "float32",
        min_new_tokens: int = 0,
        replay_support: bool = False,
    ):
        require(
            isinstance(staleness, int) and staleness >= 0, f"engine.staleness must be an int >= 0, got {staleness!r}"
        )
        require(dtype in DTYPES, f"engine.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        require(
            not parallel.is_sharded(policy),
            "engine=off_policy keeps a whole copy of the policy on each process; use parallel=replicate",
        )
        super().__init__(policy, tokenizer, min_new_tokens, replay_support)
        self.staleness, self.dtype = staleness, DTYPES[dtype]
        self.copy = copy.deepcopy(policy).to(self.dtype).eval().requires_grad_(False)
        self.queue: deque[dict] = deque()  # versions not yet loaded, oldest first
        self.version = self.trainer_version = 0
        self._latest = KVCache(policy, tokenizer, min_new_tokens)

    def generate(
        self,
        prompts: list[str],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        episodes: Episodes | None = None,
        draws=None,
    ) -> Generation:
        return generate(
            self.copy,
            self.tokenizer,
            prompts,
            max_new_tokens,
            temperature,
            top_p,
            self.min_new_tokens,
            logprobs=temperature > 0,
            episodes=episodes,
            draws=draws,
            support=self.replay_support,
        )

    def load_weights(self, policy: torch.nn.Module) -> None:
        self.trainer_version += 1
        self.queue.append(snapshot(policy, self.dtype))
        while len(self.queue) > self.staleness:
            self.copy.load_state_dict(self.queue.popleft())
            self.version += 1

    def latest(self) -> KVCache:
        return self._latest

    @property
    def lag(self) -> int:
        """Updates between the trainer's weights and the ones this engine samples from."""
        return self.trainer_version - self.version

    def state_dict(self) -> dict:
        return {
            "weights": snapshot(self.copy, self.dtype),
            "queue": list(self.queue),
            "version": self.version,
            "trainer_version": self.trainer_version,
        }

    def load_state_dict(self, state: dict) -> None:
        self.copy.load_state_dict(state["weights"])
        self.queue = deque(state["queue"])
        self.version, self.trainer_version = state["version"], state["trainer_version"]
