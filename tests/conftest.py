"""Shared test set-up: GPU tests are collected everywhere and skipped without a GPU."""

import sys
from pathlib import Path

import pytest

from mlptrain.backend import probe_gpu

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
