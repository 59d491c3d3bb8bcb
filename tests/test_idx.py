"""Tests of mlptrain.data's IDX files: the format (read_idx, write_idx) and the verifying downloader of MNIST and
Fashion-MNIST."""

from __future__ import annotations

import gzip
import hashlib
from pathlib import Path

import numpy as np
import pytest
from numpy.testing import assert_array_equal

from mlptrain import data
from mlptrain.base.errors import DatasetError
from mlptrain.config.schema import DataConfig
from mlptrain.data import FileSpec, load_dataset, read_idx, write_idx

# ---------------------------------------------------------------------------------------------- IDX


@pytest.mark.parametrize("suffix", [".gz", ""])
@pytest.mark.parametrize(
    "array",
    [
        np.random.default_rng(0).integers(0, 256, size=(5, 28, 28), dtype=np.uint8),
        np.arange(10, dtype=np.uint8),
        np.arange(-6, 6, dtype=np.int32).reshape(3, 4),
        np.linspace(-1, 1, 7, dtype=np.float32),
        np.linspace(-1, 1, 6, dtype=np.float64).reshape(2, 3),
    ],
    ids=["u8-3d", "u8-1d", "i32-2d", "f32-1d", "f64-2d"],
)
def test_idx_round_trip(tmp_path: Path, array: np.ndarray, suffix: str) -> None:
    path = tmp_path / f"a.idx{suffix}"
    write_idx(path, array)
    back = read_idx(path)
    assert back.dtype == array.dtype and back.shape == array.shape and back.flags.writeable
    assert_array_equal(back, array)


def test_idx_header_is_big_endian_mnist_layout(tmp_path: Path) -> None:
    write_idx(tmp_path / "i", np.zeros((2, 28, 28), np.uint8))
    write_idx(tmp_path / "l", np.zeros(2, np.uint8))
    images, labels = (tmp_path / "i").read_bytes(), (tmp_path / "l").read_bytes()
    assert images[:16] == bytes.fromhex("00000803 00000002 0000001c 0000001c")
    assert labels[:8] == bytes.fromhex("00000801 00000002")
    assert len(images) == 16 + 2 * 784


def test_idx_truncated_payload_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "t.idx.gz"
    with gzip.open(path, "wb") as f:
        f.write(bytes.fromhex("00000803 00000002 00000003 00000003") + bytes(17))  # header implies 18 bytes
    with pytest.raises(DatasetError, match="17-byte payload.*implies 18 bytes"):
        read_idx(path)


def test_idx_cut_gzip_stream_and_bad_magic_are_rejected(tmp_path: Path) -> None:
    path = tmp_path / "c.idx.gz"
    write_idx(path, np.random.default_rng(0).integers(0, 256, size=(20, 28, 28), dtype=np.uint8))
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(DatasetError, match=r"c\.idx\.gz cannot be read"):
        read_idx(path)
    (tmp_path / "m").write_bytes(b"\x01\x02\x08\x01" + bytes(8))
    with pytest.raises(DatasetError, match="magic"):
        read_idx(tmp_path / "m")


def test_write_idx_rejects_unsupported_dtype(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="int64"):
        write_idx(tmp_path / "x", np.arange(3, dtype=np.int64))


# ------------------------------------------------------------------------------- MNIST downloader


def _fixture_files(folder: Path, n_train: int = 60, n_test: int = 20, label_max: int = 9) -> dict:
    """Write tiny MNIST-shaped IDX gz files into ``folder``; return their arrays and a checksum table."""
    rng = np.random.default_rng(1)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {
        data.IDX_FILES[0]: rng.integers(0, 256, size=(n_train, 28, 28), dtype=np.uint8),
        data.IDX_FILES[1]: (np.arange(n_train) % (label_max + 1)).astype(np.uint8),
        data.IDX_FILES[2]: rng.integers(0, 256, size=(n_test, 28, 28), dtype=np.uint8),
        data.IDX_FILES[3]: (np.arange(n_test) % (label_max + 1)).astype(np.uint8),
    }
    table = {}
    for file, a in arrays.items():
        write_idx(folder / file, a)
        blob = (folder / file).read_bytes()
        table[file] = FileSpec(len(blob), hashlib.sha256(blob).hexdigest())
    return {"arrays": arrays, "table": table}


@pytest.fixture
def mirror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """A file:// mirror of fixture files behind a dead one, with its checksums pinned, for both IDX datasets."""
    fx = _fixture_files(tmp_path / "mirror")
    for name in ("mnist", "fashion_mnist"):
        monkeypatch.setitem(data.CHECKSUMS, name, dict(fx["table"]))
        dead = (tmp_path / "nowhere").as_uri() + "/"
        monkeypatch.setitem(data.MIRRORS, name, [dead, (tmp_path / "mirror").as_uri() + "/"])
        monkeypatch.delenv(f"MLPTRAIN_{name.upper()}_MIRROR", raising=False)
    fx["root"] = tmp_path / "cache"
    return fx


