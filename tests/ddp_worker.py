"""A rank of a data-parallel update, started by tests/test_distributed.py with torch.multiprocessing."""

import os

import torch


def update_on(state, rollout):
    """The sampler's choice of groups from `rollout` (this rank's share of a generation batch), then
    prepare and update, as the loop runs them.  -> update stats, kept groups over all ranks"""
    from rlkit.loop import prepare_and_update

    kept, metrics = state.parts.sampler.sample(lambda rows: rollout)
    return prepare_and_update(state, kept)[1], metrics.get("sampler/kept_groups")


def snapshot(state, stats) -> dict:
    """Policy parameters, the critic's last gradient (Adam's step would turn float noise in a
    near-zero gradient into a full step) and gradient norms after an update."""
    critic = state.parts.critic.model.named_parameters() if state.parts.critic is not None else []
    full = state.runtime.parallel.policy_state(state.parts.policy, state.parts.optimizer)[0]  # None: not sharded
    params = full if full is not None else state.parts.policy.state_dict()
    return {
        "params": {k: v.detach().clone() for k, v in params.items()},
        "critic": {k: v.grad.clone() for k, v in critic if v.grad is not None},
        "grad_norms": stats.grad_norms,
        "value_losses": stats.value_losses,
        "losses": stats.losses,
    }


def update_on_shard(rank: int, world: int, port: int, cases: list, cache: str):
    """Each case (overrides, rollout file, output folder) in turn in one process group: setup, this
    rank's groups of the rollout, the update, and rank 0 saves the snapshot as `params.pt`."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    from conftest import make_cfg
    from rlkit import parallel
    from rlkit.setup import setup, validate

    parallel.init("cpu")
    for overrides, rollout_path, out in cases:
        cfg = make_cfg(overrides, cache_dir=cache)
        state = setup(cfg, os.path.join(out, f"rank{rank}"), {}, validate(cfg, world, rank))
        rollout = torch.load(rollout_path, weights_only=False)
        per_rank = rollout.num_groups // world
        mine = rollout.select_groups(torch.arange(rank * per_rank, (rank + 1) * per_rank))
        stats, kept = update_on(state, mine)
        snap = snapshot(state, stats)  # on every rank: gathering a sharded policy takes all of them
        if rank == 0:
            torch.save({**snap, "kept": kept}, os.path.join(out, "params.pt"))
    parallel.close(finished=True)
    parallel.exit_process(0)  # as rlkit-train ends a rank: the sharded cases' models outlive the group
