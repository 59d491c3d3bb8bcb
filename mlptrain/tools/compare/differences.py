"""What the index page says about how the two execution modes differ, and why their curves part.

Kept beside the code that makes the page, so that a change of either shows in one diff. Every
statement is about mlptrain/nn/execution.py and mlptrain/nn/epilogs.py.
"""

DIFFERENCES_TEMPLATE = """\
## How fused and naive differ, and why their curves part

Both modes train the same model from the same initial weights on the same batches in the same
order, with the same loss, the same optimizer kernel (fp32 master weights, a half-precision copy
for the GEMMs) and the same loss-scaling rules. In fp16 and bf16 both run every GEMM with fp32
accumulation and round its result to the half format. They differ only in how a layer's GEMMs and
the work around them are done (`mlptrain/nn/execution.py`):

{table}

Where the numbers part:

1. **Different GEMM kernels.** The two modes give cuBLASLt different problems (other operand
   orders, another output layout, with or without an epilog), so its heuristics choose different
   kernels, with different tiles and a different split of the sum over K: the fp32 accumulators add
   the same products in another order and can differ in their last bits. Rounded to fp16 (11
   significant bits) or bf16 (8), most elements still agree; those near a rounding boundary come
   out one unit in the last place apart: 0.05 % to 0.1 % of the value in fp16, 0.4 % to 0.8 % in
   bf16, where two fp32 results would differ by about 1e-7.
2. **Different reductions.** A bias gradient is a sum over the batch: inside an epilog (or the
   loss kernel) in one mode, a separate reduction in the other, the same numbers added in another
   order. At MNIST-1D's output layer (10 classes, ReLU below) the input gradient is a small kernel of
   mlptrain's in fused mode and a GEMM and a mask multiply in naive.
3. **GELU by two implementations.** The epilog and the naive kernel evaluate the same tanh formula
   in fp32 with different code, so their fp32 values need not agree in the last bit; rounding to
   the half format hides most of that, not all. ReLU has no such difference: `relu(round(z))` is
   `round(relu(z))`.
4. **Not a difference: the bias and relu'(0).** cuBLASLt's bias epilogs round the product before
   they add the bias (measured on the H200; `mlptrain/nn/epilogs.py` keeps both roundings), as the
   naive path does, so the same product gives the same `Z` in both. Both keep the mask `Z >= 0`:
   relu'(0) = 1 in both, and an exact `Z = 0` (a product that the bias cancels, common in half
   precision) passes its gradient in either mode.
5. **How one unit becomes more.** Where one mode's `Z` is exactly 0 and the other's one unit below,
   the mask bit differs: that element's gradient passes in one mode and is dropped in the other. In
   fp16 a step whose gradients overflow in one mode only is skipped in that mode only.

Each step's update depends on all of these last-bit differences, and training amplifies a
perturbation from step to step, as it amplifies a change of seed. The two runs start identical and
part a little more each step (the column "first differ by more than 1 %" says when), until they are
as different as two runs of one mode with different seeds. In half precision the question is
therefore not whether the curves coincide but whether the fused runs stay within the spread of the
naive ones over seeds and end at the same accuracy. In fp32 the same kernels differ by about 1e-7
per result and the curves stay together far longer; on the CPU both modes make the very same BLAS
calls and agree bit for bit (docs/compare-cpu/).

Speed: each naive pass over an activation or a gradient (the bias add, the ReLU and its mask, the
mask multiply, the bias-gradient sum) reads and writes the whole `batch x width` array in GPU
memory, 64 MiB for 8192 x 4096 in half precision, and the naive mask is a byte per element where
`relu_aux` is a bit. The epilogs do that work on the GEMM's output tile while it is in registers
and write it once. At MNIST-1D's sizes the GEMMs take microseconds and the replayed graph is a
chain of small kernels, so its time per step says little about the epilogs; the speed task, whose
two 4096 x 4096 layers at a batch of 8192 make the GEMMs large, does.
"""
# (per layer, fused, naive): the rows of the table in DIFFERENCES.
DIFFERENCE_ROWS = (
    (
        "forward GEMM",
        "`Z^T = W X^T`: the result column-major, with the epilog `RELU_AUX_BIAS` or `GELU_AUX_BIAS`",
        "`Z = X W^T`: the result row-major, no epilog",
    ),
    (
        "bias",
        "added by the epilog to the rounded product, rounded again",
        "`Z += b`, a separate kernel, on the rounded product, rounded again",
    ),
    (
        "activation",
        "ReLU or GELU (tanh form, fp32) in the epilog",
        "`maximum(Z, 0)`; GELU: a separate element-wise kernel, the same tanh form in fp32",
    ),
    (
        "kept for the backward",
        "ReLU: `relu_aux`, 1 bit per element (`Z >= 0`); GELU: `Z`",
        "ReLU: 1 byte per element (`Z >= 0`); GELU: `Z`",
    ),
    (
        "input gradient",
        "`W^T dZ^T` with the `DRELU` / `DGELU` epilog (the output layer of a small head with ReLU below: "
        "one kernel of mlptrain's)",
        "`dZ W`, then a multiply by the mask or by gelu'(Z)",
    ),
    (
        "bias gradient",
        "summed over the batch inside an epilog (`DRELU_BGRAD` / `DGELU_BGRAD` or `BGRADB`, whichever was "
        "timed faster for the shape; a small head's output bias: by the loss kernel)",
        "a separate column sum of `dZ`",
    ),
    ("weight gradient", "`X^T dZ`, plain or with `BGRADB`", "`X^T dZ`, plain"),
)
DIFFERENCES = DIFFERENCES_TEMPLATE.format(
    table="\n".join(
        ["| per layer | fused (`execution=fused`) | naive (`execution=naive`) |", "|---|---|---|"]
        + [f"| {what} | {fused} | {naive} |" for what, fused, naive in DIFFERENCE_ROWS]
    )
)
