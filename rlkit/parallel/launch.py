"""`python -m rlkit.parallel.launch` (or `rlkit-launch`): torchrun, with exit codes a scheduler can act on.
When the launcher itself receives SIGTERM or SIGINT (a preempted job), torchrun forwards the signal
to every rank, which checkpoint after their step and stop, and then exits 1 with a traceback; this
launcher exits 75 ("try again", as a single process does) with one line instead. When ranks fail,
it exits with the code of the rank that failed first on its own (2 for bad input, 3, 74), not
torchrun's 1, after one line per failed rank. Arguments are torchrun's:
`python -m rlkit.parallel.launch --nproc_per_node=2 -m rlkit.train steps=100`. torchrun waits 30 s for the
ranks before it kills them, so a step longer than that loses its checkpoint."""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from rlkit.exits import EXIT_PREEMPTED


def main(argv: list[str] | None = None) -> None:
    try:
        run(parse_args(argv))
    except SignalException as e:
        print(
            f"rlkit-launch: stopped by {e.sigval.name}: the ranks were asked to checkpoint and stop; rerun the "
            "same command to resume",
            file=sys.stderr,
        )
        sys.exit(EXIT_PREEMPTED)
    except ChildFailedError as e:
        failures = sorted(e.failures.items(), key=lambda kv: kv[1].timestamp)
        for rank, f in failures:
            print(f"rlkit-launch: rank {rank} exited with code {f.exitcode}", file=sys.stderr)
        own = [f.exitcode for _, f in failures if f.exitcode not in (1, None)]  # 1: stopped because another failed
        sys.exit(own[0] if own and own[0] > 0 else 1)


if __name__ == "__main__":
    main()
