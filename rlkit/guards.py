"""Guards of the update: the advantage estimator's output checked (type and shape) before it is
used, a run stopped after too many updates in a row skipped for a non-finite advantage, loss or
gradient norm (`NonFiniteGuard`; the loop skips them)."""

from __future__ import annotations

import torch

from rlkit.refusals import ConfigError


class NonFiniteError(RuntimeError):
    """Too many non-finite updates in a row."""


class NonFiniteGuard:
    """Counts updates skipped for a NaN or inf loss, advantage or gradient norm; too many in a row stop the run."""

    def __init__(self, max_in_a_row: int):
        self.max_in_a_row, self.in_a_row, self.total = max_in_a_row, 0, 0

    def record(self, skipped: bool, step: int) -> None:
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        self.total += skipped
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteError(
                f"{self.in_a_row} non-finite updates in a row (last at step {step}); stopping. "
                "The last checkpoint holds the last good state (optim.max_nonfinite sets the limit)"
            )


def checked_advantages(estimator, rollout, values=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Call the estimator; its advantages (and returns, if it gives them) must be float tensors of
    the rollout's [N, Tc] shape. A failure names the estimator, before any update."""
    name = type(estimator).__qualname__
    try:
        out = estimator(rollout, values)
    except Exception as e:  # a plugin's bug: name it and the rollout it failed on
        raise ConfigError(
            f"advantage={name} raised on a rollout of {rollout.num_rows} rows: {type(e).__name__}: {e}"
        ) from e
    adv, returns = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
    expect = tuple(rollout.completion_mask.shape)
    named = [("advantages", adv)] + ([("returns", returns)] if returns is not None else [])
    for what, x in named:
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != expect or not x.is_floating_point():
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ConfigError(
                f"advantage={name} returned {what} of shape {got}; expected a float tensor of shape "
                f"[N, Tc] = {list(expect)} (see rlkit.components.AdvantageEstimator)"
            )
    return adv, returns
