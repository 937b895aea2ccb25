"""The floor of tensor helpers that components and the model paths share: groups, centring,
sequence means, positions, widths, inputs trimmed of shared padding, and the finiteness test.
Imports nothing but torch; every other module may import it, so no component imports another
component for a helper."""

from __future__ import annotations

import heapq

import torch


def flat(groups: torch.Tensor) -> torch.Tensor:
    """Whether each group's values are all equal (no signal to learn from).  [P, G] -> [P, 1]"""
    return (groups == groups[:, :1]).all(1, keepdim=True)


def centred(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """r - mean_g(r), exactly 0 in groups whose values are all equal.  [P, G] -> [P, G], [P, 1]"""
    same = flat(groups)  # [P, 1]
    diff = groups - groups.mean(1, keepdim=True)  # [P, G]
    return torch.where(same, torch.zeros_like(diff), diff), same


def seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's mean over its masked tokens (0 for a row with none).  [n, Tc] -> [n, 1]"""
    return (x * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding.  [N, S] -> [N, S]"""
    return (mask.cumsum(-1) - 1).clamp(min=0)


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


def finite(*xs) -> bool:
    """Whether every value of every tensor (or number) is finite."""
    return all(bool(torch.isfinite(torch.as_tensor(x)).all()) for x in xs)


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
