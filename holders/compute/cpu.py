"""CPU backend of the compute seam: ``Y = X·Wᵀ`` for dense float32 and GGUF-quantized weights.

- Dense float32: one BLAS GEMM (``x @ w.T``, numpy's OpenBLAS), bit-identical to the
  plain numpy pipeline.
- Quantized (Q8_0 / Q4_K / Q6_K), small batches (``n <= small_batch``): a numba kernel,
  parallel over output rows, that decodes one weight row at a time into an L1-sized f32
  scratch and takes its dot products with every input row. Only the quantized bytes are
  read from memory (Q4_K: 4.5 bits per weight instead of 32), which is what makes batch-1
  latency lower than dense. Source of the block layouts and decode formulas: ggml
  ``ggml-common.h`` / ``dequantize_row_q8_0/q4_K/q6_K`` (as gguf-py ``quants.py``).
- Quantized, larger batches: decode the whole matrix (``holders.quant.dequantize``,
  bit-identical to gguf-py) and run one BLAS GEMM; at these sizes the GEMM dominates and
  the decode is a few percent. Measured in ``bench/bench_expert.py``: a cache of decoded
  matrices would buy at most those few percent at the cost of 4 bytes per weight of
  extra memory, so none is kept.

Pure Python + numpy + numba; imports nothing from Django.
"""
from __future__ import annotations

import math
import os

import numba
import numpy as np
from numba import njit, prange

from holders.quant import QuantizedMatrix

# Batch rows up to which the quantized kernel beats decode + GEMM (bench_expert.py).
SMALL_BATCH = int(os.environ.get("TENZRO_QUANT_SMALL_BATCH", "16"))


@njit(inline="always", cache=True)
def _f16(lo, hi):
    """IEEE half (two little-endian bytes) → float32, exact."""
    h = np.int64(lo) | (np.int64(hi) << 8)
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        v = math.ldexp(float(m), -24)
    elif e == 31:
        v = math.inf if m == 0 else math.nan
    else:
        v = math.ldexp(float(m + 1024), int(e) - 25)
    return np.float32(-v if (h >> 15) & 1 else v)


@njit(inline="always", cache=True)
def _row_q8_0(b, r, w, cols):
    nb = cols // 32
    for blk in range(nb):
        o = blk * 34
        d = _f16(b[r, o], b[r, o + 1])
        for j in range(32):
            q = np.int32(b[r, o + 2 + j])
            if q > 127:
                q -= 256
            w[blk * 32 + j] = np.float32(q) * d


@njit(inline="always", cache=True)
def _row_q4_k(b, r, w, cols):
    nb = cols // 256
    for blk in range(nb):
        o = blk * 144
        d = _f16(b[r, o], b[r, o + 1])
        dmin = _f16(b[r, o + 2], b[r, o + 3])
        for s in range(8):
            if s < 4:
                sc = b[r, o + 4 + s] & 63
                mn = b[r, o + 8 + s] & 63
            else:
                sc = (b[r, o + 8 + s] & 0x0F) | ((b[r, o + s] >> 6) << 4)
                mn = (b[r, o + 8 + s] >> 4) | ((b[r, o + 4 + s] >> 6) << 4)
            dl = d * np.float32(sc)
            ml = dmin * np.float32(mn)
            qo = o + 16 + (s // 2) * 32
            shift = 4 * (s % 2)
            base = blk * 256 + s * 32
            for j in range(32):
                w[base + j] = np.float32((b[r, qo + j] >> shift) & 0x0F) * dl - ml


@njit(inline="always", cache=True)
def _row_q6_k(b, r, w, cols):
    nb = cols // 256
    for blk in range(nb):
        o = blk * 210
        d = _f16(b[r, o + 208], b[r, o + 209])
        for h in range(2):
            for g in range(4):
                base = blk * 256 + h * 128 + g * 32
                for j in range(32):
                    qlv = np.int64(b[r, o + h * 64 + (g % 2) * 32 + j])
                    low = (qlv >> (4 * (g // 2))) & 0x0F
                    hi = (np.int64(b[r, o + 128 + h * 32 + j]) >> (2 * g)) & 3
                    sc = np.int32(b[r, o + 192 + (h * 128 + g * 32 + j) // 16])
                    if sc > 127:
                        sc -= 256
                    w[base + j] = (np.float32(low | (hi << 4)) - np.float32(32)) * (d * np.float32(sc))


def _make_kernel(row_decoder):
    @njit(parallel=True, fastmath=True, cache=True)
    def kernel(b, x, y):
        rows = b.shape[0]
        n, cols = x.shape
        for r in prange(rows):
            w = np.empty(cols, dtype=np.float32)
            row_decoder(b, r, w, cols)
            for i in range(n):
                acc = np.float32(0)
                for j in range(cols):
                    acc += w[j] * x[i, j]
                y[i, r] = acc
    return kernel


_KERNELS = {"q8_0": _make_kernel(_row_q8_0), "q4_k": _make_kernel(_row_q4_k), "q6_k": _make_kernel(_row_q6_k)}


def quantized_matmul_xt(x: np.ndarray, w: QuantizedMatrix) -> np.ndarray:
    """``x`` f32 ``[n, cols]`` · dequantized ``w``ᵀ with the row-decoding kernel → f32 ``[n, rows]``.

    Numerically the dot products of ``x`` with the decoded rows (f32 accumulation, order
    chosen by the compiler), so results differ from the GEMM path in the last bits.
    """
    y = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    _KERNELS[w.qtype](w.blocks, x, y)
    return y


class CpuBackend:
    """The always-present backend: BLAS for dense, numba kernel or decode + BLAS for quantized."""

    tag = "cpu"
    gpu = False

    def __init__(self, small_batch: int = SMALL_BATCH):
        self.small_batch = small_batch

    def matmul_xt(self, x: np.ndarray, w) -> np.ndarray:
        """``x`` f32 ``[n, in]``, ``w`` f32 ndarray or ``QuantizedMatrix`` ``[out, in]`` → f32 ``[n, out]``."""
        if isinstance(w, QuantizedMatrix):
            if x.shape[0] <= self.small_batch:
                return quantized_matmul_xt(np.ascontiguousarray(x, dtype=np.float32), w)
            return x @ w.dequantize().T
        return x @ w.T

    def release(self, w) -> None:
        """Nothing is cached per weight on the CPU."""

    def describe(self) -> dict:
        """Backend facts for status: tag, gpu flag, threads."""
        return {"tag": self.tag, "gpu": False, "threads": numba.get_num_threads(), "small_batch": self.small_batch}
