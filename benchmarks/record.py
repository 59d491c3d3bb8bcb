"""What every benchmark of this folder writes: the command, the stack it ran on, and a .json/.md pair.

The benchmarks run as ``python benchmarks/bench_x.py ...``, so this folder is first on ``sys.path``
and they import this module as ``record``. It imports nothing of mlptrain and no GPU library at
import time.
"""

from __future__ import annotations

import datetime
import importlib
import json
import platform
import sys
from pathlib import Path
from typing import Any


def command(argv: list[str] | None = None) -> str:
    """The command that ran this benchmark, as the docs write it: ``python benchmarks/bench_x.py ARGS``."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python", f"benchmarks/{Path(sys.argv[0]).name}", *args])


def today() -> str:
    """The date of the measurement, ``YYYY-MM-DD``."""
    return datetime.date.today().isoformat()


def versions(*modules: str) -> dict[str, str]:
    """Python's version and ``module -> __version__`` for each of ``modules`` that imports."""
    out = {"python": platform.python_version()}
    for name in modules:
        try:
            out[name] = importlib.import_module(name).__version__
        except ImportError:
            pass
    return out


def gpu_name() -> str:
    """The name of CUDA device 0, as CuPy reads it (CuPy must be installed and see a GPU)."""
    import cupy as cp

    name = cp.cuda.runtime.getDeviceProperties(0)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def write(out: Path | str, stem: str, rec: Any, md: str) -> None:
    """``out/<stem>.json`` and ``out/<stem>.md`` (``out`` made if needed); the markdown also goes to stdout."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    text = md if md.endswith("\n") else md + "\n"
    (folder / f"{stem}.json").write_text(json.dumps(rec, indent=1, default=str) + "\n")
    (folder / f"{stem}.md").write_text(text)
    print(text, end="")
