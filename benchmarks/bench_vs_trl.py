"""rlkit against Hugging Face TRL's `GRPOTrainer`: the same GRPO step, side by side, in one process.

One model (the testbed's Qwen2 architecture, random initialisation), one tokenizer, one prompt set
and one reward serve both. Settings: P prompts x G completions, up to T new tokens, beta 0.04 (a
reference forward runs), clip 0.2, per-sequence token mean (TRL `loss_type="grpo"`), group z-score
with eps 1e-4 (TRL's), AdamW at a constant lr, fp32, one update per rollout.

Before timing, `equal_maths` checks on one shared rollout that both compute the same advantages,
reference log-probs, loss and gradient (after the same perturbation of both policies, so the KL
term and the ratio are not trivial). Then TRL trains `--rounds` steps and after each of its steps
rlkit trains one, so both see the same machine state; the first `--warmup` steps of each are
dropped. Modes: `natural` (each side stops a row at EOS) and `fixed` (EOS suppressed on both
sides: every row is T tokens).

    pip install -e ".[bench]"
    python benchmarks/bench_vs_trl.py [--sizes 1m 10m smollm2] [--modes natural fixed] [--rounds 10] [--warmup 2]

Prints, per size and mode: median step time, the phase split, peak memory of each side and the
ratio rlkit/TRL (below 1: rlkit is faster). Peak memory on CPU is the process's peak resident set
during that side's step (reset before each step through /proc/self/clear_refs), and the step's
own part of it (peak minus the resident set when the step began: activations and temporaries);
on CUDA, the peak allocated memory and its rise during the step.

A third side, rlkit with `optim.share_prefix=never`, runs in the same alternation, so the
shared-prefix forward is measured against the unshared one and against TRL. Long prompts:
`--context C` puts C characters of solved examples before every question (a few-shot prompt):

    python benchmarks/bench_vs_trl.py --sizes 10m --modes fixed --context 256 --group 16 --max-new 64
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from contextlib import contextmanager

import torch
from datasets import Dataset
from hydra import compose, initialize_config_module

from rlkit import parallel
from rlkit.config import build
from rlkit.guards import checked_advantages
from rlkit.llama import base_model
from rlkit.logprobs import rollout_logprobs
from rlkit.loop import collect, prepare_and_update
from rlkit.setup import setup
from rlkit.signals import StopSignals
from rlkit.types import LossInput, Rollout

MODELS: list = []  # every side's models, whose parameters `peak_memory` does not count as activations
SIZES = {  # the testbed's Qwen2 at two sizes, and a real pretrained model (chat-templated prompts)
    "1m": [
        "model.hidden_size=128",
        "model.num_layers=4",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        "model.intermediate_size=384",
    ],
    "10m": [
        "model.hidden_size=256",
        "model.num_layers=8",
        "model.num_heads=8",
        "model.num_kv_heads=4",
        "model.intermediate_size=1408",
    ],
    "smollm2": ["model=smollm2"],  # SmolLM2-135M-Instruct, Llama architecture
}


def rlkit_state(overrides: list[str], run_dir: str, prompts: int, group: int, max_new: int, fixed: bool):
    """rlkit's run state for the shared settings (no warm start: both sides start from the same random model)."""
    shared = [
        "logger=jsonl",
        "algo=grpo",
        "advantage.eps=1e-4",
        "loss.beta=0.04",
        "optim.lr=1e-5",
        "optim.warmup_steps=0",
        "warm_start.steps=0",
        "eval.every=0",
        "checkpoint.every=0",
        "samples_every=0",
        "steps=100000",
        "task.n_eval=8",
        f"rollout.prompts_per_step={prompts}",
        f"rollout.group_size={group}",
        f"rollout.max_new_tokens={max_new}",
        *([f"+engine.min_new_tokens={max_new}"] if fixed else []),
    ]
    with initialize_config_module(config_module="rlkit.conf", version_base=None):
        cfg = compose(config_name="config", overrides=[*shared, *overrides])
    state = setup(cfg, run_dir, {}, stop=StopSignals())
    return state