@pytest.mark.parametrize("name", ["mnist", "fashion_mnist"])
def test_idx_dataset_downloads_verifies_caches_and_loads(mirror: dict, name: str) -> None:
    cfg = DataConfig(name=name, root=str(mirror["root"]), normalize="none", val_fraction=0.1)
    ds = load_dataset(cfg, seed=0)
    folder = mirror["root"] / name
    assert sorted(p.name for p in folder.iterdir()) == sorted(data.IDX_FILES)  # no .part left behind
    for file in data.IDX_FILES:
        assert (folder / file).read_bytes() == (mirror["root"].parent / "mirror" / file).read_bytes()
    assert ds.x_train.shape == (54, 784) and ds.x_val.shape == (6, 784) and ds.x_test.shape == (20, 784)
    assert ds.num_classes == 10 and len(ds.class_names or []) == 10
    assert (ds.class_names or [""])[0] == ("0" if name == "mnist" else "T-shirt/top")
    assert_array_equal(ds.x_test, mirror["arrays"][data.IDX_FILES[2]].reshape(20, 784))  # official order kept
    assert_array_equal(ds.y_test, mirror["arrays"][data.IDX_FILES[3]])
    # The second load reads the cache: it works with every mirror gone.
    data.MIRRORS[name] = []
    again = load_dataset(cfg, seed=0)
    assert_array_equal(again.x_train, ds.x_train)


def test_env_mirror_is_tried_first(mirror: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    data.MIRRORS["mnist"] = ["http://127.0.0.1:9/never-used/"]  # would fail if reached
    monkeypatch.setenv("MLPTRAIN_MNIST_MIRROR", (mirror["root"].parent / "mirror").as_uri())
    ds = load_dataset(DataConfig(name="mnist", root=str(mirror["root"])), seed=0)
    assert ds.num_features == 784


def test_download_with_wrong_checksum_is_not_cached(mirror: dict) -> None:
    bad = FileSpec(mirror["table"][data.IDX_FILES[0]].size, "ab" * 32)
    data.CHECKSUMS["mnist"][data.IDX_FILES[0]] = bad
    with pytest.raises(DatasetError) as err:
        load_dataset(DataConfig(name="mnist", root=str(mirror["root"])), seed=0)
    msg = str(err.value)
    assert data.IDX_FILES[0] in msg and bad.sha256 in msg and mirror["table"][data.IDX_FILES[0]].sha256 in msg
    folder = mirror["root"] / "mnist"
    assert not (folder / data.IDX_FILES[0]).exists()
    assert not list(folder.glob("*.part"))


def test_download_of_the_wrong_size_is_rejected(mirror: dict) -> None:
    good = mirror["table"][data.IDX_FILES[1]]
    data.CHECKSUMS["mnist"][data.IDX_FILES[1]] = FileSpec(good.size - 5, good.sha256)  # the mirror sends 5 too many
    with pytest.raises(DatasetError, match=rf"{data.IDX_FILES[1]}.*expected {good.size - 5}"):
        load_dataset(DataConfig(name="mnist", root=str(mirror["root"])), seed=0)
    assert not (mirror["root"] / "mnist" / data.IDX_FILES[1]).exists()


def test_corrupt_cached_file_is_reported_not_deleted(mirror: dict) -> None:
    folder = mirror["root"] / "mnist"
    load_dataset(DataConfig(name="mnist", root=str(mirror["root"])), seed=0)
    victim = folder / data.IDX_FILES[2]
    victim.write_bytes(victim.read_bytes()[:-10])  # truncated
    with pytest.raises(DatasetError, match="delete it") as err:
        load_dataset(DataConfig(name="mnist", root=str(mirror["root"])), seed=0)
    assert str(victim) in str(err.value) and mirror["table"][data.IDX_FILES[2]].sha256 in str(err.value)
    assert victim.exists()


def test_out_of_range_label_is_rejected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fx = _fixture_files(tmp_path / "cache" / "mnist", label_max=10)  # placed by hand: label 10 appears
    monkeypatch.setitem(data.CHECKSUMS, "mnist", fx["table"])
    with pytest.raises(DatasetError, match=r"labels of dtype int64 in \[0, 10\]; expected integers in \[0, 10\)"):
        load_dataset(DataConfig(name="mnist", root=str(tmp_path / "cache"), download=False), seed=0)


def test_no_download_and_empty_cache_names_files_and_folder(tmp_path: Path) -> None:
    cfg = DataConfig(name="mnist", root=str(tmp_path), download=False)
    with pytest.raises(DatasetError, match="download=false") as err:
        load_dataset(cfg, seed=0)
    msg = str(err.value)
    assert str(tmp_path / "mnist") in msg
    for file, spec in data.CHECKSUMS["mnist"].items():
        assert file in msg and spec.sha256 in msg
    assert not (tmp_path / "mnist").exists()


def test_every_mirror_failing_names_files_and_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(data.MIRRORS, "fashion_mnist", [(tmp_path / "nowhere").as_uri()])
    monkeypatch.delenv("MLPTRAIN_FASHION_MNIST_MIRROR", raising=False)
    with pytest.raises(DatasetError, match="could not download") as err:
        load_dataset(DataConfig(name="fashion_mnist", root=str(tmp_path / "c")), seed=0)
    msg = str(err.value)
    assert str(tmp_path / "c" / "fashion_mnist") in msg and "nowhere" in msg
    for file, spec in data.CHECKSUMS["fashion_mnist"].items():
        assert file in msg and spec.sha256 in msg
