"""Sampling one token per row from the logits: softmax at a temperature, the top-p nucleus, and
inverse-CDF sampling (one uniform per row placed on the running sum of the probabilities), each
computed on as few vocabulary entries as gives the same token as the whole-vocabulary formula."""

from __future__ import annotations

import torch

BLOCK = 1024  # vocabulary entries summed together before the running sum looks inside one block
FIRST_K = 64  # candidates the nucleus first tries; doubled until every row's nucleus fits


def sample(logits: torch.Tensor, temperature: float, top_p: float, u: torch.Tensor | None = None, support=None):
    """One token per row from softmax(logits / temperature), restricted to the top-p nucleus;
    temperature 0 is greedy. `u` [N] (float64 in [0, 1)): each row's uniform, drawn from torch's
    generator when not given. `support`: a list that receives the nucleus, each row's vocabulary
    ids [N, k] (-1 past its end; nothing with top_p 1 or greedy).  [N, V] -> [N]"""
    if temperature == 0:
        return logits.argmax(-1)  # [N]
    probs = torch.softmax(logits / temperature, -1)  # [N, V]
    if u is None:
        u = torch.rand(len(probs), dtype=torch.float64, device=probs.device)  # [N]
    if top_p >= 1.0:
        return inverse_cdf(probs, u)  # [N]
    kept, order = nucleus(probs, top_p)  # [N, k] each
    if support is not None:
        support.append(order.masked_fill(kept == 0, -1))  # [N, k]
    return order.gather(-1, inverse_cdf(kept, u)[:, None]).squeeze(-1)  # [N]


def nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest prefix of each row's probabilities in descending order whose mass reaches
    top_p (an entry is kept while the mass before it is at most top_p), the rest zeroed, found
    among the k largest entries with k doubled from 64 until every row's prefix ends inside them
    (no sort of the whole vocabulary).  -> probabilities [N, k], their vocabulary ids [N, k]"""
    V, k = probs.shape[-1], min(FIRST_K, probs.shape[-1])
    while True:
        top, order = probs.topk(k, -1)  # [N, k] each, descending
        drop = top.cumsum(-1) - top > top_p  # [N, k]
        if k == V or bool(drop[:, -1].all()):  # every row's nucleus ended before its k-th entry
            return top.masked_fill(drop, 0.0), order
        k = min(2 * k, V)


def support_logp(logp_all: torch.Tensor, logp: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """Log-probs under the distribution renormalised on each token's sampling support: `logp` less
    the log of the mass that softmax `logp_all` puts on the support's ids (-1: none; a token with
    none keeps its log-prob).  logp_all [..., V], logp [...], support [..., k] -> [...]"""
    on = logp_all.gather(-1, support.clamp(min=0)).masked_fill(support < 0, float("-inf"))  # [..., k]
    mass = on.logsumexp(-1)  # [...]
    return logp - torch.where(support[..., 0] < 0, 0.0, mass)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first entry of each row whose running sum of `probs` exceeds u times the row's total,
    summed in float64 so that a tail entry's share is kept to its last digits over a 50k
    vocabulary. The sum runs in two levels: the totals of blocks of 1,024 entries, then the running
    sum inside the one block that holds the point (the same entry as one running sum over the whole
    row but where the point lies within float64 rounding of an edge).  [N, V], [N] -> [N]"""
    N, V = probs.shape
    nb = -(-V // BLOCK)
    blocks = torch.nn.functional.pad(probs, (0, nb * BLOCK - V)).view(N, nb, BLOCK)  # [N, nb, B]
    sums = blocks.sum(-1, dtype=torch.float64)  # [N, nb]
    edges = sums.cumsum(-1)  # [N, nb]
    point = u[:, None].to(edges) * edges[:, -1:]  # [N, 1] in [0, total)
    b = torch.searchsorted(edges, point, right=True).clamp_(max=nb - 1)  # [N, 1] the block holding the point
    before = torch.where(b > 0, edges.gather(-1, (b - 1).clamp(min=0)), 0.0)  # [N, 1] mass of the earlier blocks
    inside = blocks.gather(1, b[:, :, None].expand(-1, -1, BLOCK)).squeeze(1)  # [N, B]
    j = torch.searchsorted(before + inside.double().cumsum(-1), point, right=True)  # [N, 1]
    last = BLOCK - 1 - (inside.flip(-1) > 0).int().argmax(-1, keepdim=True)  # [N, 1] the block's last non-zero entry
    return (b * BLOCK + torch.minimum(j, last)).squeeze(-1)  # [N] past the block's sum by rounding: its last entry
