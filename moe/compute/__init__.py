"""The compute seam: ``Y = X·Wᵀ`` for dense float32 and GGUF-quantized expert weights.

One interface, several backends (reference §5.4, without its gaps 26: GPU backends keep
weights resident on the device instead of uploading them per call):

- ``cpu`` (``moe.compute.cpu``): always present.
- ``cuda`` (``moe.compute.cuda``, CuPy; extra ``[cuda]``): selected when CuPy imports,
  a device is visible and a probe matmul agrees with the CPU.
- ``wgpu`` (``moe.compute.wgpu``, wgpu-py + WGSL; extra ``[wgpu]``): any vendor's GPU;
  ``auto`` takes it only on a real GPU adapter, ``wgpu`` also on a CPU emulation (lavapipe).

``select_backend()`` runs once per process (``TENZRO_COMPUTE_BACKEND`` = ``auto`` (default),
``cpu``, ``cuda`` or ``wgpu``; ``auto`` tries CUDA, then wgpu, then the CPU); ``backend()``
returns the selected one; status reports its ``tag`` and ``gpu`` flag and the agent
advertises ``moe_gpu`` from it. Imports nothing from Django.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Protocol, Union

import numpy as np

from moe.quant import QuantizedMatrix

log = logging.getLogger(__name__)

Weight = Union[np.ndarray, QuantizedMatrix]
BACKENDS = ("auto", "cpu", "cuda", "wgpu")


class ComputeBackend(Protocol):
    """What every backend provides."""

    tag: str
    gpu: bool

    def matmul_xt(self, x: np.ndarray, w: Weight) -> np.ndarray:
        """``x`` f32 ``[n, in]`` times ``w`` ``[out, in]`` transposed → f32 ``[n, out]`` (host array)."""

    def prepare(self, w: Weight) -> None:
        """Make whatever host-side copy of ``w`` the backend keeps (called when an expert enters
        the memory tier, before its bytes are counted)."""

    def release(self, w: Weight) -> None:
        """Forget anything cached for ``w`` (called when an expert leaves the memory tier)."""

    def describe(self) -> dict:
        """JSON-able facts for status."""


class BackendUnavailable(RuntimeError):
    """A backend named explicitly cannot run here (the message says why)."""


def _probe(b) -> None:
    """Check a GPU backend against numpy on a small product; raises on any disagreement."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 64), dtype=np.float32)
    w = rng.standard_normal((5, 64), dtype=np.float32)
    y = b.matmul_xt(x, w)
    b.release(w)
    if not np.allclose(y, x @ w.T, rtol=1e-4, atol=1e-4):
        raise BackendUnavailable(f"{b.tag} probe matmul disagrees with numpy")


def make_backend(name: str, allow_cpu_adapter: bool = True) -> ComputeBackend:
    """Construct and probe backend ``name`` (``cpu``, ``cuda`` or ``wgpu``; ``allow_cpu_adapter``
    lets wgpu run on a CPU emulation such as lavapipe).

    Raises ``BackendUnavailable`` with the reason (package missing, no device, probe failed)
    and ``ValueError`` for an unknown name.
    """
    if name == "cpu":
        from moe.compute.cpu import CpuBackend
        return CpuBackend()
    if name == "cuda":
        from moe.compute.cuda import CudaBackend
        b = CudaBackend()
        _probe(b)
        return b
    if name == "wgpu":
        from moe.compute.wgpu import WgpuBackend
        b = WgpuBackend(allow_cpu=allow_cpu_adapter)
        _probe(b)
        return b
    raise ValueError(f"unknown compute backend {name!r}; choose one of {', '.join(BACKENDS)}")


def select_backend(preference: str | None = None) -> ComputeBackend:
    """Pick the backend: an explicit ``preference`` (or ``TENZRO_COMPUTE_BACKEND``) must work,
    ``auto`` tries CUDA, then wgpu on a real GPU adapter, and falls back to the CPU, logging why.

    Raises ``BackendUnavailable`` when an explicitly requested GPU backend cannot run, and
    ``ValueError`` for an unknown name.
    """
    name = (preference or os.environ.get("TENZRO_COMPUTE_BACKEND") or "auto").strip().lower()
    if name not in BACKENDS:
        raise ValueError(f"unknown compute backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name != "auto":
        return make_backend(name)
    for gpu in ("cuda", "wgpu"):
        try:
            return make_backend(gpu, allow_cpu_adapter=False)
        except Exception as exc:  # any import/driver failure means "not here": fall back
            log.info("%s compute backend not used: %s", gpu, exc)
    return make_backend("cpu")


_selected: ComputeBackend | None = None
_lock = threading.Lock()


def backend() -> ComputeBackend:
    """The process's backend, selected on first use."""
    global _selected
    if _selected is None:
        with _lock:
            if _selected is None:
                _selected = select_backend()
    return _selected


def set_backend(b: ComputeBackend) -> None:
    """Use ``b`` for this process from now on (selection at agent start, tests)."""
    global _selected
    _selected = b


def matmul_xt(x: np.ndarray, w: Weight) -> np.ndarray:
    """``x`` f32 ``[n, in]`` · ``w``ᵀ (``w`` f32 ndarray or ``QuantizedMatrix`` ``[out, in]``) → f32 ``[n, out]``
    on the selected backend."""
    return backend().matmul_xt(x, w)


def matmul_xt_many(x: np.ndarray, ws) -> list[np.ndarray]:
    """``[matmul_xt(x, w) for w in ws]`` on the selected backend, which may share work between the
    products (the CPU backend quantizes ``x`` once for quantized matrices of one qtype and shape);
    the results are those of ``matmul_xt``, bit for bit."""
    b = backend()
    many = getattr(b, "matmul_xt_many", None)
    return many(x, ws) if many is not None else [b.matmul_xt(x, w) for w in ws]


__all__ = ["BACKENDS", "BackendUnavailable", "ComputeBackend", "Weight", "backend", "make_backend",
           "matmul_xt", "matmul_xt_many", "select_backend", "set_backend"]
