"""The device-weight cache shared by the GPU backends (CUDA, wgpu).

A GPU backend keeps each expert weight resident on its device (reference gap 26): the first
product with a weight uploads it as float32 (a ``QuantizedMatrix`` decoded on the host once)
and later products reuse the device copy. ``DeviceWeightCache`` is that one byte-bounded LRU,
keyed by the weight object's identity: a backend supplies ``upload`` (host array → device
handle) and, when device memory must be freed explicitly, ``free``. Pure Python + numpy;
imports nothing from Django and no GPU package.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Callable

import numpy as np

from moe.quant import QuantizedMatrix


def host_f32(w) -> np.ndarray:
    """``w`` as a C-contiguous float32 host array ``[out, in]``: a ``QuantizedMatrix`` decoded
    (bit-identical to gguf-py's ``dequantize``), a dense array converted without copy when it
    already is one."""
    if isinstance(w, QuantizedMatrix):
        return w.dequantize()
    return np.ascontiguousarray(w, dtype=np.float32)


class DeviceWeightCache:
    """LRU of device copies of weights, bounded by ``capacity_bytes`` of float32 data.

    ``upload(host f32 [out, in]) -> handle`` puts a weight on the device; ``free(handle)``
    (optional) releases a handle dropped from the cache (eviction, ``drop``, the weight being
    garbage-collected); without it dropped handles are left to the device library's own
    reference counting (CuPy). The most recently used entry is never evicted, so a single
    weight larger than the bound still works. ``lock`` (default a new ``RLock``) guards the
    table; a backend that serialises its device queue passes its own so a drop cannot free a
    buffer in use. Keys are ``id(w)``; a finalizer drops the entry when ``w`` is collected, since
    ``id`` values are reused.
    """

    def __init__(self, capacity_bytes: int, upload: Callable[[np.ndarray], object],
                 free: Callable[[object], None] | None = None, lock=None):
        self.capacity_bytes = int(capacity_bytes)
        self._upload = upload
        self._free = free
        self._entries: OrderedDict[int, tuple[object, int]] = OrderedDict()  # id(w) → (handle, bytes)
        self._bytes = 0
        self._lock = lock if lock is not None else threading.RLock()  # finalizers may re-enter

    @property
    def resident_bytes(self) -> int:
        """Bytes of float32 weight data currently held on the device."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, w) -> bool:
        return id(w) in self._entries

    def get(self, w):
        """The device handle of weight ``w`` (ndarray or ``QuantizedMatrix`` ``[out, in]``),
        uploading it on a miss and evicting least-recently-used entries beyond the bound.
        Errors of ``upload`` propagate and leave the cache unchanged."""
        key = id(w)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit[0]
        host = host_f32(w)  # decode and upload outside the lock: other weights stay usable
        handle = self._upload(host)
        evicted = []
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:  # another thread uploaded it meanwhile: keep that copy
                self._entries.move_to_end(key)
                evicted.append(handle)
                handle = hit[0]
            else:
                self._entries[key] = (handle, host.nbytes)
                self._bytes += host.nbytes
                while self._bytes > self.capacity_bytes and len(self._entries) > 1:
                    _, (old, nbytes) = self._entries.popitem(last=False)
                    self._bytes -= nbytes
                    evicted.append(old)
                weakref.finalize(w, self._drop_key, key)
            for old in evicted:
                self._release(old)
        return handle

    def drop(self, w) -> None:
        """Forget ``w``'s device copy (no-op when none is held)."""
        self._drop_key(id(w))

    def clear(self) -> None:
        """Drop every device copy."""
        with self._lock:
            while self._entries:
                _, (handle, _n) = self._entries.popitem(last=False)
                self._release(handle)
            self._bytes = 0

    def _drop_key(self, key: int) -> None:
        with self._lock:
            hit = self._entries.pop(key, None)
            if hit is not None:
                self._bytes -= hit[1]
                self._release(hit[0])

    def _release(self, handle) -> None:
        if self._free is not None:
            self._free(handle)


__all__ = ["DeviceWeightCache", "host_f32"]
