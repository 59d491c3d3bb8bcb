"""One rulebook for every Python file of the repository (house.md rule 4): no module over 400 lines, no function
over 80, no comment that turns the formatter off.

Sizes are counted as ``ruff format`` writes the code, with every comment that turns the formatter off
removed first, so a limit cannot be met by keeping the formatter away; and a separate test refuses those
comments (``# fmt: skip``, ``# fmt: off``) anywhere. The rules hold for every Python file under the
folders of RULED; every Python file of the repository lies in one of them, or in a folder of NOT_YET
that is still being made to comply.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tempfile
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The top-level folders whose Python files follow the rules. A folder joins with one entry here: scripts/ (its
# maintained files moving into benchmarks/) once its files comply, as "benchmarks" does when it lands.
RULED = ("mlptrain", "tests", "examples", "benchmarks", "scripts", ".ci")
NOT_YET: tuple[str, ...] = ()  # Python files outside the rules today, each folder to comply and move into RULED
MAX_SCRIPTS_LINES = 600  # scripts/ holds thin entry points; what has logic lives in benchmarks/ or the package
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80
# the comments ruff format obeys to leave code as it is (yapf's are its aliases of fmt: off / on)
FORMATTER_OFF = re.compile(r"#\s*(fmt:\s*(skip|off)|yapf:\s*disable)\b")
FORMATTER_ON = re.compile(r"#\s*(fmt:\s*on|yapf:\s*enable)\b")


def _directives(src: str) -> list[tuple[int, int, int]]:
    """``(line, column, offset in the comment)`` of each comment of ``src`` that turns the formatter off
    or on again; read as tokens, so the words inside a string are not a directive."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            m = FORMATTER_OFF.search(tok.string) or FORMATTER_ON.search(tok.string)
            if m:
                found.append((tok.start[0], tok.start[1], m.start()))
    return found


def formatter_off(src: str) -> list[int]:
    """The lines of ``src`` whose comment keeps ``ruff format`` away (``# fmt: skip``, ``# fmt: off``)."""
    lines = src.splitlines()
    return [n for n, col, at in _directives(src) if FORMATTER_OFF.match(lines[n - 1][col + at :])]


def without_directives(src: str) -> str:
    """``src`` with every formatter directive cut out (a line holding nothing else goes with it)."""
    lines = src.splitlines(keepends=True)
    for n, col, at in reversed(_directives(src)):
        kept = lines[n - 1][: col + at].rstrip()
        lines[n - 1] = kept + "\n" if kept.strip() else ""
    return "".join(lines)


def ruff_format(sources: dict[str, str]) -> dict[str, str]:
    """Each source as ``ruff format`` writes it with the project's settings: one run over a temporary copy."""
    with tempfile.TemporaryDirectory() as tmp:
        files = {key: Path(tmp, f"m{i}.py") for i, key in enumerate(sources)}
        for key, path in files.items():
            path.write_text(sources[key])
        cmd = [sys.executable, "-m", "ruff", "format", "--quiet", "--config", str(ROOT / "pyproject.toml")]
        subprocess.run([*cmd, *map(str, files.values())], check=True, capture_output=True)
        return {key: path.read_text() for key, path in files.items()}


def too_long(src: str) -> list[str]:
    """What of ``src`` is over a limit: the module's lines, each function's lines."""
    out = [f"{src.count(chr(10))} lines"] if src.count("\n") > MAX_MODULE_LINES else []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                out.append(f"line {node.lineno} {node.name} has {length} lines")
    return out


def python_files(folders: tuple[str, ...] = RULED) -> dict[str, Path]:
    """``tests/test_x.py`` -> its file, for every Python file under the top-level ``folders`` of the repository."""
    found = (p for folder in folders for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)
    return {p.relative_to(ROOT).as_posix(): p for p in sorted(found)}


def repository_python_files() -> list[str]:
    """Every Python file of the repository, tracked or new but not ignored (git's view), as paths from its root."""
    cmd = ["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard", "--", "*.py"]
    try:
        listed = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the repository's files cannot be listed")
    return sorted(path for path in listed if (ROOT / path).is_file())


def test_every_python_file_of_the_repository_is_under_the_rules() -> None:
    files = repository_python_files()
    assert len(files) > 200 and {"tests", "examples"} <= {path.split("/")[0] for path in files}
    assert [path for path in files if path.split("/")[0] not in RULED + NOT_YET] == []
    assert {path for path in files if path.split("/")[0] in RULED} <= set(python_files())


@pytest.fixture(scope="module")
def formatted() -> dict[str, str]:
    """Every Python file under the rules as ``ruff format`` writes it once its formatter directives are removed."""
    return ruff_format({name: without_directives(path.read_text()) for name, path in python_files().items()})


def test_sizes_are_counted_as_formatted_and_a_fmt_skip_is_refused() -> None:
    call = "total = combine(" + ", ".join(f"argument_number_{i}" for i in range(12)) + ")"
    src = f"def f():\n    {call}  # fmt: skip\n    # fmt: off\n    x = [1,\n  2]\n    # fmt: on\n    return x\n"
    assert formatter_off(src) == [2, 3]
    assert formatter_off('s = "# fmt: skip"  # a string, not a comment\n') == []
    assert "fmt" not in without_directives(src) and without_directives(src).count("\n") == 5
    out = ruff_format({"m": without_directives(src)})["m"]
    assert out.count("\n") > 12, out  # the long line, formatted, counts as the lines ruff makes of it
    body = "    " + "\n    ".join(["x = 1"] * (MAX_FUNCTION_LINES - 2)) + "\n"
    short = f"def g():\n{body}    {call}  # fmt: skip\n"
    assert too_long(short) == [] and too_long(ruff_format({"m": without_directives(short)})["m"]) != []


def test_no_python_file_turns_the_formatter_off() -> None:
    found = {path: formatter_off(file.read_text()) for path, file in python_files().items()}
    assert len(found) > 200, "the repository's Python files were not read"
    assert {path: lines for path, lines in found.items() if lines} == {}, "lines with # fmt: skip / # fmt: off"


@pytest.mark.parametrize("path", sorted(python_files()))
def test_module_and_function_sizes(path: str, formatted: dict[str, str]) -> None:
    assert too_long(formatted[path]) == [], f"{path} (as ruff format writes it)"


def test_scripts_hold_at_most_600_lines_of_python() -> None:
    found = {p.name: p.read_text().count("\n") for p in (ROOT / "scripts").rglob("*.py")}
    assert 0 < sum(found.values()) <= MAX_SCRIPTS_LINES, found
