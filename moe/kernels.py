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

SIMD path, chosen at import from the CPU (cpuid via ``__builtin_cpu_supports``): ``avx512vnni``
(vpdpbusd / vpdpwssd), ``avx2`` (maddubs / madd) or ``portable`` (plain C). Set
``TENZRO_KERNEL_ISA=portable|avx2|avx512vnni`` to force one; a path the CPU lacks is refused
with a log line and the best available one is kept. Rows are split over ``threads`` OpenMP
threads in tasks of 16 output rows.

When the extension is not built, ``available()`` is False, one log line says why, and the CPU
backend keeps its numba/numpy path. Imports nothing from Django.
"""
from __future__ import annotations

import logging
import os

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
        packed = np.frombuffer(_native.pack_x8(w.quant.native_name, w.blocks, rows, cols), dtype=np.uint8)
        w.native_layouts["x8"] = packed
    return packed


__all__ = ["ISAS", "available", "default_threads", "isa", "layout", "matmul_xt", "native_weights", "set_isa",
           "supported_isas"]
