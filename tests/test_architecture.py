"""The package's shape, as docs/architecture.md and README.md's layout describe it: folders and their entries,
the import graph, where CuPy lives.

Imports are read from the source (every ``import`` anywhere in a module: at the top, inside
functions, under ``TYPE_CHECKING``), so a cycle or a stray CuPy import cannot hide in a function.
The sizes and the formatter rules, for every Python file of the repository: tests/test_architecture_sizes.py.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "mlptrain"


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
    assert len(graph) > 30 and graph["mlptrain.run.run"], "the import graph was not read"
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph) or [])}"


def test_the_checkpoint_format_knows_nothing_of_trainers_or_runs() -> None:
    graph = import_graph()
    reach, todo = set(), ["mlptrain.run.checkpoint"]
    while todo:
        for m in graph[todo.pop()] - reach:
            reach.add(m)
            todo.append(m)
    assert not reach & {"mlptrain.step.trainer", "mlptrain.run.run", "mlptrain.run.loop", "mlptrain.nn.network"}, (
        sorted(reach)
    )


def in_cuda(name: str) -> bool:
    """Whether module ``name`` lives in a ``cuda/`` folder (each concept's GPU half)."""
    return ".cuda." in name


def test_cupy_and_nvmath_are_imported_only_under_cuda_folders_torch_and_the_backend() -> None:
    known = set(modules())
    offenders = {
        name: sorted(m for m in imports(path, known) if m.split(".")[0] in ("cupy", "cupyx", "nvmath"))
        for name, path in modules().items()
        if not in_cuda(name) and not name.startswith("mlptrain.torch.") and name != "mlptrain.base.backend"
    }
    assert {k: v for k, v in offenders.items() if v} == {}
    gpu = [name for name, path in modules().items() if in_cuda(name) and path.name != "__init__.py"]
    assert len(gpu) >= 20 and all(
        any(m.split(".")[0] in ("cupy", "nvmath") for m in imports(modules()[name], known)) for name in gpu
    ), "every module of a cuda/ folder imports CuPy or nvmath (that is what puts it there)"


# Where torch may be imported besides mlptrain.torch and the cuda/ folders, and why (an exception that is gone
# is taken out of the set too): torchrun's rendezvous store, and the PyTorch baselines the benchmarks time.
TORCH_EXCEPTIONS = {
    "mlptrain.distributed.launch",  # torch.distributed.TCPStore: the store torchrun already started
    "mlptrain.tools.bench.largest_model",  # the largest model PyTorch fits, beside mlptrain's
    "mlptrain.tools.bench.memory_vs_torch",
    "mlptrain.tools.bench.step_timing",  # PyTorch's step, timed as the baseline
    "mlptrain.tools.bench.suite",
}


def test_torch_is_imported_only_by_the_torch_front_end_cuda_folders_and_named_exceptions() -> None:
    known = set(modules())
    found = {
        name
        for name, path in modules().items()
        if any(m.split(".")[0] == "torch" for m in imports(path, known))
        and not in_cuda(name)
        and name != "mlptrain.torch"
        and not name.startswith("mlptrain.torch.")
    }
    assert found == TORCH_EXCEPTIONS


def reach(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    found: set[str] = set()
    todo = [start]
    while todo:
        for m in graph[todo.pop()] - found:
            found.add(m)
            todo.append(m)
    return found


# What an engine (a module of a cuda/ folder) may import outside the cuda/ folders: the contracts it
# carries out and plain helpers. Never the step, the network, the builders or the precision policy.
ENGINES_MAY_IMPORT = {
    "mlptrain.base.member_settings",  # the stacked layout of an ensemble: the member of an element
    "mlptrain.nn.epilogs",  # the epilog contract the GEMM engines run
    "mlptrain.nn.epilogs_fp8",
    "mlptrain.nn.fp8",  # the FP8 scaling contract
    "mlptrain.base.backend",  # device selection
    "mlptrain.base.fs",  # atomic_write, the cache folder
    "mlptrain.base.cuda_source",  # pieces of CUDA source and the Job a component declares to compile ahead
    "mlptrain.base.errors",  # the user-facing exceptions (imports nothing)
    "mlptrain.config.schema",  # the names a setting takes (BGRAD_STRATEGIES: the probe's options; imports nothing)
}
# Today's exceptions, each to go once its module is given what it needs instead of importing it:
ENGINE_EXCEPTIONS = {
    # starts compiling the dtype kernels (the parameters' cast) from the config, before the trainer exists,
    # so it builds the run's precision policy itself (the components' own jobs come from the trainer)
    "mlptrain.step.cuda.precompile": {"mlptrain.step.precision"},
    # compares the pools with the step's memory formula, its CPU twin (#29: the device runtime apart from the step)
    "mlptrain.step.cuda.memory": {"mlptrain.step.memory"},
}


def engine_imports_outside(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each module of a cuda/ folder -> what it imports of the package beyond cuda/ and ENGINES_MAY_IMPORT."""
    return {
        name: {m for m in deps if not in_cuda(m) and not m.endswith(".cuda")} - ENGINES_MAY_IMPORT
        for name, deps in graph.items()
        if in_cuda(name)
    }


def test_gpu_modules_are_engines_that_never_import_the_step_the_network_or_the_precision_policy() -> None:
    found = {name: deps for name, deps in engine_imports_outside(import_graph()).items() if deps}
    assert found == ENGINE_EXCEPTIONS  # an exception that is gone is taken out of the set too


def test_the_engine_rule_refuses_an_engine_that_imports_the_network() -> None:
    graph = {"mlptrain.nn.cuda.x": {"mlptrain.nn.network", "mlptrain.nn.epilogs", "mlptrain.step.cuda.y"}}
    graph["mlptrain.step.cuda.y"] = set()
    assert engine_imports_outside(graph) == {
        "mlptrain.nn.cuda.x": {"mlptrain.nn.network"},
        "mlptrain.step.cuda.y": set(),
    }


def test_the_launcher_is_above_the_run_and_data_parallelism_below_it() -> None:
    graph = import_graph()
    assert "mlptrain.run.run" in graph["mlptrain.cli.launcher"], "the launcher's workers call run.train"
    assert {name for name, deps in graph.items() if "mlptrain.cli.launcher" in deps} == {"mlptrain.cli.main"}
    above = {
        "mlptrain.cli.launcher",
        "mlptrain.cli.main",
        "mlptrain.run.run",
        "mlptrain.run.loop",
        "mlptrain.step.trainer",
    }
    distributed = [name for name in graph if name.startswith("mlptrain.distributed")]
    assert len(distributed) >= 4 and {n: sorted(reach(graph, n) & above) for n in distributed} == {
        n: [] for n in distributed
    }


def test_every_module_is_named_where_the_package_is_described() -> None:
    """docs/architecture.md names every folder (``nn/cuda/``) and every module (``nn/cuda/losses.py``)."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    mods = [p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py") if p.stem not in ("__init__", "__main__")]
    folders = [p.parent.relative_to(PKG).as_posix() + "/" for p in PKG.rglob("*/__init__.py")]
    assert len(mods) > 100 and [m for m in mods + folders if f"`{m}`" not in doc] == []


def layout_block(readme: str) -> tuple[list[str], list[str]]:
    """README's layout block (the first fenced block of its "## Layout" section): the names it gives inside
    ``mlptrain/`` (the lines indented by two: ``base/``, ``sklearn/, torch/``, ``*/cuda/``) and at the top
    (``conf/``). A name is the text before the description's column; a line with none continues a description."""
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```\n", 2)[1]
    inside, top = [], []
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        names = [n.strip() for n in re.split(r" {2,}", line.strip())[0].split(",")] if line.strip() else []
        if indent == 0:
            top += names
        elif indent == 2:
            inside += names
    return inside, top


def layout_errors(readme: str, root: Path) -> dict[str, list[str]]:
    """What the layout block gets wrong about the repository at ``root``: entries of ``mlptrain/`` it does not
    name, and names it gives that do not exist (a pattern such as ``*/cuda/`` names at least one folder)."""
    inside, top = layout_block(readme)
    pkg = root / "mlptrain"
    there = [f"{name}/" if (pkg / name).is_dir() else name for name in entries(pkg)]
    missing = [name for name in inside if not (list(pkg.glob(name)) if "*" in name else name in there)]
    missing += [name for name in top if not (root / name).exists()]
    return {"not named": [name for name in there if name not in inside], "not there": missing}


def test_the_readmes_layout_names_every_folder_of_the_package_and_nothing_else() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "mlptrain/" in layout_block(readme)[1] and len(layout_block(readme)[0]) >= 14
    assert layout_errors(readme, ROOT) == {"not named": [], "not there": []}


def test_the_layout_rule_refuses_a_wrong_folder_name() -> None:
    readme = (ROOT / "README.md").read_text().replace("\n  nn/ ", "\n  nx/ ", 1).replace("\nconf/ ", "\nconfs/ ", 1)
    assert layout_errors(readme, ROOT) == {"not named": ["nn/"], "not there": ["nx/", "confs/"]}


MAX_ENTRIES = 14  # files and subfolders of one folder of the package, __init__.py and __main__.py included


def entries(folder: Path) -> list[str]:
    """What a folder of the package holds: its files and subfolders, caches and hidden files left out."""
    return sorted(p.name for p in folder.iterdir() if p.name != "__pycache__" and not p.name.startswith("."))


def crowded(root: Path) -> dict[str, int]:
    """Each folder under ``root`` (``root`` included) that holds more than MAX_ENTRIES entries."""
    folders = [root, *(p for p in root.rglob("*") if p.is_dir() and p.name != "__pycache__")]
    return {str(f.relative_to(root.parent)): n for f in folders if (n := len(entries(f))) > MAX_ENTRIES}


def test_no_folder_of_the_package_holds_more_than_14_entries() -> None:
    assert len(entries(PKG)) >= 10 and crowded(PKG) == {}


def test_the_entries_rule_refuses_a_15th_entry(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    for i in range(MAX_ENTRIES):
        (tmp_path / "pkg" / "sub" / f"m{i}.py").write_text("")
    assert crowded(tmp_path / "pkg") == {}
    (tmp_path / "pkg" / "sub" / "one_more.py").write_text("")
    assert crowded(tmp_path / "pkg") == {"pkg/sub": MAX_ENTRIES + 1}


def same_names(paths: list[str]) -> dict[str, list[str]]:
    """Module file names that more than one module of ``paths`` has, a CUDA twin left out: ``a/cuda/x.py``
    beside ``a/x.py`` is the GPU half of ``x``. ``__init__.py`` and ``__main__.py`` are no module names."""
    by_name: dict[str, list[str]] = {}
    for path in sorted(paths):
        folder, _, name = path.rpartition("/")
        if name in ("__init__.py", "__main__.py"):
            continue
        if folder.endswith("cuda") and f"{folder[: -len('cuda')]}{name}" in paths:
            continue
        by_name.setdefault(name, []).append(path)
    return {name: found for name, found in by_name.items() if len(found) > 1}


def test_module_names_are_unique_but_cuda_twins() -> None:
    paths = [p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py")]
    assert len(paths) > 100 and same_names(paths) == {}


# The package-level import order (house.md): a package imports its own modules and those of lower floors only.
FLOORS = [
    ["base", "config"],
    ["nn", "distributed"],
    ["data"],
    ["step"],
    ["torch", "run"],
    ["inference"],
    ["cli", "sklearn"],
    ["tools"],
]


def package_order_violations(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each module -> the modules it imports from another package on its own floor or above (FLOORS)."""
    floor = {package: i for i, group in enumerate(FLOORS) for package in group}
    found = {}
    for name, deps in graph.items():
        own = name.split(".")[1] if name.count(".") else ""
        if own not in floor:
            continue  # mlptrain/__init__.py and __main__.py stand above every floor
        up = {
            m for m in deps if m.count(".") and m.split(".")[1] != own and floor.get(m.split(".")[1], -1) >= floor[own]
        }
        if up:
            found[name] = up
    return found


def test_packages_import_only_their_own_floor_and_below() -> None:
    graph = import_graph()
    assert {m.split(".")[1] for m in graph if m.count(".")} >= {p for group in FLOORS for p in group}
    assert package_order_violations(graph) == {}  # no exception: cli/help.py renders --help, the schema imports nothing


def test_the_order_rule_refuses_the_network_importing_the_trainer() -> None:
    graph = {"mlptrain.nn.network": {"mlptrain.step.trainer", "mlptrain.nn.layers", "mlptrain.base.errors"}}
    graph["mlptrain.torch.ops"] = {"mlptrain.run.checkpoint"}  # a sibling on the same floor
    assert package_order_violations(graph) == {
        "mlptrain.nn.network": {"mlptrain.step.trainer"},
        "mlptrain.torch.ops": {"mlptrain.run.checkpoint"},
    }


def test_the_name_rule_refuses_a_second_name_and_keeps_a_twin() -> None:
    assert same_names(["nn/losses.py", "nn/cuda/losses.py", "base/__init__.py", "nn/__init__.py"]) == {}
    assert same_names(["base/fs.py", "data/fs.py"]) == {"fs.py": ["base/fs.py", "data/fs.py"]}
    assert same_names(["nn/cuda/losses.py", "step/losses.py"]) != {}  # a cuda/ module away from its twin
