"""Typed config schemas (registered with Hydra's ConfigStore) and checks that run before any
model is built. Each field is documented once, here."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List

from hydra.core.config_store import ConfigStore
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

import hydra_plugins.rlkit_sweeper  # noqa: F401  (registers hydra/sweeper=rlkit, which conf/config.yaml chooses)
from rlkit.refusals import ConfigError, check_class, require_all
from rlkit.tasks.base import TaskError


@dataclass
class RolloutConfig:
    prompts_per_step: int = 16  # P: prompts (groups) per RL step
    group_size: int = 8  # G: completions sampled per prompt
    max_new_tokens: int = 24  # generation budget per completion
    temperature: float = 1.0  # sampling temperature (log-probs use the same temperature)
    top_p: float = 1.0  # nucleus sampling mass


@dataclass
class RewardConfig:
    overlong_cache: int = 0  # DAPO soft overlong punishment over the last k tokens of the budget; 0 = off
    functions: Dict[str, Any] = field(default_factory=dict)  # name -> weighted reward function; {} = the task's reward
    combine: str = "sum"  # sum (weighted sum) | normalise (z-score each term in its group, then sum)
    shuffle: str = "none"  # control: none | step (the step's rewards permuted across its completions) |
    # group (each group's rewards permuted among its own completions); true = step
    timeout_s: float = 60.0  # time limit of one reward call (one completion); past it the run stops naming
    # the row; 0 = no limit


@dataclass
class OptimConfig:
    lr: float = 1e-4  # AdamW learning rate of the policy
    warmup_steps: int = 10  # linear learning-rate warm-up over the first RL steps
    weight_decay: float = 0.0  # AdamW weight decay
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.99  # AdamW beta2
    eps: float = 1e-8  # AdamW epsilon; far above a weight's typical gradient it turns Adam into
    # momentum SGD with step lr/eps, whose noise shrinks with the batch
    max_grad_norm: float = 1.0  # gradient clipping (global norm)
    epochs: int = 1  # passes over each rollout
    mini_batches: int = 1  # optimizer steps per pass (split by groups)
    micro_batch_size: int = 0  # rows per forward/backward (gradient accumulation); 0 = whole mini-batch.
    # Need not divide the batch: weights are global, the gradient is the same
    micro_batch_tokens: int = 0  # padded tokens per forward/backward, 0 = no limit; rows of similar length
    # go together and each micro-batch is trimmed to its longest row
    max_nonfinite: int = 3  # stop after this many updates in a row skipped for NaN/inf
    share_prefix: str = "auto"  # training forwards compute each distinct prompt of a micro-batch once, its
    # completions attending to it (Llama-family models): auto (where that runs fewer
    # tokens than packing) | always | never


@dataclass
class WarmStartConfig:
    steps: int = 120  # supervised steps on task demonstrations before RL; 0 skips
    batch_size: int = 64  # demonstrations per step
    lr: float = 3e-3  # AdamW learning rate of the warm start
    seed: int = 0  # fixed across RL seeds, so seeds share one starting policy
    cache_dir: str = "${oc.env:RLKIT_CACHE,'~/.cache/rlkit'}/warm_start"  # cached by config hash


@dataclass
class EvalConfig:
    every: int = 25  # evaluate every k RL steps (and before the first and after the last)
    batch_size: int = 256  # prompts per greedy generation batch
    max_new_tokens: int = 0  # 0 = rollout.max_new_tokens
    samples: int = 0  # k > 0: also eval/mean@k, k completions per prompt at the rollout temperature
    seed: int = 0  # random state of those samples, the same at every evaluation (of every run, unless seed_per_run)
    seed_per_run: bool = False  # true: the samples' state is eval.seed + seed, so each run seed draws its own
    # samples and a starting policy measured at several seeds carries its sampling error (a study whose
    # baseline is `start` on a sampled metric needs it); false: one draw for every run
    pass_k: List[int] = field(default_factory=list)  # k of eval/pass@k (unbiased, from those samples), <= samples


@dataclass
class CheckpointConfig:
    every: int = 50  # write a checkpoint every k steps (and at the end); 0 = only at the end
    keep: int = 2  # newest checkpoints kept
    resume: bool = True  # continue from the run directory's last checkpoint if there is one


@dataclass
class RLKitConfig:
    advantage: Any = None  # advantage estimator (group `advantage`)
    aggregator: Any = None  # loss aggregator (group `aggregator`)
    sampler: Any = None  # prompt sampler (group `sampler`)
    loss: Any = None  # policy loss, with KL and entropy options (group `loss`)
    correction: Any = None  # off-policy correction of the policy loss (group `correction`)
    critic: Any = None  # value model, built only when the estimator needs one (group `critic`)
    engine: Any = None  # generation engine for training and evaluation (group `engine`)
    environment: Any = None  # what answers the model between turns: single_turn | calculator (group `environment`)
    task: Any = None  # task: data and reward (group `task`)
    model: Any = None  # policy model (group `model`)
    logger: Any = None  # metrics sink (group `logger`)
    seed: int = 0  # seed of the RL run
    steps: int = 200  # RL steps
    device: str = "cpu"  # torch device
    parallel: str = "replicate"  # with several processes: replicate (each holds the whole model) | shard (each
    # holds 1/K of the policy's and reference's weights, gradients and optimizer state)
    threads: int = 0  # torch CPU threads; 0 = torch's default (in a parallel sweep: cores / jobs)
    portable: bool = False  # pin ATen, MKL and oneDNN CPU kernels to AVX2, so x86 machines with AVX2 or
    # AVX-512 run the same kernels; give it on the command line (set before torch starts)
    samples_every: int = 25  # log a table of sample completions every k steps (and at step 1); 0 = off
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


ConfigStore.instance().store(name="rlkit_schema", node=RLKitConfig)


def short_dirname(overrides: str, limit: int = 96) -> str:
    """A sweep job's directory name from its overrides, cut with a hash when too long for a file name."""
    if len(overrides) <= limit:
        return overrides
    return f"{overrides[: limit - 9]}-{hashlib.sha1(overrides.encode()).hexdigest()[:8]}"


