"""Native quantized matmul: GGUF weight blocks × 8-bit-quantized activation rows (``tenzro_kernels``).

The C extension (``native/_kernels.c``, built by ``pip install ./native`` in ``make``'s venv
step) computes ``Y = X·Wᵀ`` for ``W`` a ``QuantizedMatrix`` (Q8_0, Q4_K or Q6_K) as ggml's CPU
backend does (``ggml_vec_dot_q8_0_q8_0``, ``ggml_vec_dot_q4_K_q8_K``, ``ggml_vec_dot_q6_K_q8_K``):
each activation row is first quantized to 8 bits (Q8_0 for Q8_0 weights: f32 scale per 32
values; Q8_K for K-quant weights: f32 scale and int16 group sums per 256), then every block's
dot product is an exact integer sum scaled in float32. That quantization is part of the
contract: results differ from ``x @ dequantize(W).T`` by the activation rounding (relative
error about 1e-3 of the row norm, see ``bench/bench_expert.py``), and are **bit-identical**
across the SIMD paths, the thread count and the batch a row arrives in.

SIMD path, chosen at import from the CPU (cpuid; on aarch64 the auxiliary vector): ``avx512vnni``
(512-bit vpdpbusd / vpdpwssd), ``avxvnni`` (256-bit VEX vpdpbusd), ``avx2`` (maddubs / madd),
``neondot`` (sdot), ``neon`` or ``portable`` (plain C). Set ``TENZRO_KERNEL_ISA`` to one of
those to force it; a path the CPU lacks is refused with a log line and the best available one
is kept. The x86 paths read the ``x8`` layout (``native_weights``: rows interleaved in groups
of eight, repacked once from the GGUF bytes and kept on the matrix) in tiles of eight weight
rows x up to eight activation rows; the others read the GGUF bytes one row at a time. Output
rows are split over ``threads`` OpenMP threads (groups of eight rows, or single rows).

When the extension is not built, ``available()`` is False, one log line says why, and the CPU
backend keeps its numba/numpy path. Imports nothing from Django.
"""
from __future__ import annotations

import logging
import os
import threading
import weakref

import numpy as np

from moe.quant import QuantizedMatrix

log = logging.getLogger(__name__)

ISAS = ("portable", "avx2", "avxvnni", "avx512vnni", "neon", "neondot")

try:
    import tenzro_kernels as _native
except ImportError as exc:  # not built (no compiler at install time): numba path
    _native = None
    log.warning("native quantized kernels not available (%s); the CPU backend uses its numba path. "
                "Build them with: .venv/bin/pip install ./native", exc)


def _apply_env_isa() -> None:
    want = os.environ.get("TENZRO_KERNEL_ISA", "").strip().lower()
    if not want or _native is None:
        return
    try:
        _native.set_isa(want)
    except ValueError as exc:
        log.warning("TENZRO_KERNEL_ISA=%s refused (%s); using %s", want, exc, _native.isa())


_apply_env_isa()


def available() -> bool:
    """Whether the native extension is built and importable."""
    return _native is not None


def isa() -> str | None:
    """The SIMD path in use (``portable``, ``avx2`` or ``avx512vnni``), None without the extension."""
    return _native.isa() if _native is not None else None


def supported_isas() -> list[str]:
    """The SIMD paths this CPU can run (always includes ``portable``); empty without the extension."""
    return list(_native.supported()) if _native is not None else []


def set_isa(name: str) -> None:
    """Force the SIMD path for this process. Raises ``ValueError`` for an unknown name or a path
    this CPU lacks, ``RuntimeError`` without the extension."""
    if _native is None:
        raise RuntimeError("native kernels are not built")
    _native.set_isa(name)


def env_int(name: str, default: int, minimum: int) -> int:
    """The integer environment variable ``name`` (``default`` when unset or empty). Raises
    ``ValueError`` naming the variable for text that is not an integer or a value below ``minimum``."""
    v = os.environ.get(name, "").strip()
    if not v:
        return default
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {v!r}") from None
    if n < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {n}")
    return n


def default_threads() -> int:
    """Row threads for one matmul: ``TENZRO_KERNEL_THREADS``, else numba's thread count (which
    follows ``NUMBA_NUM_THREADS``, the agent's core share). Raises ``ValueError`` naming the
    variable when it is not an integer >= 1."""
    import numba
    return env_int("TENZRO_KERNEL_THREADS", max(1, numba.get_num_threads()), 1)


