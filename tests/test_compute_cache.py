"""The device-weight cache shared by the CUDA and wgpu backends, exercised with a host "device"
(numpy copies) so it runs without a GPU; both backend modules import without their packages."""
import gc
import importlib

import numpy as np
import pytest

from moe.compute.cache import DeviceWeightCache, host_f32
from moe.quant import QuantizedMatrix


class FakeDevice:
    """Uploads are copies; frees are recorded."""

    def __init__(self):
        self.uploads = 0
        self.freed = []

    def upload(self, host):
        self.uploads += 1
        return host.copy()

    def free(self, handle):
        self.freed.append(handle.nbytes)


def _w(rows, seed=0):
    return np.random.default_rng(seed).standard_normal((rows, 64), dtype=np.float32)


def test_upload_once_then_hit():
    dev = FakeDevice()
    cache = DeviceWeightCache(1 << 20, dev.upload, dev.free)
    w = _w(4)
    a = cache.get(w)
    b = cache.get(w)
    assert a is b and dev.uploads == 1
    assert np.array_equal(a, w) and cache.resident_bytes == w.nbytes and w in cache


def test_lru_eviction_by_bytes_keeps_most_recent():
    dev = FakeDevice()
    w1, w2, w3 = _w(4, 1), _w(4, 2), _w(4, 3)  # 1 KiB each
    cache = DeviceWeightCache(2 * w1.nbytes, dev.upload, dev.free)
    cache.get(w1)
    cache.get(w2)
    cache.get(w1)  # w1 most recent: w2 is the one to go
    cache.get(w3)
    assert w1 in cache and w3 in cache and w2 not in cache
    assert dev.freed == [w2.nbytes] and cache.resident_bytes == 2 * w1.nbytes
    big = _w(64, 4)  # larger than the bound on its own: kept alone
    cache.get(big)
    assert len(cache) == 1 and big in cache and cache.resident_bytes == big.nbytes


def test_drop_clear_and_collection_free_the_device_copy():
    dev = FakeDevice()
    cache = DeviceWeightCache(1 << 20, dev.upload, dev.free)
    w1, w2 = _w(4, 1), _w(8, 2)
    cache.get(w1)
    cache.get(w2)
    cache.drop(w1)
    cache.drop(w1)  # second drop is a no-op
    assert w1 not in cache and dev.freed == [w1.nbytes] and cache.resident_bytes == w2.nbytes
    del w2
    gc.collect()
    assert len(cache) == 0 and cache.resident_bytes == 0 and dev.freed == [w1.nbytes, 8 * 64 * 4]
    w3 = _w(2, 3)
    cache.get(w3)
    cache.clear()
    assert len(cache) == 0 and cache.resident_bytes == 0


def test_quantized_weights_are_decoded_once_on_the_host():
    dev = FakeDevice()
    cache = DeviceWeightCache(1 << 20, dev.upload)
    m = QuantizedMatrix.from_dense(np.random.default_rng(5).standard_normal((3, 256)).astype(np.float32), "q4_k")
    d = cache.get(m)
    assert np.array_equal(d, m.dequantize()) and d.dtype == np.float32
    assert np.array_equal(host_f32(m), m.dequantize())
    assert cache.get(m) is d and dev.uploads == 1


def test_failed_upload_changes_nothing():
    def boom(host):
        raise MemoryError("device full")

    cache = DeviceWeightCache(1 << 20, boom)
    with pytest.raises(MemoryError):
        cache.get(_w(2))
    assert len(cache) == 0 and cache.resident_bytes == 0


@pytest.mark.parametrize("mod", ["moe.compute.cuda", "moe.compute.wgpu"])
def test_gpu_backends_import_without_their_packages(mod):
    m = importlib.import_module(mod)
    assert m.DeviceWeightCache is DeviceWeightCache
