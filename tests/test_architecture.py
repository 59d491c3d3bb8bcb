"""The package's shape, as docs/architecture.md describes it: sizes, the import graph, where CuPy lives.

Imports are read from the source (every ``import`` anywhere in a module: at the top, inside
functions, under ``TYPE_CHECKING``), so a cycle or a stray CuPy import cannot hide in a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "mlptrain"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def modules() -> dict[str, Path]:
    """``mlptrain.x.y`` -> its file, for every module of the package."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(path: Path, known: set[str]) -> set[str]:
    """The modules ``path`` imports, anywhere in it; ``from mlptrain import x`` names module ``mlptrain.x``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports. A package's ``__init__`` importing its own submodules
    is left out: importing a submodule runs the package first, never the reverse."""
    mods = modules()
    known = set(mods)
    return {
        name: {m for m in imports(path, known) if m in known and m != name and not m.startswith(name + ".")}
        for name, path in mods.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_between_modules() -> None:
    graph = import_graph()
    assert len(graph) > 30 and graph["mlptrain.run"], "the import graph was not read"
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph) or [])}"


def test_the_checkpoint_format_knows_nothing_of_trainers_or_runs() -> None:
    graph = import_graph()
    reach, todo = set(), ["mlptrain.checkpoint"]
    while todo:
        for m in graph[todo.pop()] - reach:
            reach.add(m)
            todo.append(m)
    assert not reach & {"mlptrain.trainer", "mlptrain.run", "mlptrain.loop", "mlptrain.network"}, sorted(reach)


def test_cupy_and_nvmath_are_imported_only_by_the_backend_and_mlptrain_gpu() -> None:
    known = set(modules())
    offenders = {
        name: sorted(m for m in imports(path, known) if m.split(".")[0] in ("cupy", "cupyx", "nvmath"))
        for name, path in modules().items()
        if not name.startswith("mlptrain.gpu.") and name != "mlptrain.backend"
    }
    assert {k: v for k, v in offenders.items() if v} == {}
    gpu = [name for name in modules() if name.startswith("mlptrain.gpu.")]
    # (gpu.torch_gemm drives nvmath on torch tensors: nvmath, not CuPy, is what puts it there)
    assert len(gpu) >= 8 and all(
        any(m.split(".")[0] in ("cupy", "nvmath") for m in imports(modules()[name], known)) for name in gpu
    ), "every module of mlptrain.gpu imports CuPy or nvmath (that is what puts it there)"


@pytest.mark.parametrize("name", sorted(modules()))
def test_module_and_function_sizes(name: str) -> None:
    path = modules()[name]
    src = path.read_text()
    assert src.count("\n") <= MAX_MODULE_LINES, f"{path}: {src.count(chr(10))} lines"
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            assert length <= MAX_FUNCTION_LINES, f"{path}:{node.lineno} {node.name} has {length} lines"
