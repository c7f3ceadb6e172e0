"""Row-invariant products: each output row depends only on its own input row, never on how
many rows share the call or which (batch invariance, issue 21 item 4).

BLAS picks kernels and blockings by shape: numpy's OpenBLAS computes ``x @ w.T`` for one
row with GEMV and for several with GEMM, which round differently (last bits), so a
sequence's greedy tokens could change with the number of its neighbours in a decode step.
``matmul_xt`` therefore always calls the same GEMM shape: rows in blocks of ``ROW_BLOCK``,
the last block zero-padded. A row's result then depends on its values alone (checked on
every fixture family in ``tests/test_batch_invariance.py``).

Pure numpy; imports nothing from Django.
"""
from __future__ import annotations

import numpy as np

# Rows per GEMM call: large enough that a prefill chunk runs as real GEMMs, small enough that
# a one-row decode pays little for the padding (weights are read once per call either way).
ROW_BLOCK = 16


def matmul_xt(x: np.ndarray, w: np.ndarray, block: int = ROW_BLOCK) -> np.ndarray:
    """``x · wᵀ`` computed in fixed-shape GEMMs of ``block`` rows: ``x`` float32 ``[n, in]``,
    ``w`` float32 ``[out, in]`` → float32 ``[n, out]``, each row bit-identical whatever
    ``n`` and the other rows are. Raises ``ValueError`` for mismatched widths."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"matmul_xt: x {x.shape} and w {w.shape} do not fit ([n, in] · [out, in]ᵀ)")
    n = x.shape[0]
    out = np.empty((n, w.shape[0]), dtype=np.result_type(x.dtype, w.dtype))
    wt = w.T
    pad = np.zeros((block, x.shape[1]), dtype=np.float32)
    for s in range(0, n, block):
        e = min(n, s + block)
        pad[:e - s] = x[s:e]
        pad[e - s:] = 0
        out[s:e] = (pad @ wt)[:e - s]
    return out
