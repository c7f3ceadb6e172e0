"""Row-invariant products in one fixed summation order: each output depends only on its own
input row and weight row, never on the batch, the thread count or the CPU (issue 21 item 4,
issue 24 item 1).

BLAS picks kernels, blockings and thread splits by shape, thread count and CPU: numpy's
OpenBLAS rounded ``x @ w.T`` differently for one row (GEMV) and several (GEMM), a
1000 × 1100 GEMM differently with 1 and 2 threads (4.2e-05), and its AVX2 and AVX-512 kernels
differently from each other, so a holder's expert rows need not equal the site's
monolithic forward (``verify_forward`` printed 5.96e-08 on an EPYC unless
``OPENBLAS_NUM_THREADS=1``). ``matmul_xt`` therefore computes every output
``y[r, o] = x[r] · w[o]`` itself, in this order, which depends on the width ``k`` alone:

- 16 lane sums in float32: lane ``l`` adds, in ascending ``j``, the products
  ``x[r, j] · w[o, j]`` of every ``j ≡ l (mod 16)``; ``k`` is zero-padded to a multiple of
  16 (the last step adds ``0 · 0`` to the lanes past the end);
- the lanes reduced by halves: ``s8[l] = p[l] + p[l + 8]``, ``s4[l] = s8[l] + s8[l + 4]``,
  ``y = (s4[0] + s4[2]) + (s4[1] + s4[3])``;
- every product and sum a separate IEEE float32 operation (no fused multiply-add).

Threads split the outputs, never one dot product. The native extension ``tenzro_rowwise``
(``native_rowwise/_rowwise.c``, ``pip install ./native_rowwise``: AVX-512 / AVX2 / baseline
clones chosen at run time, OpenMP threads) runs it at 1.0-2.6× the time of single-threaded
OpenBLAS (``bench/bench_rowwise.py``); without it a numba loop gives the same bits, slower.

Pure numpy + numba; imports nothing from Django.
"""
from __future__ import annotations

import logging

import numpy as np
from numba import njit

log = logging.getLogger(__name__)

LANES = 16
# Multiply-adds below which one call stays on the calling thread (an OpenMP hand-off costs
# more than the product); the split never changes a result.
THREADED_MIN = 1 << 18

try:
    import tenzro_rowwise as _native
except ImportError as exc:  # not built (no compiler at install time): the numba loop below
    _native = None
    log.warning("tenzro_rowwise not available (%s); dense products use the slower numba loop with the same "
                "bits. Build it with: .venv/bin/pip install ./native_rowwise", exc)


def available() -> bool:
    """Whether the native extension is loaded (else ``matmul_xt`` runs the numba loop)."""
    return _native is not None


@njit(cache=True, nogil=True)
def _matmul_xt_loop(x, w, y):
    """The module's order, one output at a time (the fallback and the tests' second reading)."""
    n, k = x.shape
    m = w.shape[0]
    k16 = k - k % 16
    acc = np.empty(16, dtype=np.float32)
    s8 = np.empty(8, dtype=np.float32)
    zero = np.float32(0)
    for r in range(n):
        for o in range(m):
            for lane in range(16):
                acc[lane] = zero
            for j in range(0, k16, 16):
                for lane in range(16):
                    acc[lane] += x[r, j + lane] * w[o, j + lane]
            if k16 < k:
                for lane in range(16):
                    if k16 + lane < k:
                        acc[lane] += x[r, k16 + lane] * w[o, k16 + lane]
                    else:
                        acc[lane] += zero * zero
            for lane in range(8):
                s8[lane] = acc[lane] + acc[lane + 8]
            a = (s8[0] + s8[4]) + (s8[2] + s8[6])
            b = (s8[1] + s8[5]) + (s8[3] + s8[7])
            y[r, o] = a + b


def matmul_xt(x: np.ndarray, w: np.ndarray, threads: int | None = None) -> np.ndarray:
    """``x · wᵀ`` in the module's fixed order: ``x`` float32 ``[n, in]``, ``w`` float32
    ``[out, in]`` → float32 ``[n, out]``, each element bit-identical whatever ``n``, the other
    rows, ``threads`` and the CPU. ``threads`` (default ``moe.kernels.default_threads()``:
    ``TENZRO_KERNEL_THREADS``, else numba's thread count) split the outputs of large products.
    Raises ``ValueError`` for mismatched widths."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    w = np.ascontiguousarray(w, dtype=np.float32)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1] or x.shape[1] == 0:
        raise ValueError(f"matmul_xt: x {x.shape} and w {w.shape} do not fit ([n, in] · [out, in]ᵀ, in ≥ 1)")
    n, k = x.shape
    m = w.shape[0]
    y = np.empty((n, m), dtype=np.float32)
    if n == 0 or m == 0:
        return y
    if _native is None:
        _matmul_xt_loop(x, w, y)
        return y
    if threads is None:
        from moe.kernels import default_threads
        threads = default_threads() if n * m * k >= THREADED_MIN else 1
    _native.matmul_xt(x, n, k, w, m, y, max(1, int(threads)))
    return y
