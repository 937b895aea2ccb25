"""How the update cuts a rollout: mini-batches of whole groups (one optimizer step each), and
micro-batches of rows grouped by length so that each is trimmed to little padding; and a no-grad
forward run over micro-batches with its outputs put back in row order."""

from __future__ import annotations

import torch

from rlkit.types import Rollout


def micro_batches(r: Rollout, rows: torch.Tensor, max_rows: int, max_tokens: int) -> list[torch.Tensor]:
    """`rows` of `r` in micro-batches of similar length, so that trimming each to its own longest
    row (`trimmed_inputs`) leaves little padding: sorted by prompt + completion length and cut
    before a micro-batch passes `max_rows` rows or `max_tokens` padded tokens (0: no limit).
    Returns positions in `rows`.  -> [m] each"""
    if not max_rows and not max_tokens:  # one micro-batch, in the same (stable, by length) order
        lengths = r.prompt_mask[rows].sum(-1) + r.completion_mask[rows].sum(-1)  # [n]
        return [torch.argsort(lengths, stable=True).cpu()] if len(rows) else []
    plen, clen = r.prompt_mask[rows].sum(-1).tolist(), r.completion_mask[rows].sum(-1).tolist()  # [n] each
    out, cur, width = [], [], (0, 0)
    for i in sorted(range(len(plen)), key=lambda i: plen[i] + clen[i]):
        grown = (max(width[0], plen[i]), max(width[1], clen[i]))
        if cur and (len(cur) == max_rows or max_tokens and (len(cur) + 1) * sum(grown) > max_tokens):
            out.append(torch.tensor(cur))
            cur, grown = [], (plen[i], clen[i])
        cur.append(i)
        width = grown
    return out + [torch.tensor(cur)] if cur else out


def mini_batches(rollout: Rollout, epochs: int, n: int):
    """Row indices of each mini-batch, whole groups, reshuffled every epoch when n > 1.  -> [n_rows] each"""
    for _ in range(epochs):
        groups = torch.randperm(rollout.num_groups) if n > 1 else torch.arange(rollout.num_groups)
        yield from (rollout.group_rows(mb) for mb in groups.chunk(n))


@torch.no_grad()
def over_micro_batches(fn, r: Rollout, micro: list[torch.Tensor], outputs: int = 1):
    """fn over the micro-batches of rows `micro`, put back in row order; `outputs` > 1: fn returns
    that many tensors.  -> [N, Tc] (each)"""
    out = [torch.zeros(r.completion_ids.shape, device=r.completion_ids.device) for _ in range(outputs)]  # [N, Tc] each
    for rows in micro:
        res = fn(r.select_rows(rows))
        for i, x in enumerate(res if outputs > 1 else (res,)):
            if x is None:  # an output fn does not compute
                out[i] = None
            elif out[i] is not None:
                out[i][rows] = x
    return out if outputs > 1 else out[0]
