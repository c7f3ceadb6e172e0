"""``moe.rowwise.matmul_xt``: one fixed summation order, whatever the batch, the thread count,
the SIMD clone or the implementation (issue 24 item 1)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from moe import rowwise

SHAPES = [(5, 3, 2), (7, 17, 5), (64, 256, 13), (33, 1100, 9), (512, 256, 70), (96, 2048, 4)]


def fixed_order(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The module docstring's order written with numpy elementwise float32 operations (each an
    exact IEEE operation per element): a third reading, independent of both implementations."""
    n, k = x.shape
    pad = -k % 16
    xp = np.concatenate([x, np.zeros((n, pad), np.float32)], axis=1)
    wp = np.concatenate([w, np.zeros((w.shape[0], pad), np.float32)], axis=1)
    acc = np.zeros((n, w.shape[0], 16), np.float32)
    for j in range(0, k + pad, 16):
        acc += xp[:, None, j:j + 16] * wp[None, :, j:j + 16]
    s8 = acc[..., :8] + acc[..., 8:]
    s4 = s8[..., :4] + s8[..., 4:]
    return (s4[..., 0] + s4[..., 2]) + (s4[..., 1] + s4[..., 3])


def _case(m, k, n, seed=1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, k)).astype(np.float32), rng.standard_normal((m, k)).astype(np.float32)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_native_numba_and_numpy_readings_agree_bit_for_bit(m, k, n):
    x, w = _case(m, k, n)
    want = fixed_order(x, w)
    loop = np.empty((n, m), np.float32)
    rowwise._matmul_xt_loop(x, w, loop)
    np.testing.assert_array_equal(loop, want)
    if rowwise.available():
        for threads in (1, 2, 3, 4):
            np.testing.assert_array_equal(rowwise.matmul_xt(x, w, threads=threads), want)


@pytest.mark.skipif(not rowwise.available(), reason="tenzro_rowwise not built")
def test_rows_do_not_depend_on_their_batch():
    x, w = _case(300, 700, 11)
    whole = rowwise.matmul_xt(x, w, threads=4)
    for i in range(x.shape[0]):
        np.testing.assert_array_equal(rowwise.matmul_xt(x[i:i + 1], w, threads=1)[0], whole[i])
    np.testing.assert_array_equal(rowwise.matmul_xt(x[3:9], w, threads=2), whole[3:9])


def test_close_to_float64_and_rejects_bad_shapes():
    x, w = _case(100, 1000, 7)
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    assert np.max(np.abs(rowwise.matmul_xt(x, w) - ref)) < 1e-4
    assert rowwise.matmul_xt(np.zeros((0, 4), np.float32), np.ones((3, 4), np.float32)).shape == (0, 3)
    with pytest.raises(ValueError, match="do not fit"):
        rowwise.matmul_xt(np.ones((2, 4), np.float32), np.ones((3, 5), np.float32))


def test_same_bits_with_any_blas_or_openmp_thread_setting():
    """Each process computes the same products under other OPENBLAS/OMP/NUMBA thread settings."""
    code = ("import sys, numpy as np; from moe import rowwise; rng = np.random.default_rng(3); "
            "x = rng.standard_normal((37, 1100), dtype=np.float32); w = rng.standard_normal((1000, 1100), "
            "dtype=np.float32); sys.stdout.buffer.write(rowwise.matmul_xt(x, w).tobytes())")
    outs = set()
    for t in ("1", "2", "4"):
        env = dict(os.environ, OPENBLAS_NUM_THREADS=t, OMP_NUM_THREADS=t, NUMBA_NUM_THREADS=t,
                   PYTHONPATH=os.getcwd())
        env.pop("TENZRO_KERNEL_THREADS", None)
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120)
        assert res.returncode == 0, res.stderr.decode()
        outs.add(res.stdout)
    assert len(outs) == 1
