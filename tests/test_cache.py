"""The data cache (issue #28.5, #31): keyed by the source's content, its arrays checked on every read.

A file changed in place with its time restored, an array overwritten in the cache, an array of
another shape, a damaged ``meta.json``: each is found, logged, and the entry rebuilt from the file.
A file whose identity (size, times, inode, device) is the one recorded when it was hashed is not
hashed again; any other identity is, and a changed file's stale entry is never used.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from numpy.testing import assert_array_equal

from mlptrain.config.schema import DataConfig, DatasetName
from mlptrain.data import load_dataset
from mlptrain.data.files import cache


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


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The files the cache hashes, in order (the SHA-256 is still taken)."""
    seen: list[Path] = []
    real = cache.sha256_file
    monkeypatch.setattr(cache, "sha256_file", lambda p: seen.append(Path(p)) or real(p))
    return seen


@pytest.mark.parametrize("racy_ns", [0, cache.RACY_NS])  # 0: the identity alone must find it (ctime)
def test_a_file_changed_in_place_with_its_time_restored_is_parsed_again(
    tmp_path: Path, cache_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, racy_ns: int
) -> None:
    monkeypatch.setattr(cache, "RACY_NS", racy_ns)
    path, x, labels = source(tmp_path)
    first, _ = cache.read_cached(path, "label")
    st = path.stat()
    flipped = ["dog" if v == "cat" else "cat" for v in labels]  # the same size, the same time
    write(path, x, flipped)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    with caplog.at_level(logging.INFO, logger="mlptrain.data.files.cache"):
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


def test_an_unchanged_file_is_not_hashed_again(
    tmp_path: Path, hashes: list[Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cache, "RACY_NS", 0)  # the file was written a moment ago (see the racy test below)
    path, x, labels = source(tmp_path)
    first, _ = cache.read_cached(path, "label")
    assert hashes == [path]
    with caplog.at_level(logging.INFO, logger="mlptrain.data.files.cache"):
        second, _ = cache.read_cached(path, "label")
    assert hashes == [path], "the recorded identity holds: the file is not read"
    assert "its SHA-256 is not taken again" in caplog.text, caplog.text
    assert isinstance(second.x, np.memmap) and second.y.tolist() == labels
    assert_array_equal(second.x, x)


def test_a_file_hashed_just_after_it_was_written_is_hashed_again(
    tmp_path: Path, hashes: list[Path], caplog: pytest.LogCaptureFixture
) -> None:
    """A write in the same clock tick as the hash would leave the recorded times: such an entry is not
    trusted until the file is older than RACY_NS at a look-up (git's "racily clean" entries)."""
    path, _, labels = source(tmp_path)
    cache.read_cached(path, "label")
    with caplog.at_level(logging.INFO, logger="mlptrain.data.files.cache"):
        table, _ = cache.read_cached(path, "label")
    assert hashes == [path, path] and table.y.tolist() == labels
    assert "changed within" in caplog.text and "the bytes that were cached" in caplog.text, caplog.text


def test_a_touched_file_is_hashed_once_and_then_trusted(
    tmp_path: Path, hashes: list[Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cache, "RACY_NS", 0)
    path, _, labels = source(tmp_path)
    cache.read_cached(path, "label")
    os.utime(path, ns=(10**18, 10**18))  # another time, the same bytes
    with caplog.at_level(logging.INFO, logger="mlptrain.data.files.cache"):
        cache.read_cached(path, "label")
    assert "mtime_ns and ctime_ns differ" in caplog.text and "the bytes that were cached" in caplog.text, caplog.text
    assert "rebuilt" not in caplog.text and "written" not in caplog.text, "the entry is kept, its identity updated"
    assert hashes == [path, path]
    table, _ = cache.read_cached(path, "label")  # the new identity was recorded
    assert hashes == [path, path] and table.y.tolist() == labels


@pytest.mark.parametrize("change", ["another size", "the same size", "the same size and time", "replaced"])
def test_a_file_rewritten_is_hashed_and_its_stale_entry_not_used(
    tmp_path: Path, hashes: list[Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, change: str
) -> None:
    monkeypatch.setattr(cache, "RACY_NS", 0)  # the identity alone must tell (the racy rule would hide a miss)
    path, x, labels = source(tmp_path)
    cache.read_cached(path, "label")
    st = path.stat()
    flipped = ["dog" if v == "cat" else "cat" for v in labels]  # the same bytes in number
    if change == "another size":
        write(path, x, ["bird" if v == "cat" else v for v in labels])
    elif change == "replaced":  # a new file renamed over the old: a new inode, its size and times the old ones
        write(tmp_path / "new.csv", x, flipped)
        os.utime(tmp_path / "new.csv", ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(tmp_path / "new.csv", path)
    else:
        write(path, x, flipped)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - (0 if change == "the same size and time" else 10**9)))
    now = path.stat()
    assert (now.st_size == st.st_size) == (change != "another size")
    assert (now.st_mtime_ns == st.st_mtime_ns) == (change in ("the same size and time", "replaced"))
    with caplog.at_level(logging.INFO, logger="mlptrain.data.files.cache"):
        table, _ = cache.read_cached(path, "label")
    assert hashes == [path, path]  # the first entry; the look-up, whose hash the rebuilt entry records
    assert "changed since it was cached" in caplog.text and "rebuilt" in caplog.text, caplog.text
    assert table.y.tolist() == ([v.replace("cat", "bird") for v in labels] if change == "another size" else flipped)
    assert_array_equal(table.x, x)
    again, _ = cache.read_cached(path, "label")  # the rebuilt entry records the new identity
    assert again.y.tolist() == table.y.tolist() and len(hashes) == 2


def flip_byte(file: Path, at: int) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= 0x10
    file.write_bytes(bytes(data))


DAMAGES = [
    "values",
    "shape",
    "labels",
    "meta",
    "missing file",
    "missing x",
    "truncated x",
    "truncated y",
    "flipped data byte",
    "flipped header byte",
    "another entry's x",
]


@pytest.mark.parametrize("damage", DAMAGES)
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
    elif damage == "missing file":
        (folder / "train_y.npy").unlink()
    elif damage == "missing x":
        (folder / "train_x.npy").unlink()
    elif damage.startswith("truncated"):
        file = folder / f"train_{damage[-1]}.npy"
        os.truncate(file, file.stat().st_size - 9)
    elif damage == "flipped data byte":  # one bit of one value, in the middle of the array's bytes
        file = folder / "train_x.npy"
        flip_byte(file, file.stat().st_size - x.nbytes // 2)
    elif damage == "flipped header byte":  # the .npy header's shape: (60, 3) read as (60, 7)
        file = folder / "train_x.npy"
        data = file.read_bytes()
        flip_byte(file, data.index(b"(60, 3)") + 5)
    else:  # a whole entry of another file in its place: its arrays' checksums are the other file's
        other = write(tmp_path / "other.csv", x * 2, labels)
        cache.read_cached(other, "label")
        (other_folder,) = [p for p in (cache_dir / "tables").iterdir() if p.is_dir() and p != folder]
        shutil.copy(other_folder / "train_x.npy", folder / "train_x.npy")
    with caplog.at_level(logging.INFO, logger="mlptrain.data.files.cache"):
        table, _ = cache.read_cached(path, "label")
    assert_array_equal(table.x, x)
    assert table.y.tolist() == labels
    assert "is damaged" in caplog.text and "rebuilt" in caplog.text, caplog.text
    assert json.loads((folder / "meta.json").read_text())["version"] == cache.VERSION


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