OmegaConf.register_new_resolver("rlkit_dirname", short_dirname, replace=True)

GROUPS = (
    "advantage",
    "aggregator",
    "sampler",
    "loss",
    "correction",
    "engine",
    "environment",
    "task",
    "model",
    "logger",
)


def chosen(cfg: DictConfig, key: str) -> bool:
    """Whether an option with a `_target_` was chosen for the optional group `key` (e.g. critic=none: no)."""
    return cfg[key] is not None and "_target_" in cfg[key]


def target_class(cfg: DictConfig, key: str) -> type:
    node = OmegaConf.select(cfg, key)
    if node is None or "_target_" not in node:
        raise ConfigError(f"'{key}' needs a _target_ naming a class")
    try:
        return get_class(node._target_)
    except Exception as e:
        raise ConfigError(f"{key}._target_={node._target_!r} cannot be imported: {e}") from e


def options(target: type) -> dict | None:
    """The constructor arguments of `target` with their type hints, following `**kwargs` up the
    class hierarchy; None when it takes any keyword."""
    params = {}
    for cls in target.__mro__:
        init = vars(cls).get("__init__")
        if init is None or cls is object:
            continue
        hints = typing.get_type_hints(init)
        sig = inspect.signature(init).parameters.values()
        params.update(
            {
                p.name: hints.get(p.name)
                for p in sig
                if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in params
            }
        )
        if not any(p.kind == p.VAR_KEYWORD for p in sig):
            return params
    return params if target.__init__ is object.__init__ else None


def _type_ok(value, hint) -> bool:
    """Whether a config value fits a plain type hint (int, float, bool, str, optionally None);
    other hints are not checked."""
    allowed = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if not all(t in (int, float, bool, str, type(None)) for t in allowed):
        return True
    if isinstance(value, bool):
        return bool in allowed
    return isinstance(value, tuple(allowed)) or (isinstance(value, int) and float in allowed)


def build(cfg: DictConfig, key: str, kind: type | None = None, **runtime) -> Any:
    """Instantiate the component at `key` (dotted for a nested one); a class that does not define the
    methods of `kind` (its Protocol) is refused unbuilt, and a wrong argument name or type is
    reported with its key."""
    node, target = OmegaConf.select(cfg, key), target_class(cfg, key)
    if kind is not None:
        check_class(target, kind, key)
    params = options(target)
    for k in node if params is not None else ():
        if str(k).startswith("_") or OmegaConf.is_missing(node, k):
            continue
        if k not in params:
            raise ConfigError(f"{key}.{k} is not an option of {node._target_} (options: {list(params)})")
        if not _type_ok(node[k], params[k]):
            raise ConfigError(f"{key}.{k}={node[k]!r} must be of type {getattr(params[k], '__name__', params[k])}")
    try:
        obj = instantiate(node, _recursive_=False)  # a nested `_target_` is refused (`stray_targets`), never built
        return obj(**runtime) if node.get("_partial_", False) else obj
    except Exception as e:
        cause = e.__cause__ or e
        if isinstance(cause, (ConfigError, TaskError)):
            raise cause from None
        raise ConfigError(f"{key}: {type(cause).__name__}: {cause}") from e


