"""`rlkit-study`: a declared study run end to end. It runs a pilot of paired seeds, plans the seed
count from the pilot's spread at the declared smallest effect, runs the rest up to the cap, keeps
every run's raw metrics under `experiments/<name>/results/`, and writes the verdict into the
study's README. A killed study resumes where it stopped: recorded runs are kept, an interrupted run
resumes from its checkpoint, and the plan is never recomputed.

    rlkit-study length_bias                 # pilot, plan, runs, analysis, README
    rlkit-study length_bias --jobs 2        # two runs at a time (each on one thread): the same records
    rlkit-study length_bias --analyse-only  # recompute every number from results/ alone
    rlkit-study length_bias --to-cap        # run a plan that needs more seeds than the cap anyway
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlkit.analysis.records import check_declaration, read_plan, read_records
from rlkit.analysis.runner import run_all
from rlkit.analysis.study import Stopped, StudyError, load_spec
from rlkit.analysis.verdict import write_report
from rlkit.exits import EXIT_BAD_INPUT, EXIT_DECISION, EXIT_PREEMPTED


def study_paths(target: str) -> tuple[str, Path]:
    """(name, study file) from a study name under ./experiments or a path to a study file or its folder."""
    p = Path(target)
    if p.suffix in (".yaml", ".yml"):
        path = p
    else:
        path = p / "study.yaml" if p.is_dir() else Path("experiments", target, "study.yaml")
    if not path.exists():
        raise StudyError(f"no study file {path}; a study is experiments/<name>/study.yaml (or give its path)")
    return path.parent.name, path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rlkit-study",
        description="Run a declared study end to end: pilot, plan, "
        "runs, analysis and the verdict in the study's README.",
    )
    p.add_argument("study", help="a study name (experiments/<name>/study.yaml) or the path of a study file")
    p.add_argument("--runs", type=Path, help="where run directories go (default: outputs/studies/<name>)")
    p.add_argument("--analyse-only", action="store_true", help="no runs: recompute the analysis from results/")
    p.add_argument(
        "--to-cap",
        action="store_true",
        help="when the pilot's plan foreseeably cannot decide (it needs more seeds than the cap, or a gate's pilot "
        "fell short), run the planned seeds anyway; without it the study stops after its pilot (exit 4) and asks",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at a time, each on one thread (default 1); the records and the verdict are the same for any number",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.jobs < 1:
        parser().error(f"--jobs must be >= 1, got {a.jobs}")
    try:
        name, path = study_paths(a.study)
        spec = load_spec(path)
    except StudyError as e:
        print(f"rlkit-study: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    results, runs = path.parent / "results", a.runs or Path("outputs", "studies", name)
    try:
        if not a.analyse_only:
            run_all(spec, name, runs, results, a.jobs, a.to_cap)
        records, plan_file = read_records(results), results / "plan.json"
        check_declaration(spec, name, results, records)
        fixed = read_plan(plan_file) if plan_file.exists() else None
    except Stopped as e:
        kind = {EXIT_PREEMPTED: "", EXIT_DECISION: "decision needed: "}.get(e.code, "error: ")
        print(f"rlkit-study: {kind}{e}", file=sys.stderr)
        return e.code
    if not records:
        print(f"rlkit-study: error: {name}: no recorded runs in {results / 'runs'}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(write_report(spec, name, path, results, records, fixed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
