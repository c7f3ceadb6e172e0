"""CUDA backend of the compute seam (CuPy; optional extra ``[cuda]``).

Weights stay resident on the device: the first product with a weight uploads it (dense
as is, quantized decoded on the host once) and keeps the device copy in a byte-bounded
LRU (``TENZRO_CUDA_CACHE_BYTES``, default half the device's free memory); ``release``
drops it when the expert leaves the memory tier. Per call only X goes up and Y comes
back. The product is cuBLAS SGEMM through ``cupy.matmul``. Imports nothing from Django.

Raises ``holders.compute.BackendUnavailable`` at construction when CuPy or a device is
missing.
"""
from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict

import numpy as np

from holders.quant import QuantizedMatrix


class CudaBackend:
    """cuBLAS SGEMM with device-resident weights."""

    tag = "cuda"
    gpu = True

    def __init__(self, device: int = 0, cache_bytes: int | None = None):
        from holders.compute import BackendUnavailable
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
        self._cache: OrderedDict[int, object] = OrderedDict()  # id(weight) → device f32 [out, in]
        self._bytes = 0
        self._lock = threading.RLock()  # weakref finalizers may run inside a locked section

    def _device_weight(self, w):
        key = id(w)
        with self._lock:
            d = self._cache.get(key)
            if d is not None:
                self._cache.move_to_end(key)
                return d
        host = w.dequantize() if isinstance(w, QuantizedMatrix) else np.ascontiguousarray(w, dtype=np.float32)
        d = self.cp.asarray(host)
        with self._lock:
            self._cache[key] = d
            self._bytes += d.nbytes
            while self._bytes > self.cache_bytes and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._bytes -= old.nbytes
        weakref.finalize(w, self._drop, key)  # id() may be reused once w is gone
        return d

    def _drop(self, key: int) -> None:
        with self._lock:
            d = self._cache.pop(key, None)
            if d is not None:
                self._bytes -= d.nbytes

    def matmul_xt(self, x: np.ndarray, w) -> np.ndarray:
        """``x`` f32 ``[n, in]`` · ``w``ᵀ → host f32 ``[n, out]``; ``w`` uploaded once and kept."""
        with self.dev:
            dw = self._device_weight(w)
            dx = self.cp.asarray(np.ascontiguousarray(x, dtype=np.float32))
            return self.cp.asnumpy(dx @ dw.T)

    def release(self, w) -> None:
        """Drop ``w``'s device copy."""
        self._drop(id(w))

    def describe(self) -> dict:
        """Tag, gpu flag, device name, resident bytes and the cache bound."""
        props = self.cp.cuda.runtime.getDeviceProperties(self.dev.id)
        name = props.get("name", b"")
        return {"tag": self.tag, "gpu": True, "device": name.decode() if isinstance(name, bytes) else str(name),
                "resident_bytes": self._bytes, "cache_bytes": self.cache_bytes}
