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
of eight, repacked once from the GGUF bytes and kept on the matrix instead of them, in slabs of the
``Arena``) in tiles of eight weight
rows x up to eight activation rows; the others read the GGUF bytes one row at a time. Output
rows are split over ``threads`` OpenMP threads (groups of eight rows, or single rows).

When the extension is not built, ``available()`` is False, one log line says why, and the CPU
backend keeps its numba/numpy path. Imports nothing from Django.
"""
from __future__ import annotations

import logging
import functools
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
    if os.environ.get("TENZRO_KERNEL_THREADS", "").strip():  # numba asked only when unset (per matmul: µs count)
        return env_int("TENZRO_KERNEL_THREADS", 1, 1)
    import numba
    return max(1, numba.get_num_threads())


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


def matmul_xt_many(x: np.ndarray, ws, threads: int | None = None, isa: str | None = None) -> list[np.ndarray]:
    """``[x · wᵀ for w in ws]`` for ``QuantizedMatrix`` es of one qtype and shape (an expert's gate and
    up projections): ``x`` is quantized once, not per matrix. Bit-identical to ``matmul_xt`` on each.
    Raises as ``matmul_xt``, and ``ValueError`` when the matrices differ in qtype or shape."""
    if _native is None:
        raise RuntimeError("native kernels are not built")
    ws = tuple(ws)
    if not ws or any(w.qtype != ws[0].qtype or w.shape != ws[0].shape for w in ws):
        raise ValueError("matmul_xt_many needs one or more matrices of one qtype and shape")
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, cols = ws[0].shape
    if x.ndim != 2 or x.shape[1] != cols:
        raise ValueError(f"x must be [n, {cols}] for a {rows}x{cols} {ws[0].qtype} matrix, got shape {x.shape}")
    ys = tuple(np.empty((x.shape[0], rows), dtype=np.float32) for _ in ws)
    _native.matmul_xt_many(ws[0].quant.native_name, tuple(native_weights(w, isa) for w in ws), rows, cols, x,
                           x.shape[0], ys, threads if threads is not None else default_threads(), isa)
    return list(ys)


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
    layout; for x8 the repacked copy, made on first use in the arena and adopted by ``w``
    (``QuantizedMatrix.adopt_layout``): from then on ``w`` holds only the x8 copy, and
    ``w.blocks`` rebuilds the GGUF bytes from it bit for bit (``unpack_x8``). The x8 block goes
    back to the arena when ``w`` is collected. Raises as ``layout``."""
    if layout(isa) == "gguf":
        return w.blocks
    packed = w.native_layouts.get("x8")
    if packed is None:
        rows, cols = w.shape
        q = w.quant.native_name
        packed = _ARENA.alloc(_native.x8_nbytes(q, rows, cols))
        _native.pack_x8(q, w.blocks, rows, cols, packed)
        kept = w.adopt_layout("x8", packed, functools.partial(unpack_x8, q, rows, cols))
        if kept is not packed:  # another thread adopted its copy first
            _ARENA.release(packed)
            return kept
        weakref.finalize(w, _ARENA.release, packed)
    return packed


def unpack_x8(qtype: str, rows: int, cols: int, packed: np.ndarray) -> np.ndarray:
    """The GGUF rows (uint8 ``[rows * row_bytes]``) of an x8 layout ``packed`` of a ``rows`` x
    ``cols`` matrix of ``qtype`` (``q8_0``, ``q4_k``, ``q6_k``), byte for byte those it was packed
    from. Raises ``ValueError`` for sizes that do not match, ``RuntimeError`` without the extension."""
    if _native is None:
        raise RuntimeError("native kernels are not built")
    from moe.quant import quantized_nbytes
    out = np.empty(rows * quantized_nbytes(cols, qtype), dtype=np.uint8)
    _native.unpack_x8(qtype, packed, rows, cols, out)
    return out


class _Slab:
    """One huge-page-advised array the arena carves: bump offset, live blocks, freed blocks by size."""

    __slots__ = ("buf", "base", "off", "live", "free")

    def __init__(self, nbytes: int, align: int):
        self.buf = np.empty(nbytes + align, dtype=np.uint8)
        self.base = -self.buf.ctypes.data % align  # first aligned offset
        self.off = self.base
        self.live = 0
        self.free: dict[int, list[int]] = {}


