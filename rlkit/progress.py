"""What a run prints while it works. On a terminal: a progress bar for the steps (and for a warm
start or an evaluation). Elsewhere (a file under nohup or SLURM), where a bar's redraws would be
one long line of carriage returns: plain lines, one every few steps (about 20 a run) and one at
each evaluation, with the step's reward, the held-out accuracy, seconds a step and the time left,
and a line every 30 s of a long warm start or evaluation. The run's lines also go to its train.log."""

from __future__ import annotations

import functools
import sys
import time
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

from tqdm import tqdm

LINE_EVERY_S = 30.0  # a line this often through a long warm start or evaluation, away from a terminal
LINES_A_RUN = 20  # about this many step lines a run, away from a terminal


def on_terminal() -> bool:
    return sys.stderr.isatty()


@contextmanager
def library_bars_off_terminal(module):
    """The tqdm bars a library module draws (transformers' GGUF conversion) silenced away from a
    terminal, where their redraws would be one long line in a log file."""
    bar = getattr(module, "tqdm", None)
    if on_terminal() or bar is None:
        yield
        return
    module.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        module.tqdm = bar


def minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def steps(iterable, desc: str, total: int):
    """`iterable` with progress: a bar on a terminal; elsewhere a line every LINE_EVERY_S seconds
    and one at the end when it took that long."""
    if on_terminal():
        yield from tqdm(iterable, desc=desc, total=total, file=sys.stderr, leave=False)
        return
    t0 = last = time.perf_counter()
    for i, item in enumerate(iterable, 1):
        yield item
        now = time.perf_counter()
        if now - last >= LINE_EVERY_S or (i == total and now - t0 >= LINE_EVERY_S):
            print(f"{desc}: {i}/{total} ({minutes(now - t0)})", file=sys.stderr, flush=True)
            last = now


class Display:
    """The training steps' progress (rank 0 only; the other ranks' is None)."""

    def __init__(self, start: int, total: int, run_dir: str):
        self.start, self.total, self.log = start, total, Path(run_dir, "train.log")
        self.every = max(1, round(total / LINES_A_RUN))
        self.t0 = time.perf_counter()
        self.bar = tqdm(initial=start, total=total, desc="rlkit", file=sys.stderr) if on_terminal() else None

    def line(self, text: str) -> None:
        """`text` on stderr (above the bar on a terminal) and, time-stamped, in train.log."""
        (self.bar.write if self.bar is not None else print)(text, file=sys.stderr)
        with self.log.open("a") as f:
            f.write(f"[{datetime.now():%Y-%m-%d %H:%M:%S}] {text}\n")

    def step(self, n: int, reward: float | None, held_out: float, evaluated: bool) -> None:
        """After step n: the bar moves; a line at an evaluation and, away from a terminal, every few steps."""
        per_step = (time.perf_counter() - self.t0) / (n - self.start)
        shown = f"{reward:.3f}" if reward is not None else "n/a"
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=shown, held_out_acc=f"{held_out:.3f}")
        if evaluated:
            self.line(f"rlkit: step {n}/{self.total}: held-out accuracy {held_out:.3f}")
        elif self.bar is None and (n % self.every == 0 or n == self.start + 1):
            self.line(
                f"rlkit: step {n}/{self.total}: reward {shown}, held-out accuracy {held_out:.3f} (last evaluation), "
                f"{per_step:.2f} s a step, about {minutes(per_step * (self.total - n))} left"
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
