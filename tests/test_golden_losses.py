"""The per-step training losses of four CPU configurations, bit for bit as recorded (tests/data/golden_losses.json).

A move of modules, a merge of two copies of a concept, or any other change that should not change
the arithmetic must leave these exactly as they were: fused and naive execution in fp32 (on the CPU the
same BLAS calls: the same bits), fp8 emulated on the CPU, a GELU model, and a run interrupted after its
first epoch and resumed. The values are the
``train/loss`` of every ``kind: step`` record in ``metrics.jsonl``, kept as ``float.hex`` strings.

They are bits of this machine's arithmetic: OpenBLAS picks its kernels by the processor, and NumPy's
reductions may change between releases. The file records both; where they differ the test is
skipped, saying so. After a change that is meant to change the arithmetic (or on a new machine),
record them again, and say why in the commit:

    python -m tests.test_golden_losses --record     # from the repository's root
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlptrain.base.errors import TrainingInterrupted
from mlptrain.config.schema import Mode
from mlptrain.run.metrics import read_metrics
from mlptrain.run.run import train
from mlptrain.step.trainer import Trainer
from tests.helpers import make_cfg

GOLDEN = Path(__file__).resolve().parent / "data" / "golden_losses.json"
CONFIGS: dict[str, dict[str, Any]] = {
    "fused-fp32": {},
    "naive-fp32": {"execution__mode": Mode.naive},
    "fused-fp8": {"precision__name": "fp8"},
    "gelu": {"model__activation": "gelu"},
}
EPOCHS = 2  # 21 steps an epoch (digits, batch 64): 42 losses a configuration


def environment() -> dict[str, str]:
    """What the bits depend on besides mlptrain: NumPy's release and the BLAS kernels NumPy's own OpenBLAS
    chose for this CPU (libraries other packages load, torch's OpenMP or MKL, do not count)."""
    from threadpoolctl import threadpool_info

    mine = [i for i in threadpool_info() if i["user_api"] == "blas" and "numpy" in i["filepath"]]
    blas = [f"{i['internal_api']} {i['version']} {i.get('architecture')}" for i in mine]
    return {"numpy": np.__version__, "blas": "; ".join(sorted(blas))}


@contextlib.contextmanager
def interrupted_after(step: int) -> Iterator[None]:
    """A real SIGINT to this process once the trainer has taken ``step`` steps (the run saves and stops)."""
    original = Trainer.step

    def step_then_sigint(self: Trainer, x: Any, y: Any) -> Any:
        out = original(self, x, y)
        if self.step_count == step:
            signal.raise_signal(signal.SIGINT)
        return out

    Trainer.step = step_then_sigint  # type: ignore[method-assign]
    try:
        yield
    finally:
        Trainer.step = original  # type: ignore[method-assign]


def step_losses(run_dir: Path) -> list[str]:
    return [float(r["train/loss"]).hex() for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "step"]


def run(name: str, root: Path) -> list[str]:
    """Train configuration ``name`` in ``root/name`` and return its per-step losses."""
    out = root / name
    if name == "resumed":  # Ctrl-C after step 30 (mid-epoch), then resumed: its metrics.jsonl is the whole run's
        with interrupted_after(30), contextlib.suppress(TrainingInterrupted):
            train(make_cfg(epochs=EPOCHS), out)
        train(make_cfg(epochs=EPOCHS, resume="last"), out)
    else:
        train(make_cfg(epochs=EPOCHS, **CONFIGS[name]), out)
    return step_losses(out)


NAMES = [*CONFIGS, "resumed"]


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    data = json.loads(GOLDEN.read_text())
    if data["environment"] != environment():
        pytest.skip(f"recorded on {data['environment']}, this is {environment()}: record again (module docstring)")
    return data


@pytest.mark.parametrize("name", NAMES)
def test_per_step_losses_are_bit_for_bit_as_recorded(name: str, golden: dict[str, Any], tmp_path: Path) -> None:
    want = golden["losses"][name]
    got = run(name, tmp_path)
    assert len(got) == len(want) == 21 * EPOCHS
    first = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
    assert first is None, (
        f"{name}: step {first} loss {float.fromhex(got[first])!r}, recorded {float.fromhex(want[first])!r}"
    )


def test_the_recorded_configurations_agree_and_differ_where_they_should(golden: dict[str, Any]) -> None:
    """Resume is exact, and on the CPU fused and naive execution issue the same BLAS calls: both record the
    fused fp32 losses. fp8 and GELU each exercise arithmetic of their own: their losses differ."""
    losses = golden["losses"]
    assert losses["resumed"] == losses["fused-fp32"] == losses["naive-fp32"]
    assert len({tuple(losses[n]) for n in ("fused-fp32", "fused-fp8", "gelu")}) == 3


def record() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        losses = {name: run(name, Path(tmp)) for name in NAMES}
    GOLDEN.write_text(json.dumps({"environment": environment(), "losses": losses}, indent=1) + "\n")
    print(f"wrote {GOLDEN}: {', '.join(f'{n} {len(v)} steps' for n, v in losses.items())}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help="train each configuration and write the file")
    if not parser.parse_args().record:
        parser.error("nothing to do: --record writes tests/data/golden_losses.json")
    record()
