"""Datasets on the host: loading, verifying, splitting and normalising, in NumPy only.

This module owns everything between a dataset name and a :class:`Dataset` of host arrays:

- ``digits``: the bundled UCI optdigits test set (``mlptrain/datasets/digits.csv.gz``), its pinned
  SHA-256 checked on every load;
- ``mnist1d``: generated offline by the optional ``mnist1d`` package (never downloaded);
- ``mnist`` and ``fashion_mnist``: IDX files fetched into a cache folder by a small downloader that
  tries mirrors in order and checks size and SHA-256 before a file takes its final name;
- ``synthetic``: Gaussian class clusters, dependency-free, any size;
- the IDX reader and writer (:func:`read_idx`, :func:`write_idx`), the seeded stratified splits and
  the train-split normalisation.

It never imports CuPy: :mod:`mlptrain.loader` moves the arrays to the device. All randomness comes
from a ``numpy.random.Generator`` seeded by the ``seed`` argument, so a split depends on nothing else.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import io
import logging
import math
import os
import random
import struct
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

from mlptrain.config import DataConfig
from mlptrain.errors import ConfigError, DatasetError

log = logging.getLogger(__name__)

DIGITS_PATH = Path(__file__).resolve().parent / "datasets" / "digits.csv.gz"
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

# Train images, train labels, test images, test labels: the same names for MNIST and Fashion-MNIST.
IDX_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)


class FileSpec(NamedTuple):
    """Expected byte size and SHA-256 (hex) of one downloaded file."""

    size: int
    sha256: str


# Size and SHA-256 of the gzip files (tensorflow-datasets url_checksums). Tests replace entries.
CHECKSUMS: dict[str, dict[str, FileSpec]] = {
    "mnist": {
        IDX_FILES[0]: FileSpec(9912422, "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609"),
        IDX_FILES[1]: FileSpec(28881, "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c"),
        IDX_FILES[2]: FileSpec(1648877, "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6"),
        IDX_FILES[3]: FileSpec(4542, "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6"),
    },
    "fashion_mnist": {
        IDX_FILES[0]: FileSpec(26421880, "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84"),
        IDX_FILES[1]: FileSpec(29515, "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845"),
        IDX_FILES[2]: FileSpec(4422102, "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073"),
        IDX_FILES[3]: FileSpec(5148, "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5"),
    },
}

# Base URLs tried in order (yann.lecun.com answers 403). $MLPTRAIN_<NAME>_MIRROR (comma-separated
# base URLs, e.g. MLPTRAIN_MNIST_MIRROR) is tried first; tests replace the lists with file:// URLs.
MIRRORS: dict[str, list[str]] = {
    "mnist": ["https://ossci-datasets.s3.amazonaws.com/mnist/", "https://storage.googleapis.com/cvdf-datasets/mnist/"],
    "fashion_mnist": ["http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"],
}
DOWNLOAD_TIMEOUT_S = 30.0

STD_FLOOR = 1e-6  # a feature whose train std (or range) is below this is only centred, not scaled
SYNTHETIC_SEPARATION = 4.0  # blob-centre spread; linear models reach ~80 %, an MLP ~93 % at 32 features


@dataclass
class Dataset:
    """One dataset's splits as host arrays, normalised with statistics of the train split.

    Attributes:
        name: Dataset name, one of :data:`DATASETS`.
        x_train: ``(N, F)`` float32, C-contiguous.
        y_train: ``(N,)`` int64 labels in ``[0, num_classes)``.
        x_val: ``(V, F)`` float32; ``V == 0`` when ``val_fraction == 0``.
        y_val: ``(V,)`` int64.
        x_test: ``(T, F)`` float32.
        y_test: ``(T,)`` int64.
        num_classes: Number of classes ``C``.
        class_names: ``C`` readable names, or None.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    class_names: list[str] | None = None

    def __post_init__(self) -> None:
        for split in ("train", "val", "test"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            if x.ndim != 2 or y.ndim != 1 or len(x) != len(y) or x.shape[1] != self.x_train.shape[1]:
                raise DatasetError(
                    f"dataset {self.name!r} split {split}: x {x.shape} and y {y.shape} are not (N, F) and (N,) "
                    f"with F={self.x_train.shape[-1]} as in the train split"
                )

    @property
    def num_features(self) -> int:
        """Number of input features ``F``."""
        return int(self.x_train.shape[1])


# --------------------------------------------------------------------------------------------- paths


def default_root() -> Path:
    """The download cache: ``$MLPTRAIN_DATA``, else ``$XDG_CACHE_HOME/mlptrain``, else ``~/.cache/mlptrain``."""
    if os.environ.get("MLPTRAIN_DATA"):
        return Path(os.environ["MLPTRAIN_DATA"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "mlptrain"
    return Path.home() / ".cache" / "mlptrain"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------- IDX

_IDX_CODES = {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_IDX_CODE_OF = {np.dtype(t).newbyteorder("="): code for code, t in _IDX_CODES.items()}


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (gzip-compressed when the name ends in ``.gz``).

    Layout: two zero bytes, a type code, the number of dimensions ``d``, ``d`` big-endian uint32
    sizes, then the values big-endian in C order.

    Returns:
        A writable array in native byte order with the header's shape and dtype (uint8, int8,
        int16, int32, float32 or float64).

    Raises:
        DatasetError: the file cannot be read or decompressed, the header is not IDX, or the payload
            length differs from the size the header implies.
    """
    path = Path(path)
    try:
        with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as exc:  # BadGzipFile is an OSError; a cut-off gzip stream raises EOFError
        raise DatasetError(f"IDX file {path} cannot be read: {type(exc).__name__}: {exc}") from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_CODES:
        raise DatasetError(f"IDX file {path} has magic {raw[:4].hex()!r}; expected 0000 then a type code and a rank")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DatasetError(f"IDX file {path} is {len(raw)} bytes, shorter than its {header}-byte header")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    dtype = np.dtype(_IDX_CODES[raw[2]])
    expected = math.prod(shape) * dtype.itemsize
    if len(raw) - header != expected:
        raise DatasetError(
            f"IDX file {path} has a {len(raw) - header}-byte payload; its header (shape {shape}, {dtype.name}) "
            f"implies {expected} bytes, so the file is truncated or corrupt"
        )
    return np.frombuffer(raw, dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def write_idx(path: str | os.PathLike, array: np.ndarray) -> None:
    """Write ``array`` as an IDX file, gzip-compressed (with mtime 0) when the name ends in ``.gz``.

    Args:
        path: Destination file.
        array: Any shape with 1 to 255 dimensions; dtype uint8, int8, int16, int32, float32 or float64.

    Raises:
        DatasetError: the dtype or rank cannot be written as IDX.
    """
    path, array = Path(path), np.asarray(array)
    code = _IDX_CODE_OF.get(array.dtype.newbyteorder("="))
    if code is None or not 1 <= array.ndim <= 255:
        raise DatasetError(
            f"write_idx: array of dtype {array.dtype} and rank {array.ndim} cannot be written as IDX; "
            "expected uint8, int8, int16, int32, float32 or float64 with 1 to 255 dimensions"
        )
    payload = array.astype(np.dtype(_IDX_CODES[code]), copy=False).tobytes(order="C")
    blob = struct.pack(f">BBBB{array.ndim}I", 0, 0, code, array.ndim, *array.shape) + payload
    if path.suffix == ".gz":
        with open(path, "wb") as raw_file, gzip.GzipFile(fileobj=raw_file, mode="wb", mtime=0) as f:
            f.write(blob)
    else:
        path.write_bytes(blob)


# ---------------------------------------------------------------------------------------- downloader


def _mirrors(name: str) -> list[str]:
    env = os.environ.get(f"MLPTRAIN_{name.upper()}_MIRROR", "")
    return [u.strip() for u in env.split(",") if u.strip()] + list(MIRRORS[name])


def _manual_hint(name: str, folder: Path) -> str:
    files = ", ".join(f"{f} (SHA-256 {spec.sha256})" for f, spec in CHECKSUMS[name].items())
    return f"put these {len(CHECKSUMS[name])} files in {folder}: {files}"


def _check_file(path: Path, spec: FileSpec) -> str | None:
    """Return None when ``path`` has the expected size and SHA-256, else what is wrong."""
    size = path.stat().st_size
    if size != spec.size:
        return f"size {size} bytes, expected {spec.size} (SHA-256 {_sha256(path)}, expected {spec.sha256})"
    digest = _sha256(path)
    if digest != spec.sha256:
        return f"SHA-256 {digest}, expected {spec.sha256}"
    return None


def _download(name: str, file: str, folder: Path) -> None:
    """Fetch ``file`` from the first mirror that serves it intact; it gets its name only once verified."""
    spec = CHECKSUMS[name][file]
    final, part = folder / file, folder / f"{file}.{os.getpid()}.part"  # per process: parallel sweeps
    failures = []
    for base in _mirrors(name):
        url = base.rstrip("/") + "/" + file
        log.info("downloading %s", url)
        try:
            with (
                urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as resp,
                open(part, "wb") as out,
                tqdm(
                    total=spec.size, desc=file, unit="B", unit_scale=True, unit_divisor=1024, leave=False, disable=None
                ) as bar,
            ):
                got = 0  # bytes so far; a disabled bar does not count them
                while (chunk := resp.read(1 << 16)) and got <= spec.size:  # stop early on an oversized reply
                    out.write(chunk)
                    got += len(chunk)
                    bar.update(len(chunk))
            problem = _check_file(part, spec)
        except (OSError, http.client.HTTPException, ValueError) as exc:  # URLError, timeouts, bad URLs
            problem = f"{type(exc).__name__}: {exc}"
        if problem is None:
            os.replace(part, final)
            return
        part.unlink(missing_ok=True)  # our own partial download, never a user file
        log.warning("%s: %s", url, problem)
        failures.append(f"{url}: {problem}")
    raise DatasetError(
        f"dataset {name!r}: could not download {file} ({'; '.join(failures) or 'no mirrors configured'}); "
        f"download the files by hand and {_manual_hint(name, folder)}"
    )


def _ensure_idx_files(name: str, folder: Path, download: bool) -> None:
    """Make sure the four IDX files of ``name`` are in ``folder``, verified; download missing ones."""
    missing = []
    for file, spec in CHECKSUMS[name].items():
        path = folder / file
        if not path.exists():
            missing.append(file)
            continue
        problem = _check_file(path, spec)
        if problem is not None:
            raise DatasetError(
                f"dataset {name!r}: cached file {path} is corrupt or truncated ({problem}); "
                "delete it and run again to re-download it, or replace it with a good copy"
            )
    if not missing:
        return
    if not download:
        raise DatasetError(
            f"dataset {name!r}: {', '.join(missing)} not found and data.download=false; {_manual_hint(name, folder)}, "
            "or set data.download=true"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DatasetError(f"dataset {name!r}: cannot create cache folder {folder} ({exc}); set data.root") from exc
    for file in missing:
        _download(name, file, folder)


# ------------------------------------------------------------------------------------------ sources
# Each returns (x_train, y_train, x_test, y_test, num_classes, class_names); x_test is None when the
# dataset has no official test split (the caller then splits with test_fraction).


def _load_digits(cfg: DataConfig, rng: np.random.Generator) -> tuple:
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
    return table[:, :64], table[:, 64].astype(np.int64), None, None, 10, DIGIT_NAMES


_MNIST1D_CACHE: dict[str, np.ndarray] = {}


def _load_mnist1d(cfg: DataConfig, rng: np.random.Generator) -> tuple:
    if not _MNIST1D_CACHE:
        try:
            from mnist1d.data import get_dataset_args, make_dataset
        except ImportError as exc:
            raise DatasetError(
                f"dataset 'mnist1d' needs the optional package mnist1d ({exc}); "
                "pip install mnist1d, or pip install 'mlptrain[datasets]'"
            ) from exc
        np_state, py_state = np.random.get_state(), random.getstate()
        try:  # make_dataset reseeds the global random and np.random; never get_dataset (it downloads)
            d = make_dataset(get_dataset_args())
        finally:
            np.random.set_state(np_state)
            random.setstate(py_state)
        for key in ("x", "y", "x_test", "y_test"):
            _MNIST1D_CACHE[key] = np.array(d[key])
            _MNIST1D_CACHE[key].setflags(write=False)
    c = _MNIST1D_CACHE
    return c["x"], c["y"].astype(np.int64), c["x_test"], c["y_test"].astype(np.int64), 10, DIGIT_NAMES


def _load_idx_dataset(name: str, class_names: list[str]) -> Callable[[DataConfig, np.random.Generator], tuple]:
    def load(cfg: DataConfig, rng: np.random.Generator) -> tuple:
        folder = (Path(cfg.root).expanduser() if cfg.root else default_root()) / name
        _ensure_idx_files(name, folder, cfg.download)
        xtr, ytr, xte, yte = (read_idx(folder / f) for f in IDX_FILES)
        for file, x, y in ((IDX_FILES[0], xtr, ytr), (IDX_FILES[2], xte, yte)):
            if x.ndim != 3 or x.dtype != np.uint8 or y.ndim != 1 or len(x) != len(y):
                raise DatasetError(
                    f"dataset {name!r}: {folder / file} holds {x.dtype} {x.shape} for {y.shape} labels; "
                    "expected uint8 (N, H, W) images and N labels"
                )
        # uint8 (N, 28, 28) -> float32 (N, 784)
        flat = [x.reshape(len(x), -1).astype(np.float32) for x in (xtr, xte)]
        return flat[0], ytr.astype(np.int64), flat[1], yte.astype(np.int64), 10, class_names

    return load


def _load_synthetic(cfg: DataConfig, rng: np.random.Generator) -> tuple:
    """Each class is a mixture of two Gaussian blobs, so the classes are not linearly separable."""
    n, f, c = cfg.samples, cfg.features, cfg.classes
    if n < 2 or f < 1 or c < 2:
        raise ConfigError(f"synthetic data: samples={n}, features={f}, classes={c}; expected >= 2, >= 1, >= 2")
    centres = rng.normal(size=(c, 2, f)) * (SYNTHETIC_SEPARATION / math.sqrt(f))  # (C, 2, F)
    y = rng.permutation(np.arange(n) % c)  # (N,) balanced classes
    blob = rng.integers(0, 2, size=n)  # (N,) which blob of its class each sample comes from
    x = centres[y, blob] + rng.normal(size=(n, f))  # (N, F), unit noise
    return x, y.astype(np.int64), None, None, c, None


_SOURCES: dict[str, Callable[[DataConfig, np.random.Generator], tuple]] = {
    "digits": _load_digits,
    "mnist1d": _load_mnist1d,
    "mnist": _load_idx_dataset("mnist", DIGIT_NAMES),
    "fashion_mnist": _load_idx_dataset("fashion_mnist", FASHION_NAMES),
    "synthetic": _load_synthetic,
}
DATASETS = tuple(_SOURCES)


# --------------------------------------------------------------------------- splits and normalisation


def stratified_split(y: np.ndarray, fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Split indices of ``y`` into ``(keep, taken)`` with each class's share kept in both parts.

    ``round(N * fraction)`` indices are taken (at least one when ``fraction > 0``), shared among the
    classes in proportion to their counts by the largest-remainder rule.

    Args:
        y: ``(N,)`` integer labels.
        fraction: Share of samples to take, in ``[0, 1)``.
        rng: Source of the shuffles.

    Returns:
        Two int64 index arrays, each in random order, together a permutation of ``arange(N)``.
    """
    n = len(y)
    k = 0 if fraction <= 0 else max(1, round(n * fraction))
    if k >= n:
        raise ConfigError(f"a split fraction of {fraction} takes {k} of {n} samples and leaves none to train on")
    classes, counts = np.unique(y, return_counts=True)
    quota = counts * (k / n)  # (K,) ideal share per class
    take = np.floor(quota).astype(np.int64)
    take[np.argsort(take - quota, kind="stable")[: k - int(take.sum())]] += 1  # largest remainders first
    keep, taken = [], []
    for cls, t in zip(classes, take, strict=True):
        idx = rng.permutation(np.flatnonzero(y == cls))
        taken.append(idx[:t])
        keep.append(idx[t:])
    return rng.permutation(np.concatenate(keep)), rng.permutation(np.concatenate(taken))


def _normalize(method: str, x_train: np.ndarray, *others: np.ndarray) -> list[np.ndarray]:
    """Scale every split with statistics of ``x_train`` only; return float32 C-contiguous arrays."""
    if method == "standard":
        shift = x_train.mean(axis=0, dtype=np.float64)  # (F,)
        scale = x_train.std(axis=0, dtype=np.float64)  # (F,)
    elif method == "minmax":
        shift = x_train.min(axis=0).astype(np.float64)
        scale = x_train.max(axis=0).astype(np.float64) - shift
    elif method == "none":
        return [np.ascontiguousarray(a, dtype=np.float32) for a in (x_train, *others)]
    else:
        raise ConfigError(f"data.normalize={method!r} is not a normalisation; expected standard, minmax or none")
    scale = np.where(scale < STD_FLOOR, 1.0, scale)  # constant features: centre only, never divide by ~0
    shift32, inv32 = shift.astype(np.float32), (1.0 / scale).astype(np.float32)
    return [np.ascontiguousarray((a.astype(np.float32) - shift32) * inv32) for a in (x_train, *others)]


def _check_labels(name: str, split: str, y: np.ndarray, num_classes: int) -> None:
    if len(y) and (y.min() < 0 or y.max() >= num_classes):
        raise DatasetError(
            f"dataset {name!r} split {split} has labels in [{y.min()}, {y.max()}]; expected [0, {num_classes})"
        )


def load_dataset(cfg: DataConfig, seed: int) -> Dataset:
    """Load ``cfg.name``, split it with a generator seeded by ``seed`` and normalise it.

    Datasets without an official test split (digits, synthetic) first lose a stratified
    ``test_fraction`` to the test split; then a stratified ``val_fraction`` of what remains for
    training becomes the validation split. Normalisation statistics come from the train split only.

    Args:
        cfg: The data config; ``name`` and ``normalize`` may be enum members or plain strings.
        seed: Seed of the splits (and of the synthetic data); same seed, same arrays.

    Returns:
        A :class:`Dataset` of float32 features and int64 labels.

    Raises:
        DatasetError: unknown name, missing optional package, missing/corrupt/undownloadable files.
        ConfigError: fractions or normalisation out of range.
    """
    name = str(getattr(cfg.name, "value", cfg.name))
    if name not in _SOURCES:
        raise DatasetError(f"data.name={name!r} is not a dataset; expected one of {', '.join(DATASETS)}")
    if not (0.0 <= cfg.val_fraction < 1.0 and 0.0 < cfg.test_fraction < 1.0):
        raise ConfigError(
            f"data.val_fraction={cfg.val_fraction} and data.test_fraction={cfg.test_fraction}; "
            "expected [0, 1) and (0, 1)"
        )
    rng = np.random.default_rng([seed, 0xDA7A])  # a stream of its own, apart from init and data order
    x, y, x_test, y_test, num_classes, class_names = _SOURCES[name](cfg, rng)
    if x_test is None:
        train, test = stratified_split(y, cfg.test_fraction, rng)
        x, y, x_test, y_test = x[train], y[train], x[test], y[test]
    train, val = stratified_split(y, cfg.val_fraction, rng)
    x_train, y_train, x_val, y_val = x[train], y[train], x[val], y[val]
    for split, labels in (("train", y_train), ("val", y_val), ("test", y_test)):
        _check_labels(name, split, labels, num_classes)
    x_train, x_val, x_test = _normalize(str(getattr(cfg.normalize, "value", cfg.normalize)), x_train, x_val, x_test)
    ds = Dataset(name, x_train, y_train, x_val, y_val, x_test, np.asarray(y_test, np.int64), num_classes, class_names)
    log.info(
        "dataset %s: %d train, %d val, %d test, %d features, %d classes",
        name,
        len(ds.x_train),
        len(ds.x_val),
        len(ds.x_test),
        ds.num_features,
        num_classes,
    )
    return ds
