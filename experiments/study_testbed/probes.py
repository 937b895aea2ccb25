"""The probes behind experiments/study_testbed/README.md: each a single rlkit-train run, kept as
`probes/<name>.jsonl.gz` (first line: its overrides and hardware; then its metrics.jsonl).

    python experiments/study_testbed/probes.py                  # the table, from probes/ alone
    python experiments/study_testbed/probes.py --save RUN_DIR.. # record finished runs (name = folder name)
"""

import gzip
import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).parent / "probes"
EVAL = ("eval/accuracy", "eval/acc_hard", "eval/mean@4", "eval/mean@4_hard")


def mean(xs):
    return sum(xs) / len(xs) if xs else None


def save(run_dir: Path) -> None:
    meta = json.loads((run_dir / "run.json").read_text())
    head = {
        "name": run_dir.name,
        "overrides": yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text()),
        "hardware": meta.get("hardware"),
        "summary": json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else None,
    }
    HERE.mkdir(exist_ok=True)
    body = (run_dir / "metrics.jsonl").read_text()
    (HERE / f"{run_dir.name}.jsonl.gz").write_bytes(gzip.compress((json.dumps(head) + "\n" + body).encode(), mtime=0))


def load(path: Path) -> tuple[dict, list[dict]]:
    lines = gzip.decompress(path.read_bytes()).decode().splitlines()
    return json.loads(lines[0]), [json.loads(line) for line in lines[1:]]


def fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def table() -> str:
    out = [
        "| probe | kernels | overrides (besides the shared ones) | steps | "
        + " | ".join(f"{m} start -> end" for m in EVAL)
        + " | train/entropy first 20 -> last 20 steps |",
        "|---" * (5 + len(EVAL)) + "|",
    ]
    for path in sorted(HERE.glob("*.jsonl.gz")):
        head, rows = load(path)
        evals = [r for r in rows if "eval/accuracy" in r]
        ent = [r["train/entropy"] for r in rows if "train/entropy" in r]
        shared = {"logger=jsonl", "threads=1", "checkpoint.every=0", "samples_every=0"}
        out.append(
            f"| {head['name']} | {head['hardware']['cpu_capability']} | "
            f"{' '.join(o for o in head['overrides'] if o not in shared and not o.startswith('hydra'))} "
            f"| {rows[-1]['step']} | "
            + " | ".join(f"{fmt(evals[0].get(m))} -> {fmt(evals[-1].get(m))}" for m in EVAL)
            + f" | {fmt(mean(ent[:20]))} -> {fmt(mean(ent[-20:]))} |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--save"]:
        for d in sys.argv[2:]:
            save(Path(d))
    print(table())
