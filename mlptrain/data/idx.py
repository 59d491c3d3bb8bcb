"""MNIST and Fashion-MNIST: the IDX file format, and a downloader that verifies what it fetches.

The downloader tries mirrors in order and checks size and SHA-256 before a file takes its final
name in the cache folder (:func:`mlptrain.base.fs.cache_root`); with no network the error names the
four files, their SHA-256 and the folder to put them in.
"""

from __future__ import annotations

import gzip
import http.client
import logging
import math
import os
import stat
import struct
import urllib.request
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

from mlptrain.base.errors import DatasetError
from mlptrain.base.fs import sha256_file

log = logging.getLogger(__name__)

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
    """Return None when ``path`` is a regular file of the expected size and SHA-256, else what is wrong.

    Only a file of the right size is read: a directory, a device or a link to one (``/dev/zero``
    never ends) is refused by its type.
    """
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file (a directory, a device, or a link to one)"
    if st.st_size != spec.size:
        return f"size {st.st_size} bytes, expected {spec.size} (and SHA-256 {spec.sha256})"
    digest = sha256_file(path)
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


def ensure_idx_files(name: str, folder: Path, download: bool) -> None:
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
                f"dataset {name!r}: cached file {path} is corrupt, truncated or not a file ({problem}); "
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
