"""`rlkit-compare`: group run directories by config keys and write a Markdown table and PNG plots.

rlkit-compare multirun/2026-11-30/10-00-00 --by algo --metric eval/accuracy --threshold 0.4 --baseline grpo
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from pathlib import Path

from rlkit.analysis import stats
from rlkit.analysis.runs import (  # noqa: F401
    WARNINGS,
    RunHistory,
    aggregate,
    aggregate_name,
    differing_keys,
    finished_only,
    load_runs,
    load_wandb_runs,
    parse_aggregate,
    warn,
    x_of,
)
from rlkit.analysis.stats import mean_ci


# two-sided 95% Student-t quantiles for 1..30 degrees of freedom; 1.96 beyond
class BadArgument(ValueError):
    """A command-line value that does not fit the runs (exit 2 with the usage line)."""


def group_runs(runs: list[RunHistory], by: list[str]) -> dict[tuple, list[RunHistory]]:
    groups = defaultdict(list)
    for run in runs:
        missing = [k for k in by if k not in run.keys]
        if missing:
            raise BadArgument(
                f"--by: run {run.name} has no key {missing[0]!r}; "
                f"choices and config keys are: {', '.join(sorted(run.keys))}"
            )
        groups[tuple(str(run.keys[k]) for k in by)].append(run)
    for key, members in groups.items():
        differ = differing_keys(members, by)
        if differ:
            warn(
                f"group {', '.join(key)} averages runs whose other config keys differ: "
                + "; ".join(f"{k} ({', '.join(v)})" for k, v in list(differ.items())[:8])
                + f". Add them to --by to separate them (--by {' '.join(by)} {' '.join(list(differ)[:2])})"
            )
    return dict(sorted(groups.items()))


def first_reaching(series: list[tuple[int, float]], threshold: float, lower: bool) -> int | None:
    return next((s for s, v in series if (v <= threshold if lower else v >= threshold)), None)


def fmt(mean: float, ci: float) -> str:
    return f"{mean:.3f} ± {ci:.3f}" if not math.isnan(ci) else f"{mean:.3f}"


def table(
    groups: dict, by: list[str], metrics: list[str], threshold: float | None, lower: set, spec: str = "final"
) -> str:
    """One row per group: each metric's per-run aggregate (`spec`) and its best value after step 0
    (mean ± 95% CI over runs), steps to the threshold of the first metric, wall time."""
    head = [*by, "runs"]
    for m in metrics:
        head += [f"{aggregate_name(spec)} {m}", f"best {m} (after step 0)"]
    if threshold is not None:
        head.append(f"steps to {metrics[0]} {'<=' if metrics[0] in lower else '>='} {threshold}")
    head.append("wall time (s)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, runs in groups.items():
        cells = [*key, str(len(runs))]
        for m in metrics:
            for what in (spec, "best"):
                values = [v for v in (aggregate(r, m, what, m in lower) for r in runs) if v is not None]
                missing = len(runs) - len(values)
                note = f" ({missing} of {len(runs)} runs without it)" if missing else ""
                cells.append((fmt(*mean_ci(values)) if values else "n/a") + note)
        if threshold is not None:
            hits = [first_reaching(r.history.get(metrics[0], []), threshold, metrics[0] in lower) for r in runs]
            reached = [h for h in hits if h is not None]
            cells.append(
                f"{fmt(*mean_ci(reached))} ({len(reached)}/{len(runs)} runs)" if reached else f"never (0/{len(runs)})"
            )
        walls = [r.wall_s for r in runs if r.wall_s is not None]
        cells.append(fmt(*mean_ci(walls)) if walls else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def smoothed(series: list[tuple[int, float]], k: int) -> list[tuple[int, float]]:
    """Trailing moving average over the last k logged values (k <= 1: unchanged)."""
    if k <= 1:
        return series
    values = [v for _, v in series]
    return [
        (s, sum(values[max(0, i - k + 1) : i + 1]) / (i + 1 - max(0, i - k + 1))) for i, (s, _) in enumerate(series)
    ]


def curve(runs: list[RunHistory], metric: str, axis: str, smooth: int):
    """Mean and 95% band over runs. By step: at the steps every run logged; by tokens or time: each
    run interpolated onto a common grid up to the shortest run's end.  -> (x, mean, half-width)"""
    import numpy as np

    series = [smoothed(r.history.get(metric, []), smooth) for r in runs]
    if not all(series):
        return None
    if axis == "step":
        common = sorted(set.intersection(*({s for s, _ in ser} for ser in series)))
        if not common:
            return None
        table_ = [dict(ser) for ser in series]
        stats = [mean_ci([t[s] for t in table_]) for s in common]
        x = [float(s) for s in common]
    else:
        positions = [x_of(r, axis) for r in runs]
        xs = [[pos[s] for s, _ in ser] for pos, ser in zip(positions, series)]
        end = min(x[-1] for x in xs)
        grid = np.linspace(0, end, 60)
        ys = [np.interp(grid, x, [v for _, v in ser]) for x, ser in zip(xs, series)]
        stats = [mean_ci([float(y[i]) for y in ys]) for i in range(len(grid))]
        x = grid.tolist()
    return x, [m for m, _ in stats], [0.0 if math.isnan(c) else c for _, c in stats]


