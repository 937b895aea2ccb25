"""The study model: a study file (`experiments/<name>/study.yaml`) fixes, before any run, the arms,
the claim, the primary metric and its per-run aggregate, the direction and smallest effect of
interest, alpha and power, the secondary metrics, an engagement check, a learning check, control
arms and the seed cap. `load_spec` reads and checks it; `declared` is the declaration as plain
data, which the plan and every record keep."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlkit.analysis.runs import WITHDRAWN, parse_aggregate
from rlkit.analysis.sequential import first_decisive


@dataclass
class MetricSpec:
    metric: str = MISSING  # a logged metric, e.g. eval/accuracy
    aggregate: str = "last:3"  # each run's one number: final, last:K, auc, auc:tokens:B, best (after step 0), ...
    lower: bool = False  # lower values are better (lengths, losses)


@dataclass
class Primary(MetricSpec):
    direction: str = MISSING  # the claimed effect of each treatment against the baseline: higher, lower or equal
    smallest_effect: float = MISSING  # the smallest difference of interest; for `equal`, the equivalence margin


@dataclass
class Engagement(MetricSpec):
    at_least: float | None = None  # each treatment arm's mean aggregate must reach this ...
    at_most: float | None = None  # ... or stay below this, for the treatment to count as applied
    arm: str | None = None  # or this one arm's (e.g. the baseline's: the mechanism must bind there)


@dataclass
class Learning(MetricSpec):
    """The baseline arm must learn for any verdict to count: its mean `aggregate` of `metric` per
    run (by default held-out accuracy, the mean of the last 3 evaluations minus step 0) exceeds
    `margin` with its whole 95% interval."""

    metric: str = "eval/accuracy"
    aggregate: str = "gain:3"
    margin: float | None = None  # the gain the baseline must exceed; None = twice primary.smallest_effect when
    # `metric` is the primary metric (the same units), else 0
    arm: str | None = None  # whose gain: None = the learner (`learner`); a control's where the arm under test is
    # claimed not to learn (the check then shows the training acts where the claim says it should)


def learning_margin(spec) -> float:
    """The gain the baseline must exceed with its whole interval (see `Learning.margin`)."""
    L = spec.learning
    if L.margin is not None:
        return L.margin
    return 2 * spec.primary.smallest_effect if L.metric == spec.primary.metric else 0.0


@dataclass
class Sensitivity:
    """The positive control: a control arm that applies the mechanism at a strength known to matter.
    It must differ from the baseline on the primary metric in `direction`, significantly and by at
    least the smallest effect, else no verdict is given (the testbed cannot see the mechanism)."""

    arm: str = MISSING  # one of `controls`, run at the same seeds
    direction: str | None = None  # higher or lower; None = the primary's direction (required for `equal`)


@dataclass
class Premise(MetricSpec):
    """What the claim assumes, measured before it could act (`aggregate: start` is the step-0 value)
    in one arm; outside its bound, no verdict is given."""

    aggregate: str = "start"
    arm: str | None = None  # None = the baseline (`learner`)
    at_least: float | None = None
    at_most: float | None = None
    why: str = ""  # the assumption in words, for the README


@dataclass
class Seeds:
    pilot: int = 3  # paired seeds per arm run first; their spread plans the rest
    cap: int = 20  # most seeds per arm the study may spend
    pilot_confidence: float = 0.8  # the pilot's sd is raised to this upper confidence limit before planning
    first: int = 0  # the run seed of the study's seed 0 (seed i runs with seed=first+i): fresh seeds for a new
    # declaration of a claim whose earlier runs already used 0, 1, ...


@dataclass
class Sequential:
    """A sequential design: a look after every completed seed from `seeds.pilot` (at least 3) to
    `seeds.cap`, each decision anytime-valid (`rlkit.analysis.sequential`), the study stopped as soon
    as every gate and every verdict is decided. No plan is made; raising the cap later continues the
    study (an extension) without invalidating its error rates."""

    prior: float = 1.0  # phi, the mixture's precision on the standardised effect (1: effects about one sd)


START = "start"  # the baseline that is each seed's starting policy: its step-0 evaluation, held (`learner`)
SAMPLED = ("eval/mean@", "eval/pass@")  # the held-out metrics drawn from sampled completions (rlkit.evaluate)


def learning_arm(spec) -> str:
    """The arm whose gain the learning check tests: `learning.arm`, else the learner."""
    return spec.learning.arm or learner(spec)


def learner(spec) -> str:
    """The arm whose learning the gates check: the baseline, or with `baseline: start` the first
    arm (whose runs also give the starting policy's values: every arm of a seed starts from it)."""
    return next(iter(spec.arms)) if spec.baseline == START else spec.baseline


@dataclass
class StudySpec:
    claim: str = MISSING  # the published claim under test, in one or two sentences
    source: str = MISSING  # the paper (authors, year, arXiv id)
    config: list = field(
        default_factory=list
    )  # overrides every arm shares (the testbed), e.g. [+experiment=wide_testbed]
    arms: dict = MISSING  # arm name -> its own overrides; arms differ in one mechanism
    baseline: str = MISSING  # the arm the others are compared with; `start`: each arm against its starting policy
    primary: Primary = MISSING
    secondary: list = field(default_factory=list)  # MetricSpec entries, Holm-corrected together
    engagement: Engagement | None = None  # a metric that shows the treatment acted
    learning: Learning | None = None  # a check that the baseline learns at all; failing it, no verdict
    sensitivity: Sensitivity | None = None  # the positive control; without one, "equivalent" is never printed
    premises: list = field(default_factory=list)  # Premise entries; any outside its bound, no verdict
    unfinished: str = "last"  # how a run that stopped early (diverged, crashed) counts: last (its aggregate
    # over what it logged; the arm's worst value when it logged none) | worst (the arm's worst value)
    controls: dict = field(default_factory=dict)  # control arm name -> overrides (e.g. [reward.shuffle=group]),
    # run at the same seeds and reported beside the baseline on the learning metric, outside the tests
    alpha: float = 0.05
    power: float = 0.8
    seeds: Seeds = field(default_factory=Seeds)
    sequential: Sequential | None = None  # a sequential design (see `Sequential`); None: fixed n from the pilot
    budget: float | None = None  # run-hours (the runs' wall times summed) the study may spend: no seed starts that
    # the recorded cost of a seed says would pass it (`rlkit.analysis.budget`); None: the seed cap alone


class StudyError(ValueError):
    """A study file that cannot run as written."""


class Stopped(Exception):
    """The study stops here; `code` is its exit status."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def load_spec(path: Path) -> StudySpec:
    """The study file checked against `StudySpec`: unknown or missing keys and impossible values are named."""
    try:
        loaded = OmegaConf.load(path)
        check_lists(path, loaded)
        merged = OmegaConf.merge(OmegaConf.structured(StudySpec), loaded)
        merged.secondary = [OmegaConf.merge(OmegaConf.structured(MetricSpec), s) for s in merged.secondary]
        merged.premises = [OmegaConf.merge(OmegaConf.structured(Premise), s) for s in merged.premises]
        spec = OmegaConf.to_object(merged)
    except (OmegaConfBaseException, OSError, yaml.YAMLError) as e:
        raise StudyError(f"{path} cannot be read as a study file: {e}".strip()) from None
    problems = baseline_problems(spec)
    if spec.primary.direction not in ("higher", "lower", "equal"):
        problems.append(f"primary.direction must be higher, lower or equal, got {spec.primary.direction!r}")
    if not spec.primary.smallest_effect > 0:
        problems.append("primary.smallest_effect must be > 0")
    if not (0 < spec.alpha < 0.5 and 0.5 <= spec.power < 1):
        problems.append(f"alpha must be in (0, 0.5) and power in [0.5, 1), got {spec.alpha}, {spec.power}")
    problems += unsafe_names(spec) + gate_problems(spec) + seed_problems(spec)
    if set(spec.controls) & set(spec.arms):
        problems.append(f"a control may not share an arm's name: {', '.join(set(spec.controls) & set(spec.arms))}")
    if spec.controls and spec.learning is None:
        problems.append("controls are compared with the baseline on the learning metric: declare `learning` too")
    if spec.learning is not None and spec.learning.arm not in (None, *every_arm(spec)):
        problems.append(f"learning.arm {spec.learning.arm!r} is not one of the arms or controls")
    if spec.engagement is not None and (spec.engagement.at_least is None) == (spec.engagement.at_most is None):
        problems.append("engagement needs exactly one of at_least and at_most")
    if spec.engagement is not None and spec.engagement.arm not in (None, *spec.arms):
        problems.append(f"engagement.arm {spec.engagement.arm!r} is not one of the arms ({', '.join(spec.arms)})")
    for m in [spec.primary, *spec.secondary, *spec.premises, *[c for c in (spec.engagement, spec.learning) if c]]:
        if m in spec.secondary and m.aggregate in WITHDRAWN:
            continue  # a declared secondary line stays in the family, reported as withdrawn
        try:
            parse_aggregate(m.aggregate)
        except ValueError as e:
            problems.append(f"{m.metric}: {e}")
    if problems:
        raise StudyError(f"{path}: " + "; ".join(problems))
    return spec


def baseline_problems(spec: StudySpec) -> list[str]:
    """The baseline is one of at least two arms, or `start` beside at least one arm (none named so)."""
    if spec.baseline == START:
        if spec.arms and START not in every_arm(spec):
            return []
        return [f"baseline {START!r} needs at least one arm and no arm or control named {START!r}"]
    if spec.baseline in spec.arms and len(spec.arms) >= 2:
        return []
    return [f"baseline {spec.baseline!r} must be one of at least two arms, or {START!r} (arms: {', '.join(spec.arms)})"]


def gate_problems(spec: StudySpec) -> list[str]:
    """The positive control, the premises and how unfinished runs count, as declared."""
    problems, S = [], spec.sensitivity
    if S is not None and S.arm not in spec.controls:
        problems.append(f"sensitivity.arm {S.arm!r} must be one of the controls ({', '.join(spec.controls)})")
    if S is not None and (S.direction or spec.primary.direction) not in ("higher", "lower"):
        problems.append("sensitivity.direction must be higher or lower (a claimed equality needs it said)")
    for p in spec.premises:
        if (p.at_least is None) == (p.at_most is None):
            problems.append(f"premise {p.metric}: needs exactly one of at_least and at_most")
        if p.arm not in (None, *every_arm(spec)):
            problems.append(f"premise {p.metric}: arm {p.arm!r} is not one of the arms or controls")
    if spec.unfinished not in ("last", "worst"):
        problems.append(f"unfinished must be last or worst, got {spec.unfinished!r}")
    return problems


def seed_problems(spec: StudySpec) -> list[str]:
    """The pilot within the cap (a sequential design's first look needs 3 pairs), a positive prior and budget,
    and a cap that lets a sequential design reject at all (`first_decisive`)."""
    problems, first = [], 3 if spec.sequential else 2
    if spec.seeds.first < 0:
        problems.append(f"seeds.first must be >= 0, got {spec.seeds.first}")
    if not first <= spec.seeds.pilot <= spec.seeds.cap:
        problems.append(f"seeds need {first} <= pilot <= cap, got pilot {spec.seeds.pilot}, cap {spec.seeds.cap}")
    if spec.budget is not None and not spec.budget > 0:
        problems.append(f"budget must be > 0 run-hours, got {spec.budget}")
    if spec.sequential and not spec.sequential.prior > 0:
        problems.append(f"sequential.prior must be > 0, got {spec.sequential.prior}")
    elif spec.sequential and 0 < spec.alpha < 1 and earliest_look(spec) is None:
        problems.append(
            f"seeds.cap={spec.seeds.cap}: at sequential.prior={spec.sequential.prior:g} no look up to the cap can "
            f"reject at alpha {spec.alpha:g} (Holm across {len(treatments(spec))} treatment(s)) however large the "
            "effect (the e-value of n pairs is at most (1 + n / prior)^((n - 2) / 2)); raise the cap or declare a "
            "smaller prior"
        )
    return problems


def earliest_look(spec: StudySpec) -> int | None:
    """The fewest seeds at which a sequential study can reject anything: Holm's first step tests the
    smallest p against alpha / m (`first_decisive`); None if no look up to the cap can."""
    return first_decisive(spec.alpha / max(1, len(treatments(spec))), spec.sequential.prior, spec.seeds.cap)


def unsafe_names(spec: StudySpec) -> list[str]:
    """An arm's name becomes its run folders' and records' names: plain names only, never a path."""
    return [
        f"arm name {arm!r} must be a plain name (letters, digits, '_', '-', '.'; no '/' and no '..'): it names "
        "the arm's run folders and records"
        for arm in every_arm(spec)
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", str(arm)) or ".." in str(arm)
    ]


def check_lists(path: Path, loaded) -> None:
    """The shared overrides and each arm's are lists (a string would be taken apart into characters)."""
    if not OmegaConf.is_dict(loaded) or not OmegaConf.is_dict(loaded.get("arms", {})):
        raise StudyError(f"{path}: a study file is a mapping whose `arms` map each arm's name to its overrides")
    arms = [(f"{group}.{a}", o) for group in ("arms", "controls") for a, o in (loaded.get(group) or {}).items()]
    for where, value in [("config", loaded.get("config", [])), *arms]:
        if not (OmegaConf.is_list(value) or isinstance(value, list)):
            raise StudyError(f"{path}: {where} must be a list of overrides, e.g. [algo=grpo], got {value!r}")


def every_arm(spec: StudySpec) -> dict:
    """The arms under test and the control arms: name -> own overrides."""
    return {**spec.arms, **spec.controls}


def treatments(spec: StudySpec) -> list[str]:
    """The arms tested against the baseline."""
    return [a for a in spec.arms if a != spec.baseline]


def overrides(spec: StudySpec, arm: str) -> list[str]:
    return [*spec.config, *every_arm(spec)[arm]]


def declared(spec: StudySpec) -> dict:
    """The whole declaration as plain data: the plan and every record keep it, and a study file that
    no longer says the same is refused, for new runs and for the analysis alike."""
    return json.loads(json.dumps(OmegaConf.to_container(OmegaConf.structured(spec))))


def with_defaults(was: dict) -> dict:
    """A kept declaration with the keys the study schema gained since at their defaults (a study
    file that never named them still declares the same), so only what was said is compared."""
    try:
        return json.loads(json.dumps(OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(StudySpec), was))))
    except OmegaConfBaseException:  # a key the schema no longer has: compared as it was kept
        return was


def extensible(decl: dict) -> dict:
    """A sequential declaration without its seed cap and budget, which an extension may raise: the
    looks stay anytime-valid however far the study goes."""
    if not decl.get("sequential"):
        return decl
    kept = {k: v for k, v in decl.items() if k != "budget"}
    return {**kept, "seeds": {k: v for k, v in decl["seeds"].items() if k != "cap"}}


def changes(was: dict, now: dict, prefix: str = "") -> list[str]:
    """'key: old -> new' for every leaf where two declarations differ."""
    out = []
    for k in sorted(set(was) | set(now), key=str):
        a, b = was.get(k, "(absent)"), now.get(k, "(absent)")
        if isinstance(a, dict) and isinstance(b, dict):
            out += changes(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out
