"""Native quantized kernels (moe.kernels / native/_kernels.c): every SIMD path bit-identical to an
independent numpy model of the contract (8-bit activation quantization, exact integer block sums,
fixed float order), on ggml's golden quantized bytes and on random and adversarial blocks."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moe import kernels, rowwise
from moe.compute.cpu import CpuBackend
from moe.quant import QuantizedMatrix, quantize

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels not built (pip install ./native)")

GOLDEN = Path(__file__).parent / "fixtures" / "gguf_golden" / "ggml_ref_quant_vectors.npz"
F32 = np.float32


# ---- numpy model of the contract -------------------------------------------------------

def _roundf(v):
    """C roundf (half away from zero), exact."""
    r = np.rint(v)
    tie = np.abs(v - np.trunc(v)) == F32(0.5)
    return np.where(tie, np.trunc(v) + np.sign(v), r)


def _q8_0_act(x):
    xb = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(axis=2)
    d = (amax / F32(127)).astype(F32)
    with np.errstate(divide="ignore"):
        idv = np.where(d != 0, F32(1) / d, F32(0)).astype(F32)
    q = _roundf((xb * idv[..., None]).astype(F32)).astype(np.int64)
    return q, d


def _q8_k_act(x):
    xb = x.reshape(x.shape[0], -1, 256)
    i = np.abs(xb).argmax(axis=2)
    mx = np.take_along_axis(xb, i[..., None], axis=2)[..., 0]
    with np.errstate(divide="ignore"):
        iscale = np.where(mx != 0, F32(-127) / mx, F32(0)).astype(F32)
    v = ((xb * iscale[..., None]).astype(F32) + F32(12582912.0)).astype(F32)
    q = np.minimum((v.view(np.int32) & 0x7FFFFF) - 0x400000, 127).astype(np.int64)
    with np.errstate(divide="ignore"):
        d = np.where(mx != 0, F32(1) / iscale, F32(0)).astype(F32)
    return q, d


def _f16(b, off):
    return np.ascontiguousarray(b[..., off:off + 2]).view("<f2")[..., 0].astype(F32)


def model_matmul(x, m):
    """The kernel's result computed in numpy from integer decodes (no SIMD, no C)."""
    rows, cols = m.shape
    n = x.shape[0]
    y = np.zeros((n, rows), F32)
    if m.qtype == "q8_0":
        b = m.blocks.reshape(rows, -1, 34)
        qw = b[..., 2:].view(np.int8).astype(np.int64)
        dw = _f16(b, 0)
        qx, dx = _q8_0_act(x)
        s = np.einsum("rbj,nbj->nrb", qw, qx).astype(F32)  # exact integers
        terms = s * (dw[None] * dx[:, None, :]).astype(F32)
        acc = np.zeros((n, rows, 8), F32)
        for blk in range(terms.shape[2]):
            acc[..., blk % 8] = acc[..., blk % 8] + terms[..., blk]
        a = acc
        return ((a[..., 0] + a[..., 1]) + (a[..., 2] + a[..., 3])) + ((a[..., 4] + a[..., 5]) + (a[..., 6] + a[..., 7]))
    qx, dx = _q8_k_act(x)
    nb = cols // 256
    if m.qtype == "q4_k":
        b = m.blocks.reshape(rows, nb, 144).astype(np.int64)
        sc12 = b[..., 4:16]
        sc = np.empty((rows, nb, 8), np.int64)
        mn = np.empty((rows, nb, 8), np.int64)
        for j in range(8):
            if j < 4:
                sc[..., j], mn[..., j] = sc12[..., j] & 63, sc12[..., j + 4] & 63
            else:
                sc[..., j] = (sc12[..., j + 4] & 0xF) | ((sc12[..., j - 4] >> 6) << 4)
                mn[..., j] = (sc12[..., j + 4] >> 4) | ((sc12[..., j] >> 6) << 4)
        qs = b[..., 16:].reshape(rows, nb, 4, 32)
        q = np.stack([qs & 0xF, qs >> 4], axis=3).reshape(rows, nb, 8, 32)
        sub = np.einsum("rbjl,nbjl->nrbj", q, qx.reshape(n, nb, 8, 32))
        sumi = (sub * sc[None]).sum(axis=3).astype(F32)
        bsum = qx.reshape(n, nb, 8, 32).sum(axis=3)
        mins = np.einsum("rbj,nbj->nrb", mn, bsum).astype(F32)
        d, dmin = _f16(m.blocks.reshape(rows, nb, 144), 0), _f16(m.blocks.reshape(rows, nb, 144), 2)
        for blk in range(nb):
            y = y + (d[None, :, blk] * dx[:, None, blk]).astype(F32) * sumi[..., blk]
            y = y - (dmin[None, :, blk] * dx[:, None, blk]).astype(F32) * mins[..., blk]
        return y
    b = m.blocks.reshape(rows, nb, 210).astype(np.int64)
    q = np.empty((rows, nb, 256), np.int64)
    for h in range(2):
        ql, qh = b[..., 64 * h:64 * h + 64], b[..., 128 + 32 * h:160 + 32 * h]
        base = 128 * h
        q[..., base:base + 32] = (ql[..., :32] & 0xF) | ((qh & 3) << 4)
        q[..., base + 32:base + 64] = (ql[..., 32:] & 0xF) | (((qh >> 2) & 3) << 4)
        q[..., base + 64:base + 96] = (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4)
        q[..., base + 96:base + 128] = (ql[..., 32:] >> 4) | ((qh >> 6) << 4)
    sc = m.blocks.reshape(rows, nb, 210)[..., 192:208].view(np.int8).astype(np.int64)
    sub = np.einsum("rbgl,nbgl->nrbg", (q - 32).reshape(rows, nb, 16, 16), qx.reshape(n, nb, 16, 16))
    sumi = (sub * sc[None]).sum(axis=3).astype(F32)
    d = _f16(m.blocks.reshape(rows, nb, 210), 208)
    for blk in range(nb):
        y = y + (d[None, :, blk] * dx[:, None, blk]).astype(F32) * sumi[..., blk]
    return y


