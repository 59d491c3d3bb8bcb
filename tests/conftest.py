"""Shared test set-up: GPU tests are collected everywhere and skipped without a GPU; Ctrl-C is Python's default.

Started with SIGINT ignored (``nohup``, ``make test &`` from a script), Python leaves it ignored, and the
processes the tests start inherit that: the tests of Ctrl-C then see nothing. Every test starts with
Python's own handler, which the tests' subprocesses get as the default disposition.
"""

import signal
import sys
from pathlib import Path

import pytest

from mlptrain.base.backend import probe_gpu

# tests/gpu/ imports the helpers that live here
sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_collection_modifyitems(config, items):
    available, reason = probe_gpu()
    if available:
        return
    skip = pytest.mark.skip(reason=f"needs an NVIDIA GPU: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def default_ctrl_c():
    """Python's default SIGINT handler (KeyboardInterrupt) for the test, whatever the test run was started with."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)
