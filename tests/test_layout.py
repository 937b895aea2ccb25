"""The shape of the package: rlkit's imports (module-level and inside functions) form no circle,
and the data types on the ground floor import nothing from rlkit."""
import ast
from pathlib import Path

import rlkit

ROOT = Path(rlkit.__file__).parent


def import_graph() -> dict:
    graph = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(("rlkit", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "rlkit":
                deps |= {f"rlkit.{a.name}" for a in node.names} if node.module == "rlkit" else {node.module}
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
                return path[path.index(d):] + [d]
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
