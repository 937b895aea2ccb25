"""A rank of a data-parallel update, started by tests/test_distributed.py with torch.multiprocessing."""
import os

import torch


def update_on_shard(rank: int, world: int, port: int, overrides: list, cache: str, rollout_path: str, out: str):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from conftest import make_cfg
    from rlkit import distributed
    from rlkit.setup import setup
    from rlkit.train import Timer, prepare, update

    distributed.init("cpu")
    state = setup(make_cfg(overrides, cache_dir=cache), os.path.join(out, f"rank{rank}"), {}, rank=rank, world=world)
    state.timer = Timer()
    rollout = torch.load(rollout_path, weights_only=False)
    per_rank = rollout.num_groups // world
    mine = rollout.select_groups(torch.arange(rank * per_rank, (rank + 1) * per_rank))
    stats = update(state, prepare(state, mine))
    if rank == 0:
        torch.save({"params": {k: v.detach().clone() for k, v in state.policy.state_dict().items()},
                    "grad_norms": stats.grad_norms}, os.path.join(out, "params.pt"))
    torch.distributed.destroy_process_group()
