"""The sources of data: digits (bundled), mnist1d (generated), MNIST and Fashion-MNIST (downloaded),
synthetic, and the user's own files (``data=file``).

Each source returns a :class:`Raw`: host arrays, with ``x_test`` None when the dataset has no test
split of its own (the caller then splits one off). :mod:`mlptrain.data.prepare` splits and
normalises.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import math
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np

from mlptrain.base.errors import ConfigError, DatasetError
from mlptrain.base.fs import cache_root
from mlptrain.config.schema import DataConfig
from mlptrain.data.dataset import Raw
from mlptrain.data.idx import IDX_FILES, ensure_idx_files, read_idx
from mlptrain.data.user_source import load_file

DIGITS_PATH = Path(__file__).resolve().parent / "digits.csv.gz"
DIGITS_SHA256 = "09f66e6debdee2cd2b5ae59e0d6abbb73fc2b0e0185d2e1957e9ebb51e23aa22"

DIGIT_NAMES = [str(d) for d in range(10)]
FASHION_NAMES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]

SYNTHETIC_SEPARATION = 4.0  # blob-centre spread; linear models reach ~80 %, an MLP ~93 % at 32 features


def _load_digits(cfg: DataConfig, rng: np.random.Generator) -> Raw:
    path = Path(DIGITS_PATH)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DatasetError(f"bundled digits file {path} cannot be read ({exc}); reinstall mlptrain") from exc
    digest = hashlib.sha256(raw).hexdigest()
    if digest != DIGITS_SHA256:
        raise DatasetError(
            f"bundled digits file {path} fails its checksum: SHA-256 {digest}, expected {DIGITS_SHA256}; "
            "reinstall mlptrain"
        )
    table = np.loadtxt(io.BytesIO(gzip.decompress(raw)), delimiter=",", dtype=np.float64, ndmin=2)  # (1797, 65)
    if table.shape != (1797, 65):
        raise DatasetError(f"bundled digits file {path} has shape {table.shape}; expected (1797, 65)")
    pixels = [f"pixel_{r}_{c}" for r in range(8) for c in range(8)]
    return Raw(table[:, :64], table[:, 64].astype(np.int64), None, None, 10, DIGIT_NAMES, feature_names=pixels)


# data.samples=null: the standard sizes. MNIST-1D's is the draw of mnist1d's get_dataset_args() (4,000
# training and 1,000 test samples); any other size is the same generator with the same seed (42), so
# every size is one fixed draw, but not a superset of the smaller ones (the digits are drawn in turn).
SYNTHETIC_SAMPLES = 10000
MNIST1D_SAMPLES = 5000

_MNIST1D_CACHE: dict[int, dict[str, np.ndarray]] = {}  # by the number of samples drawn


def mnist1d_samples_problem(samples: object) -> str | None:
    """Why ``data.samples`` cannot size an MNIST-1D draw, or None (null: the standard draw)."""
    if samples is None or (isinstance(samples, (int, np.integer)) and samples >= 10 and samples % 10 == 0):
        return None
    return (
        f"data.samples={samples} cannot size MNIST-1D: expected a positive multiple of 10 (mnist1d draws "
        f"data.samples/10 of each digit and keeps 80 % of the draw for training), or null for its standard "
        f"{MNIST1D_SAMPLES}"
    )


def _load_mnist1d(cfg: DataConfig, rng: np.random.Generator) -> Raw:
    if problem := mnist1d_samples_problem(cfg.samples):
        raise ConfigError(problem)
    n = MNIST1D_SAMPLES if cfg.samples is None else int(cfg.samples)
    if n not in _MNIST1D_CACHE:
        try:
            from mnist1d.data import get_dataset_args, make_dataset
        except ImportError as exc:
            raise DatasetError(
                f"dataset 'mnist1d' needs the optional package mnist1d ({exc}); "
                "pip install mnist1d, or pip install -e '.[datasets]'"
            ) from exc
        args = get_dataset_args()  # its own seed (42) and train_split (0.8) stay: the same draw on every call
        args.num_samples = n
        np_state, py_state = np.random.get_state(), random.getstate()
        try:  # make_dataset reseeds the global random and np.random; never get_dataset (it downloads)
            d = make_dataset(args)
        finally:
            np.random.set_state(np_state)
            random.setstate(py_state)
        arrays = {key: np.array(d[key]) for key in ("x", "y", "x_test", "y_test")}
        for a in arrays.values():
            a.setflags(write=False)
        _MNIST1D_CACHE[n] = arrays
    c = _MNIST1D_CACHE[n]
    return Raw(c["x"], c["y"].astype(np.int64), c["x_test"], c["y_test"].astype(np.int64), 10, DIGIT_NAMES)


def _load_idx_dataset(name: str, class_names: list[str]) -> Callable[[DataConfig, np.random.Generator], Raw]:
    def load(cfg: DataConfig, rng: np.random.Generator) -> Raw:
        folder = (Path(cfg.root).expanduser() if cfg.root else cache_root()) / name
        ensure_idx_files(name, folder, cfg.download)
        xtr, ytr, xte, yte = (read_idx(folder / f) for f in IDX_FILES)
        for file, x, y in ((IDX_FILES[0], xtr, ytr), (IDX_FILES[2], xte, yte)):
            if x.ndim != 3 or x.dtype != np.uint8 or y.ndim != 1 or len(x) != len(y):
                raise DatasetError(
                    f"dataset {name!r}: {folder / file} holds {x.dtype} {x.shape} for {y.shape} labels; "
                    "expected uint8 (N, H, W) images and N labels"
                )
        # uint8 (N, 28, 28) -> float32 (N, 784)
        flat = [x.reshape(len(x), -1).astype(np.float32) for x in (xtr, xte)]
        return Raw(flat[0], ytr.astype(np.int64), flat[1], yte.astype(np.int64), 10, class_names)

    return load


def _load_synthetic(cfg: DataConfig, rng: np.random.Generator) -> Raw:
    """Each class is a mixture of two Gaussian blobs, so the classes are not linearly separable."""
    n, f, c = SYNTHETIC_SAMPLES if cfg.samples is None else cfg.samples, cfg.features, cfg.classes
    if n < 2 or f < 1 or c < 2:
        raise ConfigError(f"synthetic data: samples={n}, features={f}, classes={c}; expected >= 2, >= 1, >= 2")
    centres = rng.normal(size=(c, 2, f)) * (SYNTHETIC_SEPARATION / math.sqrt(f))  # (C, 2, F)
    y = rng.permutation(np.arange(n) % c)  # (N,) balanced classes
    blob = rng.integers(0, 2, size=n)  # (N,) which blob of its class each sample comes from
    x = centres[y, blob] + rng.normal(size=(n, f))  # (N, F), unit noise
    return Raw(x, y.astype(np.int64), None, None, c)


SOURCES: dict[str, Callable[[DataConfig, np.random.Generator], Raw]] = {
    "digits": _load_digits,
    "mnist1d": _load_mnist1d,
    "mnist": _load_idx_dataset("mnist", DIGIT_NAMES),
    "fashion_mnist": _load_idx_dataset("fashion_mnist", FASHION_NAMES),
    "synthetic": _load_synthetic,
    "file": load_file,
}