# ---- tests ------------------------------------------------------------------------------

def _golden_matrices():
    z = np.load(GOLDEN)
    for case in ("normal", "heavy", "uniform_pos", "uniform_neg", "edge", "bf16"):
        for key, q in (("q8_0", "q8_0"), ("q4_K", "q4_k"), ("q6_K", "q6_k")):
            raw = z[f"{case}__{key}"]
            yield case, QuantizedMatrix(q, (8, 2048), raw)


@pytest.mark.parametrize("isa", kernels.supported_isas())
def test_every_path_matches_the_numpy_model_on_golden_bytes(isa):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3, 2048), dtype=np.float32)
    x[1] *= 1e-3
    x[2, :256] = 0.0  # an all-zero activation block
    for case, m in _golden_matrices():
        y = kernels.matmul_xt(x, m, threads=1, isa=isa)
        np.testing.assert_array_equal(y.view(np.uint32), model_matmul(x, m).view(np.uint32), err_msg=f"{case} {m.qtype}")


def _random_blocks(q, rows, cols, rng):
    """Random bytes with valid finite scales: every quant pattern, incl. int8 -128 and fp16 subnormal scales."""
    m = QuantizedMatrix.from_dense(rng.standard_normal((rows, cols), dtype=np.float32), q)
    b = m.blocks.copy()
    bb = b.reshape(-1, {"q8_0": 34, "q4_k": 144, "q6_k": 210}[q])
    scale_offs = {"q8_0": (0,), "q4_k": (0, 2), "q6_k": (208,)}[q]
    body = np.ones(bb.shape[1], bool)
    for o in scale_offs:
        body[o:o + 2] = False
    bb[:, body] = rng.integers(0, 256, (bb.shape[0], body.sum()), dtype=np.uint8)
    bb[::7, scale_offs[0]:scale_offs[0] + 2] = np.array([1, 0], np.uint8)  # subnormal fp16 scale
    return QuantizedMatrix(q, (rows, cols), b)