def drawable(groups: dict, metric: str, axis: str, smooth: int) -> dict:
    """{group key: ((x, mean, ci), runs)} of the groups whose runs all logged `metric` at a common step."""
    curves = {}
    for key, runs in groups.items():
        c = curve(runs, metric, axis, smooth)
        if c is None:
            print(
                f"rlkit-compare: {metric}: no step where all {len(runs)} runs of {key} logged it; not drawn",
                file=sys.stderr,
            )
            continue
        curves[key] = (c, len(runs))
    if not curves:
        print(f"rlkit-compare: {metric}: nothing to draw; no plot written", file=sys.stderr)
    return curves


def draw_panel(ax, curves: dict, panel, by: list[str], colours: list) -> None:
    """Each group's mean with its band; with `panel` set, the other groups' means in grey behind it."""
    for i, (key, ((x, mean, ci), n)) in enumerate(curves.items()):
        if panel is not None and key != panel:
            ax.plot(x, mean, color="0.75", lw=1)
            continue
        colour = colours[i % len(colours)]
        ax.plot(x, mean, color=colour, label=f"{', '.join(f'{k}={v}' for k, v in zip(by, key))} (n={n})")
        ax.fill_between(
            x, [m - c for m, c in zip(mean, ci)], [m + c for m, c in zip(mean, ci)], color=colour, alpha=0.15
        )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot(groups: dict, by: list[str], metric: str, path: Path, axis: str = "step", smooth: int = 1) -> bool:
    """`figure` written to `path` as a PNG; False (nothing written) when there is nothing to draw."""
    import matplotlib.pyplot as plt

    fig = figure(groups, by, metric, axis, smooth)
    if fig is None:
        return False
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def figure(groups: dict, by: list[str], metric: str, axis: str = "step", smooth: int = 1):
    """Mean of `metric` per group with a shaded 95% band over runs, titled with the metric and the
    grouping, whole steps on a step axis. Up to three groups share one panel; more get a panel each,
    with the other groups' means in grey behind, so bands stay readable. None: nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    curves = drawable(groups, metric, axis, smooth)
    if not curves:
        return None
    panels = list(curves) if len(curves) > 3 else [None]
    cols = min(len(panels), 3)
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(5 * cols if cols > 1 else 7, 3.6 * rows if rows > 1 else 4.5),
        sharex=True,
        sharey=True,
        squeeze=False,
    )
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, panel in zip(axes.flat, panels):
        draw_panel(ax, curves, panel, by, colours)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel({"step": "step", "tokens": "generated tokens", "time": "wall time (s)"}[axis])
    for ax in axes[:, 0]:
        ax.set_ylabel(metric + (f" (moving average of {smooth})" if smooth > 1 else ""))
    if axis == "step":
        axes[0, 0].xaxis.set_major_locator(MaxNLocator(integer=True))  # the panels share it
    fig.suptitle(f"{metric} by {', '.join(by)} (mean, 95% band over runs)")
    fig.tight_layout()
    return fig


def differences(
    groups: dict,
    by: list[str],
    metrics: list[str],
    baseline: str,
    lower: set,
    spec: str = "final",
    margins: dict | None = None,
    alpha: float = 0.05,
) -> str:
    """Each group against the baseline group, for each metric's per-run aggregate and best value:
    the difference with its interval, effect size and p-value (paired by seed where possible),
    Holm's adjusted p across every line printed, TOST at a given margin, and from
    `stats.BOOTSTRAP_FROM` runs per arm the IQM and probability of improvement."""
    names = {", ".join(key): key for key in groups}
    if baseline not in names:
        raise BadArgument(f"--baseline {baseline!r} is not a group; groups: {', '.join(names)}")
    base, margins = groups[names[baseline]], margins or {}
    rows = []
    for name, key in names.items():
        if name == baseline:
            continue
        for m in metrics:
            for what in (spec, "best"):
                a, b = seeded(base, m, what, m in lower), seeded(groups[key], m, what, m in lower)
                d, pairs = stats.compare(a, b, alpha), stats.matched(a, b)
                xa, xb = pairs or ([v for _, v in a], [v for _, v in b])
                rob = stats.robust(xa, xb, m in lower, alpha, paired=pairs is not None)
                rows.append(stats.Row(f"{aggregate_name(what)} {m}: {name} - {baseline}", d, rob, name, m, m in lower))
    adjusted = stats.holm([row.p for row in rows])
    tested = len(adjusted)  # a line with too few runs has no p but stays in the family
    lines = [
        difference_line(row, p_holm, tested, baseline, margins.get(row.metric), alpha)
        for row, p_holm in zip(rows, adjusted)
    ]
    return "\n".join(lines) + "\n"


def seeded(runs: list[RunHistory], metric: str, what: str, lower: bool) -> list[tuple]:
    """(seed, aggregate) of each run that has a value."""
    return [(r.keys.get("seed", r.name), v) for r in runs if (v := aggregate(r, metric, what, lower)) is not None]


def difference_line(
    row: stats.Row, p_holm: float, tested: int, baseline: str, margin: float | None, alpha: float
) -> str:
    """One line of `differences`: the difference, Holm's p, TOST at `margin`, the robust statistics."""
    d = row.diff
    text = f"- {row.label}: {d.describe()}"
    if not math.isnan(p_holm):
        text += f"; Holm-adjusted p = {p_holm:.2g} over {tested} lines"
    if margin is not None and d.n >= 2:
        p_eq = d.tost(margin)
        text += f"; {'equivalent' if p_eq < alpha else 'not shown equivalent'} within ±{margin:g} (TOST p = {p_eq:.2g})"
    if row.robust is not None:
        text += f"; {row.robust.describe(baseline, row.arm, row.lower)}"
    return text


