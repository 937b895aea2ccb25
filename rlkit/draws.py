"""Keyed random draws (`rollout.coupled=true`): each sampled token's uniform computed from what it
is for and where it is (the run's seed, the purpose, the step and the call within it, the prompt's
text, the completion's index in its group, the token's position) by a counter-based hash, never
taken from a generator's running state. Two runs at one seed then give a row the same uniforms
whatever else they do, so two arms that differ in one mechanism sample the same tokens wherever
their policies agree (inverse-CDF sampling maps one uniform through two close distributions to the
same token), and a row's tokens do not depend on which other rows share its batch."""

from __future__ import annotations

import zlib

import torch

MASK = 0xFFFFFFFF
PURPOSES = {"rollout": 1, "eval": 2}


def mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply, full avalanche) of int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK  # products stay below 2**63: exact in int64
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK
    return x ^ (x >> 16)


def hashed(*keys: torch.Tensor | int) -> torch.Tensor:
    """One 32-bit hash of several keys (ints or int64 tensors that broadcast), folded in order."""
    h = torch.tensor(0x9E3779B9, dtype=torch.int64)
    for k in keys:
        k = torch.as_tensor(k, dtype=torch.int64) & MASK
        h = mix(h ^ ((k + 0x9E3779B9 + (h << 6) + (h >> 2)) & MASK))
    return h


def text_key(text: str) -> int:
    """A prompt's key: the CRC-32 of its UTF-8 text (the same prompt, the same key, in every run)."""
    return zlib.crc32(text.encode())


class RowDraws:
    """The uniforms of N rows, each keyed by the seed, the purpose and `call` (for the rollout: the
    step and the sampler's request within it), its prompt's text and its index in its group;
    `at(rows, t)` gives the rows' uniforms for token position t (float64 in [0, 1), 53 bits)."""

    def __init__(self, seed: int, purpose: str, call: tuple[int, ...], prompts: list[str], index: list[int]):
        prompt = torch.tensor([text_key(p) for p in prompts], dtype=torch.int64)  # [N]
        self.base = hashed(seed, PURPOSES[purpose], *call, prompt, torch.tensor(index))  # [N]

    def at(self, rows: torch.Tensor, t: int) -> torch.Tensor:
        base = self.base.to(rows.device)[rows]  # [n]
        hi, lo = hashed(base, t, 1) >> 6, hashed(base, t, 2) >> 5  # [n] 26 and 27 bits
        return (hi * 2**27 + lo).double() / 2**53  # [n]

    @classmethod
    def of_groups(cls, seed: int, purpose: str, call: tuple[int, ...], prompts: list[str], group: int) -> "RowDraws":
        """Rows laid out as groups of `group` completions of one prompt each, contiguous."""
        return cls(seed, purpose, call, prompts, [i % group for i in range(len(prompts))])
