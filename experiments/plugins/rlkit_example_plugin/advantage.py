"""An advantage estimator as an rlkit plugin: a group-mean baseline scaled by the batch's std of
the centred rewards (close to rlkit's own `advantage.std_scope=batch`, which divides by the std of
the rewards themselves)."""

import torch

from rlkit import parallel
from rlkit.advantages import grouped, per_token
from rlkit.components import AdvantageEstimator
from rlkit.tensors import centred


class BatchStdBaseline(AdvantageEstimator):
    """Subtract the group mean, then divide by the std of the whole batch (not of the group as
    GRPO does), so low-variance groups are not up-weighted. Under data parallel the batch is every
    process's groups together, so the std is taken over all of them (`parallel.mean_std`), and two
    processes give the advantages of one."""

    min_group_size = 2

    def __init__(self, eps: float = 1e-6):
        self.eps = eps

    def __call__(self, rollout, values=None) -> torch.Tensor:
        diff, _ = centred(grouped(rollout))  # [P, G] this process's groups
        std = parallel.mean_std(diff.reshape(-1))[1]  # [] over every process's groups
        return per_token(diff / (std + self.eps), rollout)  # [N, Tc]