SEED_MAX = 2**32 - 1  # numpy's seeds are 32-bit


def numbers(node, prefix: str = ""):
    """(dotted key, value) of every number in a resolved config."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        if isinstance(v, (dict, list)):
            yield from numbers(v, f"{prefix}{k}.")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            yield f"{prefix}{k}", v


def stray_targets(node, roots: set[str], prefix: str = "") -> list[str]:
    """The dotted keys of every `_target_` in a resolved config that is not at the top of a
    component (`roots`): inside a component's options, a list, or any other key."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    here = prefix.rstrip(".")
    stray = [f"{prefix}_target_"] if isinstance(node, dict) and "_target_" in node and here not in roots else []
    for k, v in items:
        stray += stray_targets(v, roots, f"{prefix}{k}.")
    return stray


def check_targets(cfg: DictConfig) -> None:
    """Only a component's own node names a class: a `_target_` anywhere else (a list option such as
    `environment.preamble`, a component's nested option, a key added with `+`) would be built by the
    component's constructor call, so it is refused before anything is built."""
    tree = {k: v for k, v in resolved(cfg).items() if k != "hydra"}
    roots = {*GROUPS, "critic", *(f"reward.functions.{n}" for n in tree.get("reward", {}).get("functions") or {})}
    stray = stray_targets(tree, roots)
    if stray:
        raise ConfigError(
            f"{', '.join(stray)}: a _target_ names a class only at the top of a component ({', '.join(GROUPS)}, "
            "critic, reward.functions.<name>); refusing to build anything from it"
        )


def unknown_keys(cfg: DictConfig) -> list[str]:
    """Keys the schema does not have (added with `+`, which Hydra lets through): at the top level
    and in the typed sections (rollout, optim, ...). A component's own options are checked against
    its class when it is built."""
    schema = {f.name: f for f in dataclasses.fields(RLKitConfig)}
    out = [k for k in cfg if k not in schema and k != "hydra"]
    for name, f in schema.items():
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            known = {g.name for g in dataclasses.fields(f.default_factory)}
            out += [f"{name}.{k}" for k in cfg[name] if k not in known]
    return out


def check_values(cfg: DictConfig) -> None:
    """The config's own numbers and choices, before any component is built: no class named outside
    a component's node, no unknown key, every number of every group finite, then each key's
    range. Every value that fails is named in one refusal."""
    check_targets(cfg)
    unknown = unknown_keys(cfg)
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(unknown)}: not in rlkit's config (`rlkit-train --help` lists the groups; "
            "each key is documented in rlkit/config.py); a misspelled key would be ignored, so it is refused"
        )
    finite = [(math.isfinite(v), f"{key} must be a finite number, got {v}") for key, v in numbers(resolved(cfg))]
    ranges = range_checks(cfg) + run_checks(cfg)
    require_all(ranges if all(ok for ok, _ in finite) else finite)  # a non-finite number's range would repeat it


