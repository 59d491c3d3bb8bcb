"""The data cache (issue #28.5): keyed by the source's content, its arrays checked on every read.

A file changed in place with its time restored, an array overwritten in the cache, an array of
another shape, a damaged ``meta.json``: each is found, logged, and the entry rebuilt from the file.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
from numpy.testing import assert_array_equal

from mlptrain.config import DataConfig, DatasetName
from mlptrain.data import cache, load_dataset


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MLPTRAIN_DATA", str(tmp_path / "cache"))
    return tmp_path / "cache"


def write(path: Path, x: np.ndarray, labels: list[str]) -> Path:
    lines = [",".join([*(f"f{j}" for j in range(x.shape[1])), "label"])]
    lines += [",".join([*(repr(v) for v in row), label]) for row, label in zip(x.tolist(), labels, strict=True)]
    path.write_text("\n".join(lines) + "\n")
    return path


def source(tmp_path: Path, n: int = 60, features: int = 3) -> tuple[Path, np.ndarray, list[str]]:
    x = np.random.default_rng(0).standard_normal((n, features))
    labels = ["cat" if i % 3 else "dog" for i in range(n)]
    return write(tmp_path / "d.csv", x, labels), x, labels


def entry(cache_dir: Path) -> Path:
    (folder,) = [p for p in (cache_dir / "tables").iterdir() if p.is_dir()]
    return folder


def test_a_file_changed_in_place_with_its_time_restored_is_parsed_again(
    tmp_path: Path, cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path, x, labels = source(tmp_path)
    first, _ = cache.read_cached(path, "label")
    st = path.stat()
    flipped = ["dog" if v == "cat" else "cat" for v in labels]  # the same size, the same time
    write(path, x, flipped)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    with caplog.at_level(logging.INFO, logger="mlptrain.data.cache"):
        second, _ = cache.read_cached(path, "label")
    assert second.y.tolist() == flipped
    assert "changed since it was cached" in caplog.text and "rebuilt" in caplog.text, caplog.text
    third, _ = cache.read_cached(path, "label")  # the rebuilt entry serves the next read
    assert isinstance(third.x, np.memmap) and third.y.tolist() == flipped


def test_labels_flipped_in_place_train_on_the_new_labels(tmp_path: Path) -> None:
    path, x, labels = source(tmp_path)
    cfg = DataConfig(name=DatasetName.file, path=str(path))
    before = load_dataset(cfg)
    st = path.stat()
    write(path, x, ["dog" if v == "cat" else "cat" for v in labels])
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after, parsed = load_dataset(cfg), load_dataset(DataConfig(name=DatasetName.file, path=str(path), cache=False))
    assert_array_equal(after.y_train, parsed.y_train)
    assert_array_equal(after.x_train, parsed.x_train)
    assert not np.array_equal(after.y_test, before.y_test) or not np.array_equal(after.x_test, before.x_test)


@pytest.mark.parametrize("damage", ["values", "shape", "labels", "meta", "missing file"])
def test_a_damaged_entry_is_found_logged_and_rebuilt(
    tmp_path: Path, cache_dir: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    path, x, labels = source(tmp_path)
    cache.read_cached(path, "label")
    folder = entry(cache_dir)
    if damage == "values":  # overwritten in place: same shape, same dtype
        cached = np.load(folder / "train_x.npy", mmap_mode="r+")
        cached[5, 1] = 1234.5
        cached.flush()
        del cached
    elif damage == "shape":  # another file's x: 5 columns for a 3-column file
        np.save(folder / "train_x.npy", np.zeros((60, 5)))
    elif damage == "labels":
        y = np.load(folder / "train_y.npy")
        np.save(folder / "train_y.npy", y[::-1].copy())
    elif damage == "meta":
        (folder / "meta.json").write_text("{not json")
    else:
        (folder / "train_y.npy").unlink()
    with caplog.at_level(logging.INFO, logger="mlptrain.data.cache"):
        table, _ = cache.read_cached(path, "label")
    assert_array_equal(table.x, x)
    assert table.y.tolist() == labels
    assert "is damaged" in caplog.text and "rebuilt" in caplog.text, caplog.text
    assert json.loads((entry(cache_dir) / "meta.json").read_text())["version"] == cache.VERSION


def test_a_cached_x_of_another_shape_does_not_build_another_model(tmp_path: Path, cache_dir: Path) -> None:
    path, _, _ = source(tmp_path)
    cfg = DataConfig(name=DatasetName.file, path=str(path))
    assert load_dataset(cfg).num_features == 3
    np.save(entry(cache_dir) / "train_x.npy", np.zeros((60, 5)))
    assert load_dataset(cfg).num_features == 3


def test_the_checksum_sees_one_changed_word_and_a_swap() -> None:
    a = np.random.default_rng(1).standard_normal((1000, 37))  # 37: bytes that are not whole blocks
    base = cache.checksum(a)
    assert cache.checksum(a.copy()) == base
    changed = a.copy()
    changed[999, 36] = np.nextafter(changed[999, 36], np.inf)  # the last word, one bit
    swapped = a.copy()
    swapped[[3, 700]] = swapped[[700, 3]]
    text = np.array(["cat", "dog", "emu"])
    assert len({base, cache.checksum(changed), cache.checksum(swapped), cache.checksum(a[:-1])}) == 4
    assert cache.checksum(text) != cache.checksum(text[::-1].copy())
    assert cache.checksum(np.zeros(3, np.uint8)) != cache.checksum(np.zeros(4, np.uint8))  # the length counts
