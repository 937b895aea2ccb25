"""How far one training step and one whole run wander through rlkit's files, measured on the code
as it runs: every call and return of a function in rlkit is traced (`sys.setprofile`), and the file
of the innermost rlkit frame is followed. Printed: the files entered and the distinct moves between
them (from file A to file B, by a call or by a return), the structure a reader follows;
the count of all moves mostly counts loop iterations (tokens decoded, micro-batches) and is printed
beside them.

    python benchmarks/call_path.py            # the default tiny run: the whole run (2 steps), then one step
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import rlkit

ROOT = str(Path(rlkit.__file__).parent)
TINY = ["steps=2", "threads=1", "logger=jsonl", "warm_start.steps=20", "eval.every=1", "checkpoint.every=0"]


class Trail:
    """The files of rlkit's innermost frames, in the order the code ran them."""

    def __init__(self):
        self.stack, self.seen, self.moves, self.edges = [], set(), 0, set()

    def top(self) -> str | None:
        return self.stack[-1] if self.stack else None

    def __call__(self, frame, event, arg):
        file = frame.f_code.co_filename
        if event not in ("call", "return") or not file.startswith(ROOT):
            return
        before = self.top()
        self.stack.append(file) if event == "call" else self.stack.pop()
        now = self.top()
        if now is not None and now != before:
            self.moves += 1
            self.seen.add(now)
            self.edges |= {(before, now)} if before is not None else set()

    def line(self, what: str) -> str:
        return (
            f"{what}: {len(self.seen)} files, {len(self.edges)} distinct moves between them ({self.moves} moves in all)"
        )


def traced(fn, *args):
    path = Trail()
    sys.setprofile(path)
    try:
        out = fn(*args)
    finally:
        sys.setprofile(None)
    return path, out


def main() -> None:
    from hydra import compose, initialize_config_module

    from rlkit.loop import report, step
    from rlkit.session import run
    from rlkit.setup import setup, validate
    from rlkit.signals import StopSignals

    work = Path(tempfile.mkdtemp())
    with initialize_config_module(config_module="rlkit.conf", version_base=None):
        cfg = compose(config_name="config", overrides=[*TINY, f"warm_start.cache_dir={work / 'cache'}"])
    whole, _ = traced(run, cfg, str(work / "whole"))
    with StopSignals() as stop:
        built = setup(cfg, str(work / "step"), {}, validate(cfg), stop)
        phases, done = traced(step, built, 1)
        reported, _ = traced(report, built, 1, done)
        one, _ = traced(lambda: report(built, 2, step(built, 2)))
    print(whole.line("the whole run (session.run, 2 steps)"))
    print(one.line("one step with its evaluation and log line (loop.step, then loop.report)"))
    print(phases.line("loop.step alone (its four phases)"))
    print(reported.line("loop.report alone (evaluation, log line)"))


if __name__ == "__main__":
    main()
