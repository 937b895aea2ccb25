"""A study's analysis as values: each gate (its state, the reason it stops a verdict, its report
lines), each verdict (its word, whether it was gated and why) and the whole `Analysis` of a study.
The decision code (`rlkit.analysis.decision`) returns them; the report (`rlkit.analysis.verdict`)
and the studies table only format them."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import Enum

from rlkit.analysis.stats import Difference, Robust, Row


class State(Enum):
    PASSED = "passed"
    FAILED = "failed"
    UNDECLARED = "not declared"


@dataclass(frozen=True)
class Bound:
    """A declared bound on a mean: at least `at_least`, or at most `at_most` (exactly one is set)."""

    at_least: float | None = None
    at_most: float | None = None

    @classmethod
    def of(cls, declared) -> Bound:
        """The bound of a declared check (an engagement check or a premise)."""
        return cls(declared.at_least, declared.at_most)

    def holds(self, value: float) -> bool:
        """Whether `value` lies within the bound (a missing value, nan, never does)."""
        if math.isnan(value):
            return False
        return value >= self.at_least if self.at_least is not None else value <= self.at_most

    def __str__(self) -> str:
        return f">= {self.at_least:g}" if self.at_least is not None else f"<= {self.at_most:g}"


@dataclass(frozen=True)
class Reason:
    """Why a gate stops a verdict: its first clause (`short`, what a table shows) and the rest."""

    short: str
    rest: str = ""

    @property
    def text(self) -> str:
        return self.short + self.rest


@dataclass(frozen=True)
class Gate:
    """One gate of a verdict: passed, failed or not declared; `reason` is why no verdict is given
    when it fails; `lines` report what it measured."""

    state: State
    reason: Reason
    lines: tuple[str, ...] = ()

    @property
    def failed(self) -> bool:
        return self.state is State.FAILED

    @property
    def declared(self) -> bool:
        return self.state is not State.UNDECLARED


def gate(passed: bool | None, reason: Reason, lines: list[str] | tuple = ()) -> Gate:
    """A gate from its check's outcome: True passed, False failed, None not declared."""
    state = State.UNDECLARED if passed is None else State.PASSED if passed else State.FAILED
    return Gate(state, reason, tuple(lines))


@dataclass(frozen=True)
class Verdict:
    """One treatment's verdict: `word` (reproduced, negligible, equivalent, refuted, inconclusive
    or not tested), its `reason`, the gates it went without (`ungated`: none declared), and the
    seed cap when the study ran to it."""

    word: str
    reason: str
    short: str = ""  # the reason's first clause, for tables
    ungated: tuple[str, ...] = ()
    cap: int | None = None

    @property
    def text(self) -> str:
        """The verdict as the README heads it: `reproduced (not gated)`."""
        return self.word + (" (not gated)" if self.ungated else "")

    @property
    def why(self) -> str:
        """The reason in full: the gates it went without and, when inconclusive, the seed cap."""
        why = self.reason
        if self.ungated:
            why += f"; not gated: no {' and no '.join(self.ungated)} declared"
        if self.cap is not None and self.word == "inconclusive":
            why += f"; at the seed cap ({self.cap})"
        return why


@dataclass(frozen=True)
class Analysis:
    """Every number of a study's report, computed from its records alone."""

    treatments: tuple[str, ...]
    values: dict  # {arm: {seed: the primary's per-run aggregate}}
    diffs: dict[str, Difference]  # treatment -> its paired difference from the baseline
    p_adjusted: dict[str, float]  # Holm across treatments, significance against 0 (a claimed equality: beyond it)
    p_tost_adjusted: dict[str, float]  # Holm across treatments, TOST at the smallest effect
    robust: dict[str, Robust | None]  # treatment -> IQM and P(improvement), from BOOTSTRAP_FROM pairs
    verdicts: dict[str, Verdict]
    gates: dict[str, Gate]  # learning, sensitivity, premises, start: what every verdict passes
    engagement: dict[str, Gate]  # treatment -> its engagement check
    engagement_lines: tuple[str, ...]
    secondary: tuple[Row, ...]
    secondary_holm: tuple[float, ...]
    unfinished: tuple[str, ...]  # a line for each run that stopped before its last step
    unpaired: tuple[str, ...]  # a line for each seed without its pair
    arms: dict = field(repr=False)  # {arm: {seed: RunHistory}}

    @property
    def learned(self) -> bool | None:
        """Whether the baseline learned (None: no learning check declared)."""
        g = self.gates["learning"]
        return None if not g.declared else not g.failed


@dataclass(frozen=True)
class Need:
    """What one part of a plan needs: the pilot's spread (and effect, for a gate), the spread it was
    raised to, and the seeds needed (None: the pilot fell short of the gate's bound)."""

    pilot_sd: float
    planning_sd: float
    needed: int | None
    pilot_pairs: int | None = None  # a treatment's pairs in the pilot
    pilot_effect: float | None = None  # a gate's effect in the pilot

    def to_json(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None or k == "needed"}


@dataclass(frozen=True)
class Plan:
    """The seed count fixed once from the pilot (`plan.json`): each treatment's and each gate's
    `Need`, the most needed, the seeds that will run (up to the cap), and the decision to run to
    the cap when the plan foreseeably cannot decide."""

    pilot_seeds: int
    cap: int
    alpha_for_planning: float
    arms: dict[str, Need]
    declared: dict  # the study file's declaration the plan was made under
    needed: int
    seeds: int
    capped: bool
    gates: dict[str, Need] = field(default_factory=dict)
    short: tuple[str, ...] = ()  # the gates whose pilot fell short of their bound
    to_cap: bool = False
    affordable: int | None = None  # seeds per arm the declared budget pays for at the pilot's cost of a seed

    @property
    def limit(self) -> int:
        """The most seeds the plan may run: the cap, or fewer where the budget affords fewer."""
        return min(self.cap, self.affordable or self.cap)

    @property
    def undecidable(self) -> bool:
        """Whether running the plan foreseeably ends without a decision."""
        return self.capped or bool(self.short)

    @classmethod
    def from_json(cls, d: dict) -> Plan:
        """A plan as `plan.json` keeps it (files from before gates were planned have none)."""
        needs = {g: {a: Need(**v) for a, v in d.get(g, {}).items()} for g in ("arms", "gates")}
        keep = {k: d[k] for k in ("pilot_seeds", "cap", "alpha_for_planning", "declared", "needed", "seeds", "capped")}
        extra = {"to_cap": d.get("to_cap", False), "affordable": d.get("affordable")}
        return cls(**keep, **needs, short=tuple(d.get("short", ())), **extra)

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(
            arms={a: n.to_json() for a, n in self.arms.items()}, gates={g: n.to_json() for g, n in self.gates.items()}
        )
        out["short"] = list(self.short)
        return out
