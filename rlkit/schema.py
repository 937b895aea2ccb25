"""The typed config schema, registered with Hydra's ConfigStore (so a misspelled key fails when the
config composes): each key once, with its type, default, one-line description and the range its
values must lie in. One generic pass (`range_checks`) checks every range; `key_help` and
`keys_table` write the descriptions for `rlkit-train --help` and the configuration page. Rules
that tie two keys together live beside the schema, in `rlkit.config.run_checks`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

SEED_MAX = 2**32 - 1  # numpy's seeds are 32-bit


def number(x: float | None) -> str:
    """A bound as written: whole numbers in full (4294967295, not 4.29e+09)."""
    return "" if x is None else str(int(x)) if float(x).is_integer() else f"{x:g}"


@dataclass(frozen=True)
class Range:
    """Numbers from `low` to `high` (None: unbounded), each end closed unless said open."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    note: str = ""  # what a boundary value means, e.g. "0 = no limit"

    def ok(self, v) -> bool:
        above = self.low is None or (v > self.low if self.low_open else v >= self.low)
        below = self.high is None or (v < self.high if self.high_open else v <= self.high)
        return above and below

    def __str__(self) -> str:
        low, high = number(self.low), number(self.high)
        if self.high is None:
            words = f"{'>' if self.low_open else '>='} {low}"
        else:
            words = f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        return words + (f" ({self.note})" if self.note else "")


@dataclass(frozen=True)
class OneOf:
    """One of a few words."""

    options: tuple

    def ok(self, v) -> bool:
        return v in self.options

    def __str__(self) -> str:
        return f"one of {', '.join(self.options)}"


def key(default: Any = None, help: str = "", check: Range | OneOf | None = None, factory=None) -> Any:
    """A schema field: its default (or `factory` for a list or dict), description and range."""
    meta = {"help": help, "check": check}
    return field(default_factory=factory, metadata=meta) if factory else field(default=default, metadata=meta)


AT_LEAST_0, AT_LEAST_1, ABOVE_0 = Range(0), Range(1), Range(0, low_open=True)


@dataclass
class RolloutConfig:
    prompts_per_step: int = key(16, "P: prompts (groups) per RL step", AT_LEAST_1)
    group_size: int = key(8, "G: completions sampled per prompt", AT_LEAST_1)
    max_new_tokens: int = key(24, "generation budget per completion", AT_LEAST_1)
    temperature: float = key(1.0, "sampling temperature (log-probs use the same temperature)", ABOVE_0)
    top_p: float = key(1.0, "nucleus sampling mass", Range(0, 1, low_open=True))
    coupled: bool = key(
        False,
        "true: each sampled token's uniform keyed by (seed, step, prompt, index in group, position), so arms at one "
        "seed sample alike where their policies agree",
    )


@dataclass
class RewardConfig:
    overlong_cache: int = key(0, "DAPO soft overlong punishment over the last k tokens of the budget", AT_LEAST_0)
    functions: Dict[str, Any] = key(
        help="name -> weighted reward function (group `rewards`); {} = the task's reward", factory=dict
    )
    combine: str = key(
        "sum", "sum (weighted sum) | normalise (z-score each term in its group, then sum)", OneOf(("sum", "normalise"))
    )
    shuffle: str = key(
        "none",
        "control: none | step (the step's rewards permuted across its completions) | group (each group's "
        "rewards permuted among its own completions); true = step",
    )
    timeout_s: float = key(
        60.0,
        "time limit of one reward call (one completion); past it the run stops naming the row",
        Range(0, note="0 = no limit"),
    )


