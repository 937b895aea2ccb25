"""A few RL steps on one GPU, printing what a user sizing a run wants to know: rollout tokens/s,
update tokens/s, model FLOPs utilisation (MFU) and peak memory. Minutes, not hours.

    python benchmarks/gpu_check.py                                  # the built-in testbed
    python benchmarks/gpu_check.py --model Qwen/Qwen2.5-0.5B-Instruct --dtype bfloat16 --steps 5
    python benchmarks/gpu_check.py --device cpu --steps 2            # the same numbers on CPU (no MFU)

MFU counts 2 FLOPs per parameter per token forward and 6 forward plus backward (the usual dense
approximation, attention excluded) against `--peak-tflops` (default 989, an H100/H200's dense bf16).
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch
from hydra import compose, initialize_config_module

import rlkit.config  # noqa: F401  (registers the config schema)
from rlkit.loop import collect, prepare_and_update
from rlkit.setup import setup


def check(overrides: list[str], steps: int, peak_tflops: float, device: str) -> dict:
    with initialize_config_module(config_module="rlkit.conf", version_base=None):
        cfg = compose("config", overrides=[f"device={device}", "logger=jsonl", *overrides])
    with tempfile.TemporaryDirectory() as run_dir:
        state = setup(cfg, run_dir, {})
        params = sum(p.numel() for p in state.parts.policy.parameters())
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        gen_tokens = train_tokens = gen_s = update_s = 0.0
        for step in range(steps + 1):  # the first step warms up kernels and is not counted
            state.runtime.timer.clear()
            rollout, _ = collect(state)
            prepare_and_update(state, rollout)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            if step:
                gen_tokens += float(rollout.completion_mask.sum())
                train_tokens += float(rollout.completion_mask.sum() + rollout.prompt_mask.sum())
                gen_s += state.runtime.timer["generate"]
                update_s += state.runtime.timer["update"] + state.runtime.timer.get("logprob", 0.0)
    flops = 2 * params * gen_tokens + 6 * params * train_tokens
    out = {
        "parameters (M)": params / 1e6,
        "rollout tokens/s": gen_tokens / gen_s,
        "update tokens/s": train_tokens / update_s,
    }
    if device.startswith("cuda"):
        out["MFU"] = flops / (gen_s + update_s) / (peak_tflops * 1e12)
        out["peak memory (GiB)"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a Hugging Face causal LM (path or hub id); default: the testbed's tiny model")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    a = p.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("gpu_check: no GPU here (use --device cpu for a dry run)")
    overrides = ["rollout.prompts_per_step=16", "rollout.group_size=8"]
    if a.model:
        overrides += [
            "model=pretrained",
            f"model.path={a.model}",
            f"model.dtype={a.dtype}",
            "warm_start.steps=0",
            "task=arithmetic",
            "rollout.max_new_tokens=128",
        ]
    for k, v in check(overrides, a.steps, a.peak_tflops, a.device).items():
        print(f"{k:>20}: {v:.4g}")


if __name__ == "__main__":
    main()
