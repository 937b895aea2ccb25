"""The README's studies table, from the studies' own files: each declared study's verdicts and
primary differences recomputed from its `results/` (as `rlkit-study <name> --analyse-only` does),
its replication on a second warm-start seed (`<name>_ws1`) or, for a real-model study, its carry-over
to the tiny testbed (`<name>_tiny`) beside it, and for a study whose planned runs are not all in
the `**Status.**` line of its README.

    python experiments/studies.py           # prints the table
    python experiments/studies.py --write   # every study's README from its records, then the table into the README
"""

import contextlib
import dataclasses
import io
import re
import sys
from pathlib import Path

from rlkit.analysis.arms import missing_runs
from rlkit.analysis.decision import analyse, premises_gate
from rlkit.analysis.records import read_plan, read_records
from rlkit.analysis.study import Premise, load_spec
from rlkit.analysis.values import Analysis, Gate, Verdict
from rlkit.analysis.verdict import ended

HERE = Path(__file__).parent
README = HERE.parent / "README.md"
BEGIN, END = "<!-- studies table: python experiments/studies.py -->", "<!-- end of studies table -->"
STUDIES = [
    "rloo_vs_dr_grpo",
    "dynamic_sampling",
    "dynamic_sampling_smollm2_dense",  # second declaration of dynamic_sampling_smollm2, linked from it
    "dynamic_sampling_smollm2_coupled",  # third: coupled arms, fresh seeds, sequential within a budget
    "difficulty_bias",
    "difficulty_bias_smollm2_controlled",  # second declaration of difficulty_bias_smollm2, with a positive control
    "difficulty_bias_smollm2_sampled",  # third: 64 questions of the level, a sampled mean@8, sequential
    "off_policy",
    "clip_higher",
    "clip_higher_smollm2_binding",  # second declaration of clip_higher_smollm2 (its premise failed), linked from it
    "length_bias",
    "length_bias_smollm2_powered",  # second declaration of length_bias_smollm2 (inconclusive, 3 seeds), linked from it
    "length_bias_smollm2_grown",  # third declaration: 96 tokens, 30 steps, the baseline's growth a premise
    "pass_at_k32_smollm2",  # second declaration of pass_at_k_smollm2 (its positive control failed), linked from it
    "pass_at_k128_smollm2",  # third: k up to 128, each run's own evaluation seed, sequential within a budget
    "calculator_smollm2",
    "calculator_smollm2_no_tool",  # its "without the tool it does not" half as its own comparison
]

# premises a study's claim needs that its declaration left out, checked on its records after the runs
# and shown beside its verdict (never changing it): what the verdict is worth
POST_HOC = {
    "length_bias_smollm2_powered": Premise(
        metric="eval/len_incorrect",
        aggregate="gain:2",
        arm="token_mean",
        at_least=2.0,
        why="the baseline's incorrect answers grow by the smallest effect (the mechanism acts)",
    ),
}


@dataclasses.dataclass(frozen=True)
class Result:
    """One treatment of a complete study, as the table shows it."""

    verdict: Verdict
    words: str  # the verdict in the table's words
    diff: str  # the primary difference, labelled with the arms it compares


def verdicts(name: str) -> tuple[dict[str, Result], Analysis, str, Gate | None] | None:
    """Of a study whose planned runs are all recorded (a sequential one: whose runs are over):
    {treatment: Result}, its analysis, what it was tested on and its post-hoc premise (None: none);
    else None (no interim verdict)."""
    folder = HERE / name
    spec = load_spec(folder / "study.yaml")
    if spec.sequential:  # over when its last look settled it, its budget is spent or it reached its cap
        records, fixed = read_records(folder / "results") if (folder / "results").exists() else [], None
        if not records:
            return None
        r = analyse(spec, records, fixed, robust=False)
        if ended(spec, records, r) is None:
            return None
    else:
        if not (folder / "results" / "plan.json").exists():
            return None
        records, fixed = read_records(folder / "results"), read_plan(folder / "results" / "plan.json")
        if missing_runs(spec, records, fixed):
            return None
        r = analyse(spec, records, fixed, robust=False)
    post_hoc = premises_gate(dataclasses.replace(spec, premises=[POST_HOC[name]]), r.arms) if name in POST_HOC else None
    claimed_equal = spec.primary.direction == "equal"
    results = {
        arm: Result(v, word(v, claimed_equal), f"{arm} - {spec.baseline}: {r.diffs[arm].brief()}")
        for arm, v in r.verdicts.items()
    }
    return results, r, covers(spec, records), post_hoc


