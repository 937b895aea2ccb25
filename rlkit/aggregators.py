"""Loss aggregators: how the per-token loss matrix L[N, Tc] becomes one number.

Each aggregator returns per-token weights W[N, Tc] computed once over the whole optimizer-step
batch, and the loss is sum(L * W). A micro-batch's share is sum(L_mb * W_mb), so splitting the
batch into micro-batches (or ranks) gives exactly the same gradient.
"""

from __future__ import annotations

import torch

from rlkit.components import Aggregator
from rlkit.refusals import require


class SeqMeanTokenMean(Aggregator):
    """GRPO paper (arXiv 2402.03300, Eq. 3): mean over sequences of sum_t L / |o_i|. A short
    answer's tokens weigh more than a long answer's (the length bias Dr. GRPO removes)."""

    def token_weights(self, mask: torch.Tensor) -> torch.Tensor:
        mask = mask.float()  # [N, Tc]
        lengths = mask.sum(-1, keepdim=True).clamp(min=1)  # [N, 1]
        return mask / lengths / max(mask.shape[0], 1)  # [N, Tc]


class TokenMean(Aggregator):
    """DAPO (Yu et al. 2025, arXiv 2503.14476): sum of L over all completion tokens of the batch /
    their number. Every token weighs the same, so long answers count in proportion to length."""

    def token_weights(self, mask: torch.Tensor) -> torch.Tensor:
        mask = mask.float()  # [N, Tc]
        return mask / mask.sum().clamp(min=1)  # [N, Tc]


class SeqMeanTokenSum(Aggregator):
    """Mean over sequences of sum_t L (no length normalisation at all)."""

    def token_weights(self, mask: torch.Tensor) -> torch.Tensor:
        mask = mask.float()  # [N, Tc]
        return mask / max(mask.shape[0], 1)  # [N, Tc]


class SeqMeanTokenSumNorm(Aggregator):
    """Dr. GRPO (Liu et al. 2025, arXiv 2503.20783): mean over sequences of sum_t L / C with a
    constant C (the generation budget by default), so no answer's tokens are up- or down-weighted
    by its length."""

    def __init__(self, constant: float):
        require(constant > 0, f"aggregator.constant must be > 0, got {constant}")
        self.constant = constant

    def token_weights(self, mask: torch.Tensor) -> torch.Tensor:
        mask = mask.float()  # [N, Tc]
        return mask / self.constant / max(mask.shape[0], 1)  # [N, Tc]