@dataclass
class OptimConfig:
    lr: float = key(1e-4, "AdamW learning rate of the policy", ABOVE_0)
    warmup_steps: int = key(10, "linear learning-rate warm-up over the first RL steps", AT_LEAST_0)
    weight_decay: float = key(0.0, "AdamW weight decay", AT_LEAST_0)
    beta1: float = key(0.9, "AdamW beta1", Range(0, 1, high_open=True))
    beta2: float = key(0.99, "AdamW beta2", Range(0, 1, high_open=True))
    eps: float = key(
        1e-8,
        "AdamW epsilon; far above a weight's typical gradient it turns Adam into momentum SGD with step lr/eps",
        ABOVE_0,
    )
    max_grad_norm: float = key(1.0, "gradient clipping (global norm)", ABOVE_0)
    epochs: int = key(1, "passes over each rollout", AT_LEAST_1)
    mini_batches: int = key(
        1, "optimizer steps per pass (split by groups), at most rollout.prompts_per_step", AT_LEAST_1
    )
    micro_batch_size: int = key(
        0,
        "rows per forward/backward (gradient accumulation); need not divide the batch: the gradient is the same",
        Range(0, note="0 = the whole mini-batch"),
    )
    micro_batch_tokens: int = key(
        0,
        "padded tokens per forward/backward; rows of similar length go together, each micro-batch trimmed to "
        "its longest row",
        Range(0, note="0 = no limit"),
    )
    max_nonfinite: int = key(3, "stop after this many updates in a row skipped for NaN/inf", AT_LEAST_1)
    share_prefix: str = key(
        "auto",
        "training forwards compute each distinct prompt of a micro-batch once, its completions attending to it "
        "(Llama-family models): auto (where that runs fewer tokens than packing) | always | never",
        OneOf(("auto", "always", "never")),
    )


@dataclass
class WarmStartConfig:
    steps: int = key(120, "supervised steps on task demonstrations before RL", Range(0, note="0 skips"))
    batch_size: int = key(64, "demonstrations per step", AT_LEAST_1)
    lr: float = key(3e-3, "AdamW learning rate of the warm start", ABOVE_0)
    seed: int = key(0, "fixed across RL seeds, so seeds share one starting policy", Range(0, SEED_MAX))
    cache_dir: str = key(
        "${oc.env:RLKIT_CACHE,'~/.cache/rlkit'}/warm_start", "where warm starts are cached, by config hash"
    )


@dataclass
class EvalConfig:
    every: int = key(25, "evaluate every k RL steps (and before the first and after the last)", AT_LEAST_0)
    batch_size: int = key(256, "prompts per greedy generation batch", AT_LEAST_1)
    max_new_tokens: int = key(0, "generation budget of an evaluation", Range(0, note="0 = rollout.max_new_tokens"))
    samples: int = key(
        0,
        "k > 0: also eval/mean@k, k completions per prompt at the rollout temperature",
        Range(0, note="0 = greedy evaluation only"),
    )
    seed: int = key(
        0,
        "random state of those samples, the same at every evaluation (of every run, unless seed_per_run)",
        Range(0, SEED_MAX),
    )
    seed_per_run: bool = key(
        False,
        "true: the samples' state is eval.seed + seed, so a starting policy measured at several seeds carries its "
        "sampling error (a study whose baseline is `start` on a sampled metric needs it)",
    )
    pass_k: List[int] = key(
        help="k of eval/pass@k (unbiased, from those samples), each in [1, eval.samples]", factory=list
    )
    sample_levels: List[float] = key(
        help="difficulty levels whose held-out prompts those samples are drawn for (empty: every prompt); with "
        "levels named, only their per-level metrics are logged (eval/mean@k_d<level>, ...)",
        factory=list,
    )


@dataclass
class CheckpointConfig:
    every: int = key(50, "write a checkpoint every k steps (and at the end)", Range(0, note="0 = only at the end"))
    keep: int = key(2, "newest checkpoints kept", AT_LEAST_1)
    resume: bool = key(True, "continue from the run directory's last checkpoint if there is one")