def range_checks(cfg: DictConfig) -> list[tuple[bool, str]]:
    """(ok, refusal) of the seeds, the rollout's sizes and the optimiser's settings."""
    seeds = [(k, OmegaConf.select(cfg, k)) for k in ("seed", "warm_start.seed", "eval.seed")]
    r, op = cfg.rollout, cfg.optim
    return [
        *((0 <= v <= SEED_MAX, f"{k} must be in [0, {SEED_MAX}], got {v}") for k, v in seeds),
        (cfg.steps >= 1, f"steps must be >= 1, got {cfg.steps}"),
        (r.prompts_per_step >= 1, f"rollout.prompts_per_step must be >= 1, got {r.prompts_per_step}"),
        (r.group_size >= 1, f"rollout.group_size must be >= 1, got {r.group_size}"),
        (r.max_new_tokens >= 1, f"rollout.max_new_tokens must be >= 1, got {r.max_new_tokens}"),
        (r.temperature > 0, f"rollout.temperature must be > 0, got {r.temperature}"),
        (0 < r.top_p <= 1, f"rollout.top_p must be in (0, 1], got {r.top_p}"),
        (op.lr > 0, f"optim.lr must be > 0, got {op.lr}"),
        (op.eps > 0, f"optim.eps must be > 0, got {op.eps}"),
        (op.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {op.weight_decay}"),
        (
            0 <= op.beta1 < 1 and 0 <= op.beta2 < 1,
            f"optim.beta1 and optim.beta2 must be in [0, 1), got {op.beta1}, {op.beta2}",
        ),
        (cfg.threads >= 0, f"threads must be >= 0 (0 = torch's default), got {cfg.threads}"),
        (op.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {op.warmup_steps}"),
        (op.max_grad_norm > 0, f"optim.max_grad_norm must be > 0, got {op.max_grad_norm}"),
        (op.epochs >= 1, f"optim.epochs must be >= 1, got {op.epochs}"),
        (
            1 <= op.mini_batches <= r.prompts_per_step,
            f"optim.mini_batches must be in [1, rollout.prompts_per_step={r.prompts_per_step}], got {op.mini_batches}",
        ),
        (op.max_nonfinite >= 1, f"optim.max_nonfinite must be >= 1, got {op.max_nonfinite}"),
        (op.micro_batch_size >= 0, f"optim.micro_batch_size must be >= 0, got {op.micro_batch_size}"),
        (op.micro_batch_tokens >= 0, f"optim.micro_batch_tokens must be >= 0, got {op.micro_batch_tokens}"),
        (
            op.share_prefix in ("auto", "always", "never"),
            f"optim.share_prefix must be auto, always or never, got {op.share_prefix!r}",
        ),
    ]


def shuffle_mode(value) -> str:
    """`reward.shuffle` as a mode; true and false (the older spelling) are step and none."""
    return {"true": "step", "false": "none"}.get(str(value).lower(), str(value))


def run_checks(cfg: DictConfig) -> list[tuple[bool, str]]:
    """(ok, refusal) of the rewards, warm start, evaluation, logging and checkpoints."""
    rw, ws, ev = cfg.reward, cfg.warm_start, cfg.eval
    bad_k = [k for k in ev.pass_k if not (1 <= k <= ev.samples)]
    return [
        (
            0 <= rw.overlong_cache <= cfg.rollout.max_new_tokens,
            f"reward.overlong_cache must be in [0, rollout.max_new_tokens={cfg.rollout.max_new_tokens}], "
            f"got {rw.overlong_cache}",
        ),
        (
            shuffle_mode(rw.shuffle) in ("none", "step", "group"),
            f"reward.shuffle must be none, step or group (true = step), got {rw.shuffle!r}",
        ),
        (rw.combine in ("sum", "normalise"), f"reward.combine must be 'sum' or 'normalise', got {rw.combine!r}"),
        (rw.timeout_s >= 0, f"reward.timeout_s must be >= 0, got {rw.timeout_s}"),
        (ws.steps >= 0, f"warm_start.steps must be >= 0, got {ws.steps}"),
        (
            ws.batch_size >= 1 and ws.lr > 0,
            f"warm_start.batch_size must be >= 1 and warm_start.lr > 0, got {ws.batch_size}, {ws.lr}",
        ),
        (cfg.samples_every >= 0, f"samples_every must be >= 0, got {cfg.samples_every}"),
        (ev.every >= 0 and cfg.checkpoint.every >= 0, "eval.every and checkpoint.every must be >= 0"),
        (ev.batch_size >= 1, f"eval.batch_size must be >= 1, got {ev.batch_size}"),
        (ev.samples >= 0, f"eval.samples must be >= 0 (0 = greedy evaluation only), got {ev.samples}"),
        (not bad_k, f"eval.pass_k needs integers in [1, eval.samples={ev.samples}], got {bad_k}"),
        (
            not ev.max_new_tokens or ev.max_new_tokens >= 1,
            f"eval.max_new_tokens must be >= 1 (or 0 = rollout.max_new_tokens), got {ev.max_new_tokens}",
        ),
        (cfg.checkpoint.keep >= 1, f"checkpoint.keep must be >= 1, got {cfg.checkpoint.keep}"),
        *((cfg[g] is not None, f"no option chosen for group '{g}'") for g in GROUPS),
    ]


def eval_seed(cfg: DictConfig) -> int:
    """The random state of a run's sampled evaluations (`eval.seed`, plus the run's seed with
    `eval.seed_per_run`)."""
    return cfg.eval.seed + (cfg.seed if cfg.eval.seed_per_run else 0)


def resolved(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)
