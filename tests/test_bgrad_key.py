"""execution.bgrad=auto's remembered choice is keyed by whether the step's GEMMs end in mlptrain's epilogue kernels:
a choice timed with cuBLASLt's epilogues is not the step's that runs the kernels (mlptrain.step.bgrad)."""

from __future__ import annotations

from types import SimpleNamespace

from mlptrain.step.bgrad import own_epilogues


class _Gemm:
    """A GPU engine's ``own_epilogues`` as the threshold rule, recording what it is asked."""

    def __init__(self) -> None:
        self.asked: list[tuple] = []

    def own_epilogues(self, dtype: str, batched: bool, macs: int) -> bool:
        self.asked.append((dtype, batched, macs))
        return batched or macs >= 2**31


def test_the_key_asks_the_engine_with_the_largest_gemm_at_the_probes_batch() -> None:
    gemm = _Gemm()
    tr = SimpleNamespace(gemm=gemm, precision=SimpleNamespace(compute_dtype="bfloat16"), members=1)
    tr.widths = [784, 1024, 1024, 10]  # the largest layer: 1024 x 1024
    assert own_epilogues(tr, 2048) and not own_epilogues(tr, 1024)
    assert gemm.asked == [("bfloat16", False, 2048 * 1024 * 1024), ("bfloat16", False, 1024 * 1024 * 1024)]
    tr.members = 4  # an ensemble's GEMMs are batched
    assert own_epilogues(tr, 8) and gemm.asked[-1][1] is True


def test_an_engine_without_the_kernels_never_keys_them() -> None:
    tr = SimpleNamespace(gemm=object(), precision=SimpleNamespace(compute_dtype="bfloat16"), members=1)
    tr.widths = [4096] * 5
    assert not own_epilogues(tr, 16384)  # the CPU's engine: no such kernels