@dataclass
class RLKitConfig:
    advantage: Any = key(None, "advantage estimator (group `advantage`)")
    aggregator: Any = key(None, "loss aggregator (group `aggregator`)")
    sampler: Any = key(None, "prompt sampler (group `sampler`)")
    loss: Any = key(None, "policy loss, with KL and entropy options (group `loss`)")
    correction: Any = key(None, "off-policy correction of the policy loss (group `correction`)")
    critic: Any = key(None, "value model, built only when the estimator needs one (group `critic`)")
    engine: Any = key(None, "generation engine for training and evaluation (group `engine`)")
    environment: Any = key(None, "what answers the model between turns (group `environment`)")
    task: Any = key(None, "task: data and reward (group `task`)")
    model: Any = key(None, "policy model (group `model`)")
    logger: Any = key(None, "metrics sink (group `logger`)")
    seed: int = key(0, "seed of the RL run", Range(0, SEED_MAX))
    steps: int = key(200, "RL steps", AT_LEAST_1)
    device: str = key("cpu", "torch device")
    parallel: str = key(
        "replicate",
        "with several processes: replicate (each holds the whole model) | shard (each holds 1/K of the policy's "
        "and reference's weights, gradients and optimizer state)",
    )
    threads: int = key(0, "torch CPU threads (in a parallel sweep: cores / jobs)", Range(0, note="0 = torch's default"))
    portable: bool = key(
        False,
        "pin ATen, MKL and oneDNN CPU kernels to AVX2, so x86 machines with AVX2 or AVX-512 run the same kernels; "
        "give it on the command line (set before torch starts)",
    )
    samples_every: int = key(
        25, "log a table of sample completions every k steps (and at step 1)", Range(0, note="0 = off")
    )
    rollout: RolloutConfig = key(factory=RolloutConfig)
    reward: RewardConfig = key(factory=RewardConfig)
    optim: OptimConfig = key(factory=OptimConfig)
    warm_start: WarmStartConfig = key(factory=WarmStartConfig)
    eval: EvalConfig = key(factory=EvalConfig)
    checkpoint: CheckpointConfig = key(factory=CheckpointConfig)


ConfigStore.instance().store(name="rlkit_schema", node=RLKitConfig)


def schema_keys(cls: type = RLKitConfig, prefix: str = ""):
    """(dotted key, dataclass field) of every leaf key of the schema, section by section."""
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
            yield from schema_keys(f.default_factory, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f


def unknown_keys(cfg) -> list[str]:
    """Keys the schema does not have (added with `+`, which Hydra lets through): at the top level
    and in the typed sections (rollout, optim, ...). A component's own options are checked against
    its class when it is built."""
    leaves = {name for name, _ in schema_keys()}
    sections = {name.split(".")[0] for name in leaves if "." in name}
    out = []
    for k in cfg:
        if k in sections:
            out += [f"{k}.{sub}" for sub in cfg[k] if f"{k}.{sub}" not in leaves]
        elif k not in leaves and k != "hydra":
            out.append(k)
    return out


def settings():
    """(dotted key, type, default, range or None, description) of every key but the component groups
    (typed Any: their options are their classes' arguments)."""
    for name, f in schema_keys():
        if f.type != "Any":
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            yield name, f.type, default, f.metadata["check"], f.metadata["help"]


def range_checks(cfg) -> list[tuple[bool, str]]:
    """(ok, refusal) of every key with a declared range, by one rule: `KEY must be RANGE, got VALUE`."""
    out = []
    for name, f in schema_keys():
        check, value = f.metadata["check"], OmegaConf.select(cfg, name)
        if check is not None:
            shown = repr(value) if isinstance(check, OneOf) else value
            out.append((check.ok(value), f"{name} must be {check}, got {shown}"))
    return out


def key_help() -> str:
    """Every key, a line each: `name (type, default; range): description`, for `rlkit-train --help`."""
    return "\n".join(
        f"{name} ({kind}, default {default!r}{'; ' + str(check) if check else ''}): {help}"
        for name, kind, default, check, help in settings()
    )


def keys_table() -> str:
    """The keys as a markdown table, for the configuration page."""
    rows = [
        f"| `{name}` | `{default!r}` | {check or ''} | {help.replace('|', 'or')} |"
        for name, _, default, check, help in settings()
    ]
    return "\n".join(["| key | default | range | what it is |", "|---|---|---|---|", *rows])


# in `rlkit-train --help` (conf/config.yaml), whose template Hydra fills with string.Template: `$` doubled
OmegaConf.register_new_resolver("rlkit_key_help", lambda: key_help().replace("$", "$$"), replace=True)
