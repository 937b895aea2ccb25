"""dapo against uniform at equal generated tokens, from the study's records (a post-hoc analysis,
outside the declared verdict: the declared per-token line used an aggregate now withdrawn).

    python experiments/dynamic_sampling_smollm2_dense/analysis/equal_tokens.py

Two comparisons, paired by seed: the accuracy area over the first B generated tokens, B the fewest
any dapo or uniform run generated in its 20 steps (every run's curve covers it), and dapo's accuracy
at the tokens its own seed's uniform run had generated at its end (linear between evaluations),
less uniform's final accuracy."""

from pathlib import Path

from rlkit.analysis import stats
from rlkit.analysis.arms import runs_by_arm
from rlkit.analysis.records import read_records
from rlkit.analysis.runs import aggregate, x_of
from rlkit.analysis.study import load_spec

HERE = Path(__file__).resolve().parents[1]
METRIC = "eval/accuracy"


def at(run, budget: float) -> float | None:
    """The run's accuracy at `budget` generated tokens, linear between its evaluations."""
    pos = x_of(run, "tokens")
    points = [(pos[s], v) for s, v in run.history[METRIC]]
    for (x0, v0), (x1, v1) in zip(points, points[1:]):
        if x0 <= budget <= x1:
            return v0 + (v1 - v0) * (budget - x0) / (x1 - x0) if x1 > x0 else v1
    return None


def lines() -> list[str]:
    spec = load_spec(HERE / "study.yaml")
    arms = runs_by_arm(read_records(HERE / "results"), spec)[0]
    uniform, dapo = arms["uniform"], arms["dapo"]
    seeds = sorted(set(uniform) & set(dapo))
    ends = {
        (a, s): max(x_of(r, "tokens").values())
        for a, runs in (("uniform", uniform), ("dapo", dapo))
        for s, r in runs.items()
    }
    budget = int(min(ends.values()))
    area = [f"auc:tokens:{budget}"] * 2
    a = [aggregate(uniform[s], METRIC, area[0]) for s in seeds]
    b = [aggregate(dapo[s], METRIC, area[1]) for s in seeds]
    final_u = [aggregate(uniform[s], METRIC, "final") for s in seeds]
    at_u = [at(dapo[s], ends[("uniform", s)]) for s in seeds]
    ratio = [ends[("dapo", s)] / ends[("uniform", s)] for s in seeds]
    return [
        f"- generated tokens in 20 steps: uniform {min(ends[('uniform', s)] for s in seeds):.0f}-"
        f"{max(ends[('uniform', s)] for s in seeds):.0f}, dapo {min(ends[('dapo', s)] for s in seeds):.0f}-"
        f"{max(ends[('dapo', s)] for s in seeds):.0f} (dapo / uniform {min(ratio):.2f}-{max(ratio):.2f} by seed)",
        f"- accuracy area over the first {budget} generated tokens, dapo - uniform: {stats.paired(a, b).describe()}",
        f"- accuracy at uniform's final token count, dapo - uniform: {stats.paired(final_u, at_u).describe()}",
    ]


if __name__ == "__main__":
    print("\n".join(lines()))
