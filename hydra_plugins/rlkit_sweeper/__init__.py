"""rlkit's sweeper (`hydra/sweeper=rlkit`, rlkit-train's default): Hydra's basic sweeper, except
that a job whose overrides do not compose (an unknown option, a value of the wrong type) is recorded
as failed in its own folder (`failed.json`, exit 2) and the sweep runs every other job, where the
basic sweeper refuses the whole sweep before any job runs. A Hydra plugin lives in the
`hydra_plugins` namespace; rlkit installs this one with itself."""

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.plugins.sweeper import Sweeper
from omegaconf import OmegaConf

EXIT_BAD_INPUT = 2  # rlkit.exits' code for input that cannot run (not imported: plugins load with every Hydra app)


@dataclass
class RlkitSweeperConf:
    _target_: str = "hydra_plugins.rlkit_sweeper.RlkitSweeper"
    max_batch_size: Optional[int] = None
    params: Optional[Dict[str, str]] = None


ConfigStore.instance().store(group="hydra/sweeper", name="rlkit", node=RlkitSweeperConf, provider="rlkit")


class RlkitSweeper(Sweeper):
    """Hydra's basic sweeper by composition (Hydra's plugin scan re-executes its module, so a
    subclass made before the scan would break), launching only the jobs that compose."""

    def __init__(self, max_batch_size: Optional[int] = None, params: Optional[Dict[str, str]] = None) -> None:
        from hydra._internal.core_plugins import basic_sweeper  # the class as it is now

        self.basic = basic_sweeper.BasicSweeper(max_batch_size, params)

    def setup(self, *, hydra_context, task_function, config) -> None:
        self.basic.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: List[str]) -> Any:
        """The basic sweep, batch by batch, launching only the jobs that compose; each run of
        consecutive composable jobs keeps its job numbers, so folders and `rlkit-compare` agree."""
        from hydra.core.override_parser.overrides_parser import OverridesParser

        b = self.basic
        parser = OverridesParser.create(config_loader=b.hydra_context.config_loader)
        b.overrides = b.split_arguments(parser.parse_overrides(b._parse_config() + list(arguments)), b.max_batch_size)
        sweep_dir = Path(b.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(b.config, sweep_dir / "multirun.yaml")
        returns, first = [], 0
        while not b.is_done():
            batch = b.get_job_batch()
            legal = [self.composes(job, first + i, sweep_dir) for i, job in enumerate(batch)]
            for start, end in runs_of(legal):
                results = b.launcher.launch(batch[start:end], initial_job_idx=first + start)
                for r in results:
                    _ = r.return_value  # a job's own failure, as the basic sweeper raises it
                returns.append(results)
            first += len(batch)
        return returns

    def composes(self, job: Sequence[str], num: int, sweep_dir: Path) -> bool:
        """Whether the job's overrides compose; if not, its failure is printed and recorded."""
        try:
            loader = self.basic.hydra_context.config_loader
            loader.load_sweep_config(master_config=self.basic.config, sweep_overrides=list(job))
            return True
        except Exception as e:  # Hydra's and OmegaConf's composition errors, whatever their class
            from rlkit import sweeps

            error = " ".join(str(e).split()).split(" Config search path")[0] or type(e).__name__
            print(f"rlkit: error: job {num} ({' '.join(job)}) does not compose: {error}", file=sys.stderr)
            folder = sweep_dir / f"{num}_not_composed"
            folder.mkdir(parents=True, exist_ok=True)
            sweeps.record_failure(folder, num, list(job), EXIT_BAD_INPUT, error)
            return False


def runs_of(flags: list[bool]) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive True values."""
    out, start = [], None
    for i, ok in enumerate([*flags, False]):
        if ok and start is None:
            start = i
        elif not ok and start is not None:
            out.append((start, i))
            start = None
    return out
