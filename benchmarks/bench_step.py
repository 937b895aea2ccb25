"""One rlkit step on SmolLM2-135M-Instruct, timed by phase with its FLOP count, against the same
step of another revision measured in the same run.

Two settings on `--model` (default smollm2), both fixed length (EOS suppressed, so each side
generates the same number of tokens whatever it samples), 4 prompts x 8 completions, beta 0.04,
2 threads:

- `full`: full fine-tuning, 24 tokens, temperature 1, lr 1e-5;
- `lora`: the studies' model settings: LoRA rank 8 on every linear layer, 48 tokens, temperature
  0.7, lr 1e-4.

    python benchmarks/bench_step.py --setting full --against 0bce8d8 --rounds 4

(`--model` and `--extra` change the model and add overrides for both sides; the tests run it on
the tiny model.)

With `--against REV` the script checks that revision out into a temporary git worktree and runs
a second worker on REV's rlkit after the first, on this checkout's, has finished (two full
fine-tunings with their optimizer state do not fit in 24 GiB side by side): time it on an
otherwise idle machine. Before timing, each worker decodes
the same prompts greedily and runs one update on a rollout built from those tokens (rewards fixed
by row); the script prints whether the greedy tokens are identical and the largest differences of
the reference log-probs, the loss, the gradients and the weights after the optimizer step.

FLOPs are the matrix products of the step, counted from the model's shape: 2 x parameters per
token through the decoder, 2 x vocabulary x hidden where logits are taken, the attention products
over each token's context; the update's backward twice its forward with full fine-tuning (input
and weight gradients), once with LoRA (input gradients; the adapters' own are negligible). Prompts
shared by a group are counted once (the prefill and the training forward compute them once).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = {
    "full": dict(overrides=["optim.lr=1e-5"], tokens=24, lora=False),
    "lora": dict(overrides=["model.lora_r=8", "optim.lr=1e-4", "rollout.temperature=0.7"], tokens=48, lora=True),
}
PROMPTS, GROUP = 4, 8
REPO = Path(__file__).resolve().parents[1]


# ---- the worker: one side's state, answering the parent's requests -------------------------------------------------


def worker(setting: str, check_path: str, overrides: list[str]) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_vs_trl import rlkit_state

    import rlkit
    from rlkit.engines.kv_cache import generate
    from rlkit.loop import prepare_and_update, step
    from rlkit.types import Rollout

    torch.set_num_threads(2)
    s = SETTINGS[setting]
    run = rlkit_state(s["overrides"] + overrides, tempfile.mkdtemp(), PROMPTS, GROUP, s["tokens"], fixed=True)
    prompts = [r["prompt"] for r in list(run.parts.task.train)[:PROMPTS] for _ in range(GROUP)]
    gen = generate(run.parts.policy, run.parts.tokenizer, prompts, s["tokens"], 0.0, 1.0, s["tokens"])
    prompt = float(gen.prompt_mask.sum(-1).float().mean())  # the task's prompts are about this long
    say({"rlkit": rlkit.__file__, "flops": flops(run.parts.policy.config, prompt, s["tokens"], s["lora"])})
    rewards = torch.arange(len(prompts)).remainder(3).float()  # [N] varies within every group
    rollout = Rollout.from_generation(gen, GROUP, rewards=rewards, rows=[{"prompt": p} for p in prompts])
    batch, stats = prepare_and_update(run, rollout)
    named = [(n, p) for n, p in run.parts.policy.named_parameters() if p.requires_grad and p.numel() <= 2**20]
    torch.save(
        {
            "tokens": gen.completion_ids,
            "ref_logp": batch.ref_logp,
            "loss": stats.losses,
            "grads": {n: p.grad.clone() for n, p in named},
            "weights": {n: p.detach().clone() for n, p in named},
        },
        check_path,
    )
    say({"checked": True})
    for n, line in enumerate(sys.stdin, start=1):
        run.runtime.timer.clear()
        step(run, n)
        say({"phases": dict(run.runtime.timer)})


def say(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def flops(config, prompt: float, tokens: int, lora: bool) -> dict:
    """The step's matrix-product FLOPs by phase for prompts of `prompt` tokens (see the module docstring)."""
    H, L, V, I = config.hidden_size, config.num_hidden_layers, config.vocab_size, config.intermediate_size
    kv = config.num_key_value_heads * (H // config.num_attention_heads)
    body = 2 * L * (2 * H * H + 2 * H * kv + 3 * H * I)  # per token: q, o, k, v and the MLP
    head, attend = 2 * V * H, 4 * L * H  # per token with logits; per token and context position
    U, N, T = PROMPTS, PROMPTS * GROUP, tokens
    prompts = U * (prompt * body + attend * prompt * (prompt + 1) / 2)  # each distinct prompt once
    decode = N * (T - 1) * (body + head + attend * (prompt + T / 2))  # T - 1 steps after the prefill's logits
    forward = prompts + N * T * (body + head + attend * (prompt + (T + 1) / 2))  # logits at every completion token
    return {"generate": prompts + U * head + decode, "logprob": forward, "update": forward * (2 if lora else 3)}


# ---- the parent: a worker per side, one after the other -------------------------------------------------------------


class Side:
    def __init__(self, name: str, root: str | None, setting: str, overrides: list[str], log):
        env = dict(os.environ, OMP_NUM_THREADS="2", WANDB_MODE="offline", WANDB_SILENT="true")
        if root is not None:
            env["PYTHONPATH"] = root
        self.name, self.check = name, str(Path(tempfile.mkdtemp(prefix="bench_step-")) / "check.pt")
        cmd = [sys.executable, __file__, "--worker", setting, self.check, *overrides]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        self.info = self.read()
        if root is not None and not self.info["rlkit"].startswith(root):
            raise SystemExit(f"bench_step: the {name} worker imported {self.info['rlkit']}, not the worktree's rlkit")
        self.read()  # the check is written
        self.phases: list[dict] = []

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"bench_step: the {self.name} worker stopped (see its log)")
        return json.loads(line)

    def step(self) -> None:
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        self.phases.append(self.read()["phases"])

    def summary(self, warmup: int) -> dict:
        kept = self.phases[warmup:]
        return {k: statistics.median(p.get(k, 0.0) for p in kept) for k in ("step", "generate", "logprob", "update")}


