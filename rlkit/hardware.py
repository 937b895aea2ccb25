"""What decides a run's float rounding (the CPU, the kernels torch, MKL and oneDNN chose for it, the
versions and threads), recorded in every run.json, and the portable mode that pins those kernels (checked by
`rlkit.preflight.check_portable`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from pathlib import Path

import torch

# What `portable=true` pins before torch starts: ATen's vectorised kernels, MKL's BLAS (conditional
# numerical reproducibility) and oneDNN all to AVX2, the widest that most x86 machines of the last
# decade run, so that every such machine runs the same kernels (threads must match too).
PORTABLE_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def kernels() -> dict:
    """The CPU kernels torch runs and the pins set for them: what a cached result depends on."""
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "pins": {k: os.environ[k] for k in PORTABLE_ENV if k in os.environ},
    }


def hardware(device: torch.device) -> dict:
    """What decides float rounding: the CPU, the kernels torch chose for it, the versions and threads."""
    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), platform.processor())
    out = {
        "cpu": cpu,
        "machine": platform.machine(),
        **kernels(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
    }
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    return out


def keep_freed_memory() -> bool:
    """Let glibc's malloc keep the memory a step frees for the next step's tensors: no trimming of
    the heap's top, and blocks up to 32 MiB (glibc's largest threshold) from the heap rather than
    each a fresh `mmap` whose pages fault in again at every use. Decode steps and updates allocate
    and free the same large tensors many times a second, so this saves page faults without
    changing a number. True where it was applied (Linux with glibc); False elsewhere."""
    name = ctypes.util.find_library("c") if platform.system() == "Linux" else None
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    trim, mmap = -1, -3  # M_TRIM_THRESHOLD, M_MMAP_THRESHOLD (malloc.h)
    return bool(libc.mallopt(trim, 1 << 30)) and bool(libc.mallopt(mmap, 32 << 20))