def parse_margins(items: list[str], metrics: list[str]) -> dict:
    """--margin METRIC=X (or X alone for the first metric) -> {metric: X}."""
    out = {}
    for item in items:
        metric, _, value = item.rpartition("=")
        try:
            out[metric or metrics[0]] = float(value)
        except ValueError:
            raise BadArgument(f"--margin {item!r}: use METRIC=X or X, with X a number") from None
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlkit-compare", description=__doc__.split("\n")[0])
    p.add_argument("paths", nargs="*", type=Path, help="run or sweep directories (searched for run.json)")
    p.add_argument(
        "--by", nargs="+", default=["algo"], help="choices (algo, advantage, ...) or config keys (loss.beta)"
    )
    p.add_argument("--metric", nargs="+", default=["eval/accuracy"], help="metrics to tabulate and plot")
    p.add_argument(
        "--aggregate",
        default="final",
        metavar="SPEC",
        help="each run's one number: final, last:K (mean of the last K logged values), auc or "
        "auc:tokens:B (mean height of the curve over steps, or over the first B generated tokens), gain (final minus "
        "step 0), start (the step-0 value), reach:X[:tokens|:time] (steps, tokens or seconds until the "
        "metric first reaches X; a run that never does counts at its end); 'best' (after step 0) is always "
        "shown beside it",
    )
    p.add_argument("--threshold", type=float, help="report steps until the first metric reaches this value")
    p.add_argument("--lower", nargs="*", default=[], help="metrics where lower is better")
    p.add_argument("--out", type=Path, help="output directory (default: <first path>/compare)")
    p.add_argument("--wandb", metavar="ENTITY/PROJECT", help="read runs from a wandb project instead of directories")
    p.add_argument(
        "--include-unfinished",
        action="store_true",
        help="keep runs that stopped before their last step (left out, and named, by default)",
    )
    return add_test_and_plot_options(p)