def matmul_xt(x: np.ndarray, w: QuantizedMatrix, threads: int | None = None, isa: str | None = None) -> np.ndarray:
    """``x`` f32 ``[n, cols]`` · ``w``ᵀ (``w`` a ``QuantizedMatrix`` ``[rows, cols]``) → f32 ``[n, rows]``.

    Each row of ``x`` is quantized to Q8_0 (``w`` Q8_0) or Q8_K (``w`` Q4_K/Q6_K) and multiplied
    with integer dot products; ``threads`` (default ``default_threads()``) split the output rows;
    ``isa`` forces a SIMD path for this call. A non-finite value in a row makes that row's
    outputs NaN. Raises ``ValueError`` for a shape mismatch or an unavailable ``isa``,
    ``RuntimeError`` when the extension is not built.
    """
    if _native is None:
        raise RuntimeError("native kernels are not built")
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, cols = w.shape
    if x.ndim != 2 or x.shape[1] != cols:
        raise ValueError(f"x must be [n, {cols}] for a {rows}x{cols} {w.qtype} matrix, got shape {x.shape}")
    y = np.empty((x.shape[0], rows), dtype=np.float32)
    _native.matmul_xt(w.quant.native_name, native_weights(w, isa), rows, cols, x, x.shape[0], y,
                      threads if threads is not None else default_threads(), isa)
    return y


def layout(isa: str | None = None) -> str:
    """The weight layout a SIMD path reads: ``"x8"`` (the x86 paths: rows interleaved in groups of
    eight, repacked from the GGUF bytes once, ``native_weights``) or ``"gguf"`` (portable, NEON: the
    GGUF bytes as they are). Raises ``ValueError`` for a path this CPU lacks, ``RuntimeError``
    without the extension."""
    if _native is None:
        raise RuntimeError("native kernels are not built")
    return _native.layout(isa)


def native_weights(w: QuantizedMatrix, isa: str | None = None) -> np.ndarray:
    """``w``'s bytes in the layout of ``isa`` (default: the path in use): ``w.blocks`` for the GGUF
    layout; for x8 the repacked copy, made on first use and kept on ``w`` (``w.native_nbytes``
    counts it). Raises as ``layout``."""
    if layout(isa) == "gguf":
        return w.blocks
    packed = w.native_layouts.get("x8")
    if packed is None:
        rows, cols = w.shape
        packed = _ARENA.alloc(_native.x8_nbytes(w.quant.native_name, rows, cols))
        _native.pack_x8(w.quant.native_name, w.blocks, rows, cols, packed)
        weakref.finalize(w, _ARENA.release, packed)
        w.native_layouts["x8"] = packed
    return packed


class _Arena:
    """Where repacked layouts live: slabs of ``SLAB`` bytes from numpy, which advises transparent
    huge pages for them (``madvise(MADV_HUGEPAGE)``), carved per matrix; a freed block (its
    matrix collected) is reused for the next layout of the same size (a model's experts share
    their shapes). Slabs are kept for the process. Why: a one-row pass over weights in memory
    walks the page tables at every 4 KiB page, and in a VM (nested paging) that is slow: on the
    AVX-512 VNNI Xeon VM, 60 repacked 768 x 2048 Q8_0 matrices at batch 1 streamed at 0.3-0.5 GB/s
    each in its own allocation, 3.7-4.6 GB/s carved from one huge-page-advised array."""

    SLAB = 64 << 20
    ALIGN = 64

    def __init__(self):
        self._lock = threading.Lock()
        self._slab: np.ndarray | None = None
        self._off = 0
        self._free: dict[int, list[np.ndarray]] = {}

    def alloc(self, nbytes: int) -> np.ndarray:
        """A uint8 array of ``nbytes`` (uninitialised), 64-byte aligned."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
            if nbytes > self.SLAB // 4:  # a large one: its own array (numpy advises huge pages too)
                return np.empty(nbytes, dtype=np.uint8)
            if self._slab is None or self._off + nbytes > self.SLAB:
                self._slab, self._off = np.empty(self.SLAB + self.ALIGN, dtype=np.uint8), 0
                self._off = -self._slab.ctypes.data % self.ALIGN
            a = self._slab[self._off:self._off + nbytes]
            self._off += -(-nbytes // self.ALIGN) * self.ALIGN
            return a

    def release(self, a: np.ndarray) -> None:
        """Give ``a`` (from ``alloc``) back for reuse."""
        if a.base is not None:  # carved from a slab (a large one is simply freed)
            with self._lock:
                self._free.setdefault(a.nbytes, []).append(a)


_ARENA = _Arena()


__all__ = ["ISAS", "available", "default_threads", "isa", "layout", "matmul_xt", "native_weights", "set_isa",
           "supported_isas"]
