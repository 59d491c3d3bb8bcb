"""What a report says about a comparison's two arms: their names (fused and naive, fp8 and bf16),
and, for an axis other than the execution mode, its verdict, its note and the half-point check of
the paired final-accuracy difference (``s["equivalence"]``, :func:`mlptrain.tools.compare.stats.interval_within`).

A summary written before the axis was recorded (an older compare.json) is a fused-vs-naive one.
"""

from __future__ import annotations

from typing import Any

from mlptrain.tools.compare.axis import EXECUTION

# The account of the FP8 study (docs/compare-fp8/): what differs between precision=fp8 and bf16.
FP8_README = "docs/compare-fp8/README.md"


def arms(s: dict[str, Any]) -> tuple[str, str]:
    """``(candidate, reference)``: ``("fused", "naive")``, ``("fp8", "bf16")``."""
    got = (s.get("axis") or {}).get("arms")
    return (got[0], got[1]) if got else EXECUTION.arms


def axis_name(s: dict[str, Any]) -> str:
    """``execution``, ``precision``, or the compared key."""
    return (s.get("axis") or {}).get("name") or EXECUTION.name


def short_names(s: dict[str, Any]) -> tuple[str, str]:
    """The arms in the formula of the loss difference: ``f``, ``n`` for fused and naive, else the names."""
    return ("f", "n") if axis_name(s) == EXECUTION.name else arms(s)


def points(x: float) -> str:
    return f"{x * 100:+.2f}"


def equivalence_cell(s: dict[str, Any]) -> str:
    """``[-0.42, +0.18] pp inside ± 0.5: yes``, or why it cannot be told."""
    eq = s.get("equivalence") or {}
    if eq.get("inside") is None:
        n = len(s.get("seeds", []))
        why = "1 seed" if n < 2 else "no interval: the difference did not vary over the seeds, or is not finite"
        return f"n/a ({why})"
    bound = f"{eq['bound'] * 100:g}"
    verdict = "yes" if eq["inside"] else "NO"
    return f"[{points(eq['low'])}, {points(eq['high'])}] pp, inside ± {bound} pp: {verdict}"


def equivalence_row(s: dict[str, Any]) -> list[str]:
    """compare.md's row of the half-point check, for an axis other than the execution mode (whose
    report stays as it was)."""
    if axis_name(s) == EXECUTION.name or not s.get("equivalence"):
        return []
    cand, ref = arms(s)
    return [f"| 95 % interval of {cand} - {ref} (final test accuracy, paired by seed) | {equivalence_cell(s)} | |"]


def other_axis_verdict(s: dict[str, Any], n: str) -> str:
    """The verdict of a comparison across precisions (or another key): judged by final accuracy, not step by step."""
    cand, ref = arms(s)
    return (
        f"{cand} vs {ref}: the two arms round every GEMM differently, so their curves part from the first steps and "
        f"are compared by final accuracy and the band over seeds, not step by step (largest relative difference "
        f"{s['max_rel_diff']:.3g} over {n}); 95 % interval of the paired final-accuracy difference: "
        f"{equivalence_cell(s)}"
    )


def other_axis_note(s: dict[str, Any]) -> str:
    """compare.md's paragraph on what the two arms do differently."""
    cand, ref = arms(s)
    if axis_name(s) == "precision" and cand == "fp8":
        cpu = " (the CPU has no bf16: there fp32 is the reference)" if ref == "fp32" else ""
        return (
            f"fp8 and {ref}{cpu} train the same model from the same weights on the same batches with the same "
            "optimizer and fp32 master weights. fp8 runs every GEMM whose three dimensions are multiples of 16 "
            "on e4m3 operands (3 mantissa bits: weights and activations) and e5m2 gradients (2 mantissa bits), each "
            "cast with its own per-tensor scale from the amaxes of the steps before (delayed scaling), accumulated "
            "in fp32 into a bf16 result; the other GEMMs (the 10-class head, MNIST-1D's 40-feature input layer) "
            "and its activations and gradients are bf16. An e4m3 operand is rounded 16 times, an e5m2 one 32 "
            "times more coarsely than a bf16 one, so the curves part at once; the test is whether fp8 ends at "
            f"{ref}'s accuracy, seed by seed. {FP8_README} says what runs in FP8 in each task, and why."
        )
    return (
        f"The two arms differ in {(s.get('axis') or {}).get('key')} ({cand} and {ref}) and in nothing else but the "
        "seed; each seed's two runs start from the same weights and see the same batches."
    )
