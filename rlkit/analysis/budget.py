"""A study's compute from its records: the run-hours spent (each run's wall time as its summary
gave it, or, for a record kept without one, the sum of its logged step and evaluation times), what
one seed of every arm costs, and whether the declared `budget` affords another seed."""

from __future__ import annotations

import math

from rlkit.analysis.study import earliest_look


def run_hours(head: dict, rows: list[dict]) -> float:
    """One recorded run's wall time in hours."""
    wall = head.get("wall_s")
    if not isinstance(wall, (int, float)):
        wall = sum(r.get("time/step", 0.0) + r.get("time/eval", 0.0) for r in rows)
    return wall / 3600


def arm_hours(records: list) -> dict[str, float]:
    """Each arm's mean run-hours over its recorded runs."""
    took: dict[str, list[float]] = {}
    for head, rows in records:
        took.setdefault(head["arm"], []).append(run_hours(head, rows))
    return {arm: sum(t) / len(t) for arm, t in took.items()}


def spent(records: list) -> float:
    return sum(run_hours(head, rows) for head, rows in records)


def seed_hours(records: list) -> float:
    """What one more seed of every recorded arm costs: the sum of the arms' mean run-hours."""
    return sum(arm_hours(records).values())


def affordable(spec, records: list) -> int | None:
    """Seeds per arm the declared budget pays for at the recorded cost of a seed; None without a budget."""
    if spec.budget is None or not records:
        return None
    return max(spec.seeds.pilot, math.floor(spec.budget / seed_hours(records) + 1e-9))


def exhausted(spec, records: list) -> str | None:
    """Why no further seed starts: the runs recorded so far plus one more seed would pass the
    declared budget, or (a sequential design) the budget pays for fewer seeds than the first look
    that can reject needs (`earliest_look`); None while it affords one (or none is declared)."""
    if spec.budget is None or not records:
        return None
    used, seed = spent(records), seed_hours(records)
    first = earliest_look(spec) if spec.sequential else None
    if first is not None and spec.budget < first * seed:
        return (
            f"the declared budget of {spec.budget:g} run-hours pays for about {math.floor(spec.budget / seed)} "
            f"seeds at about {seed:.2f} a seed, fewer than the {first} from which a look can reject "
            f"(prior {spec.sequential.prior:g}), so no further seed could decide anything"
        )
    if used + seed <= spec.budget:
        return None
    return (
        f"the declared budget of {spec.budget:g} run-hours is spent ({used:.2f} run-hours recorded; "
        f"one more seed would cost about {seed:.2f})"
    )


def compute_words(spec, records: list) -> str:
    """The study's compute in one phrase, against its budget when it declares one."""
    of = f" of the declared {spec.budget:g}" if spec.budget is not None else ""
    logged = any(not isinstance(head.get("wall_s"), (int, float)) for head, _ in records)
    kept = "; logged step and evaluation times where a record keeps no wall time" if logged else ""
    return f"{spent(records):.2f} run-hours{of} (about {seed_hours(records):.2f} a seed of every arm{kept})"
