"""Reductions over every process of the run. Every rank draws the same P prompts and keeps its own
contiguous share (`shard`), so a group never spans ranks; the aggregator's weights are computed
over all ranks' masks (`global_weights`) and gradients summed (`sum_gradients`), so the update
equals the single-process update on the same batch; batch statistics (`mean_std`, `total`) cover
every rank. With one process every helper here is the identity."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def shard(rows: list, rank: int, world: int) -> list:
    """This rank's contiguous share of the step's prompts (P divisible by the world size)."""
    n = len(rows) // world
    return rows[rank * n : (rank + 1) * n]


def any_rank(flag: bool) -> bool:
    if size() == 1:
        return flag
    t = torch.tensor([float(flag)])
    dist.all_reduce(t)
    return bool(t.item() > 0)


def total(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over every rank (a copy)."""
    x = x.detach().clone()
    if size() > 1:
        dist.all_reduce(x)
    return x


def mean_std(x: torch.Tensor, unbiased: bool = True) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Mean, std and count of the values `x` [k] of every rank together, in two passes as torch
    computes them; with one process, `x.mean()` and `x.std()`.  -> [], [], n"""
    if size() == 1:
        return x.mean(), x.std(unbiased=unbiased), x.numel()
    n = int(total(x.new_tensor(float(x.numel()))))
    mean = total(x.sum()) / max(n, 1)
    var = total(((x - mean) ** 2).sum()) / max(n - (1 if unbiased else 0), 1)
    return mean, var.sqrt(), n


def global_weights(aggregator, mask: torch.Tensor) -> torch.Tensor:
    """The aggregator's weights for this rank's rows, normalised over every rank's rows.  [n, T] -> [n, T]"""
    if size() == 1:
        return aggregator.token_weights(mask)
    shapes = [None] * size()
    dist.all_gather_object(shapes, tuple(mask.shape))
    rows, cols = max(s[0] for s in shapes), max(s[1] for s in shapes)
    padded = F.pad(mask.float(), (0, cols - mask.shape[1], 0, rows - mask.shape[0]))  # [rows, cols]
    parts = [torch.empty_like(padded) for _ in shapes]
    dist.all_gather(parts, padded)
    full = torch.cat([p[: s[0]] for p, s in zip(parts, shapes)])  # [sum n, cols] every rank's rows, in rank order
    start = sum(s[0] for s in shapes[: rank()])
    return aggregator.token_weights(full)[start : start + mask.shape[0], : mask.shape[1]]


def sum_gradients(params) -> None:
    """Add up every rank's gradients of replicated parameters (each rank's loss already carries its
    global weights)."""
    if size() == 1:
        return
    params = [p for p in params if p.requires_grad]
    for p in params:  # a rank with no rows this step has no gradients: it adds zeros
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    for g, s in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(s)


def mean_metrics(metrics: dict) -> dict:
    """Each numeric metric averaged over the ranks that logged it (rank 0 logs the result); a metric
    with no value (None: the statistic of a subset a rank did not draw) counts on no rank."""
    if size() == 1:
        return metrics
    every, out = gather(metrics), {}
    for k in dict.fromkeys(k for m in every for k in m):  # a metric of a subset only another rank drew counts too
        values = [m[k] for m in every if isinstance(m.get(k), (int, float)) and not isinstance(m[k], bool)]
        out[k] = sum(values) / len(values) if values else next(m[k] for m in every if k in m)
    return out


def gather(obj) -> list:
    """Every rank's `obj`, in rank order (on every rank)."""
    if size() == 1:
        return [obj]
    out = [None] * size()
    dist.all_gather_object(out, obj)
    return out
