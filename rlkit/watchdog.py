"""A time limit for user code that runs in the main thread (reward functions, task scorers): one
daemon thread watches the call in progress and, past its limit, makes the main thread raise
`TimeLimit` where it is, so a scorer stuck in a Python loop or a slow library ends with a named
error instead of hanging the run."""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager

# The main thread is interrupted by a signal nobody else uses, sent to that thread alone: a real
# signal, so that a blocking call (sleep, a socket read) returns and the handler runs at once.
SIGNAL = signal.SIGRTMIN + 7 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR1


class TimeLimit(BaseException):
    """The call ran past its limit. A BaseException, so that the user code it interrupts cannot
    swallow it with `except Exception`."""


class Watchdog:
    def __init__(self):
        self.cond = threading.Condition()
        self.active: tuple[int, float, float] | None = None  # (call number, monotonic deadline, seconds)
        self.calls, self.fired, self.thread = 0, None, None

    @contextmanager
    def limit(self, seconds: float):
        """Raise TimeLimit in the block when it runs past `seconds` (0: no limit; only in the main thread)."""
        if not seconds or threading.current_thread() is not threading.main_thread():
            yield
            return
        if self.thread is None:
            signal.signal(SIGNAL, self._interrupt)
            self.thread = threading.Thread(target=self._watch, daemon=True, name="rlkit-watchdog")
            self.thread.start()
        with self.cond:
            self.calls += 1
            self.active = (self.calls, time.monotonic() + seconds, seconds)
            self.cond.notify()
        try:
            yield
        finally:
            with self.cond:
                self.active = None

    def _interrupt(self, signum, frame) -> None:
        active = self.active
        if active is not None and self.fired == active[0]:  # still the call that ran out of time
            raise TimeLimit(f"still running after {active[2]:g} s")

    def _watch(self) -> None:
        with self.cond:
            while True:
                if self.active is None or self.fired == self.active[0]:
                    self.cond.wait()
                    continue
                call, deadline, _ = self.active
                left = deadline - time.monotonic()
                if left > 0:
                    self.cond.wait(left)
                    continue
                self.fired = call
                signal.pthread_kill(threading.main_thread().ident, SIGNAL)


WATCHDOG = Watchdog()
