"""CUDA backend of the compute seam (CuPy; optional extra ``[cuda]``).

Weights stay resident on the device: the first product with a weight uploads it (dense
as is, quantized decoded on the host once) and keeps the device copy in a byte-bounded
LRU (``moe.compute.cache.DeviceWeightCache``, bounded by ``TENZRO_CUDA_CACHE_BYTES``,
default half the device's free memory); ``release``
drops it when the expert leaves the memory tier. Per call only X goes up and Y comes
back. The product is cuBLAS SGEMM through ``cupy.matmul``. Imports nothing from Django.

Raises ``moe.compute.BackendUnavailable`` at construction when CuPy or a device is
missing.
"""
from __future__ import annotations

import os

import numpy as np

from moe.compute.cache import DeviceWeightCache


class CudaBackend:
    """cuBLAS SGEMM with device-resident weights."""

    tag = "cuda"
    gpu = True

    def __init__(self, device: int = 0, cache_bytes: int | None = None):
        from moe.compute import BackendUnavailable
        try:
            import cupy
        except Exception as exc:  # ImportError, or a CUDA runtime that fails to load
            raise BackendUnavailable(f"CuPy is not importable ({exc}); install the [cuda] extra") from exc
        try:
            if cupy.cuda.runtime.getDeviceCount() < 1:
                raise BackendUnavailable("no CUDA device is visible")
            self.dev = cupy.cuda.Device(device)
            self.dev.use()
            free, _total = cupy.cuda.runtime.memGetInfo()
        except BackendUnavailable:
            raise
        except Exception as exc:
            raise BackendUnavailable(f"CUDA device {device} is unusable: {exc}") from exc
        self.cp = cupy
        env = os.environ.get("TENZRO_CUDA_CACHE_BYTES")
        self.cache_bytes = int(env) if env else (cache_bytes or free // 2)
        # device f32 [out, in] per weight; CuPy frees a dropped array when its last reference goes
        self._weights = DeviceWeightCache(self.cache_bytes, upload=cupy.asarray)

    def matmul_xt(self, x: np.ndarray, w) -> np.ndarray:
        """``x`` f32 ``[n, in]`` · ``w``ᵀ → host f32 ``[n, out]``; ``w`` uploaded once and kept."""
        with self.dev:
            dw = self._weights.get(w)
            dx = self.cp.asarray(np.ascontiguousarray(x, dtype=np.float32))
            return self.cp.asnumpy(dx @ dw.T)

    def prepare(self, w) -> None:
        """Nothing on the host: the device copy is made on first use (and counted by the cache)."""

    def release(self, w) -> None:
        """Drop ``w``'s device copy."""
        self._weights.drop(w)

    def describe(self) -> dict:
        """Tag, gpu flag, device name, resident bytes and the cache bound."""
        props = self.cp.cuda.runtime.getDeviceProperties(self.dev.id)
        name = props.get("name", b"")
        return {"tag": self.tag, "gpu": True, "device": name.decode() if isinstance(name, bytes) else str(name),
                "resident_bytes": self._weights.resident_bytes, "cache_bytes": self.cache_bytes}
