"""CPU backend of the compute seam: ``Y = X·Wᵀ`` for dense float32 and GGUF-quantized weights.

- Dense float32: ``moe.rowwise.matmul_xt``, one fixed summation order per output, so each
  row's result is the same whatever the batch, the thread count and the CPU.
- Quantized (Q8_0 / Q4_K / Q6_K) with the native extension built (``moe.kernels``): activation
  rows quantized to 8 bits and integer dot products (AVX-512 VNNI / AVX-VNNI / AVX2 / NEON /
  portable, chosen at run time, bit-identical to each other), OpenMP threads over output rows.
  On the x86 SIMD paths every batch size runs there (tiles of eight weight rows x up to eight
  activation rows on the repacked x8 layout, at or under numpy's f32 GEMM time at batch 512 in
  ``bench/bench_expert.py``), so a row's result never depends on the batch it arrives in; on the
  portable and NEON paths (one row at a time) batches up to ``native_batch`` rows (32).
- Quantized, small batches (``n <= small_batch``) without the native extension: numba kernels,
  parallel over tasks of 16 output rows, that decode one weight row at a time into an
  L1-resident f32 scratch (constant shifts so the decode vectorises, as ggml's
  ``dequantize_row_*`` loops) and take its dot product with every input row. Only the
  quantized bytes are read from memory (Q4_K: 4.5 bits per weight instead of 32). Source
  of the block layouts and decode formulas: ggml ``ggml-common.h`` /
  ``dequantize_row_q8_0/q4_K/q6_K`` (as gguf-py ``quants.py``).
- Quantized, larger batches: decode the whole matrix (``dequantize_matrix``, a numba decoder
  bit-identical to gguf-py) and run one BLAS GEMM; at these sizes the GEMM dominates and the
  decode is a few percent. The decode runs on the calling thread: a numba ``prange`` decode
  left its OpenMP workers spinning after the loop, on the cores the GEMM's BLAS threads
  needed next (with 2 BLAS threads, decode + GEMM of a 768 x 2048 Q8_0 matrix at batch 512 took
  13.0-16.7 ms against 7.9-9.2 ms for the GEMM alone and 0.4-0.7 ms for the decode). Measured in ``bench/bench_expert.py``: a cache of decoded
  matrices would buy at most those few percent at the cost of 4 bytes per weight of
  extra memory, so none is kept.

Pure Python + numpy + numba; imports nothing from Django.
"""
from __future__ import annotations

import threading

import numba
import numpy as np
from numba import njit, prange

from moe import kernels, rowwise
from moe.quant import Q4_K, Q6_K, Q8_0, QUANT_TYPES, QuantizedMatrix

# Batch rows up to which the numba kernel beats decode + GEMM (bench_expert.py).
SMALL_BATCH = 8  # TENZRO_QUANT_SMALL_BATCH's default
# Batch rows up to which the native integer kernel runs, per SIMD path (None: every batch). The
# x8 tile kernels of the x86 paths stay at or under decode + GEMM at batch 512 (bench_expert.py);
# the one-row portable / NEON kernels lose to it above about 32 rows (bench_expert.py --switch).
# TENZRO_QUANT_NATIVE_BATCH overrides.
NATIVE_BATCH_BY_ISA = {"avx512vnni": None, "avxvnni": None, "avx2": None, "portable": 32, "neon": 32, "neondot": 32}


def native_batch_default() -> int | None:
    """``TENZRO_QUANT_NATIVE_BATCH`` if set (0 turns the native kernels off), else the SIMD path's
    entry in ``NATIVE_BATCH_BY_ISA`` (None: no limit). Raises ``ValueError`` naming the variable
    for a value that is not an integer >= 0."""
    return kernels.env_int("TENZRO_QUANT_NATIVE_BATCH", NATIVE_BATCH_BY_ISA.get(kernels.isa() or "portable", 32), 0)


# Every IEEE half bit pattern → float32 (exact): one L2-resident lookup instead of bit fiddling.
_F16_TABLE = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@njit(inline="always", cache=True)
def _f16(lo, hi):
    """IEEE half (two little-endian bytes) → float32, exact."""
    return _F16_TABLE[np.int64(lo) | (np.int64(hi) << 8)]