class Arena:
    """Where repacked layouts live: slabs of ``slab_bytes`` from numpy, which advises transparent
    huge pages for them (``madvise(MADV_HUGEPAGE)``), carved per matrix (64-byte aligned).

    A released block (its matrix collected) is reused for the next block of the same size (a
    model's experts share their shapes), taken from the fullest slab first so that emptier slabs
    drain; a slab whose blocks are all released is freed at once (numpy gives it back to the OS:
    an allocation of this size is its own mmap), so evict / reload cycles do not grow memory. A
    block above a quarter slab is its own array. Why slabs: a one-row pass over weights in memory
    walks the page tables at every 4 KiB page, and in a VM (nested paging) that is slow: on the
    AVX-512 VNNI Xeon VM, 60 repacked 768 x 2048 Q8_0 matrices at batch 1 streamed at 0.3-0.5
    GB/s each in its own allocation, 3.7-4.6 GB/s carved from one huge-page-advised array."""

    ALIGN = 64

    def __init__(self, slab_bytes: int = 64 << 20):
        self.slab_bytes = int(slab_bytes)
        self._lock = threading.RLock()  # release runs from finalizers, possibly inside alloc
        self._slabs: dict[int, _Slab] = {}  # id(slab.buf) -> slab
        self._cur: _Slab | None = None  # the slab being carved
        self._large = 0  # bytes in blocks of their own

    def alloc(self, nbytes: int) -> np.ndarray:
        """A uint8 array of ``nbytes`` (uninitialised), 64-byte aligned; give it back with ``release``."""
        nbytes = int(nbytes)
        if nbytes > self.slab_bytes // 4:
            with self._lock:
                self._large += nbytes
            return np.empty(nbytes, dtype=np.uint8)
        size = -(-nbytes // self.ALIGN) * self.ALIGN
        while True:
            with self._lock:
                reuse = [s for s in self._slabs.values() if s.free.get(size)]
                if reuse:
                    slab = max(reuse, key=lambda s: s.live)
                    return self._take(slab, slab.free[size].pop(), nbytes)
                slab = self._cur
                if slab is not None and slab.off + size <= slab.base + self.slab_bytes:
                    slab.off += size
                    return self._take(slab, slab.off - size, nbytes)
            fresh = _Slab(self.slab_bytes, self.ALIGN)  # outside the lock (a finalizer may run meanwhile)
            with self._lock:
                self._slabs[id(fresh.buf)] = fresh
                self._cur = fresh

    @staticmethod
    def _take(slab: _Slab, off: int, nbytes: int) -> np.ndarray:
        slab.live += 1
        return slab.buf[off:off + nbytes]

    def release(self, a: np.ndarray) -> None:
        """Give ``a`` (from ``alloc``) back: its space is reused, and its slab freed once empty."""
        with self._lock:
            slab = self._slabs.get(id(a.base)) if a.base is not None else None
            if slab is None:  # a block of its own: freed with the array
                self._large -= a.nbytes
                return
            slab.live -= 1
            if slab.live == 0:
                del self._slabs[id(slab.buf)]
                if self._cur is slab:
                    self._cur = None
                return
            off = a.ctypes.data - slab.buf.ctypes.data
            slab.free.setdefault(-(-a.nbytes // self.ALIGN) * self.ALIGN, []).append(off)

    def stats(self) -> dict:
        """``slabs`` (count), ``slab_bytes`` (held in slabs), ``live_blocks`` (handed out in slabs),
        ``large_bytes`` (live blocks of their own)."""
        with self._lock:
            return {"slabs": len(self._slabs), "slab_bytes": len(self._slabs) * self.slab_bytes,
                    "live_blocks": sum(s.live for s in self._slabs.values()), "large_bytes": self._large}


_ARENA = Arena()


def arena_stats() -> dict:
    """The process arena's ``Arena.stats()`` (where the x8 layouts live)."""
    return _ARENA.stats()


__all__ = ["ISAS", "Arena", "arena_stats", "available", "default_threads", "isa", "layout", "matmul_xt", "matmul_xt_many", "native_weights",
           "set_isa", "supported_isas", "unpack_x8"]
