"""The documentation: `mkdocs build --strict` succeeds, and every command README.md and docs/ show
is checked. rlkit-train commands (alone, under torchrun, and every job of a sweep) are composed by
Hydra and validated as rlkit-train validates them, with the processes torchrun would start;
rlkit-compare and rlkit-study commands parse, and a study's arms compose and validate; the plugin
files the pages show are written out first, so the plugin commands compose with them; pip and
benchmark commands name extras and files that exist. A command of any other program fails."""

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml
from hydra import compose, initialize_config_module
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser

from cli import metrics, run_cli
from conftest import FAST
from helpers import SIGN_ONLY, write_plugin
from rlkit import calibrate
from rlkit.analysis import compare, study, study_cli
from rlkit.setup import validate

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLE_PLUGIN = ROOT / "experiments" / "plugins"


def shown_commands(text: str) -> list[str]:
    """The indented (4-space) code lines outside fenced blocks, continuation lines joined."""
    out, lines, fenced, i = [], text.splitlines(), False, 0
    while i < len(lines):
        line = lines[i]
        fenced = not fenced if line.startswith("```") else fenced
        if not fenced and line.startswith("    ") and line.strip():
            cmd = line.strip()
            while cmd.endswith("\\"):
                i += 1
                cmd = cmd[:-1].rstrip() + " " + lines[i].strip()
            out.append(cmd.split("  #")[0].strip())
        i += 1
    return out


def shown_files(text: str) -> dict[str, str]:
    """Fenced blocks whose first line is a comment naming a file: path -> content."""
    blocks = text.split("```")[1::2]
    out = {}
    for block in blocks:
        body = block.split("\n", 1)[1] if "\n" in block else ""
        first = body.split("\n", 1)[0]
        if first.startswith("# ") and ("/" in first or first.split()[1].endswith(".py")):
            out[first[2:].split()[0]] = body
    return out


ALL = [(page.name, cmd) for page in PAGES for cmd in shown_commands(page.read_text())]


def test_the_pages_show_commands_and_the_readme_is_short():
    assert len(ALL) >= 30 and {"README.md", "distributed.md", "sweeps.md", "plugins.md"} <= {p for p, _ in ALL}
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_the_docs_build_strictly(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "-d",
            str(tmp_path / "site"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "site" / "distributed" / "index.html").exists()


def train_overrides(tokens: list[str]) -> tuple[list[str], int] | None:
    """(overrides, processes) of an rlkit-train command, alone or under torchrun; None for another program."""
    if tokens[0] == "rlkit-train":
        return tokens[1:], 1
    if tokens[:3] == ["python", "-m", "rlkit.train"]:
        return tokens[3:], 1
    if tokens[0] in ("torchrun", "rlkit-launch") and "rlkit.train" in tokens:
        at = tokens.index("rlkit.train")
        flags = dict(t.lstrip("-").split("=", 1) for t in tokens[1 : at - 1] if "=" in t)
        return tokens[at + 1 :], int(flags.get("nproc_per_node", 1)) * int(flags.get("nnodes", 1))
    return None


def check_train(args: list[str], world: int) -> int:
    """Compose every job of the command (a sweep's too) and validate it; returns the number of jobs."""
    args = [a for a in args if a != "..."]  # the page's placeholder for "and your other overrides"
    sweep = "-m" in args
    args = [a for a in args if a != "-m"]
    jobs = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(args), None)[0] if sweep else [args]
    for job in jobs:
        with initialize_config_module(config_module="rlkit.conf", version_base=None):
            cfg = compose("config", overrides=job)
        validate(cfg, world)
    return len(jobs)


def check_command(cmd: str) -> None:
    for part in cmd.split(" && "):
        tokens = shlex.split(part)
        train = train_overrides(tokens)
        if train is not None:
            assert check_train(*train) >= 1
        elif tokens[0] == "rlkit-calibrate":
            check_train(calibrate.parser().parse_args(tokens[1:]).overrides, 1)
        elif tokens[0] == "rlkit-compare":
            assert compare.parser().parse_args(tokens[1:]).metric
        elif tokens[0] == "rlkit-study":
            name, path = study_cli.study_paths(study_cli.parser().parse_args(tokens[1:]).study)
            spec = study.load_spec(path)
            for arm in study.every_arm(spec):
                check_train(study.overrides(spec, arm), 1)
        elif tokens[:2] == ["pip", "install"]:
            target = tokens[-1]
            base, _, extra = target.partition("[")
            assert (ROOT / base).exists(), target
            extras = tomllib.loads((ROOT / base / "pyproject.toml").read_text())["project"].get(
                "optional-dependencies", {}
            )
            assert not extra or extra.rstrip("]") in extras, target
        elif tokens[0] == "python" and tokens[1].startswith("benchmarks/"):
            assert (ROOT / tokens[1]).is_file()
        else:
            assert tokens == ["pytest"], f"a command the docs test does not know: {part}"  # CI runs it


