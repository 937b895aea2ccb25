"""The config's checks that run before any model is built (the schema's ranges, the rules that tie
keys together, no class named outside a component, no unknown key) and the building of components
from it. The schema itself, each key documented once, is `rlkit.schema`."""

from __future__ import annotations

import hashlib
import inspect
import math
import types
import typing
from typing import Any

from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

import hydra_plugins.rlkit_sweeper  # noqa: F401  (registers hydra/sweeper=rlkit, which conf/config.yaml chooses)
from rlkit import schema
from rlkit.refusals import ConfigError, check_class, require_all
from rlkit.tasks.base import TaskError


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


def nodes(node, key: str = ""):
    """(dotted key, value) of every node of a resolved config, the containers and their contents."""
    yield key, node
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        yield from nodes(v, f"{key}.{k}" if key else str(k))


def numbers(node):
    """(dotted key, value) of every number in a resolved config."""
    return ((k, v) for k, v in nodes(node) if isinstance(v, (int, float)) and not isinstance(v, bool))


def stray_targets(tree: dict, roots: set[str]) -> list[str]:
    """The dotted keys of every `_target_` in a resolved config that is not at the top of a
    component (`roots`): inside a component's options, a list, or any other key."""
    return [
        f"{k}._target_" if k else "_target_"
        for k, v in nodes(tree)
        if isinstance(v, dict) and "_target_" in v and k not in roots
    ]


def check_targets(config: dict) -> None:
    """Only a component's own node names a class: a `_target_` anywhere else (a list option such as
    `environment.preamble`, a component's nested option, a key added with `+`) in the resolved
    `config` would be built by the component's constructor call, so it is refused before anything is built."""
    tree = {k: v for k, v in config.items() if k != "hydra"}
    functions = [f"reward.functions.{n}" for n in tree.get("reward", {}).get("functions") or {}]
    roots = {*GROUPS, "critic", *functions, *(f"{f}.model" for f in functions)}  # a reward model's own model
    stray = stray_targets(tree, roots)
    if stray:
        raise ConfigError(
            f"{', '.join(stray)}: a _target_ names a class only at the top of a component ({', '.join(GROUPS)}, "
            "critic, reward.functions.<name> and its model); refusing to build anything from it"
        )


def check_values(cfg: DictConfig) -> None:
    """The config's own numbers and choices, before any component is built: no class named outside
    a component's node, no unknown key, every number of every group finite, then each key's
    range. Every value that fails is named in one refusal."""
    tree = resolved(cfg)
    check_targets(tree)
    unknown = schema.unknown_keys(cfg)
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(unknown)}: not in rlkit's config (`rlkit-train --help` lists the groups; "
            "each key is documented in rlkit/schema.py); a misspelled key would be ignored, so it is refused"
        )
    finite = [(math.isfinite(v), f"{key} must be a finite number, got {v}") for key, v in numbers(tree)]
    ranges = schema.range_checks(cfg) + run_checks(cfg)
    require_all(ranges if all(ok for ok, _ in finite) else finite)  # a non-finite number's range would repeat it


def shuffle_mode(value) -> str:
    """`reward.shuffle` as a mode; true and false (the older spelling) are step and none."""
    return {"true": "step", "false": "none"}.get(str(value).lower(), str(value))


def run_checks(cfg: DictConfig) -> list[tuple[bool, str]]:
    """(ok, refusal) of the rules that tie keys together, and of the values no range describes."""
    rw, ev, op = cfg.reward, cfg.eval, cfg.optim
    bad_k = [k for k in ev.pass_k if not (1 <= k <= ev.samples)]
    return [
        (
            op.mini_batches <= cfg.rollout.prompts_per_step,
            f"optim.mini_batches must be in [1, rollout.prompts_per_step={cfg.rollout.prompts_per_step}], "
            f"got {op.mini_batches}",
        ),
        (
            rw.overlong_cache <= cfg.rollout.max_new_tokens,
            f"reward.overlong_cache must be in [0, rollout.max_new_tokens={cfg.rollout.max_new_tokens}], "
            f"got {rw.overlong_cache}",
        ),
        (
            shuffle_mode(rw.shuffle) in ("none", "step", "group"),
            f"reward.shuffle must be none, step or group (true = step), got {rw.shuffle!r}",
        ),
        (not bad_k, f"eval.pass_k needs integers in [1, eval.samples={ev.samples}], got {bad_k}"),
        (ev.samples or not ev.sample_levels, f"eval.sample_levels={list(ev.sample_levels)} needs eval.samples > 0"),
        *((cfg[g] is not None, f"no option chosen for group '{g}'") for g in GROUPS),
    ]


def eval_seed(cfg: DictConfig) -> int:
    """The random state of a run's sampled evaluations (`eval.seed`, plus the run's seed with
    `eval.seed_per_run`)."""
    return cfg.eval.seed + (cfg.seed if cfg.eval.seed_per_run else 0)


def resolved(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)