def add_test_and_plot_options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument(
        "--baseline",
        metavar="GROUP",
        help="compare every other group with this one (e.g. grpo, or "
        "'grpo, 0.04' for two --by keys): difference, interval, effect size, p and Holm-adjusted p",
    )
    p.add_argument(
        "--margin",
        nargs="*",
        default=[],
        metavar="METRIC=X",
        help="equivalence margins: with --baseline, TOST says whether each difference lies within ±X",
    )
    p.add_argument("--alpha", type=float, default=0.05, help="level of the tests and 1 - coverage of the intervals")
    p.add_argument(
        "--x",
        choices=["step", "tokens", "time"],
        default="step",
        help="plots' horizontal axis: RL step, generated tokens (kept or not), or wall time",
    )
    p.add_argument("--smooth", type=int, default=1, metavar="K", help="moving average over K logged values in plots")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    WARNINGS.clear()
    try:
        return write(p, a)
    except BadArgument as e:
        p.error(str(e))


def check_arguments(a: argparse.Namespace) -> dict:
    """Every numeric argument in its range and the output folder usable, before any run is read;
    returns the equivalence margins ({metric: X})."""
    problems, margins = [], parse_margins(a.margin, a.metric)
    if not 0 < a.alpha < 1:
        problems.append(f"--alpha must be in (0, 1), got {a.alpha}")
    if a.threshold is not None and not math.isfinite(a.threshold):
        problems.append(f"--threshold must be a finite number, got {a.threshold}")
    if a.smooth < 1:
        problems.append(f"--smooth must be >= 1, got {a.smooth}")
    for metric, margin in margins.items():
        if not (math.isfinite(margin) and margin > 0):
            problems.append(f"--margin {metric}={margin:g}: a margin must be a finite number > 0")
    out = output_dir(a)
    if out.exists() and not out.is_dir():
        problems.append(f"--out {out} is a file; give a directory for compare.md and the plots")
    if problems:
        raise BadArgument("; ".join(problems))
    return margins


def output_dir(a: argparse.Namespace) -> Path:
    return a.out or (a.paths[0] / "compare" if a.paths else Path("compare"))


def write(p: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    """The table, the differences and the plots of `main`'s arguments, into compare.md."""
    margins = check_arguments(a)
    runs = selected_runs(p, a)
    groups = group_runs(runs, a.by)
    out = output_dir(a)
    out.mkdir(parents=True, exist_ok=True)
    md = table(groups, a.by, a.metric, a.threshold, set(a.lower), a.aggregate)
    if a.baseline:
        md += f"\nAgainst {a.baseline}:\n\n" + differences(
            groups, a.by, a.metric, a.baseline, set(a.lower), a.aggregate, margins, a.alpha
        )
    images = []
    for m in a.metric:
        png = out / (m.replace("/", "_") + (f"_by_{a.x}" if a.x != "step" else "") + ".png")
        if plot(groups, a.by, m, png, a.x, a.smooth):
            images.append(f"![{m}]({png.name})")
    warnings = "".join(f"- {w}\n" for w in WARNINGS)
    (out / "compare.md").write_text(
        f"# {len(runs)} runs by {', '.join(a.by)}\n\n{md}\n"
        + (f"## Warnings\n\n{warnings}\n" if warnings else "")
        + "\n".join(images)
        + "\n"
    )
    print(md)
    print(f"wrote {out / 'compare.md'} and {len(images)} plot(s)", file=sys.stderr)
    return 0


def selected_runs(p: argparse.ArgumentParser, a: argparse.Namespace) -> list:
    """The runs `main`'s arguments name, finished ones only unless asked; a clear error when none
    are left or a metric was never logged."""
    if not a.paths and not a.wandb:
        p.error("give run directories or --wandb ENTITY/PROJECT")
    try:
        parse_aggregate(a.aggregate)
    except ValueError as e:
        p.error(f"--aggregate: {e}")
    runs = load_wandb_runs(a.wandb) if a.wandb else [r for path in a.paths for r in load_runs(path)]
    if not runs:
        p.error(f"no runs (directories with run.json and metrics.jsonl) under {', '.join(map(str, a.paths))}")
    runs = finished_only(runs, a.include_unfinished)
    if not runs:
        p.error("every run stopped before its last step; --include-unfinished compares them as they are")
    logged = {k for r in runs for k, series in r.history.items() if series}
    for m in a.metric:
        if m not in logged:
            p.error(f"--metric {m}: no run logged it; logged: {', '.join(sorted(logged)[:40])}")
    return runs


if __name__ == "__main__":
    sys.exit(main())