@pytest.mark.parametrize("page, cmd", ALL, ids=[f"{p}:{c[:40]}" for p, c in ALL])
def test_every_shown_command_composes(page, cmd, tmp_path, monkeypatch):
    text = (ROOT / page if page == "README.md" else ROOT / "docs" / page).read_text()
    for name, content in shown_files(text).items():  # the page's plugin files, as a reader would save them
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(content)
    monkeypatch.chdir(ROOT if any(x in cmd for x in ("rlkit-study", "pip install", "experiments/")) else tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    if "advantage=batch_std_baseline" in cmd:  # what the installed example plugin's search-path plugin adds
        monkeypatch.syspath_prepend(str(EXAMPLE_PLUGIN))
        cmd += " hydra.searchpath=[pkg://rlkit_example_plugin.conf]"
    check_command(cmd)


@pytest.mark.slow
def test_the_readme_plugin_example_runs_from_the_console_script(tmp_path):
    """`rlkit-train advantage=sign hydra.searchpath=[file://my_conf]` from the folder holding my_estimators/."""
    exe = shutil.which("rlkit-train")
    if exe is None:
        pytest.skip("rlkit-train is not installed")
    write_plugin(tmp_path, "my_estimators", SIGN_ONLY, "advantage", "sign", "_target_: my_estimators.SignOnly\n")
    out = run_cli(
        [
            "advantage=sign",
            "hydra.searchpath=[file://my_conf]",
            *FAST,
            "steps=1",
            "warm_start.steps=0",
            "hydra.run.dir=run",
        ],
        tmp_path,
        exe=(exe,),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "warm start" not in out.stderr and "rlkit: step 1/1: held-out accuracy" in out.stderr  # plain lines
    assert metrics(tmp_path / "run")[1]["train/num_rows"] == 16


def group_rows(text: str) -> dict[str, list[str]]:
    """{group: its options as a page's groups table lists them} (a `(default)` mark kept)."""
    rows = {}
    table = text.split("| group | options | what it is |")[1].split("\n\n")[0]  # the first groups table
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`") and cells[1].startswith("`"):
            rows[cells[0].strip("`")] = [o.strip() for o in cells[1].split(",")]
    return rows


@pytest.mark.parametrize("page", ["README.md", "docs/configuration.md"])
def test_the_groups_tables_list_every_option_in_conf(page):
    """A page's groups table lists exactly the options in conf/<group>/, and a `(default)` mark sits
    on the option conf/config.yaml chooses; an option added to conf/ without its row fails here."""
    conf = ROOT / "conf"
    defaults = {}
    for entry in yaml.safe_load((conf / "config.yaml").read_text())["defaults"]:
        if isinstance(entry, dict):
            defaults.update({k: v for k, v in entry.items() if "/" not in k and not k.startswith("override")})
    rows = group_rows((ROOT / page).read_text())
    groups = sorted(
        p.name for p in conf.iterdir() if p.is_dir() and p.name not in ("hydra", "experiment", "__pycache__")
    )
    assert sorted(rows) == groups
    for group, cells in rows.items():
        names = [c.split()[0].strip("`") for c in cells]
        assert sorted(names) == sorted(p.stem for p in (conf / group).glob("*.yaml")), group
        marked = [c.split()[0].strip("`") for c in cells if "(default)" in c]
        assert marked in ([], [defaults.get(group)]), group


def test_the_configuration_page_s_keys_table_is_the_schema_s_and_help_lists_every_key():
    """The keys table is written from rlkit/schema.py (each key's default, range and meaning, once),
    and `rlkit-train --help` prints a line for each key with its meaning."""
    from rlkit.schema import keys_table, settings

    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page.split("<!-- keys table: rlkit.schema.keys_table -->\n")[1].split("\n<!-- end")[0] == keys_table()
    out = run_cli(["--help"])
    assert out.returncode == 0, out.stderr[-2000:]
    for name, _, _, _, meaning in settings():
        assert f"\n{name} (" in out.stdout and meaning in out.stdout, name
    assert "optim.lr (float, default 0.0001; > 0): AdamW learning rate of the policy" in out.stdout