@pytest.mark.parametrize("q,cols", [("q8_0", 32 * 13), ("q8_0", 32 * 61), ("q4_k", 768), ("q6_k", 512)])
def test_random_blocks_bit_identical_across_paths_threads_and_batches(q, cols):
    rng = np.random.default_rng(5)
    m = _random_blocks(q, 37, cols, rng)
    x = (rng.standard_normal((5, cols)) * rng.choice([1e-30, 1.0, 1e4], size=(5, 1))).astype(np.float32)
    ref = model_matmul(x, m)
    for isa in kernels.supported_isas():
        for threads in (1, 3):
            y = kernels.matmul_xt(x, m, threads=threads, isa=isa)
            np.testing.assert_array_equal(y.view(np.uint32), ref.view(np.uint32), err_msg=f"{isa} x{threads}")
        one = kernels.matmul_xt(x[3:4], m, threads=1, isa=isa)  # a row alone == the row in a batch
        np.testing.assert_array_equal(one[0].view(np.uint32), ref[3].view(np.uint32))


@pytest.mark.parametrize("q", ["q8_0", "q4_k", "q6_k"])
def test_activation_rounding_ties_and_signed_largest_magnitude(q):
    """Activation rows whose quantization hits exact halves (Q8_0 rounds them away from zero, Q8_K to
    even) and whose largest magnitude appears with both signs: every path quantizes them as the
    model does."""
    cols = 512
    halves = (np.arange(cols) % 64 - 32 + 0.5).astype(np.float32)  # k + 0.5, |.| <= 31.5
    x = np.zeros((4, cols), np.float32)
    x[0] = halves
    x[0, ::32] = 127.0  # Q8_0: d = 1 in every block, so x * id are the halves themselves
    x[1] = halves
    x[1, 5], x[1, 9] = -127.0, 127.0  # Q8_K: mx = -127 first, iscale = 1
    x[1, 261], x[1, 300] = 127.0, -127.0  # second block: mx = +127 first, iscale = -1
    x[2] = -x[1]
    x[3] = halves * np.float32(1e-3)
    m = _random_blocks(q, 9, cols, np.random.default_rng(2))
    ref = model_matmul(x, m)
    for isa in kernels.supported_isas():
        y = kernels.matmul_xt(x, m, threads=1, isa=isa)
        np.testing.assert_array_equal(y.view(np.uint32), ref.view(np.uint32), err_msg=isa)


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512vnni"])
def test_forced_path_via_environment(isa):
    code = ("import numpy as np; from moe import kernels; from moe.quant import QuantizedMatrix;"
            "m = QuantizedMatrix.from_dense(np.random.default_rng(1).standard_normal((16, 512), dtype=np.float32), 'q4_k');"
            "x = np.random.default_rng(2).standard_normal((2, 512), dtype=np.float32);"
            "print(kernels.isa()); print(kernels.matmul_xt(x, m, threads=1).tobytes().hex())")
    env = dict(os.environ, TENZRO_KERNEL_ISA=isa,
               PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got_isa, got = r.stdout.split()
    if isa in kernels.supported_isas():
        assert got_isa == isa
    else:  # refused with a log line, best available path kept
        assert "refused" in r.stderr and got_isa == kernels.supported_isas()[-1]
    m = QuantizedMatrix.from_dense(np.random.default_rng(1).standard_normal((16, 512), dtype=np.float32), "q4_k")
    x = np.random.default_rng(2).standard_normal((2, 512), dtype=np.float32)
    assert got == kernels.matmul_xt(x, m, threads=1, isa="portable").tobytes().hex()


@pytest.mark.parametrize("q", ["q8_0", "q4_k", "q6_k"])
def test_error_against_the_f32_decode_path(q):
    rng = np.random.default_rng(9)
    m = QuantizedMatrix(q, (64, 1024), quantize(rng.standard_normal((64, 1024), dtype=np.float32), q))
    x = rng.standard_normal((4, 1024), dtype=np.float32)
    ref = x @ m.dequantize().T
    err = np.abs(kernels.matmul_xt(x, m) - ref).max() / np.abs(ref).max()
    assert 0 < err < 2e-2  # activation rounding to 8 bits, nothing more


def test_non_finite_rows_give_nan_and_bad_shapes_raise():
    m = QuantizedMatrix.from_dense(np.ones((4, 256), np.float32), "q6_k")
    x = np.ones((2, 256), np.float32)
    x[1, 7] = np.inf
    y = kernels.matmul_xt(x, m)
    assert np.isfinite(y[0]).all() and np.isnan(y[1]).all()
    with pytest.raises(ValueError, match=r"x must be \[n, 256\]"):
        kernels.matmul_xt(np.ones((2, 128), np.float32), m)
    with pytest.raises(ValueError, match="ISA"):
        kernels.matmul_xt(x, m, isa="sse9")
    with pytest.raises(ValueError):
        kernels.set_isa("sse9")


def test_cpu_backend_switches_to_decode_and_blas_above_native_batch():
    m = QuantizedMatrix.from_dense(np.random.default_rng(3).standard_normal((8, 256), dtype=np.float32), "q8_0")
    b = CpuBackend(native_batch=4)
    assert b.describe()["native_kernels"] == kernels.isa()
    small = np.random.default_rng(4).standard_normal((4, 256), dtype=np.float32)
    np.testing.assert_array_equal(b.matmul_xt(small, m), kernels.matmul_xt(small, m))
    big = np.random.default_rng(4).standard_normal((5, 256), dtype=np.float32)
    # Above it: decoded, then the dense path's row-invariant product (moe.rowwise).
    np.testing.assert_array_equal(b.matmul_xt(big, m), rowwise.matmul_xt(big, m.dequantize()))
    np.testing.assert_array_equal(b.matmul_xt(big, m)[:1], b.matmul_xt(np.repeat(big[:1], 5, 0), m)[:1])


def test_native_batch_default_follows_the_simd_path(monkeypatch):
    from moe.compute.cpu import NATIVE_BATCH_BY_ISA
    monkeypatch.delenv("TENZRO_QUANT_NATIVE_BATCH", raising=False)
    before = kernels.isa()
    try:
        for isa in kernels.supported_isas():
            kernels.set_isa(isa)
            assert CpuBackend().native_batch == NATIVE_BATCH_BY_ISA[isa]
        monkeypatch.setenv("TENZRO_QUANT_NATIVE_BATCH", "7")
        assert CpuBackend().native_batch == 7
    finally:
        kernels.set_isa(before)


@pytest.mark.parametrize("name, value", [("TENZRO_QUANT_NATIVE_BATCH", "x"), ("TENZRO_QUANT_NATIVE_BATCH", "-1"),
                                         ("TENZRO_QUANT_SMALL_BATCH", "8.5"), ("TENZRO_KERNEL_THREADS", "x"),
                                         ("TENZRO_KERNEL_THREADS", "0")])
def test_malformed_kernel_settings_are_refused_when_the_backend_starts(monkeypatch, name, value):
    """A bad value fails the CPU backend's construction (the agent's start, a CommandError there)
    naming the variable, instead of failing every quantized batch later or silently turning the
    native kernels off (-1 did)."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        CpuBackend()
    monkeypatch.setenv(name, "3")
    assert CpuBackend() is not None


X8_BLOCK = {"q8_0": (32, 272), "q4_k": (256, 1184), "q6_k": (256, 1680)}


@pytest.mark.parametrize("q", ["q8_0", "q4_k", "q6_k"])
def test_x8_tiles_and_partial_row_groups_are_bit_identical_and_batch_invariant(q):
    """The x86 paths read the repacked x8 layout in tiles of eight weight rows x up to eight
    activation rows: a partial last row group (13 rows), every tile remainder (n = 1, 3, 8, 9, 19)
    and a row alone all give the model's bits, so no row depends on its neighbours or the batch."""
    rng = np.random.default_rng(21)
    cols = 512
    m = _random_blocks(q, 13, cols, rng)
    x = rng.standard_normal((19, cols), dtype=np.float32)
    ref = model_matmul(x, m)
    for isa in kernels.supported_isas():
        for n in (1, 3, 8, 9, 19):
            y = kernels.matmul_xt(x[:n], m, threads=2, isa=isa)
            np.testing.assert_array_equal(y.view(np.uint32), ref[:n].view(np.uint32), err_msg=f"{isa} n={n}")
        alone = kernels.matmul_xt(x[17:18], m, threads=1, isa=isa)
        np.testing.assert_array_equal(alone[0].view(np.uint32), ref[17].view(np.uint32), err_msg=isa)


@pytest.mark.parametrize("q", ["q8_0", "q4_k", "q6_k"])
def test_repacked_layout_replaces_the_gguf_bytes_bit_for_bit(q):
    """Once repacked, a matrix holds only its x8 copy (``nbytes`` is its size); ``blocks`` gives the
    GGUF bytes back byte for byte (read-only, rebuilt each read), and every path's output is the
    model's on the original bytes, before and after."""
    m = _random_blocks(q, 13, 512, np.random.default_rng(4))
    orig = m.blocks.copy()
    x = np.random.default_rng(5).standard_normal((3, 512), dtype=np.float32)
    ref = model_matmul(x, QuantizedMatrix(q, (13, 512), orig))
    assert m.nbytes == orig.nbytes == m.gguf_nbytes and m.native_layouts == {} and m.holds_gguf
    for isa in kernels.supported_isas():
        w = kernels.native_weights(m, isa)
        if kernels.layout(isa) == "gguf":
            np.testing.assert_array_equal(w, orig)
        else:
            per, size = X8_BLOCK[q]
            assert w.nbytes == 2 * (512 // per) * size  # two groups of eight rows, the second padded
            assert kernels.native_weights(m, isa) is w  # made once
            assert m.nbytes == w.nbytes and not m.holds_gguf  # the GGUF bytes are gone from memory
            assert m.gguf_nbytes == orig.nbytes
        y = kernels.matmul_xt(x, m, threads=1, isa=isa)
        np.testing.assert_array_equal(y.view(np.uint32), ref.view(np.uint32), err_msg=isa)
    np.testing.assert_array_equal(m.blocks, orig)
    assert not m.holds_gguf or not any(kernels.layout(i) == "x8" for i in kernels.supported_isas())
    if not m.holds_gguf:
        assert not m.blocks.flags.writeable and m.blocks is not m.blocks  # rebuilt on each read
        np.testing.assert_array_equal(m.dequantize().view(np.uint32),
                                      QuantizedMatrix(q, (13, 512), orig).dequantize().view(np.uint32))
    with pytest.raises(ValueError, match="x8 layout"):  # the GGUF bytes handed to an x8 path
        x8 = [i for i in kernels.supported_isas() if kernels.layout(i) == "x8"]
        if not x8:
            raise ValueError("x8 layout (no x86 SIMD path on this CPU)")
        import tenzro_kernels
        tenzro_kernels.matmul_xt(q, orig, 13, 512, np.zeros((1, 512), np.float32), 1,
                                 np.zeros((1, 13), np.float32), 1, x8[0])


@pytest.mark.parametrize("q", ["q8_0", "q4_k", "q6_k"])
def test_unpack_x8_inverts_pack_x8_on_golden_and_random_bytes(q):
    """pack_x8 keeps every bit (Q4_K's twelve scale bytes are exactly its 6-bit scales and mins):
    unpacking gives the GGUF bytes back, for ggml's golden blocks and random bytes, whole and
    partial row groups."""
    import tenzro_kernels
    key = {"q8_0": "q8_0", "q4_k": "q4_K", "q6_k": "q6_K"}[q]
    z = np.load(GOLDEN)
    mats = [QuantizedMatrix(q, (8, 2048), z[f"{c}__{key}"]) for c in ("normal", "heavy", "edge", "bf16")]
    mats += [_random_blocks(q, r, 512, np.random.default_rng(r)) for r in (1, 7, 13, 24)]
    for m in mats:
        rows, cols = m.shape
        packed = np.empty(tenzro_kernels.x8_nbytes(q, rows, cols), np.uint8)
        tenzro_kernels.pack_x8(q, m.blocks, rows, cols, packed)
        np.testing.assert_array_equal(kernels.unpack_x8(q, rows, cols, packed), m.blocks.reshape(-1))
    with pytest.raises(ValueError, match="x8 layout"):
        kernels.unpack_x8(q, 8, 512, np.zeros(10, np.uint8))


def test_runtime_holds_only_the_repacked_layout_and_outputs_do_not_change(tmp_path):
    """A CPU holder keeps one copy of a quantized expert: the memory tier counts the x8 layout alone
    (x86 paths), the expert's outputs are bit-identical to those of the blob's own GGUF bytes,
    and its blob bytes (hence its content hash) rebuild exactly from what is held."""
    from moe.blobs import blob_hash
    from moe.ffn import ExpertWeights
    from moe.runtime import ExpertRuntime
    rng = np.random.default_rng(8)
    e = ExpertWeights(*(QuantizedMatrix.from_dense(rng.standard_normal(s, dtype=np.float32), k)
                        for k, s in (("q4_k", (256, 512)), ("q4_k", (256, 512)), ("q6_k", (512, 256)))))
    blob = e.to_blob()
    x = rng.standard_normal((5, 512), dtype=np.float32)
    before = {isa: _forward_on(isa, ExpertWeights.from_blob(blob), x) for isa in kernels.supported_isas()}
    gguf = e.nbytes
    rt = ExpertRuntime(memory_budget=1 << 30, backend=CpuBackend(), disk_dir=tmp_path / "disk")
    row = rt.load_expert("m", 0, 0, blob)
    held = rt.resolve("m", 0, 0)
    x8 = kernels.layout() == "x8"
    want = 32 * (2 * 2 * 1184) + 64 * 1680 if x8 else gguf  # gate/up: 32 groups x 2 blocks; down: 64 x 1
    assert row["approx_bytes"] == rt.memory_bytes == held.nbytes == want
    assert all(getattr(held, p).holds_gguf != x8 for p in ("gate_proj", "up_proj", "down_proj"))
    y = rt.execute("m", 0, 0, x, 5, metered=False)
    after = {isa: _forward_on(isa, held, x) for isa in kernels.supported_isas()}
    for isa in before:
        np.testing.assert_array_equal(after[isa].view(np.uint32), before[isa].view(np.uint32), err_msg=isa)
        np.testing.assert_array_equal(after[isa].view(np.uint32), before["portable"].view(np.uint32), err_msg=isa)
    np.testing.assert_array_equal(y.view(np.uint32), before["portable"].view(np.uint32))
    assert held.to_blob() == blob and blob_hash(held.to_blob()) == blob_hash(blob)
    rt.unload_expert("m", 0, 0)
    assert rt.memory_bytes == 0


def _forward_on(isa, e, x):
    """expert_forward with every product on SIMD path ``isa``."""
    from moe import compute
    from moe.ffn import expert_forward

    class OnIsa(CpuBackend):
        def matmul_xt(self, x, w):
            return kernels.matmul_xt(x, w, threads=1, isa=isa) if isinstance(w, QuantizedMatrix) else super().matmul_xt(x, w)
    prev = compute.backend()
    compute.set_backend(OnIsa())
    try:
        return expert_forward(e, x)
    finally:
        compute.set_backend(prev)


def test_arena_frees_a_slab_once_its_blocks_are_released_and_reuses_holes():
    """Evict / reload cycles stay bounded: a released block is reused for the next of its size, and
    a slab whose blocks are all released is dropped (its memory goes back to the OS)."""
    a = kernels.Arena(slab_bytes=1 << 20)
    blocks = [a.alloc(100_000) for _ in range(25)]  # 10 per slab (64-byte rounded): 3 slabs
    assert a.stats()["slabs"] == 3 and a.stats()["live_blocks"] == 25
    assert all(b.ctypes.data % 64 == 0 for b in blocks)
    for b in blocks[:10]:  # the whole first slab
        a.release(b)
    assert a.stats()["slabs"] == 2
    for _ in range(50):  # churn: a hole in a live slab is reused, no slab is added
        a.release(blocks[12])
        blocks[12] = a.alloc(100_000)
        assert a.stats()["slabs"] == 2
    for b in blocks[10:]:
        a.release(b)
    assert a.stats() == {"slabs": 0, "slab_bytes": 0, "live_blocks": 0, "large_bytes": 0}
    big = a.alloc(600_000)  # above a quarter slab: its own array
    assert a.stats()["slabs"] == 0 and a.stats()["large_bytes"] == 600_000
    a.release(big)
    assert a.stats()["large_bytes"] == 0


def test_runtime_evict_reload_cycles_do_not_grow_the_arena(tmp_path, monkeypatch):
    """A holder cycling more experts than its memory tier holds (each access a reload from disk)
    keeps a bounded number of slabs, and none once every expert left memory."""
    import gc
    from moe.ffn import ExpertWeights
    from moe.runtime import ExpertRuntime
    if kernels.layout() != "x8":
        pytest.skip("no x86 SIMD path: no repacked layout, no arena")
    arena = kernels.Arena(slab_bytes=4 << 20)
    monkeypatch.setattr(kernels, "_ARENA", arena)
    rng = np.random.default_rng(9)
    per = 3 * 32 * 8 * 272  # one expert: three 256 x 256 Q8_0 matrices, 32 row groups of 8 blocks
    rt = ExpertRuntime(memory_budget=3 * per, backend=CpuBackend(), disk_dir=tmp_path / "disk")
    for i in range(8):
        e = ExpertWeights(*(QuantizedMatrix.from_dense(rng.standard_normal((256, 256), dtype=np.float32), "q8_0")
                            for _ in range(3)))
        rt.load_expert("m", 0, i, e.to_blob())
    most = 0
    for _ in range(6):
        for i in range(8):
            rt.resolve("m", 0, i)
            gc.collect()
            assert rt.memory_bytes <= 3 * per
            most = max(most, arena.stats()["slabs"])
    assert most <= 2  # 9 matrices live at most (4.8 MiB), a 4 MiB slab holds 15
    for i in range(8):
        rt.unload_expert("m", 0, i)
    gc.collect()
    assert arena.stats()["slabs"] == 0 and rt.memory_bytes == 0


def test_arena_memory_goes_back_to_the_os():
    """Default 64 MiB slabs: filled with repacked matrices, then released, the process's resident
    memory falls back (the slabs are unmapped, not kept for the process)."""
    import gc
    import psutil
    if kernels.layout() != "x8":
        pytest.skip("no x86 SIMD path: no repacked layout, no arena")
    proc = psutil.Process()
    gc.collect()
    base = kernels.arena_stats()["slabs"]
    m0 = _random_blocks("q8_0", 768, 2048, np.random.default_rng(1))
    mats = [QuantizedMatrix("q8_0", m0.shape, m0.blocks) for _ in range(90)]  # one GGUF array, 150 MiB of x8
    rss0 = proc.memory_info().rss
    for m in mats:
        kernels.native_weights(m)  # packs, drops each matrix's GGUF copy
    mats_gguf_freed = sum(m.holds_gguf for m in mats) == 0
    peak = proc.memory_info().rss
    # 150 MiB need 3 slabs of 64 MiB; a slab an earlier test left partly carved may take the first
    # of them (its remaining space is used first), so at least 2 are new whatever ran before.
    assert kernels.arena_stats()["slabs"] >= base + 2 and mats_gguf_freed
    del mats, m, m0
    gc.collect()
    assert kernels.arena_stats()["slabs"] == base
    after = proc.memory_info().rss
    assert peak - rss0 > 64 << 20  # the slabs were resident (sanity of the measurement)
    assert after < peak - (64 << 20), (rss0, peak, after)


@pytest.mark.parametrize("q", ["q8_0", "q4_k", "q6_k"])
def test_gate_and_up_share_one_activation_quantization_bit_for_bit(q):
    """``matmul_xt_many`` (the expert's gate and up products, x quantized once) gives each matrix's
    ``matmul_xt`` bits on every path; mismatched matrices are refused naming why."""
    rng = np.random.default_rng(31)
    ws = [_random_blocks(q, 21, 512, rng) for _ in range(3)]
    x = rng.standard_normal((11, 512), dtype=np.float32)
    for isa in kernels.supported_isas():
        many = kernels.matmul_xt_many(x, ws, threads=2, isa=isa)
        for w, y in zip(ws, many):
            np.testing.assert_array_equal(y.view(np.uint32), model_matmul(x, w).view(np.uint32), err_msg=isa)
    other = _random_blocks(q, 13, 512, rng)
    with pytest.raises(ValueError, match="one qtype and shape"):
        kernels.matmul_xt_many(x, [ws[0], other])
    be = CpuBackend()
    got = be.matmul_xt_many(x, [ws[0], other])  # the backend falls back to one product each
    for w, y in zip((ws[0], other), got):
        np.testing.assert_array_equal(y.view(np.uint32), be.matmul_xt(x, w).view(np.uint32))
