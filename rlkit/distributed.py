"""Data parallel over torch.distributed (`torchrun --nproc_per_node=K -m rlkit.train ...`, or the
tasks of a SLURM job; gloo on CPU, NCCL on GPU). Every rank draws the same P prompts and keeps
its own contiguous share, so a group never spans ranks; the aggregator's weights are computed over
all ranks' masks and the gradients summed, so the update equals the single-process update on the
same batch; batch statistics (`mean_std`, `total`) cover every rank. Rank 0 alone writes logs and
checkpoints. With one process every helper here is the identity."""
from __future__ import annotations

import os
from datetime import datetime, timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlkit import fsdp


def init(device: str) -> tuple[int, int]:
    """Join the process group torchrun describes (WORLD_SIZE > 1), or that of a SLURM job whose
    tasks are the processes (srun, or the `slurm_ddp` launcher); returns (rank, world size)."""
    if "RANK" not in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ:
        export_slurm()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(local_device(device)))
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def close(finished: bool) -> None:
    """End this process's part in the group: when the run ended the same way on every rank (it
    finished, stopped after an agreed step, or refused its config), a barrier first so that no rank
    tears down connections another still uses; then destroy the group, so its threads are joined
    before the interpreter exits (a live gloo group can abort the process at exit with SIGABRT)."""
    if not dist.is_initialized():
        return
    if finished:
        try:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=timedelta(seconds=120))
            else:
                dist.barrier()
        except RuntimeError:  # another rank is gone already: nothing left to agree with
            pass
    dist.destroy_process_group()


def launch_time() -> datetime | None:
    """When several processes of one run start on this machine (torchrun's workers, the tasks of a
    SLURM job step), the start time of their common parent (the launcher), so that `${now:...}` in
    the run directory names one folder on every rank; None for a single process."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2 and int(os.environ.get("SLURM_NTASKS", "1")) < 2:
        return None
    try:
        ticks = int(open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        boot = next(int(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return datetime.fromtimestamp(boot + ticks / os.sysconf("SC_CLK_TCK"))


def peer_failed(e: BaseException) -> bool:
    """Whether `e` is this process's collective failing because another process of the run died."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and isinstance(e, RuntimeError) and any(
        s in str(e) for s in ("peer", "Connection", "Broken pipe", "Socket", "socket", "gloo", "NCCL"))


def export_slurm() -> None:
    """torchrun's variables from SLURM's: one process per task, the master on the job's first node,
    the port MASTER_PORT or one derived from the job id (the same on every task)."""
    from submitit.slurm.slurm import SlurmJobEnvironment

    env = os.environ
    env.update(RANK=env["SLURM_PROCID"], WORLD_SIZE=env["SLURM_NTASKS"], LOCAL_RANK=env.get("SLURM_LOCALID", "0"),
               MASTER_ADDR=SlurmJobEnvironment().hostnames[0],
               MASTER_PORT=env.get("MASTER_PORT", str(20000 + int(env["SLURM_JOB_ID"]) % 40000)))


def local_device(device: str) -> str:
    """`cuda` means this process's own GPU (`cuda:LOCAL_RANK`) when torchrun started several."""
    if device == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    return device


def size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def shard(rows: list, rank: int, world: int) -> list:
    """This rank's contiguous share of the step's prompts (P divisible by the world size)."""
    n = len(rows) // world
    return rows[rank * n:(rank + 1) * n]


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
    full = torch.cat([p[:s[0]] for p, s in zip(parts, shapes)])  # [sum n, cols] every rank's rows, in rank order
    start = sum(s[0] for s in shapes[:rank()])
    return aggregator.token_weights(full)[start:start + mask.shape[0], :mask.shape[1]]


def sum_gradients(params) -> None:
    """Add up every rank's gradients (each rank's loss already carries its global weights)."""
    if size() == 1:
        return
    params = [p for p in params if p.requires_grad]
    if any(fsdp.is_shard(p) for p in params):  # fsdp has reduced them already, as a mean over ranks
        for p in params:
            if p.grad is not None:
                p.grad.mul_(size())
        return
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
