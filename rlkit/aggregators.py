"""Loss aggregators: how the per-token loss matrix L[N, Tc] becomes one number.

Each aggregator returns per-token weights W[N, Tc] computed once over the whole optimizer-step
batch, and the loss is sum(L * W). A micro-batch's share is sum(L_mb * W_mb), so splitting the
batch into micro-batches (or ranks) gives exactly the same gradient.
"""
from __future__ import annotations

import torch


class SeqMeanTokenMean:
    """GRPO paper (arXiv 2402.03300, Eq. 3): mean over sequences of sum_t L / |o_i|. A short
    answer's tokens weigh more than a long answer's (the length bias Dr. GRPO removes)."""

    def token_weights(self, mask: torch.Tensor) -> torch.Tensor:
        mask = mask.float()  # [N, Tc]
        lengths = mask.sum(-1, keepdim=True).clamp(min=1)  # [N, 1]
        return mask / lengths / mask.shape[0]  # [N, Tc]
