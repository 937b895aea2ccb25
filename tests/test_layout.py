"""The shape of the package: rlkit's imports (module-level and inside functions) form no circle,
the data types on the ground floor import nothing from rlkit, parallelism lives in one package,
and no function is longer than 40 lines; loop.py holds only the loop."""

import ast
from pathlib import Path

import rlkit

ROOT = Path(rlkit.__file__).parent


def modules() -> dict:
    """rlkit's modules: dotted name -> source file."""
    return {
        ".".join(("rlkit", *p.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__"): p
        for p in ROOT.rglob("*.py")
    }


def import_graph() -> dict:
    """module -> the rlkit modules it imports; `from a import b` counts as importing `a.b` when that
    is a module, else `a`."""
    files = modules()
    graph = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "rlkit":
                deps |= {
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module for a in node.names
                }
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.split(".")[0] == "rlkit"}
        graph[name] = deps
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def find_cycle(graph: dict) -> list | None:
    state = {}  # 1: on the current path, 2: done

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return path[path.index(d) :] + [d]
            if d not in state and (found := visit(d, path + [d])):
                return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m, [m])):
            return found
    return None


def test_the_import_graph_has_no_circle():
    graph = import_graph()
    assert {"rlkit.train", "rlkit.types", "rlkit.engines.kv_cache", "rlkit.logprobs"} <= set(graph)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_planted_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


def test_the_data_types_sit_on_the_ground_floor():
    assert import_graph()["rlkit.types"] == set()


def test_parallelism_lives_in_one_package():
    """Only rlkit.parallel calls torch.distributed or knows how a model is sharded."""
    outside = {name: path.read_text() for name, path in modules().items() if not name.startswith("rlkit.parallel")}
    assert len(outside) > 30
    assert [n for n, text in outside.items() if "fsdp" in text.lower()] == []
    assert [n for n, text in outside.items() if "torch.distributed" in text or "DTensor" in text] == []


def test_no_function_is_longer_than_40_lines():
    long = [
        f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for name, path in modules().items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 40
    ]
    assert long == []


def test_the_readme_layout_table_names_every_module():
    """Each top-level module and package of rlkit is named in the README's Layout table."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()  # the repository, not the install
    table = readme[readme.index("## Layout") :]
    names = [p.name for p in ROOT.glob("*.py") if p.stem not in ("__init__", "__main__")]
    names += [f"rlkit/{p.name}/" for p in ROOT.iterdir() if (p / "__init__.py").exists() and p.name != "conf"]
    assert len(names) > 30
    assert [n for n in names if f"`{n}`" not in table and f"`rlkit/{n}`" not in table] == []


def test_the_loop_module_holds_only_the_loop():
    """loop.py stays the phases and `step` (under 250 lines); no module is named after the standard
    library's logging (the metric sinks are `rlkit.sinks`)."""
    files = modules()
    assert len(files["rlkit.loop"].read_text().splitlines()) < 250
    assert "rlkit.logging" not in files and "rlkit.sinks" in files