def covers(spec, records: list) -> str:
    """What a verdict was tested on, from its runs: model, task, steps, and for pass@k the k range."""
    heads = [h for h, _ in records]
    models = sorted({str(h["choices"].get("model", "?")) for h in heads})
    tasks = sorted({str(h["choices"].get("task", "?")) for h in heads})
    steps = sorted({h["config"]["steps"] for h in heads})
    parts = [*models, *tasks, f"{'/'.join(map(str, steps))} steps"]
    if spec.primary.metric.startswith("eval/pass@"):
        parts.append(f"k <= {max(k for h in heads for k in h['config']['eval']['pass_k'])}")
    return ", ".join(parts)


def word(v: Verdict, claimed_equal: bool) -> str:
    """The verdict, saying why a study was not tested and what `equivalent` means for a claimed direction."""
    if v.word == "not tested":
        return f"not tested: {v.short}"
    if claimed_equal or v.word != "equivalent":
        return v.text
    return "equivalent (no effect either way: not reproduced)" + (" (not gated)" if v.ungated else "")


def status(name: str) -> str:
    found = re.search(r"^\*\*Status\.\*\* (.+)$", (HERE / name / "README.md").read_text(), re.M)
    return found.group(1) if found else "not run"


def replicated(mine: Result, again: Result, words=("replicated", "not replicated")) -> str:
    """The replication's (or carry-over's) outcome against the original verdict."""
    if again.verdict.word == "not tested":
        return f"{again.words}; its primary difference {again.diff}"  # not the gate's number
    agrees = again.verdict.text == mine.verdict.text
    return f"{words[0]} ({again.diff})" if agrees else f"{words[1]}: {again.words} ({again.diff})"


def second(name: str) -> tuple[tuple | None, tuple[str, str]]:
    """The study's replication (`<name>_ws1`) or carry-over (`<name>_tiny`) verdicts, and the words
    for agreeing and not."""
    seconds = {"_ws1": ("replicated", "not replicated"), "_tiny": ("carries over", "does not carry over")}
    for suffix, words in seconds.items():
        if (HERE / f"{name}{suffix}").exists():
            return verdicts(f"{name}{suffix}"), words
    return None, ("", "")


def row(name: str) -> str:
    spec = load_spec(HERE / name / "study.yaml")
    claim = " ".join(spec.claim.split())
    link = f"[{name}](experiments/{name}/README.md)"
    found = verdicts(name)
    if found is None:
        return f"| {link} | {claim} | open | | | {status(name)} |"
    mine, r, tested_on, post_hoc = found
    again, agree = second(name)
    words = [f"{arm}: {x.words}" if len(mine) > 1 else x.words for arm, x in mine.items()]
    replication = [replicated(x, again[0][arm], words=agree) for arm, x in mine.items()] if again else []
    learned = {True: "; baseline learned", False: "; baseline did not learn by the margin", None: ""}[r.learned]
    worth = (
        f"; but a premise checked after the runs did not hold: {post_hoc.lines[0]}"
        if post_hoc and post_hoc.failed
        else ""
    )
    return (
        f"| {link} | {claim} | {'; '.join(words)}{worth} | {tested_on} | {'; '.join(replication) or 'not run'} | "
        f"{'; '.join(x.diff for x in mine.values())}{learned} |"
    )


def table() -> str:
    head = [
        "| study | claim | verdict | tested on | replication (warm_start.seed=1) or carry-over (tiny)"
        " | primary difference (95% interval) |",
        "|---|---|---|---|---|---|",
    ]
    return "\n".join(head + [row(name) for name in STUDIES])


def readme_table() -> str:
    """The table as the README shows it now."""
    return README.read_text().split(BEGIN)[1].split(END)[0].strip()


def write_study_readmes() -> None:
    """Every study's README section regenerated from its records (`rlkit-study <name> --analyse-only`)."""
    from rlkit.analysis.study_cli import main as study_main

    with contextlib.redirect_stdout(io.StringIO()):
        for results in sorted(HERE.glob("*/results/runs")):
            name = results.parent.parent.name
            if study_main([str(HERE / name), "--analyse-only"]) != 0:
                raise SystemExit(f"studies.py: {name} could not be analysed (its message is above)")


if __name__ == "__main__":
    if "--write" in sys.argv:
        write_study_readmes()
    print(table())
    if "--write" in sys.argv:
        before, rest = README.read_text().split(BEGIN)
        README.write_text(before + BEGIN + "\n" + table() + "\n" + END + rest.split(END)[1])