def with_context(state, chars: int) -> None:
    """Every training prompt preceded by `chars` characters of other rows' solved examples
    ("a=b;" each, cut to length): the same long prompt layout for both sides (TRL reads
    `task.train`; rlkit's sampler is rebuilt on it)."""
    task, cfg = state.parts.task, state.cfg
    rows = list(task.train)
    solved = "".join(f"{r['prompt']}{r['answer']};" for r in rows[:200])
    task.train = Dataset.from_list(
        [{**r, "prompt": (solved * 2)[i % 100 : i % 100 + chars] + r["prompt"]} for i, r in enumerate(rows)]
    )
    state.parts = dataclasses.replace(
        state.parts,
        sampler=build(cfg, "sampler", dataset=task.train, batch_size=cfg.rollout.prompts_per_step, seed=cfg.seed),
    )


def trl_trainer(state, model_dir: str, out_dir: str, rounds: int, fixed: bool, lora: int = 0):
    """TRL's GRPOTrainer on a copy of rlkit's policy (saved, so TRL can build its reference from it);
    `lora` > 0: rlkit's policy has LoRA adapters of that rank on every linear layer, TRL gets the
    same `peft_config` on the base model and a copy of rlkit's adapter weights."""
    from peft import LoraConfig, get_peft_model_state_dict, set_peft_model_state_dict
    from trl import GRPOConfig, GRPOTrainer

    c = state.cfg
    if lora:
        save_base(state.parts.policy, model_dir)
    else:
        state.parts.policy.save_pretrained(model_dir)
    state.parts.tokenizer.save_pretrained(model_dir)
    task = state.parts.task

    def reward(prompts, completions, answer, **_):
        return [float(task.reward({"prompt": p, "answer": a}, x)) for p, x, a in zip(prompts, completions, answer)]

    n = c.rollout.prompts_per_step * c.rollout.group_size
    args = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=n,
        gradient_accumulation_steps=1,
        num_generations=c.rollout.group_size,
        max_completion_length=c.rollout.max_new_tokens,
        beta=c.loss.beta,
        epsilon=c.loss.eps_low,
        epsilon_high=c.loss.eps_high,
        loss_type="grpo",
        scale_rewards="group",
        learning_rate=c.optim.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=c.optim.weight_decay,
        adam_beta1=c.optim.beta1,
        adam_beta2=c.optim.beta2,
        optim="adamw_torch",
        max_grad_norm=c.optim.max_grad_norm,
        temperature=c.rollout.temperature,
        top_p=c.rollout.top_p,
        top_k=0,
        use_cpu=state.runtime.device.type == "cpu",
        bf16=False,
        report_to=[],
        logging_steps=10**6,
        save_strategy="no",
        max_steps=rounds,
        seed=c.seed,
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
        use_bias_correction_kl=False,  # TRL's default multiplies the KL by the ratio (DeepSeek-V3.2); GRPO's does not
        generation_kwargs={"min_new_tokens": c.rollout.max_new_tokens} if fixed else None,
    )
    data = Dataset.from_dict({"prompt": list(task.train["prompt"]), "answer": [str(a) for a in task.train["answer"]]})
    model = type(base_model(state.parts.policy)).from_pretrained(model_dir).to(state.runtime.device)
    peft = LoraConfig(r=lora, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM") if lora else None
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=data,
        processing_class=state.parts.tokenizer,
        peft_config=peft,
    )
    if lora:
        set_peft_model_state_dict(trainer.model, get_peft_model_state_dict(state.parts.policy))
    trainer.current_gradient_accumulation_steps = 1  # set by its training loop; `equal_maths` runs before it
    return trainer


def save_base(policy, model_dir: str) -> None:
    """A LoRA policy's base model (its weights without the adapters) as a plain checkpoint."""
    names = {k.replace(".base_layer", ""): v for k, v in base_model(policy).state_dict().items() if "lora_" not in k}
    plain = type(base_model(policy))(base_model(policy).config)
    plain.load_state_dict(names, strict=False)
    plain.save_pretrained(model_dir)


