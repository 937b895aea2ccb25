"""The one seam for parallelism: nothing outside this package calls torch.distributed or knows how
a model is sharded. `group`: joining and leaving the process group (torchrun, SLURM). `strategy`:
the object chosen at start-up (one process, replicated, sharded) that wraps the models, reduces
gradients, saves and loads the policy and checks its own config. `collectives`: reductions over
every process that components use (batch statistics, global loss weights). `sharding`: the
sharded models themselves. With one process every reduction is the identity."""

from rlkit.parallel.collectives import (  # noqa: F401
    any_rank,
    gather,
    global_weights,
    mean_metrics,
    mean_std,
    rank,
    shard,
    size,
    sum_gradients,
    total,
)
from rlkit.parallel.group import (  # noqa: F401
    JOINED,
    close,
    exit_process,
    init,
    launch_rank,
    launch_time,
    local_device,
    peer_failed,
)
from rlkit.parallel.sharding import full_weights, is_sharded, local  # noqa: F401
from rlkit.parallel.strategy import MODES, OneProcess, Replicated, Sharded, choose  # noqa: F401
