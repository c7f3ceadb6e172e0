"""CPU backend of the compute seam: ``Y = X·Wᵀ`` for dense float32 and GGUF-quantized weights.

- Dense float32: one BLAS GEMM (``x @ w.T``, numpy's OpenBLAS), bit-identical to the
  plain numpy pipeline.
- Quantized (Q8_0 / Q4_K / Q6_K), small batches (``n <= small_batch``): numba kernels,
  parallel over output rows, that read the blocks directly: per sub-block
  ``Σ (d·sc·q − dmin·m)·x = d·sc·Σ q·x − dmin·m·Σ x`` with ``Σ x`` per sub-block computed
  once per call, so the inner loop is integer-to-float and multiply-add over 32 (16 for
  Q6_K) values. Only the quantized bytes are read from memory (Q4_K: 4.5 bits per weight
  instead of 32). Source of the block layouts and decode formulas: ggml
  ``ggml-common.h`` / ``dequantize_row_q8_0/q4_K/q6_K`` (as gguf-py ``quants.py``).
- Quantized, larger batches: decode the whole matrix (``dequantize_parallel``, a parallel
  numba decoder bit-identical to gguf-py) and run one BLAS GEMM; at these sizes the GEMM
  dominates and the decode is a few percent. Measured in ``bench/bench_expert.py``: a cache of decoded
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


@njit(parallel=True, fastmath=True, cache=True)
def _mm_q8_0(b, x, y):
    rows = b.shape[0]
    n, cols = x.shape
    for r in prange(rows):
        br = b[r]
        for i in range(n):
            y[i, r] = 0
        for blk in range(cols // 32):
            o = blk * 34
            d = _f16(br[o], br[o + 1])
            q = br[o + 2:o + 34].view(np.int8)
            for i in range(n):
                xi = x[i, blk * 32:blk * 32 + 32]
                acc = np.float32(0)
                for j in range(32):
                    acc += np.float32(q[j]) * xi[j]
                y[i, r] += d * acc


@njit(parallel=True, fastmath=True, cache=True)
def _mm_q4_k(b, x, xs, y):
    """xs: f32 [n, cols // 32] sums of x over each 32-element sub-block."""
    rows = b.shape[0]
    n, cols = x.shape
    for r in prange(rows):
        br = b[r]
        for i in range(n):
            y[i, r] = 0
        for blk in range(cols // 256):
            o = blk * 144
            d = _f16(br[o], br[o + 1])
            dmin = _f16(br[o + 2], br[o + 3])
            for s in range(8):
                if s < 4:
                    sc = br[o + 4 + s] & 63
                    mn = br[o + 8 + s] & 63
                else:
                    sc = (br[o + 8 + s] & 0x0F) | ((br[o + s] >> 6) << 4)
                    mn = (br[o + 8 + s] >> 4) | ((br[o + 4 + s] >> 6) << 4)
                dl = d * np.float32(sc)
                ml = dmin * np.float32(mn)
                qo = o + 16 + (s // 2) * 32
                shift = 4 * (s % 2)
                base = blk * 256 + s * 32
                q = br[qo:qo + 32]
                for i in range(n):
                    xi = x[i, base:base + 32]
                    acc = np.float32(0)
                    for j in range(32):
                        acc += np.float32((q[j] >> shift) & 0x0F) * xi[j]
                    y[i, r] += dl * acc - ml * xs[i, base // 32]


@njit(parallel=True, fastmath=True, cache=True)
def _mm_q6_k(b, x, xs, y):
    """xs: f32 [n, cols // 16] sums of x over each 16-element sub-block."""
    rows = b.shape[0]
    n, cols = x.shape
    for r in prange(rows):
        br = b[r]
        for i in range(n):
            y[i, r] = 0
        for blk in range(cols // 256):
            o = blk * 210
            d = _f16(br[o + 208], br[o + 209])
            scales = br[o + 192:o + 208].view(np.int8)
            for h in range(2):
                ql = br[o + h * 64:o + h * 64 + 64]
                qh = br[o + 128 + h * 32:o + 128 + h * 32 + 32]
                for g in range(4):
                    base = blk * 256 + h * 128 + g * 32
                    lo_off = (g % 2) * 32
                    lo_shift = 4 * (g // 2)
                    for half in range(2):
                        sidx = h * 8 + g * 2 + half
                        dl = d * np.float32(scales[sidx])
                        for i in range(n):
                            xi = x[i, base + half * 16:base + half * 16 + 16]
                            acc = np.float32(0)
                            for j in range(16):
                                jj = half * 16 + j
                                qv = ((ql[lo_off + jj] >> lo_shift) & 0x0F) | (((qh[jj] >> (2 * g)) & 3) << 4)
                                acc += np.float32(qv) * xi[j]
                            y[i, r] += dl * (acc - np.float32(32) * xs[i, (base + half * 16) // 16])


@njit(parallel=True, cache=True)
def _deq_q8_0(b, out):
    rows, cols = out.shape
    for r in prange(rows):
        br = b[r]
        for blk in range(cols // 32):
            o = blk * 34
            d = _f16(br[o], br[o + 1])
            q = br[o + 2:o + 34].view(np.int8)
            for j in range(32):
                out[r, blk * 32 + j] = np.float32(q[j]) * d


@njit(parallel=True, cache=True)
def _deq_q4_k(b, out):
    rows, cols = out.shape
    for r in prange(rows):
        br = b[r]
        for blk in range(cols // 256):
            o = blk * 144
            d = _f16(br[o], br[o + 1])
            dmin = _f16(br[o + 2], br[o + 3])
            for s in range(8):
                if s < 4:
                    sc = br[o + 4 + s] & 63
                    mn = br[o + 8 + s] & 63
                else:
                    sc = (br[o + 8 + s] & 0x0F) | ((br[o + s] >> 6) << 4)
                    mn = (br[o + 8 + s] >> 4) | ((br[o + 4 + s] >> 6) << 4)
                dl = d * np.float32(sc)
                ml = dmin * np.float32(mn)
                qo = o + 16 + (s // 2) * 32
                shift = 4 * (s % 2)
                base = blk * 256 + s * 32
                for j in range(32):
                    out[r, base + j] = np.float32((br[qo + j] >> shift) & 0x0F) * dl - ml


@njit(parallel=True, cache=True)
def _deq_q6_k(b, out):
    rows, cols = out.shape
    for r in prange(rows):
        br = b[r]
        for blk in range(cols // 256):
            o = blk * 210
            d = _f16(br[o + 208], br[o + 209])
            scales = br[o + 192:o + 208].view(np.int8)
            for h in range(2):
                for g in range(4):
                    base = blk * 256 + h * 128 + g * 32
                    for j in range(32):
                        qv = ((br[o + h * 64 + (g % 2) * 32 + j] >> (4 * (g // 2))) & 0x0F) | \
                            (((br[o + 128 + h * 32 + j] >> (2 * g)) & 3) << 4)
                        dl = d * np.float32(scales[h * 8 + g * 2 + j // 16])
                        out[r, base + j] = (np.float32(qv) - np.float32(32)) * dl


_DEQ = {"q8_0": _deq_q8_0, "q4_k": _deq_q4_k, "q6_k": _deq_q6_k}


def dequantize_parallel(w: QuantizedMatrix) -> np.ndarray:
    """``w`` decoded to f32 ``[rows, cols]`` by a parallel numba kernel; the same float32
    operations in the same order as ``holders.quant.dequantize`` (no fast-math), hence
    bit-identical to gguf-py's ``dequantize``."""
    out = np.empty(w.shape, dtype=np.float32)
    _DEQ[w.qtype](w.blocks, out)
    return out


def quantized_matmul_xt(x: np.ndarray, w: QuantizedMatrix) -> np.ndarray:
    """``x`` f32 ``[n, cols]`` · dequantized ``w``ᵀ with the row-decoding kernel → f32 ``[n, rows]``.

    Numerically the dot products of ``x`` with the decoded rows (f32 accumulation, order
    chosen by the compiler), so results differ from the GEMM path in the last bits.
    """
    y = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    if w.qtype == "q8_0":
        _mm_q8_0(w.blocks, x, y)
    elif w.qtype == "q4_k":
        _mm_q4_k(w.blocks, x, x.reshape(x.shape[0], -1, 32).sum(axis=2, dtype=np.float32), y)
    else:
        _mm_q6_k(w.blocks, x, x.reshape(x.shape[0], -1, 16).sum(axis=2, dtype=np.float32), y)
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
            return x @ dequantize_parallel(w).T
        return x @ w.T

    def release(self, w) -> None:
        """Nothing is cached per weight on the CPU."""

    def describe(self) -> dict:
        """Backend facts for status: tag, gpu flag, threads."""
        return {"tag": self.tag, "gpu": False, "threads": numba.get_num_threads(), "small_batch": self.small_batch}
