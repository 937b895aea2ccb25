"""Stopping a run cleanly: SIGTERM, SIGINT or SIGHUP (its terminal or ssh session closed) lets the
step in progress finish and checkpoint (`StopSignals`, then `Preempted`); a second signal stops at
once (`StoppedAtOnce`)."""

from __future__ import annotations

import signal
import threading

STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Preempted(Exception):
    """SIGTERM, SIGINT or SIGHUP arrived; a checkpoint was written and rerunning the command resumes."""


class StoppedAtOnce(BaseException):
    """A second stop signal arrived before the step ended: stopped without a checkpoint. A
    BaseException, like KeyboardInterrupt, so that no handler of user code (a scorer's) swallows it."""


class StopSignals:
    """Records SIGTERM, SIGINT or SIGHUP instead of dying mid-step; the loop checks `received` after each step.
    A second signal raises `StoppedAtOnce` wherever the run is (a scorer that never returns, say)."""

    def __init__(self):
        self.received: str | None = None
        self._old = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in STOPS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.received:  # a second signal: the step is not ending (a hung scorer, say); stop now
            raise StoppedAtOnce(
                f"stopped at once by a second signal ({signal.Signals(signum).name} after "
                f"{self.received}); no checkpoint was written for this step; rerun the same command "
                "to resume from the last checkpoint"
            )
        self.received = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
