"""The process group: joining it (torchrun's variables, or a SLURM job's tasks), leaving it cleanly,
and what a process needs to know about its peers before and after (the launcher's start time, a
peer's failure, this process's device), and ending a process that was part of one."""

from __future__ import annotations

import atexit
import os
import sys
from datetime import datetime, timedelta

import torch
import torch.distributed as dist

JOINED: list[int] = []  # this process's rank once it has joined a process group (see `exit_process`)


def init(device: str) -> tuple[int, int]:
    """Join the process group torchrun describes (WORLD_SIZE > 1), or that of a SLURM job whose
    tasks are the processes (srun, or the `slurm_ddp` launcher); returns (rank, world size)."""
    if "RANK" not in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ:
        export_slurm()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(local_device(device)))
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        JOINED.append(dist.get_rank())
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def launch_rank() -> int:
    """This process's rank as its launcher set it, before the group is joined: torchrun's RANK, or
    a SLURM job task's SLURM_PROCID; 0 for a single process."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ:
        return int(os.environ.get("SLURM_PROCID", "0"))
    return 0


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


def exit_process(code: int) -> None:
    """End a process that joined a process group with status `code`: what Python runs at exit (the
    `atexit` functions: wandb's finish, logging's flush), its output flushed, then no interpreter
    teardown. A sharded model keeps the group's C++ object alive after `destroy_process_group`
    (FSDP's mesh info holds it), and freeing it during that teardown now and then aborts the process
    ("terminate called without an active exception", SIGABRT): 2 of 30 two-process runs of a
    sharded toy model did, none of 60 that ended here."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
    return (
        int(os.environ.get("WORLD_SIZE", "1")) > 1
        and isinstance(e, RuntimeError)
        and any(s in str(e) for s in ("peer", "Connection", "Broken pipe", "Socket", "socket", "gloo", "NCCL"))
    )


def export_slurm() -> None:
    """torchrun's variables from SLURM's: one process per task, the master on the job's first node,
    the port MASTER_PORT or one derived from the job id (the same on every task)."""
    from submitit.slurm.slurm import SlurmJobEnvironment

    env = os.environ
    env.update(
        RANK=env["SLURM_PROCID"],
        WORLD_SIZE=env["SLURM_NTASKS"],
        LOCAL_RANK=env.get("SLURM_LOCALID", "0"),
        MASTER_ADDR=SlurmJobEnvironment().hostnames[0],
        MASTER_PORT=env.get("MASTER_PORT", str(20000 + int(env["SLURM_JOB_ID"]) % 40000)),
    )


def local_device(device: str) -> str:
    """`cuda` means this process's own GPU (`cuda:LOCAL_RANK`) when torchrun started several."""
    if device == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    return device