@njit(inline="always", cache=True)
def _scale_min_k4(br, o, s):
    """ggml ``get_scale_min_k4``: 6-bit scale and min of sub-block ``s`` of the Q4_K block at ``o``."""
    if s < 4:
        return br[o + 4 + s] & 63, br[o + 8 + s] & 63
    return ((br[o + 8 + s] & 0x0F) | ((br[o + s] >> 6) << 4)), ((br[o + 8 + s] >> 4) | ((br[o + 4 + s] >> 6) << 4))


@njit(inline="always", cache=True)
def _row_q8_0(br, w, cols):
    for blk in range(cols // 32):
        o = blk * 34
        d = _f16(br[o], br[o + 1])
        for j in range(32):
            q = np.int32(br[o + 2 + j])
            w[blk * 32 + j] = np.float32(q - ((q >> 7) << 8)) * d  # two's complement int8


@njit(inline="always", cache=True)
def _row_q4_k(br, w, cols):
    for blk in range(cols // 256):
        o = blk * 144
        d = _f16(br[o], br[o + 1])
        dmin = _f16(br[o + 2], br[o + 3])
        for p in range(4):  # sub-blocks 2p (low nibbles) and 2p+1 (high nibbles) share 32 bytes
            sc0, mn0 = _scale_min_k4(br, o, 2 * p)
            sc1, mn1 = _scale_min_k4(br, o, 2 * p + 1)
            dl0, ml0 = d * np.float32(sc0), dmin * np.float32(mn0)
            dl1, ml1 = d * np.float32(sc1), dmin * np.float32(mn1)
            qo = o + 16 + p * 32
            base = blk * 256 + p * 64
            for j in range(32):
                qb = br[qo + j]
                w[base + j] = np.float32(qb & 0x0F) * dl0 - ml0
                w[base + 32 + j] = np.float32(qb >> 4) * dl1 - ml1


@njit(inline="always", cache=True)
def _row_q6_k(br, w, cols):
    sc = br.view(np.int8)
    for blk in range(cols // 256):
        o = blk * 210
        d = _f16(br[o + 208], br[o + 209])
        for h in range(2):
            lo = o + h * 64
            hi = o + 128 + h * 32
            base = blk * 256 + h * 128
            for half in range(2):
                d0 = d * np.float32(sc[o + 192 + h * 8 + half])
                d1 = d * np.float32(sc[o + 192 + h * 8 + 2 + half])
                d2 = d * np.float32(sc[o + 192 + h * 8 + 4 + half])
                d3 = d * np.float32(sc[o + 192 + h * 8 + 6 + half])
                for jj in range(16):
                    j = half * 16 + jj
                    a = br[lo + j]
                    b = br[lo + 32 + j]
                    c = br[hi + j]
                    w[base + j] = (np.float32((a & 0x0F) | ((c & 3) << 4)) - np.float32(32)) * d0
                    w[base + 32 + j] = (np.float32((b & 0x0F) | (((c >> 2) & 3) << 4)) - np.float32(32)) * d1
                    w[base + 64 + j] = (np.float32((a >> 4) | (((c >> 4) & 3) << 4)) - np.float32(32)) * d2
                    w[base + 96 + j] = (np.float32((b >> 4) | ((c >> 6) << 4)) - np.float32(32)) * d3


_ROWS_PER_TASK = 16


@njit(inline="always", cache=True)
def _dots(w, x, y, r):
    n, cols = x.shape
    for i in range(n):
        acc = np.float32(0)
        for j in range(cols):
            acc += w[j] * x[i, j]
        y[i, r] = acc


# One top-level kernel per type (numba caches top-level functions on disk, not closures).
@njit(parallel=True, fastmath=True, cache=True)
def _mm_q8_0(b, x, y):
    rows, cols = b.shape[0], x.shape[1]
    for t in prange((rows + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        w = np.empty(cols, dtype=np.float32)  # one decoded weight row, L1-resident
        for r in range(t * _ROWS_PER_TASK, min(rows, (t + 1) * _ROWS_PER_TASK)):
            _row_q8_0(b[r], w, cols)
            _dots(w, x, y, r)


@njit(parallel=True, fastmath=True, cache=True)
def _mm_q4_k(b, x, y):
    rows, cols = b.shape[0], x.shape[1]
    for t in prange((rows + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        w = np.empty(cols, dtype=np.float32)
        for r in range(t * _ROWS_PER_TASK, min(rows, (t + 1) * _ROWS_PER_TASK)):
            _row_q4_k(b[r], w, cols)
            _dots(w, x, y, r)


@njit(parallel=True, fastmath=True, cache=True)
def _mm_q6_k(b, x, y):
    rows, cols = b.shape[0], x.shape[1]
    for t in prange((rows + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        w = np.empty(cols, dtype=np.float32)
        for r in range(t * _ROWS_PER_TASK, min(rows, (t + 1) * _ROWS_PER_TASK)):
            _row_q6_k(b[r], w, cols)
            _dots(w, x, y, r)


@njit(cache=True, nogil=True)
def _deq_q8_0(b, out):
    rows, cols = out.shape
    for r in range(rows):
        br = b[r]
        q = br.view(np.int8)  # one view per row: a view per block kept the loop from vectorizing
        for blk in range(cols // 32):
            o = blk * 34
            d = _f16(br[o], br[o + 1])
            ob = out[r, blk * 32:blk * 32 + 32]
            qb = q[o + 2:o + 34]
            for j in range(32):
                ob[j] = np.float32(qb[j]) * d


@njit(cache=True, nogil=True)
def _deq_q4_k(b, out):
    rows, cols = out.shape
    for r in range(rows):
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
                ob = out[r, blk * 256 + s * 32:blk * 256 + s * 32 + 32]  # 1-D slices: the loop vectorizes
                qb = br[qo:qo + 32]
                for j in range(32):
                    ob[j] = np.float32((qb[j] >> shift) & 0x0F) * dl - ml


@njit(cache=True, nogil=True)
def _deq_q6_k(b, out):
    rows, cols = out.shape
    for r in range(rows):
        br = b[r]
        for blk in range(cols // 256):
            o = blk * 210
            d = _f16(br[o + 208], br[o + 209])
            scales = br[o + 192:o + 208].view(np.int8)
            for h in range(2):
                for g in range(4):
                    base = blk * 256 + h * 128 + g * 32
                    ob = out[r, base:base + 32]  # 1-D slices: the loop vectorizes
                    ql = br[o + h * 64 + (g % 2) * 32:o + h * 64 + (g % 2) * 32 + 32]
                    qh = br[o + 128 + h * 32:o + 128 + h * 32 + 32]
                    lo_shift, hi_shift = 4 * (g // 2), 2 * g
                    d0 = d * np.float32(scales[h * 8 + g * 2])
                    d1 = d * np.float32(scales[h * 8 + g * 2 + 1])
                    for j in range(32):
                        qv = ((ql[j] >> lo_shift) & 0x0F) | (((qh[j] >> hi_shift) & 3) << 4)
                        ob[j] = (np.float32(qv) - np.float32(32)) * (d0 if j < 16 else d1)


# The kernel hooks of the quant types table (moe.quant.QUANT_TYPES).
Q8_0.bind_cpu_kernels(_mm_q8_0, _deq_q8_0)
Q4_K.bind_cpu_kernels(_mm_q4_k, _deq_q4_k)
Q6_K.bind_cpu_kernels(_mm_q6_k, _deq_q6_k)


_scratch = threading.local()


def _decode_scratch(w: QuantizedMatrix) -> np.ndarray:
    """``w`` decoded into this thread's reused f32 buffer (valid until this thread decodes again):
    a fresh multi-MiB array per matmul paid its page faults every time, about half the decode."""
    n = w.shape[0] * w.shape[1]
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < n:
        buf = _scratch.buf = np.empty(n, dtype=np.float32)
    out = buf[:n].reshape(w.shape)
    w.quant.cpu_dequantize(w.blocks, out)
    return out


def dequantize_matrix(w: QuantizedMatrix) -> np.ndarray:
    """``w`` decoded to f32 ``[rows, cols]`` by a numba kernel on this thread; the same float32
    operations in the same order as ``moe.quant.dequantize`` (no fast-math), hence
    bit-identical to gguf-py's ``dequantize``."""
    out = np.empty(w.shape, dtype=np.float32)
    w.quant.cpu_dequantize(w.blocks, out)
    return out


def quantized_matmul_xt(x: np.ndarray, w: QuantizedMatrix) -> np.ndarray:
    """``x`` f32 ``[n, cols]`` · dequantized ``w``ᵀ with the row-decoding kernel → f32 ``[n, rows]``.

    Numerically the dot products of ``x`` with the decoded rows (f32 accumulation, order
    chosen by the compiler), so results differ from the GEMM path in the last bits.
    """
    y = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    w.quant.cpu_matmul(w.blocks, x, y)
    return y


class CpuBackend:
    """The always-present backend: BLAS for dense; for quantized weights the native integer
    kernel (``native=True`` and the extension built) up to ``native_batch`` rows (None: every
    batch), else the numba kernel up to ``small_batch`` rows, else decode + BLAS."""

    tag = "cpu"
    gpu = False

    def __init__(self, small_batch: int | None = None, native: bool = True, native_batch: int | None = None):
        """Defaults from ``TENZRO_QUANT_SMALL_BATCH``, ``TENZRO_QUANT_NATIVE_BATCH`` and (checked here,
        read per matmul) ``TENZRO_KERNEL_THREADS``; raises ``ValueError`` naming a malformed one."""
        self.small_batch = small_batch if small_batch is not None else kernels.env_int(
            "TENZRO_QUANT_SMALL_BATCH", SMALL_BATCH, 0)
        self.native = native and kernels.available()
        self.native_batch = native_batch if native_batch is not None else native_batch_default()
        kernels.default_threads()

    def matmul_xt(self, x: np.ndarray, w) -> np.ndarray:
        """``x`` f32 ``[n, in]``, ``w`` f32 ndarray or ``QuantizedMatrix`` ``[out, in]`` → f32 ``[n, out]``."""
        if isinstance(w, QuantizedMatrix):
            if self.native and (self.native_batch is None or x.shape[0] <= self.native_batch):
                return kernels.matmul_xt(x, w)
            if not self.native and x.shape[0] <= self.small_batch:
                return quantized_matmul_xt(np.ascontiguousarray(x, dtype=np.float32), w)
            # Decoded, the same row-invariant product as a dense weight (the product is a new
            # array: the decode buffer is free again).
            return rowwise.matmul_xt(x, _decode_scratch(w))
        return rowwise.matmul_xt(x, w)  # each row independent of the batch's size (issue 21)

    def matmul_xt_many(self, x: np.ndarray, ws) -> list[np.ndarray]:
        """``[matmul_xt(x, w) for w in ws]``, bit for bit; quantized matrices of one qtype and shape on the
        native path share one quantization of ``x`` (an expert's gate and up projections)."""
        ws = list(ws)
        if (self.native and len(ws) > 1 and all(isinstance(w, QuantizedMatrix) for w in ws)
                and len({(w.qtype, w.shape) for w in ws}) == 1
                and (self.native_batch is None or x.shape[0] <= self.native_batch)):
            return kernels.matmul_xt_many(x, ws)
        return [self.matmul_xt(x, w) for w in ws]

    def warm(self) -> None:
        """Compile (or load from numba's on-disk cache) every quantized kernel on tiny inputs, so
        the first real batch does not pay the JIT (seconds) inside a router's deadline."""
        x = np.zeros((1, 256), dtype=np.float32)
        for qt in QUANT_TYPES.values():
            w = QuantizedMatrix(qt.name, (1, 256), np.zeros(qt.row_bytes(256), dtype=np.uint8))
            quantized_matmul_xt(x, w)
            dequantize_matrix(w)

    def prepare(self, w) -> None:
        """Repack a quantized ``w`` into the native kernels' layout now (x86 SIMD paths: the x8
        copy, ``kernels.native_weights``, which replaces the GGUF bytes in memory), so the memory
        tier counts what is held (``QuantizedMatrix.nbytes``) when the expert is admitted instead
        of the layout changing on the first matmul."""
        if self.native and isinstance(w, QuantizedMatrix):
            kernels.native_weights(w)

    def release(self, w) -> None:
        """Nothing is cached per weight beyond ``w`` itself (its repacked layout goes with it)."""

    def describe(self) -> dict:
        """Backend facts for status: tag, gpu flag, threads, the native path and its arena."""
        d = {"tag": self.tag, "gpu": False, "threads": numba.get_num_threads(), "small_batch": self.small_batch,
             "native_kernels": kernels.isa() if self.native else None,
             "native_batch": self.native_batch if self.native else 0}
        if self.native:
            d["kernel_arena"] = kernels.arena_stats()  # slabs the repacked layouts live in
        return d
