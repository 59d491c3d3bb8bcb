"""Whatever the bytes, one error: random damage to a checkpoint, a hand-edited meta, files that are not checkpoints
(each a CheckpointError naming the file), and version 1 checkpoints still read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_checkpoint import _arrays, _meta, _write_raw

from mlptrain.base.errors import CheckpointError
from mlptrain.run import checkpoint


def test_random_damage_to_a_checkpoint_is_always_a_checkpoint_error(tmp_path: Path) -> None:
    """600 mutations of a real checkpoint (flipped, overwritten, inserted, cut bytes): every load either
    returns the intact checkpoint or raises CheckpointError naming the file; never another exception."""
    good = tmp_path / "good.npz"
    arrays = _arrays()
    checkpoint.save(good, arrays, _meta())
    blob = good.read_bytes()
    rng = np.random.default_rng(0)
    path = tmp_path / "bad.npz"
    outcomes = {"refused": 0, "intact": 0}
    for _ in range(600):
        b = bytearray(blob)
        kind = rng.integers(4)
        i = int(rng.integers(len(b)))
        if kind == 0:
            b[i] ^= 1 << int(rng.integers(8))
        elif kind == 1:
            b[i : i + 8] = rng.bytes(8)
        elif kind == 2:
            b[i:i] = rng.bytes(int(rng.integers(1, 5)))
        else:
            del b[i:]
        path.write_bytes(bytes(b))
        try:
            ckpt = checkpoint.load(path)
        except CheckpointError as exc:
            assert str(path) in str(exc)
            outcomes["refused"] += 1
            continue
        assert all(np.array_equal(ckpt.arrays[k], v) for k, v in arrays.items())  # damage where it does not matter
        outcomes["intact"] += 1
    assert outcomes["refused"] > 500, outcomes


@pytest.mark.parametrize(
    ("edit", "phrase"),
    [
        (lambda m: m.update(extra=1), "unknown keys extra"),
        (lambda m: m.pop("rng"), "missing keys rng"),
        (lambda m: m.update(widths=["64", 10]), "meta.widths[0] is '64', expected a non-negative integer"),
        (lambda m: m["position"].update(step=-3), "meta.position.step is -3, expected a non-negative integer"),
        (lambda m: m["position"].update(step=8), "does not fit 10 batches per epoch"),
        (lambda m: m.update(scaler={"scale": "big"}), "meta.scaler has missing keys"),
        (lambda m: m.update(metrics_records=1.5), "meta.metrics_records is 1.5"),
    ],
    ids=["extra-key", "missing-key", "wrong-type", "negative-position", "inconsistent-position", "scaler", "float"],
)
def test_a_hand_edited_meta_is_refused(tmp_path: Path, edit: Any, phrase: str) -> None:
    path = tmp_path / "last.npz"
    checkpoint.save(path, _arrays(), _meta())
    ckpt = checkpoint.load(path)
    meta = json.loads(json.dumps(ckpt.meta))
    edit(meta)
    _write_raw(path, ckpt.arrays, meta)  # edited by hand: the SHA-256 no longer matches
    with pytest.raises(CheckpointError, match=f"checkpoint {path} is corrupt: its arrays and meta have SHA-256"):
        checkpoint.load(path)
    meta["sha256"] = checkpoint.digest(ckpt.arrays, meta)  # edited with care: the schema still says no
    _write_raw(path, ckpt.arrays, meta)
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(path)
    assert f"checkpoint {path} has a damaged meta: " in str(err.value) and phrase in str(err.value)


@pytest.mark.parametrize("kind", ["npy", "bytes meta", "2-d meta", "directory", "device"])
def test_files_that_are_not_checkpoints_are_refused(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "x.npz"
    if kind == "npy":
        with path.open("wb") as f:
            np.save(f, np.zeros(3))
    elif kind == "bytes meta":
        with path.open("wb") as f:
            np.savez(f, **_arrays(), meta=np.array(b'{"format": "mlptrain-checkpoint"}'))
    elif kind == "2-d meta":
        with path.open("wb") as f:
            np.savez(f, **_arrays(), meta=np.zeros((2, 2), np.uint8))
    elif kind == "directory":
        path.mkdir()
    else:
        path = Path("/dev/zero")
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(path)
    assert str(path) in str(err.value)


def test_version_1_checkpoints_are_still_read(tmp_path: Path) -> None:
    """Format 1: the SHA-256 covered the arrays alone."""
    path = tmp_path / "v1.npz"
    arrays = _arrays()
    meta = {**_meta(), "format": checkpoint.FORMAT, "format_version": 1, "mlptrain": "0.1.0"}
    del meta["data"], meta["best"]["mode"]  # what version 1 did not record
    meta["sha256"] = checkpoint.digest(arrays)
    _write_raw(path, arrays, meta)
    assert checkpoint.load(path).position.step == 7
