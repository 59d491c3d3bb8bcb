"""The commands' names after the move (issue #48): ``python -m mlptrain.<command>`` and ``python -m mlptrain
<command>`` run the same module, and ``mlptrain.<command>`` is the module of its new folder, not a copy."""

from __future__ import annotations

import importlib
import subprocess
import sys
import types
from pathlib import Path

import pytest

import mlptrain

REPO = Path(__file__).resolve().parent.parent
NEW_HOMES = {
    "predict": "mlptrain.cli.predict",
    "evaluate": "mlptrain.cli.evaluate",
    "export": "mlptrain.cli.export",
    "plot": "mlptrain.cli.plot",
    "compare": "mlptrain.tools.compare",
    "bench": "mlptrain.tools.bench",
}


@pytest.mark.parametrize("old", sorted(set(NEW_HOMES) - {"predict"}))  # predict: the function (below)
def test_an_old_name_is_the_module_of_its_new_folder(old: str) -> None:
    assert importlib.import_module(f"mlptrain.{old}") is importlib.import_module(NEW_HOMES[old])


def test_a_submodule_of_an_old_name_is_the_same_module_and_its_classes_the_same_classes() -> None:
    assert importlib.import_module("mlptrain.compare.runs") is importlib.import_module("mlptrain.tools.compare.runs")
    from mlptrain.compare import CompareError
    from mlptrain.tools.compare import CompareError as same

    assert CompareError is same


def test_mlptrain_predict_is_a_plain_function_and_python_m_mlptrain_predict_the_command() -> None:
    """No module swapped into a callable class: ``mlptrain.predict`` is a function of the package; the command
    is ``mlptrain.cli.predict``, which ``python -m mlptrain.predict`` runs (the help test below)."""
    assert isinstance(mlptrain.predict, types.FunctionType) and mlptrain.predict.__module__ == "mlptrain"
    assert type(importlib.import_module("mlptrain.cli.predict")) is types.ModuleType
    with pytest.raises(ModuleNotFoundError):  # as a module it would replace the function
        importlib.import_module("mlptrain.predict")
    assert isinstance(mlptrain.predict, types.FunctionType)
    assert mlptrain.compare is importlib.import_module("mlptrain.tools.compare")


@pytest.mark.parametrize("command", ["predict", "evaluate", "export", "plot", "compare"])
def test_python_m_mlptrain_dot_command_and_python_m_mlptrain_command_print_the_same_help(command: str) -> None:
    runs = [
        subprocess.run([sys.executable, "-m", *args, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
        for args in ([f"mlptrain.{command}"], ["mlptrain", command])
    ]
    assert [r.returncode for r in runs] == [0, 0], [r.stderr for r in runs]
    assert runs[0].stdout == runs[1].stdout and len(runs[0].stdout) > 100
