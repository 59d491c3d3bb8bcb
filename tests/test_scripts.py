"""scripts/ holds thin entry points and benchmarks/ the maintained benchmarks: no ``sys.path.insert``, and
no script imports another script (or a test helper); what scripts share lives in the package
(mlptrain.tools.bench, mlptrain.tools.compare), what the benchmarks share in ``benchmarks/record.py``."""

from __future__ import annotations

import ast
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
BENCHMARKS = SCRIPTS.parent / "benchmarks"
TESTS = Path(__file__).resolve().parent


def offences(source: str, local: set[str]) -> list[str]:
    """What breaks the rules in one script's source: each ``sys.path`` edit, and each ``import``/``from``
    (anywhere in it) of a module in ``local`` (the names of the scripts and of the test helpers)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ("insert", "append", "extend"):
            target = node.value
            if isinstance(target, ast.Attribute) and target.attr == "path" and getattr(target.value, "id", "") == "sys":
                found.append(f"line {node.lineno}: sys.path.{node.attr}")
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.ImportFrom):
            names = [f"(relative) {node.module}"]
            found.append(f"line {node.lineno}: relative import")
        found += [f"line {node.lineno}: imports {n}" for n in names if n.split(".")[0] in local]
    return sorted(found, key=lambda what: int(what.split()[1].rstrip(":")))


def local_names() -> set[str]:
    folders = (SCRIPTS, BENCHMARKS)
    return {p.stem for d in folders for p in d.glob("*.py")} | {p.stem for p in TESTS.rglob("*.py")}


def test_the_rule_finds_what_it_forbids() -> None:
    local = {"bench", "gpu_helpers"}
    bad = (
        "import sys\nsys.path.insert(0, 'x')\nimport bench\n"
        "def f():\n    from bench import step_trainer\n    from gpu_helpers import graph_run\n"
        "    sys.path.append('y')\n"
    )
    assert offences(bad, local) == [
        "line 2: sys.path.insert",
        "line 3: imports bench",
        "line 5: imports bench",
        "line 6: imports gpu_helpers",
        "line 7: sys.path.append",
    ]
    good = "import sys\nimport numpy\nfrom mlptrain.tools.bench.step_trainer import step_trainer\nsys.exit(0)\n"
    assert offences(good, local) == []


def test_scripts_import_nothing_from_each_other_and_leave_sys_path_alone() -> None:
    scripts = sorted(SCRIPTS.glob("*.py"))
    assert len(scripts) >= 4 and "bench" in local_names() and "gpu_helpers" in local_names()
    found = {p.name: offences(p.read_text(), local_names() - {p.stem}) for p in scripts}
    assert {name: what for name, what in found.items() if what} == {}


def test_benchmarks_share_only_their_record_module() -> None:
    benchmarks = sorted(BENCHMARKS.glob("*.py"))
    assert len(benchmarks) > 8 and "bench_run" in local_names()
    found = {p.name: offences(p.read_text(), local_names() - {p.stem, "record"}) for p in benchmarks}
    assert {name: what for name, what in found.items() if what} == {}
