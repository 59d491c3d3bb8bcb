"""mlptrain.data.cuda.upload: the split copied to the device through two pinned staging buffers, against
``cupy.asarray`` of the whole cast, byte for byte (odd sizes, dtypes, layouts, chunk sizes)."""

import logging

import numpy as np
import pytest
from gpu_helpers import cp

pytestmark = pytest.mark.gpu


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _host(layout: str, rng: np.random.Generator) -> np.ndarray:
    base = rng.standard_normal((1031, 37)) * 100  # (N, F): odd rows, odd row bytes
    return {
        "C": base,
        "F": np.asfortranarray(base),
        "strided": base[::3, 1::2],
        "1-D": base[:, 0].copy(),
        "3-D": base[:, :36].reshape(1031, 6, 6),
    }[layout]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "float16"])
@pytest.mark.parametrize("layout", ["C", "F", "strided", "1-D", "3-D"])
@pytest.mark.parametrize("chunk_bytes", [1, 4099, 1 << 20, 64 << 20])  # a row each, odd chunks, one chunk
def test_to_device_equals_cupy_asarray_byte_for_byte(dtype: str, layout: str, chunk_bytes: int) -> None:
    from mlptrain.data.cuda.upload import to_device

    dt = _dtype(dtype)
    x = _host(layout, np.random.default_rng(7))
    want = cp.asarray(np.array(x, dtype=dt, order="C"))
    got = to_device(x, dt, chunk_bytes=chunk_bytes)
    assert got.dtype == dt and got.shape == x.shape and got.flags.c_contiguous
    assert cp.asnumpy(got).tobytes() == cp.asnumpy(want).tobytes()


def test_a_memory_map_a_large_table_and_an_empty_one(tmp_path) -> None:
    from mlptrain.data.cuda.upload import to_device

    x = np.random.default_rng(1).standard_normal((300_001, 64)).astype(np.float32)  # 77 MB: two chunks
    np.save(tmp_path / "x.npy", x)
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
    got = to_device(mapped, np.float32)
    assert cp.asnumpy(got).tobytes() == x.tobytes()
    assert to_device(np.zeros((0, 5)), np.float32).shape == (0, 5)


def test_work_queued_on_the_current_stream_comes_first() -> None:
    """The memory pool may reuse a block that work on the current stream still writes: the copies wait."""
    from mlptrain.data.cuda.upload import to_device

    host = np.arange(1 << 20, dtype=np.float32)
    with cp.cuda.Stream(non_blocking=True):
        for _ in range(3):
            scratch = cp.ones(1 << 22, np.float32)
            scratch *= 2  # queued on this stream
            del scratch  # its block back to the pool: the next allocation may take it
            got = to_device(host, np.float32, chunk_bytes=1 << 18)
            assert cp.array_equal(got, cp.asarray(host))


def test_the_loader_copies_its_splits_through_the_staged_upload(caplog: pytest.LogCaptureFixture) -> None:
    from mlptrain.data.loader import DataLoader

    x = np.random.default_rng(2).standard_normal((5003, 17))  # float64 host, bfloat16 on the device
    y = np.arange(5003, dtype=np.int32)
    with caplog.at_level(logging.INFO, logger="mlptrain.data.files.chunks"):
        loader = DataLoader(x, y, 64, xp=cp, dtype=_dtype("bfloat16"), shuffle=False, drop_last=False, seed=0)
    assert "data copy to the device:" in caplog.text, caplog.text
    assert cp.asnumpy(loader.x).tobytes() == np.array(x, dtype=_dtype("bfloat16")).tobytes()
    assert loader.y.dtype == np.int64 and cp.asnumpy(loader.y).tolist() == y.tolist()