def worktree(rev: str) -> str:
    """REV checked out into a temporary worktree, its config groups where the package looks for them."""
    path = tempfile.mkdtemp(prefix="rlkit-bench-")
    subprocess.run(["git", "worktree", "add", "--detach", "-q", path, rev], check=True, cwd=REPO)
    os.symlink("../conf", os.path.join(path, "rlkit", "conf"))
    return path


def compare_checks(a: str, b: str) -> dict:
    import torch

    x, y = torch.load(a), torch.load(b)
    return {
        "greedy tokens identical": bool(torch.equal(x["tokens"], y["tokens"])),
        "reference log-probs": float((x["ref_logp"] - y["ref_logp"]).abs().max()),
        "loss": max(abs(p - q) for p, q in zip(x["loss"], y["loss"])),
        "gradients": max(float((x["grads"][n] - y["grads"][n]).abs().max()) for n in x["grads"]),
        "weights after the step": max(float((x["weights"][n] - y["weights"][n]).abs().max()) for n in x["weights"]),
        "tensors compared": len(x["grads"]),
    }


def table(sides: list[Side], flops: dict, warmup: int) -> None:
    print("| side | step | generate | logprob | update | GFLOPS (generate / logprob / update) |")
    print("|---|---|---|---|---|---|")
    summaries = [s.summary(warmup) for s in sides]
    for side, m in zip(sides, summaries):
        rate = " / ".join(f"{flops[k] / m[k] / 1e9:.0f}" for k in ("generate", "logprob", "update"))
        times = " | ".join(f"{m[k]:.2f}" for k in ("generate", "logprob", "update"))
        print(f"| {side.name} | {m['step']:.2f} s | {times} | {rate} |")
    if len(sides) == 2:
        print(f"\nstep time {sides[0].name} / {sides[1].name}: {summaries[0]['step'] / summaries[1]['step']:.2f}")


def fp32_rate(m: int = 1536, k: int = 576, n: int = 1536, repeats: int = 10) -> float:
    """This machine's fp32 matmul rate (GFLOPS, 2 threads) at the shape of the update's MLP products:
    the peer the step's rates are read against."""
    import torch

    torch.set_num_threads(2)
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * m * k * n * repeats / (time.perf_counter() - t0) / 1e9


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        return worker(sys.argv[2], sys.argv[3], sys.argv[4:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setting", choices=sorted(SETTINGS), default="full")
    ap.add_argument("--against", help="a git revision to time beside this checkout")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--model", default="smollm2", help="a config of the model group")
    ap.add_argument("--extra", nargs="*", default=[], help="more config overrides, for both sides")
    a = ap.parse_args()
    overrides = [f"model={a.model}", *a.extra]
    root = worktree(a.against) if a.against else None
    log = tempfile.NamedTemporaryFile("w", prefix="bench_step-", suffix=".log", delete=False)
    print(f"setting {a.setting}; workers' output in {log.name}; load average {open('/proc/loadavg').read().strip()}")
    try:
        sides = []
        for name, path in [("this checkout", None)] + ([(a.against, root)] if root else []):
            side = Side(name, path, a.setting, overrides, log)  # one at a time: two fine-tunings do not fit in 24 GiB
            for _ in range(a.rounds):
                side.step()
            side.proc.kill()
            sides.append(side)
        if root:
            print(json.dumps(compare_checks(sides[0].check, sides[1].check), indent=1))
        table(sides, sides[0].info["flops"], a.warmup)
        print(f"FLOPs per step: {json.dumps({k: f'{v / 1e9:.0f} G' for k, v in sides[0].info['flops'].items()})}")
        print(f"fp32 matmul [1536, 576] x [576, 1536] on this machine: {fp32_rate():.0f} GFLOPS")
        print(f"load average after: {open('/proc/loadavg').read().strip()}")
    finally:
        if root:
            subprocess.run(["git", "worktree", "remove", "--force", root], check=False, cwd=REPO)


if __name__ == "__main__":
    main()
