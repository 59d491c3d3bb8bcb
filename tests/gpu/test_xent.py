"""The softmax cross-entropy kernels (mlptrain.nn.cuda.losses) against the NumPy loss."""

import numpy as np
import pytest
from gpu_helpers import DTYPES, close, cp, f64, rand

from mlptrain.nn.losses import softmax_cross_entropy

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", DTYPES)
# one block (B <= 1024, C <= 32, B * C <= 10240: 1024 x 10 and 320 x 32 at the limit) and the two-kernel path
@pytest.mark.parametrize(
    ("B", "C"), [(7, 3), (256, 10), (1024, 10), (320, 32), (1024, 32), (1025, 10), (256, 33), (1000, 4096)]
)
def test_cross_entropy_kernels_match_numpy(dtype, B, C):
    rng = np.random.default_rng(B + C)
    z = rand(rng, (B, C), dtype) * 4
    y = rng.integers(0, C, B)
    loss, d, correct = softmax_cross_entropy(cp.asarray(z), cp.asarray(y), cp.asarray(512.0))
    ref_loss, ref_d, ref_correct = softmax_cross_entropy(f64(z), y, 512.0)
    assert d.dtype == z.dtype and d.shape == (B, C) and d.flags.c_contiguous
    assert abs(float(loss) - float(ref_loss)) < 1e-5 * max(1.0, abs(float(ref_loss)))
    close(d, ref_d, dtype, "cross-entropy gradient")
    assert int(correct) == int(ref_correct)
    # The output layer's bias gradient from the reduction kernel (both of its paths: C <= 256 and not)
    *_, db = softmax_cross_entropy(cp.asarray(z), cp.asarray(y), cp.asarray(512.0), bias_grad=True)
    assert db.dtype == z.dtype and db.shape == (C,)
    close(db, f64(d).sum(axis=0), dtype, "output bias gradient")
    # In place (the training step): the gradient written over the logits, bit for bit the same
    logits = cp.asarray(z)
    loss2, d2, correct2, db2 = softmax_cross_entropy(
        logits, cp.asarray(y), cp.asarray(512.0), bias_grad=True, inplace=True
    )
    assert d2 is logits and float(loss2) == float(loss) and int(correct2) == int(correct)
    assert bool((_bits(d2) == _bits(d)).all()) and bool((_bits(db2) == _bits(db)).all())


def _bits(a):
    """The array's bit patterns (compared exactly, whatever the dtype)."""
    return a.view(cp.uint16 if a.itemsize == 2 else cp.uint32)


def test_cross_entropy_kernel_ties_bad_labels_and_tiny_shapes():
    z = np.array([[1, 3, 3, 0], [2, 2, 2, 2], [0, 0, 5, 5], [-1, -2, -1, -3]], np.float16)  # ties: first index
    for y in ([1, 0, 2, 0], [2, 1, 3, 2]):
        for reps in (1, 300):  # the one-block kernel (B <= 1024) and the warp-per-row kernel
            zz, yy = np.tile(z, (reps, 1)), np.tile(y, reps)
            _, _, correct = softmax_cross_entropy(cp.asarray(zz), cp.asarray(yy))
            assert int(correct) == int((zz.argmax(axis=1) == yy).sum()) == reps * int((z.argmax(axis=1) == y).sum())
    loss, d, correct = softmax_cross_entropy(cp.asarray(np.zeros((1, 1), np.float32)), cp.asarray([0]))
    assert float(loss) == 0.0 and float(d[0, 0]) == 0.0 and int(correct) == 1
    for reps in (1, 300):
        zz, yy = np.tile(z.astype(np.float32), (reps, 1)), np.tile([0, 1, 4, 2], reps)
        loss, _, _ = softmax_cross_entropy(cp.asarray(zz), cp.asarray(yy))
        assert np.isnan(float(loss))  # label 4 of 4 classes: NaN, not a read past the row


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("B", "C"), [(7, 3), (256, 10), (1024, 10), (320, 32), (1025, 10), (256, 33), (1000, 4096)])
def test_class_weighted_kernels_match_numpy(dtype, B, C):
    """model.class_weight: the weighted twins (mlptrain.nn.cuda.weighted_xent) against the float64 NumPy loss,
    in place and with the output bias gradient, on the one-block and the two-kernel paths."""
    rng = np.random.default_rng(B * C)
    z = rand(rng, (B, C), dtype) * 4
    y = rng.integers(0, C, B)
    w = rng.uniform(0.0, 5.0, C).astype(np.float32)
    ref_loss, ref_d, ref_correct = softmax_cross_entropy(f64(z), y, 512.0, class_weight=w)
    logits = cp.asarray(z)
    loss, d, correct, db = softmax_cross_entropy(
        logits, cp.asarray(y), cp.asarray(512.0), bias_grad=True, inplace=True, class_weight=cp.asarray(w)
    )
    assert d is logits and d.dtype == z.dtype
    assert abs(float(loss) - float(ref_loss)) < 1e-5 * max(1.0, abs(float(ref_loss)))
    close(d, ref_d, dtype, "weighted cross-entropy gradient")
    close(db, f64(d).sum(axis=0), dtype, "weighted output bias gradient")
    assert int(correct) == int(ref_correct)