# ---- equal maths: one rollout, both sides' advantages, reference log-probs, loss and gradient ---------------------


def perturb(models: list[torch.nn.Module], seed: int, scale: float = 0.02) -> None:
    """The same random change to each model's weights, so that policy and reference differ."""
    for params in zip(*(m.parameters() for m in models)):
        noise = torch.randn(params[0].shape, generator=torch.Generator().manual_seed(seed)) * scale
        seed += 1
        with torch.no_grad():
            for p in params:
                p.add_(noise.to(p.device))


def length_reward(prompts, completions, **_) -> list[float]:
    """A reward that varies within every group even for an untrained model (accuracy is 0 there)."""
    return [len(c) / 8 for c in completions]


def equal_maths(state, trainer) -> dict:
    """Largest absolute differences between rlkit and TRL on TRL's own rollout of one batch, both
    scored by `length_reward`."""
    policy, task_reward = trainer.model, trainer.reward_funcs[0]
    perturb([policy, state.parts.policy], seed=1234)
    batch = next(iter(trainer.get_train_dataloader()))
    policy.train()
    trainer.reward_funcs[0] = length_reward
    try:
        inputs = trainer._generate_and_score_completions(batch)  # TRL: generate, score, reference, advantages
    finally:
        trainer.reward_funcs[0] = task_reward
    pid, pmask, cid, cmask = (inputs[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"))
    rows = [{"prompt": b["prompt"], "answer": b["answer"]} for b in batch]
    texts = state.parts.tokenizer.batch_decode(cid, skip_special_tokens=True)
    rewards = torch.tensor(length_reward([row["prompt"] for row in rows], texts), device=state.runtime.device)  # [N]
    r = Rollout(
        pid, pmask, cid, cmask, cmask.sum(-1) == cid.shape[1], state.cfg.rollout.group_size, rows, texts, rewards
    )
    adv, _ = checked_advantages(state.parts.advantage, r, None)  # [N, Tc]
    with torch.no_grad():
        ref = rollout_logprobs(state.parts.ref, r, state.cfg.rollout.temperature)[0]  # [N, Tc]
    state.parts.policy.train()
    logp, entropy = rollout_logprobs(state.parts.policy, r, state.cfg.rollout.temperature, "metric")  # [N, Tc]
    mask = state.parts.loss.train_mask(r)  # [N, Tc]
    L, _ = state.parts.loss(LossInput(logp, logp.detach(), adv, mask, ref, entropy))  # [N, Tc]
    ours = (L * parallel.global_weights(state.parts.aggregator, mask)).sum()
    ours.backward()
    theirs = trainer.compute_loss(policy, inputs)
    theirs.backward()
    on = cmask.bool()
    pairs = zip(state.parts.policy.parameters(), policy.parameters())
    grads = [(p.grad, q.grad) for p, q in pairs if p.requires_grad]  # LoRA: the adapters' only
    out = {
        "advantage": float((adv[:, 0] - inputs["advantages"]).abs().max()),
        "reference logp": float((ref - inputs["ref_per_token_logps"])[on].abs().max()),
        "loss": abs(float(ours.detach()) - float(theirs.detach())),
        "gradient": max(float((a - b).abs().max()) for a, b in grads),
        "rows": len(rows),
        "mean length": float(cmask.sum(-1).float().mean()),
    }
    state.parts.policy.zero_grad(set_to_none=True)
    policy.zero_grad(set_to_none=True)
    return out


# ---- timing -------------------------------------------------------------------------------------------------------


@contextmanager
def peak_memory(device: torch.device, out: list, activations: list):
    """Peak memory (MB) while the block runs, into `out` (CUDA peak allocated, else the process's
    peak resident set), and the activation memory, into `activations`: the bytes of every tensor
    autograd saved for a backward pass during the block, parameters aside (the same count on any
    device, which a CPU's resident set cannot give: freed memory stays resident)."""
    saved = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            yield
            out.append(torch.cuda.max_memory_allocated(device) / 2**20)
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM, the peak resident set
            yield
            with open("/proc/self/status") as f:
                out.append(next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024)
    params = {p.untyped_storage().data_ptr() for m in MODELS for p in m.parameters()}
    activations.append(sum(n for ptr, n in saved.items() if ptr not in params) / 2**20)


def timed(fn, phases: dict, name: str):
    """`fn`, adding its wall time to phases[name] (TRL's methods are wrapped with this)."""

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0

    return wrapper


def instrument(trainer) -> dict:
    """Phase timers on TRL's generation, reward and no-grad log-prob (reference) calls."""
    phases = {}
    trainer._generate = timed(trainer._generate, phases, "generate")
    trainer._calculate_rewards = timed(trainer._calculate_rewards, phases, "score")
    logps = trainer._get_per_token_logps_and_entropies

    def logps_split(*a, **kw):
        return (logps if torch.is_grad_enabled() else timed(logps, phases, "logprob"))(*a, **kw)

    trainer._get_per_token_logps_and_entropies = logps_split
    return phases


class Side:
    """Per-step times, phase splits, peaks and generated-token counts of one side."""

    def __init__(self):
        self.steps, self.phases, self.peaks, self.activations, self.tokens = [], [], [], [], []

    def summary(self, warmup: int) -> dict:
        keep = slice(warmup, None)
        steps = self.steps[keep]
        split = {
            k: statistics.median(p.get(k, 0.0) for p in self.phases[keep]) for k in ("generate", "score", "logprob")
        }
        split["update"] = statistics.median(
            s - sum(p.get(k, 0.0) for k in ("generate", "score", "logprob")) for s, p in zip(steps, self.phases[keep])
        )
        return {
            "step": statistics.median(steps),
            "split": split,
            "peak": max(self.peaks[keep]),
            "activations": max(self.activations[keep]),
            "tokens": statistics.mean(self.tokens[keep]),
        }


def rlkit_step(state, side: "Side") -> None:
    """One rlkit step, timed, its phases and peak memory recorded in `side`."""
    state.runtime.timer.clear()
    with peak_memory(state.runtime.device, side.peaks, side.activations):
        t0 = time.perf_counter()
        rollout, _ = collect(state)
        prepare_and_update(state, rollout)
        side.steps.append(time.perf_counter() - t0)
    side.phases.append(dict(state.runtime.timer))
    side.tokens.append(float(rollout.completion_mask.sum()))


def compare(
    size: str,
    mode: str,
    rounds: int,
    warmup: int,
    prompts: int,
    group: int,
    max_new: int,
    extra: list[str] = (),
    context: int = 0,
    lora: int = 0,
) -> dict:
    """TRL, rlkit and rlkit without the shared prefix alternating steps; `context`: long prompts;
    `lora`: LoRA adapters of that rank on every linear layer on each side."""
    from transformers import TrainerCallback

    fixed = mode == "fixed"
    positions = [f"model.max_position_embeddings={context + 32 + max_new}"] if context else []  # the prompt must fit
    adapters = [f"model.lora_r={lora}", "model.lora_alpha=16", "model.lora_targets=all-linear"] if lora else []
    extra = [*SIZES.get(size, []), *extra, *positions, *adapters]
    with tempfile.TemporaryDirectory() as tmp:
        state = rlkit_state(extra, os.path.join(tmp, "rlkit"), prompts, group, max_new, fixed)
        unshared = rlkit_state(
            [*extra, "optim.share_prefix=never"], os.path.join(tmp, "off"), prompts, group, max_new, fixed
        )
        for s in [state, unshared] if context else []:
            with_context(s, context)
        trainer = trl_trainer(state, os.path.join(tmp, "model"), os.path.join(tmp, "trl"), rounds, fixed, lora)
        MODELS[:] = [m for s in (state, unshared) for m in (s.parts.policy, s.parts.ref) if m is not None]
        MODELS.extend(m for m in (trainer.model, trainer.ref_model) if m is not None)
        params = sum(p.numel() for p in state.parts.policy.parameters())
        check = equal_maths(state, trainer)
        ours, theirs, off = Side(), Side(), Side()
        phases = instrument(trainer)

        class Alternate(TrainerCallback):
            """Times TRL's step between step begin and end, then runs one rlkit step."""

            def on_step_begin(self, args, tstate, control, **kw):
                phases.clear()
                self.t0 = time.perf_counter()
                self.mem = peak_memory(state.runtime.device, theirs.peaks, theirs.activations)
                self.mem.__enter__()

            def on_step_end(self, args, tstate, control, **kw):
                theirs.steps.append(time.perf_counter() - self.t0)
                self.mem.__exit__(None, None, None)
                theirs.phases.append(dict(phases))
                theirs.tokens.append(trainer._metrics["train"]["completions/mean_length"][-1] * prompts * group)
                rlkit_step(state, ours)
                rlkit_step(unshared, off)

        trainer.add_callback(Alternate())
        trainer.train()
        a, b = ours.summary(warmup), theirs.summary(warmup)
        res = {
            "size": size,
            "params": params,
            "mode": mode,
            "check": check,
            "rlkit": a,
            "trl": b,
            "time ratio": a["step"] / b["step"],
            "memory ratio": a["peak"] / b["peak"],
            "context": context,
            "lora": lora,
        }
        c = res["rlkit unshared"] = off.summary(warmup)
        res["sharing"] = {"time": c["step"] / a["step"], "activations": c["activations"] / a["activations"]}
        return res


def report(res: dict) -> None:
    c = res["check"]
    tuning = f"LoRA rank {res['lora']}" if res.get("lora") else "full fine-tuning"
    print(f"\n== {res['size']} ({res['params'] / 1e6:.2f}M parameters), {res['mode']} length, {tuning} ==")
    print(
        f"equal maths on one rollout ({c['rows']} rows, mean length {c['mean length']:.1f}): max |diff| "
        f"advantage {c['advantage']:.1e}, reference logp {c['reference logp']:.1e}, loss {c['loss']:.1e}, "
        f"gradient {c['gradient']:.1e}"
    )
    for name in ("rlkit", "rlkit unshared", "trl"):
        if name not in res:
            continue
        s = res[name]
        split = ", ".join(f"{k} {v / s['step']:.0%}" for k, v in s["split"].items())
        print(
            f"{name:14s}: step {s['step']:.3f} s (median), peak {s['peak']:.0f} MB, activations "
            f"{s['activations']:.0f} MB; {split}; {s['tokens']:.0f} generated tokens/step"
        )
    print(
        f"ratio rlkit/TRL: time {res['time ratio']:.2f}x, peak memory {res['memory ratio']:.2f}x, activations "
        f"{res['rlkit']['activations'] / res['trl']['activations']:.2f}x"
    )
    if "sharing" in res:
        print(
            f"shared prefix ({res['context']}-character context): unshared/shared rlkit step time "
            f"{res['sharing']['time']:.2f}x, activations {res['sharing']['activations']:.2f}x"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["1m", "10m"], choices=sorted(SIZES))
    p.add_argument("--modes", nargs="+", default=["natural", "fixed"], choices=["natural", "fixed"])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rlkit", nargs="*", default=[], help="extra rlkit overrides, e.g. optim.micro_batch_tokens=512")
    p.add_argument("--context", type=int, default=0, help="characters of solved examples before every question")
    p.add_argument(
        "--lora", type=int, default=0, help="LoRA rank on every linear layer, both sides (0: full fine-tuning)"
    )
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    with open("/proc/loadavg") as f:
        print(f"load average before: {f.read().split()[:3]}; threads {a.threads}")
    for size in a.sizes:
        for mode in a.modes:
            report(
                compare(
                    size,
                    mode,
                    a.rounds,
                    a.warmup,
                    a.prompts,
                    a.group,
                    a.max_new,
                    [f"threads={a.threads}", *a.rlkit],
                    a.context,
                    a.lora,
                )
            )


if __name__ == "__main__":
    main()
