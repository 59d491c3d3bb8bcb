"""Import every module of mlptrain, as a machine with the cu12 extra and no GPU does (#48).

CuPy and nvmath-python install and import without a GPU; nothing of mlptrain may touch the device at
import. A module may fail only for an extra this environment lacks on purpose (torch, scikit-learn),
named in --allow. Exit status 1, with each failure, otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import warnings

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--allow", default="torch,sklearn", help="missing top-level packages a module may need")
allowed = set(parser.parse_args().allow.split(","))
warnings.simplefilter("ignore")  # CuPy warns that libnccl cannot be loaded; mlptrain says so when NCCL is used

import mlptrain  # noqa: E402

names = sorted(
    m.name for m in pkgutil.walk_packages(mlptrain.__path__, "mlptrain.") if m.name.split(".")[-1] != "__main__"
)


def missing_extra(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what it was raised from) is an allowed package missing."""
    while exc is not None:
        if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] in allowed:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


failed, skipped = [], []
for name in names:
    try:
        importlib.import_module(name)
    except ImportError as exc:
        (skipped if missing_extra(exc) else failed).append(f"{name}: {exc}")
    except Exception as exc:  # noqa: BLE001 - every failure is reported
        failed.append(f"{name}: {type(exc).__name__}: {exc}")
print(
    f"{len(names)} modules: {len(names) - len(failed) - len(skipped)} imported, {len(skipped)} need an extra not here"
)
for line in skipped:
    print("  (extra)", line)
for line in failed:
    print("  FAILED", line)
sys.exit(1 if failed else 0)
