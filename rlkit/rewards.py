"""Reward shaping that any run can switch on."""
from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, budget: int, cache: int) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, Eq. 13): 0 up to
    budget - cache tokens, then falling linearly to -1 at the budget.  [N] -> [N]"""
    over = lengths.float() - (budget - cache)  # [N]
    return -(over / cache).clamp(0.0, 1.0)
