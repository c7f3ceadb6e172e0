"""Row-invariant products: each output row depends only on its own input row, never on how
many rows share the call or which (batch invariance, issue 21 item 4).

BLAS picks kernels and blockings by shape: numpy's OpenBLAS computes ``x @ w.T`` for one
row with GEMV and for several with GEMM, which round differently (last bits), so a
sequence's greedy tokens could change with the number of its neighbours in a decode step.
``matmul_xt`` therefore computes every row of a given weight the same way, chosen by the
weight's size alone: a small weight (``out × in ≤ GEMV_MAX``) one GEMV per row, where a
GEMM's thread hand-off costs more than the product (a 16 × 256 × 512 GEMM took 15 ms with
OpenBLAS's 2 threads on a loaded 2-core machine, a GEMV 0.07 ms); a larger weight always
the same GEMM shape, rows in blocks of ``ROW_BLOCK``, the last block zero-padded. A row's
result then depends on its values alone (checked on every fixture family in
``tests/test_scheduler.py``).

Pure numpy; imports nothing from Django.
"""
from __future__ import annotations

import numpy as np

# Rows per GEMM call: large enough that a prefill chunk runs as real GEMMs, small enough that
# a one-row decode pays little for the padding (weights are read once per call either way).
ROW_BLOCK = 16
# Weights up to this many elements run one GEMV per row (fast below GEMM's threading cost).
GEMV_MAX = 1 << 20


def matmul_xt(x: np.ndarray, w: np.ndarray, block: int = ROW_BLOCK) -> np.ndarray:
    """``x · wᵀ`` computed per row (GEMV, small ``w``) or in fixed-shape GEMMs of ``block``
    rows (module docstring): ``x`` float32 ``[n, in]``,
    ``w`` float32 ``[out, in]`` → float32 ``[n, out]``, each row bit-identical whatever
    ``n`` and the other rows are. Raises ``ValueError`` for mismatched widths."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"matmul_xt: x {x.shape} and w {w.shape} do not fit ([n, in] · [out, in]ᵀ)")
    n = x.shape[0]
    out = np.empty((n, w.shape[0]), dtype=np.result_type(x.dtype, w.dtype))
    if w.size <= GEMV_MAX:
        for i in range(n):
            out[i] = w @ x[i]
        return out
    wt = w.T
    pad = np.zeros((block, x.shape[1]), dtype=np.float32)
    for s in range(0, n, block):
        e = min(n, s + block)
        pad[:e - s] = x[s:e]
        pad[e - s:] = 0
        out[s:e] = (pad @ wt)[:e - s]
    return out
