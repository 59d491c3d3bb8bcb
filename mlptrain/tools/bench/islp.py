"""The tables of "An Introduction to Statistical Learning" for ``benchmarks/bench_tables.py --suite islp``: the
CSVs the ``ISLP`` package ships (``ISLP/data/*.csv``), each with the target and the columns a textbook user
leaves out, as :class:`~mlptrain.tools.bench.tables.Table` s split 75/25 as the other tables are.

The files are read from the installed package (``pip install --no-deps ISLP==0.6.0``: the wheel holds the
CSVs; its dependencies are not needed to read them) or from a folder given with ``--islp-data``. What each
table trains (the choices follow the book's labs):

* classification: Default (``default``, 3.3% positives), Caravan (``Purchase``, 6.0% positives, 85 numeric
  columns), Smarket and Weekly (``Direction``; ``Today`` is the return whose sign is the target: leakage),
  OJ (``Purchase``), College (``Private``);
* regression: Hitters (``Salary``; the 59 players without a salary are removed first, as the book does,
  leaving 263 rows), Carseats (``Sales``), Credit (``Balance``; ``ID`` dropped), Auto (``mpg``; the car's
  ``name`` dropped, an id), Wage (``wage``; ``logwage`` is its logarithm: leakage), Boston (``medv``),
  Bikeshare (``bikers``; ``casual`` and ``registered`` add up to it: leakage);
* ``*_empty``: Default, Hitters, Carseats and Credit with 10% of their feature cells emptied at random
  (the target cells kept), as the issue's variants of two tables hold.

Integer-coded categories (Auto's ``origin``, OJ's ``StoreID``, Bikeshare's ``hr``) stay numbers here: the
benchmark gives mlptrain only ``data.target``, ``data.drop`` and ``data.task``, and pandas reads them as
numbers for scikit-learn too.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd

from mlptrain.tools.bench.tables import Table, split

ISLP_PIN = "ISLP==0.6.0"


def data_folder(given: Path | None = None) -> Path:
    """The folder of the ISLP CSVs: ``given``, else the installed package's ``data`` folder.

    Raises:
        FileNotFoundError: neither holds ``Default.csv`` (the message says how to get the files).
    """
    if given is not None:
        if not (given / "Default.csv").is_file():
            raise FileNotFoundError(f"--islp-data {given}: no Default.csv there (the folder of ISLP's data/*.csv)")
        return given
    spec = importlib.util.find_spec("ISLP")  # found, not imported (ISLP's __init__ imports its dependencies)
    folder = Path(spec.origin).parent / "data" if spec is not None and spec.origin else None
    if folder is None or not (folder / "Default.csv").is_file():
        raise FileNotFoundError(
            f"the ISLP tables need the ISLP package's CSVs: pip install --no-deps {ISLP_PIN} "
            "(the wheel holds them; its dependencies are not needed), or --islp-data DIR (a folder of its data/*.csv)"
        )
    return folder


def read(folder: Path, name: str) -> pd.DataFrame:
    return pd.read_csv(folder / f"{name}.csv")


def emptied(frame: pd.DataFrame, target: str, share: float = 0.10, seed: int = 5) -> pd.DataFrame:
    """``frame`` with ``share`` of its feature cells (every column but ``target``) emptied at random."""
    rng = np.random.default_rng(seed)
    out = frame.copy()
    for c in out.columns:
        if c != target:
            gone = rng.random(len(out)) < share
            out[c] = out[c].astype(object if not pd.api.types.is_numeric_dtype(out[c]) else float)
            out.loc[gone, c] = np.nan
    return out


def table(
    folder: Path,
    name: str,
    target: str,
    task: str = "classification",
    drop: list[str] | None = None,
    what: str = "",
    empty: bool = False,
) -> Table:
    """ISLP's ``name``.csv as a :class:`Table` (``empty``: the ``<name>_empty`` variant, 10% of feature cells empty)."""
    frame = read(folder, name)
    if name == "Hitters":
        frame = frame[frame["Salary"].notna()].reset_index(drop=True)  # the book's 263 players with a salary
    if empty:
        frame = emptied(frame, target)
        what = f"{what}; 10% of the feature cells emptied"
    imbalanced = False
    if task == "classification":
        share = frame[target].value_counts(normalize=True).min()
        imbalanced = bool(share < 0.10)
        what = f"{share:.1%} positives; {what}" if imbalanced else what
    train, test = split(frame, target, task)
    label = f"{name}{'_empty' if empty else ''}"
    return Table(label, train, test, target, task, drop or [], imbalanced=imbalanced, what=what)


_SPECS: dict[str, dict] = {
    "Default": {"target": "default", "what": "text: student"},
    "Caravan": {"target": "Purchase", "what": "85 numeric columns (integer codes)"},
    "Smarket": {"target": "Direction", "drop": ["Today"], "what": "Today (the return) is leakage"},
    "Weekly": {"target": "Direction", "drop": ["Today"], "what": "Today (the return) is leakage"},
    "OJ": {"target": "Purchase", "what": "text: Store7; StoreID integer codes"},
    "College": {"target": "Private", "what": "17 numeric columns in mixed units"},
    "Hitters": {"target": "Salary", "task": "regression", "what": "text: League, Division, NewLeague"},
    "Carseats": {"target": "Sales", "task": "regression", "what": "text: ShelveLoc, Urban, US"},
    "Credit": {"target": "Balance", "task": "regression", "drop": ["ID"], "what": "text: 4 columns; an id"},
    "Auto": {"target": "mpg", "task": "regression", "drop": ["name"], "what": "the car's name (an id)"},
    "Wage": {"target": "wage", "task": "regression", "drop": ["logwage"], "what": "text: 7 columns; leakage"},
    "Boston": {"target": "medv", "task": "regression", "what": "12 numeric columns"},
    "Bikeshare": {
        "target": "bikers",
        "task": "regression",
        "drop": ["casual", "registered"],
        "what": "text: mnth, weathersit; casual + registered = bikers (leakage)",
    },
}
_EMPTY = ["Default", "Hitters", "Carseats", "Credit"]


def islp_tables(folder: Path) -> dict[str, Callable[[], Table]]:
    """``{name: make the table}`` for every ISLP table of the benchmark, reading from ``folder``."""
    out: dict[str, Callable[[], Table]] = {n: partial(table, folder, n, **spec) for n, spec in _SPECS.items()}
    out.update({f"{n}_empty": partial(table, folder, n, **_SPECS[n], empty=True) for n in _EMPTY})
    return out


NAMES = [*_SPECS, *(f"{n}_empty" for n in _EMPTY)]
