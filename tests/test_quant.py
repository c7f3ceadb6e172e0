"""moe.quant: GGUF Q8_0 / Q4_K / Q6_K encoders and decoders.

* Encoders: byte for byte against the ggml golden vectors
  (``tests/fixtures/gguf_golden``, produced by ggml's ``quantize_row_*_ref``),
  against an independent scalar port of the C reference written here (slow,
  element by element, float32 scalars) on extra input families, and against
  gguf-py's own Q8_0 quantizer.
* Decoders: bit for bit against gguf-py's ``gguf.quants.dequantize``.
* Round-trip error bounds, row/shape handling and the error cases.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moe import quant
from moe.quant import (
    BLOCK_BYTES,
    BLOCK_SIZE,
    dequantize,
    dequantize_rows,
    quantize,
    quantize_q8_0_rows,
    quantized_nbytes,
)

GOLDEN = Path(__file__).parent / "fixtures" / "gguf_golden" / "ggml_ref_quant_vectors.npz"
CASES = ["normal", "heavy", "uniform_pos", "uniform_neg", "bf16", "edge"]
GOLDEN_KEY = {"q8_0": "q8_0", "q4_k": "q4_K", "q6_k": "q6_K"}
TYPES = ["q8_0", "q4_k", "q6_k"]

F = np.float32


@pytest.fixture(scope="module")
def golden():
    with np.load(GOLDEN) as z:
        return {k: z[k] for k in z.files}


def _gguf():
    pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as G
    from gguf import quants as gq

    return gq, {"q8_0": G.Q8_0, "q4_k": G.Q4_K, "q6_k": G.Q6_K}


def _block_mismatches(got: np.ndarray, ref: np.ndarray, qt: str) -> int:
    bb = BLOCK_BYTES[qt]
    return int((got.reshape(-1, bb) != ref.reshape(-1, bb)).any(axis=1).sum())


# ---------------------------------------------------------------------------
# independent scalar reference (a line-by-line port of ggml-quants.c, float32
# scalars, sequential sums); slow, used on a few super-blocks only


def _ni(v) -> int:
    """ggml nearest_int: magic-add on the float32 bit pattern."""
    t = np.float32(np.float32(v) + F(12582912.0))
    i = int(np.array([t], dtype=np.float32).view(np.int32)[0])
    return (i & 0x007FFFFF) - 0x00400000


def _fp16(v) -> np.float16:
    return np.float16(np.float32(v))


def _ref_q8_0(x: np.ndarray) -> bytes:
    out = bytearray()
    for b in x.reshape(-1, 32):
        amax = F(0)
        for v in b:
            av = abs(v)
            amax = amax if amax > av else av  # MAX(a,b) = a > b ? a : b
        d = F(amax / F(127))
        idv = F(F(1) / d) if d != 0 else F(0)
        out += np.array([_fp16(d)], dtype="<f2").tobytes()
        for v in b:
            p = float(F(v * idv))
            if not np.isfinite(p):
                # id = inf (subnormal d): x86 float -> int8 conversion gives 0
                out += b"\x00"
                continue
            # C roundf: half away from zero (exact for float32 inputs)
            a = abs(p)
            fl = np.floor(a)
            r = fl + (1.0 if a - fl >= 0.5 else 0.0)
            q = int(np.copysign(r, p))
            out += np.array([q], dtype=np.int8).tobytes()
    return bytes(out)


def _ref_make_qkx2(x, w, nmax=15, rmin=F(-1.0), rdelta=F(0.1), nstep=20):
    n = len(x)
    mn = x[0]
    mx = x[0]
    sum_w = w[0]
    sum_x = F(sum_w * x[0])
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        sum_w = F(sum_w + w[i])
        sum_x = F(sum_x + F(w[i] * x[i]))
    if mn > 0:
        mn = F(0)
    if mx == mn:
        return F(0), F(-mn), [0] * n
    iscale = F(F(nmax) / F(mx - mn))
    scale = F(F(1) / iscale)
    best = F(0)
    L = [0] * n
    for i in range(n):
        l = max(0, min(nmax, _ni(F(iscale * F(x[i] - mn)))))
        L[i] = l
        diff = F(F(F(scale * F(l)) + mn) - x[i])
        diff = F(diff * diff)
        best = F(best + F(w[i] * diff))
    for is_ in range(nstep + 1):
        iscale = F(F(F(rmin + F(rdelta * F(is_))) + F(nmax)) / F(mx - mn))
        sum_l = F(0)
        sum_l2 = F(0)
        sum_xl = F(0)
        Laux = [0] * n
        for i in range(n):
            l = max(0, min(nmax, _ni(F(iscale * F(x[i] - mn)))))
            Laux[i] = l
            wl = F(w[i] * F(l))
            sum_l = F(sum_l + wl)
            sum_l2 = F(sum_l2 + F(wl * F(l)))
            sum_xl = F(sum_xl + F(wl * x[i]))
        D = F(F(sum_w * sum_l2) - F(sum_l * sum_l))
        if D > 0:
            this_scale = F(F(F(sum_w * sum_xl) - F(sum_x * sum_l)) / D)
            this_min = F(F(F(sum_l2 * sum_x) - F(sum_l * sum_xl)) / D)
            if this_min > 0:
                this_min = F(0)
                this_scale = F(sum_xl / sum_l2)
            cur = F(0)
            for i in range(n):
                diff = F(F(F(this_scale * F(Laux[i])) + this_min) - x[i])
                cur = F(cur + F(w[i] * F(diff * diff)))
            if cur < best:
                L = Laux
                best = cur
                scale = this_scale
                mn = this_min
    return scale, F(-mn), L


def _ref_q4_k(x: np.ndarray) -> bytes:
    out = bytearray()
    for sb in x.reshape(-1, 256):
        L = [0] * 256
        scales = [F(0)] * 8
        mins = [F(0)] * 8
        max_scale = F(0)
        max_min = F(0)
        for j in range(8):
            xs = [F(v) for v in sb[32 * j:32 * j + 32]]
            sum_x2 = F(0)
            for v in xs:
                sum_x2 = F(sum_x2 + F(v * v))
            av_x = F(np.sqrt(F(sum_x2 / F(32))))
            w = [F(av_x + abs(v)) for v in xs]
            sc, m, Lj = _ref_make_qkx2(xs, w)
            scales[j], mins[j] = sc, m
            L[32 * j:32 * j + 32] = Lj
            if sc > max_scale:
                max_scale = sc
            if m > max_min:
                max_min = m
        inv_s = F(F(63) / max_scale) if max_scale > 0 else F(0)
        inv_m = F(F(63) / max_min) if max_min > 0 else F(0)
        sbytes = [0] * 12
        ls_all, lm_all = [], []
        for j in range(8):
            ls = min(63, _ni(F(inv_s * scales[j])) & 0xFF)
            lm = min(63, _ni(F(inv_m * mins[j])) & 0xFF)
            ls_all.append(ls)
            lm_all.append(lm)
            if j < 4:
                sbytes[j] = ls
                sbytes[j + 4] = lm
            else:
                sbytes[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4)
                sbytes[j - 4] |= (ls >> 4) << 6
                sbytes[j] |= (lm >> 4) << 6
        d16 = _fp16(F(max_scale / F(63)))
        m16 = _fp16(F(max_min / F(63)))
        for j in range(8):
            # get_scale_min_k4
            if j < 4:
                sc, m = sbytes[j] & 63, sbytes[j + 4] & 63
            else:
                sc = (sbytes[j + 4] & 0xF) | ((sbytes[j - 4] >> 6) << 4)
                m = (sbytes[j + 4] >> 4) | ((sbytes[j] >> 6) << 4)
            d = F(F(d16) * F(sc))
            if d == 0:
                continue
            dm = F(F(m16) * F(m))
            for ii in range(32):
                l = _ni(F(F(F(sb[32 * j + ii]) + dm) / d))
                L[32 * j + ii] = max(0, min(15, l))
        qs = []
        for j in range(0, 256, 64):
            for l in range(32):
                qs.append(L[j + l] | (L[j + l + 32] << 4))
        out += np.array([d16, m16], dtype="<f2").tobytes() + bytes(sbytes) + bytes(qs)
    return bytes(out)


def _ref_make_qx(x, nmax=32):
    n = len(x)
    mx = F(0)
    amax = F(0)
    for v in x:
        ax = abs(v)
        if ax > amax:
            amax = ax
            mx = v
    if amax < F(1e-15):
        return F(0), [0] * n
    iscale = F(F(-nmax) / mx)
    sumlx = F(0)
    suml2 = F(0)
    L = [0] * n
    for i in range(n):
        l = max(-nmax, min(nmax - 1, _ni(F(iscale * x[i]))))
        L[i] = l + nmax
        w = F(x[i] * x[i])
        sumlx = F(sumlx + F(F(w * x[i]) * F(l)))
        suml2 = F(suml2 + F(F(w * F(l)) * F(l)))
    scale = F(sumlx / suml2) if suml2 != 0 else F(0)
    best = F(scale * sumlx)
    for is_ in range(-9, 10):
        if is_ == 0:
            continue
        iscale = F(F(-F(F(nmax) + F(F(0.1) * F(is_)))) / mx)
        sumlx = F(0)
        suml2 = F(0)
        for i in range(n):
            l = max(-nmax, min(nmax - 1, _ni(F(iscale * x[i]))))
            w = F(x[i] * x[i])
            sumlx = F(sumlx + F(F(w * x[i]) * F(l)))
            suml2 = F(suml2 + F(F(w * F(l)) * F(l)))
        if suml2 > 0 and F(sumlx * sumlx) > F(best * suml2):
            for i in range(n):
                l = max(-nmax, min(nmax - 1, _ni(F(iscale * x[i]))))
                L[i] = l + nmax
            scale = F(sumlx / suml2)
            best = F(scale * sumlx)
    return scale, L


def _ref_q6_k(x: np.ndarray) -> bytes:
    out = bytearray()
    for sb in x.reshape(-1, 256):
        L = [0] * 256
        scales = []
        max_scale = F(0)
        max_abs = F(0)
        for ib in range(16):
            sc, Lb = _ref_make_qx([F(v) for v in sb[16 * ib:16 * ib + 16]])
            scales.append(sc)
            L[16 * ib:16 * ib + 16] = Lb
            a = abs(sc)
            if a > max_abs:
                max_abs = a
                max_scale = sc
        if max_abs < F(1e-15):
            out += bytes(210)
            continue
        iscale = F(F(-128) / max_scale)
        d16 = _fp16(F(F(1) / iscale))
        sc8 = [int(np.array([min(127, _ni(F(iscale * s)))]).astype(np.int8)[0]) for s in scales]
        for j in range(16):
            d = F(F(d16) * F(sc8[j]))
            if d == 0:
                continue
            for ii in range(16):
                l = _ni(F(F(sb[16 * j + ii]) / d))
                L[16 * j + ii] = max(-32, min(31, l)) + 32
        ql = [0] * 128
        qh = [0] * 64
        for h in range(2):
            j = 128 * h
            for l in range(32):
                q1, q2, q3, q4 = L[j + l], L[j + l + 32], L[j + l + 64], L[j + l + 96]
                ql[64 * h + l] = (q1 & 0xF) | ((q3 & 0xF) << 4)
                ql[64 * h + l + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4)
                qh[32 * h + l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
        out += (bytes(ql) + bytes(qh) + np.array(sc8, dtype=np.int8).tobytes()
                + np.array([d16], dtype="<f2").tobytes())
    return bytes(out)


_REF = {"q8_0": _ref_q8_0, "q4_k": _ref_q4_k, "q6_k": _ref_q6_k}


# ---------------------------------------------------------------------------
# input families beyond the golden ones


def _family(name: str, n_super: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = 256 * n_super
    if name == "normal":
        x = rng.standard_normal(n) * 0.02
    elif name == "unit":
        x = rng.standard_normal(n)
    elif name == "tiny":
        # fp16 scales underflow (d == 0 keeps the search's quants), x**3 subnormal
        x = rng.standard_normal(n) * 10.0 ** rng.integers(-14, -5, size=(n_super, 1)).repeat(256, 1).ravel()
    elif name == "huge":
        x = rng.standard_normal(n) * 10.0 ** rng.integers(2, 6, size=(n_super, 1)).repeat(256, 1).ravel()
    elif name == "zeros":
        x = np.zeros(n)
    elif name == "constant":
        c = rng.choice([-3.5, -0.25, 0.0, 0.125, 7.0], size=n // 32)
        x = np.repeat(c, 32)
    elif name == "bf16":
        x = rng.standard_normal(n).astype(np.float32) * 0.05
        x = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    elif name == "ties":
        x = rng.integers(-8, 9, size=n) * 0.5
    elif name == "sparse":
        x = np.where(rng.random(n) < 0.1, rng.standard_normal(n), 0.0)
        x[rng.integers(0, n, size=max(1, n // 300))] *= 50.0
    elif name == "mixed_blocks":
        # zero sub-blocks, one-sided blocks and an outlier inside a super-block
        x = rng.standard_normal(n) * 0.1
        x = x.reshape(n_super, 256)
        x[:, 0:32] = 0.0
        x[:, 32:64] = np.abs(x[:, 32:64]) + 1.0
        x[:, 64:96] = -np.abs(x[:, 64:96]) - 1.0
        x[:, 100] = 40.0
        x[:, 128:144] = 1e-3 * x[:, 128:144]
        x = x.ravel()
    elif name == "subnormal":
        # float32 subnormals and values just above: infinite reciprocals and
        # iscale overflow inside the searches (exact nearest_int paths)
        x = rng.standard_normal(n) * 10.0 ** rng.integers(-44, -36, size=(n_super, 1)).repeat(256, 1).ravel()
        x = x.reshape(n_super, 256)
        x[:, 0:64] = 0.0
        x[:, 64:96] = rng.integers(-3, 4, size=(n_super, 32)) * 1.4e-45
        x = x.ravel()
    elif name == "heavy":
        x = rng.standard_t(2.0, size=n) * 0.01
    else:  # pragma: no cover
        raise AssertionError(name)
    return np.asarray(x, dtype=np.float32)


FAMILIES = ["normal", "unit", "tiny", "huge", "zeros", "constant", "bf16", "ties",
            "sparse", "mixed_blocks", "heavy", "subnormal"]


# ---------------------------------------------------------------------------
# golden bytes


@pytest.mark.parametrize("qt", TYPES)
@pytest.mark.parametrize("case", CASES)
def test_golden_bytes(golden, case, qt):
    x = golden[f"{case}__input_f32"]
    ref = golden[f"{case}__{GOLDEN_KEY[qt]}"]
    got = quantize(x, qt)
    assert got.dtype == np.uint8 and got.shape == ref.shape
    bad = _block_mismatches(got, ref, qt)
    assert bad == 0, f"{case}/{qt}: {bad} of {ref.size // BLOCK_BYTES[qt]} blocks differ"
    assert np.array_equal(got, ref)


@pytest.mark.parametrize("qt", TYPES)
def test_golden_bytes_uppercase_and_rows(golden, qt):
    """Same bytes with the qtype spelled like ggml and the input as rows."""
    x = golden["edge__input_f32"]
    ref = golden[f"edge__{GOLDEN_KEY[qt]}"]
    rows = 8
    got = quantize(x.reshape(rows, -1), qt.upper())
    assert got.shape == (rows, ref.size // rows)
    assert np.array_equal(got.ravel(), ref)


@pytest.mark.parametrize("qt", ["q4_k", "q6_k"])
@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_golden_bytes_any_chunking(golden, monkeypatch, qt, chunk):
    """Chunking only groups super-blocks; results never depend on it."""
    monkeypatch.setattr(quant, "_Q4K_CHUNK", chunk)
    monkeypatch.setattr(quant, "_Q6K_CHUNK", chunk)
    for case in CASES:
        x = golden[f"{case}__input_f32"]
        assert np.array_equal(quantize(x, qt), golden[f"{case}__{GOLDEN_KEY[qt]}"]), case


def test_golden_bytes_many_chunks(golden):
    """A larger tensor (several default chunks) built from all golden cases."""
    xs = np.concatenate([golden[f"{c}__input_f32"] for c in CASES] * 3).reshape(-1, 2048)
    for qt in TYPES:
        ref = np.concatenate([golden[f"{c}__{GOLDEN_KEY[qt]}"] for c in CASES] * 3)
        got = quantize(xs, qt)
        assert got.shape == (xs.shape[0], 2048 // BLOCK_SIZE[qt] * BLOCK_BYTES[qt])
        assert np.array_equal(got.ravel(), ref), qt


def test_golden_bytes_exact_nearest_int_path(golden, monkeypatch):
    """Force the bit-level nearest_int emulation everywhere in the Q4_K search
    (normally only taken when a block's range makes rint unsafe)."""
    monkeypatch.setattr(quant, "_NEAREST_SAFE", np.float32(-1.0))
    qt = "q4_k"
    for case in CASES:
        x = golden[f"{case}__input_f32"]
        assert np.array_equal(quantize(x, qt), golden[f"{case}__{GOLDEN_KEY[qt]}"]), case


def test_nearest_int_matches_c_semantics():
    v = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, 14.5, 15.5, -14.5,
                  4194303.0, -4194303.0, 3.0e7, -3.0e7], dtype=np.float32)
    got = quant._nearest_int(v)
    want = [_ni(a) for a in v]
    assert got.tolist() == want
    assert got[:10].tolist() == [0, 2, 2, 0, -2, -2, 0, 14, 16, -14]


# ---------------------------------------------------------------------------
# independent scalar reference on extra input families


@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("qt", TYPES)
def test_matches_scalar_reference(fam, qt):
    n_super = 3 if qt != "q8_0" else 8
    x = _family(fam, n_super, seed=FAMILIES.index(fam) * 10 + TYPES.index(qt))
    got = quantize(x, qt)
    with np.errstate(all="ignore"):  # the scalar port hits inf/NaN like the C code
        ref = np.frombuffer(_REF[qt](x), dtype=np.uint8)
    bad = _block_mismatches(got, ref, qt)
    assert bad == 0, f"{fam}/{qt}: {bad} blocks differ from the scalar reference"


def test_scalar_reference_matches_golden(golden):
    """The scalar port itself reproduces ggml (a few super-blocks per case)."""
    for case in CASES:
        x = golden[f"{case}__input_f32"][: 256 * 2]
        for qt in TYPES:
            ref = golden[f"{case}__{GOLDEN_KEY[qt]}"][: 2 * 256 // BLOCK_SIZE[qt] * BLOCK_BYTES[qt]]
            assert _REF[qt](x) == ref.tobytes(), (case, qt)


def test_single_subblock_search_paths():
    """Sub-blocks whose integer scale is 0 keep the search's quants; exercise the
    recompute path with exactly one such sub-block (B == 1 inside the search)."""
    base = np.linspace(-1, 1, 256, dtype=np.float32)[None, :]
    x4 = base.copy()
    x4[0, 32:64] = np.linspace(-1e-4, 2e-4, 32, dtype=np.float32)  # Q4_K: 6-bit scale is 0
    x6 = base.copy()
    x6[0, 16:32] = np.linspace(-1e-4, 1e-4, 16, dtype=np.float32)  # Q6_K: int8 scale is 0
    seen = []
    orig_qkx2, orig_qx = quant._make_qkx2, quant._make_qx

    def spy_qkx2(X, W, track_L):
        seen.append(("q4_k", X.shape[1], track_L))
        return orig_qkx2(X, W, track_L)

    def spy_qx(X, track_L):
        seen.append(("q6_k", X.shape[1], track_L))
        return orig_qx(X, track_L)

    quant._make_qkx2, quant._make_qx = spy_qkx2, spy_qx
    try:
        for qt, x in (("q4_k", x4), ("q6_k", x6)):
            assert quantize(x, qt).tobytes() == _REF[qt](x), qt
    finally:
        quant._make_qkx2, quant._make_qx = orig_qkx2, orig_qx
    assert ("q4_k", 1, True) in seen and ("q6_k", 1, True) in seen


# ---------------------------------------------------------------------------
# gguf-py cross-checks


@pytest.mark.parametrize("qt", TYPES)
def test_decode_matches_gguf_py_on_golden(golden, qt):
    gq, G = _gguf()
    for case in CASES:
        data = golden[f"{case}__{GOLDEN_KEY[qt]}"]
        theirs = gq.dequantize(data.reshape(8, -1), G[qt])
        ours = dequantize(data, qt, (8, 16384 // 8))
        assert theirs.dtype == np.float32 and ours.dtype == np.float32
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), case


@pytest.mark.parametrize("fam", FAMILIES)
def test_decode_matches_gguf_py_on_random(fam):
    gq, G = _gguf()
    x = _family(fam, 16, seed=7).reshape(4, -1)
    for qt in TYPES:
        data = quantize(x, qt)
        theirs = gq.dequantize(data, G[qt])
        ours = dequantize(data, qt, x.shape)
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), qt
        fast = dequantize_rows(data, qt)
        assert np.array_equal(fast.view(np.uint32), ours.view(np.uint32)), qt


def test_decode_matches_gguf_py_on_arbitrary_bytes():
    """Decoders agree with gguf-py on any bit pattern (negative d, -128 scales,
    subnormal fp16, all nibble values), not only on our own encodings."""
    gq, G = _gguf()
    rng = np.random.default_rng(3)
    for qt in TYPES:
        data = rng.integers(0, 256, size=(6, 8 * BLOCK_BYTES[qt]), dtype=np.uint8)
        bb = BLOCK_BYTES[qt]
        # keep the fp16 scales finite so both sides compare bit patterns, not NaNs
        d_off = {"q8_0": [0], "q4_k": [0, 2], "q6_k": [208]}[qt]
        blocks = data.reshape(-1, bb)
        for off in d_off:
            blocks[:, off + 1] &= 0x7B
        theirs = gq.dequantize(data, G[qt])
        ours = dequantize_rows(data, qt)
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), qt


# "subnormal" is left out: there gguf-py casts NaN to int8 (platform-defined).
@pytest.mark.parametrize("fam", [f for f in FAMILIES if f != "subnormal"])
def test_q8_0_matches_gguf_py_quantizer(fam):
    gq, G = _gguf()
    x = _family(fam, 8, seed=11).reshape(8, -1)
    theirs = gq.quantize(x, G["q8_0"])
    assert np.array_equal(quantize(x, "q8_0"), theirs)
    assert np.array_equal(quantize_q8_0_rows(x), theirs)


def test_q8_0_matches_gguf_py_quantizer_on_golden(golden):
    gq, G = _gguf()
    for case in CASES:
        x = golden[f"{case}__input_f32"]
        assert np.array_equal(gq.quantize(x, G["q8_0"]), quantize(x, "q8_0")), case


# ---------------------------------------------------------------------------
# round trip and structure


@pytest.mark.parametrize("qt,bound", [("q8_0", 0.006), ("q4_k", 0.12), ("q6_k", 0.03)])
def test_round_trip_error(qt, bound):
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((64, 1024)) * 0.02).astype(np.float32)
    y = dequantize(quantize(x, qt), qt, x.shape)
    rel_rmse = float(np.sqrt(np.mean((y - x) ** 2)) / np.sqrt(np.mean(x ** 2)))
    assert rel_rmse < bound, rel_rmse


def test_round_trip_q8_0_per_block_bound():
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((32, 512)) * rng.uniform(1e-3, 1e3, size=(32, 1))).astype(np.float32)
    y = dequantize(quantize(x, "q8_0"), "q8_0", x.shape)
    xb = x.reshape(-1, 32)
    amax = np.abs(xb).max(axis=1, keepdims=True)
    assert np.all(np.abs(y.reshape(-1, 32) - xb) <= amax * (1 / 254 + 1 / 1024))


@pytest.mark.parametrize("qt", TYPES)
def test_round_trip_exact_cases(qt):
    x = np.zeros((2, 256), dtype=np.float32)
    assert not quantize(x, qt).any()
    assert not dequantize(quantize(x, qt), qt, x.shape).any()
    # small integers (rounding ties everywhere): error within half a step
    x = np.tile(np.arange(-8, 8, dtype=np.float32), 16)[None, :]
    y = dequantize(quantize(x, qt), qt, x.shape)
    step = {"q8_0": 8 / 127, "q4_k": 16 / 15, "q6_k": 8 / 32}[qt]
    assert np.max(np.abs(y - x)) <= 0.5 * step * 1.01


def test_edge_structure_zero_blocks():
    """Q6_K all-zero super-block is 210 zero bytes; Q4_K zero super-block is all 0."""
    x = np.zeros(512, dtype=np.float32)
    x[256:] = np.linspace(-1, 1, 256)
    q6 = quantize(x, "q6_k").reshape(2, 210)
    assert not q6[0].any() and q6[1].any()
    q4 = quantize(x, "q4_k").reshape(2, 144)
    assert not q4[0].any() and q4[1].any()
    # a negative constant block decodes to (about) the constant through dmin
    c = np.full(256, -2.5, dtype=np.float32)
    y = dequantize(quantize(c, "q4_k"), "q4_k", 256)
    assert np.allclose(y, -2.5, rtol=2e-3)


# ---------------------------------------------------------------------------
# shapes and API


@pytest.mark.parametrize("qt", TYPES)
def test_shapes_rows_stay_rows(qt):
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 3, 512)).astype(np.float32)
    q = quantize(x, qt)
    assert q.shape == (2, 3, 512 // BLOCK_SIZE[qt] * BLOCK_BYTES[qt])
    assert q.dtype == np.uint8
    assert q.nbytes == quantized_nbytes(x.shape, qt)
    for i in range(2):
        for j in range(3):
            assert np.array_equal(q[i, j], quantize(x[i, j], qt))
    y = dequantize(q, qt, x.shape)
    assert y.shape == x.shape and y.dtype == np.float32
    assert np.array_equal(dequantize(q.tobytes(), qt, x.shape), y)
    assert np.array_equal(dequantize_rows(q.reshape(6, -1), qt), y.reshape(6, 512))
    assert np.array_equal(dequantize_rows(q.ravel(), qt, 512), y.reshape(6, 512))
    # 1-D input and an empty batch
    assert quantize(x[0, 0], qt).shape == (512 // BLOCK_SIZE[qt] * BLOCK_BYTES[qt],)
    assert quantize(np.zeros((0, 512), np.float32), qt).shape == (0, q.shape[-1])


def test_input_dtypes_are_converted():
    rng = np.random.default_rng(9)
    x32 = rng.standard_normal((4, 256)).astype(np.float32)
    for qt in TYPES:
        assert np.array_equal(quantize(x32.astype(np.float64), qt), quantize(x32, qt))
        x16 = x32.astype(np.float16)
        assert np.array_equal(quantize(x16, qt), quantize(x16.astype(np.float32), qt))
        # non-contiguous views
        big = np.zeros((4, 512), np.float32)
        big[:, ::2] = x32
        assert np.array_equal(quantize(big[:, ::2], qt), quantize(x32, qt))


def test_constants_and_nbytes():
    assert BLOCK_SIZE == {"q8_0": 32, "q4_k": 256, "q6_k": 256}
    assert BLOCK_BYTES == {"q8_0": 34, "q4_k": 144, "q6_k": 210}
    assert quantized_nbytes((768, 2048), "Q4_K") == 768 * 8 * 144
    assert quantized_nbytes(2048, "q8_0") == 64 * 34
    assert quantized_nbytes((3, 4, 256), "q6_k") == 12 * 210


def test_q8_0_rows_fast_path():
    rng = np.random.default_rng(10)
    x = rng.standard_normal((5, 96)).astype(np.float32)
    q = quantize_q8_0_rows(x)
    assert q.shape == (5, 3 * 34)
    assert np.array_equal(q, quantize(x, "q8_0"))
    assert np.array_equal(dequantize_rows(q, "q8_0"), dequantize(q, "q8_0", x.shape))


# ---------------------------------------------------------------------------
# errors


def test_unknown_qtype():
    x = np.zeros(256, np.float32)
    for bad in ("q5_k", "f16", "", None):
        with pytest.raises(ValueError, match="q8_0.*q4_k.*q6_k"):
            quantize(x, bad)
    with pytest.raises(ValueError, match="supported"):
        dequantize(np.zeros(34, np.uint8), "iq2_xxs", 32)
    with pytest.raises(ValueError, match="supported"):
        quantized_nbytes(32, "q4_0")


@pytest.mark.parametrize("qt,n", [("q8_0", 100), ("q8_0", 48), ("q4_k", 544), ("q6_k", 2880),
                                  ("q4_k", 32)])
def test_row_length_not_multiple(qt, n):
    x = np.zeros((2, n), np.float32)
    with pytest.raises(ValueError, match=rf"{n}.*multiple.*{BLOCK_SIZE[qt]}"):
        quantize(x, qt)
    with pytest.raises(ValueError, match=str(n)):
        quantized_nbytes((2, n), qt)
    with pytest.raises(ValueError, match=str(n)):
        dequantize(np.zeros(10, np.uint8), qt, (2, n))


@pytest.mark.parametrize("qt", TYPES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rejected(qt, bad):
    x = np.zeros((2, 256), np.float32)
    x[1, 37] = bad
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x, qt)
    with pytest.raises(ValueError, match="non-finite"):
        quantize_q8_0_rows(x)


@pytest.mark.parametrize("qt,mag", [("q8_0", 1e7), ("q4_k", 1e9), ("q6_k", 1e10)])
def test_fp16_scale_overflow_rejected(qt, mag):
    x = np.linspace(-1, 1, 256, dtype=np.float32) * np.float32(mag)
    with pytest.raises(ValueError, match="overflow"):
        quantize(x, qt)


def test_dequantize_wrong_byte_count():
    for qt in TYPES:
        nb = quantized_nbytes((2, 256), qt)
        with pytest.raises(ValueError, match=rf"{nb} bytes"):
            dequantize(np.zeros(nb - 1, np.uint8), qt, (2, 256))
        with pytest.raises(ValueError, match="bytes"):
            dequantize(np.zeros(nb + BLOCK_BYTES[qt], np.uint8), qt, (2, 256))
        with pytest.raises(ValueError):
            dequantize_rows(np.zeros((2, BLOCK_BYTES[qt] + 1), np.uint8), qt)
    with pytest.raises(TypeError):
        dequantize(np.zeros(34, np.float32), "q8_0", 32)


def test_non_numeric_input_rejected():
    with pytest.raises(TypeError):
        quantize(np.array(["a"] * 32), "q8_0")
    with pytest.raises(ValueError):
        quantize(np.float32(1.0), "q8_0")


def test_quant_types_table_matches_gguf_layouts():
    """The one table of quant types: sizes and ids as gguf-py's GGML_QUANT_SIZES /
    GGMLQuantizationType give them, derived views agree, per-type methods equal the functions."""
    from moe.quant import Q4_K, Q6_K, Q8_0, QUANT_TYPES, QTYPES, quant_type

    assert QTYPES == ("q8_0", "q4_k", "q6_k")
    assert [(qt.ggml_type, qt.block_size, qt.type_size) for qt in QUANT_TYPES.values()] == [
        (8, 32, 2 + 32), (12, 256, 2 + 2 + 12 + 128), (14, 256, 128 + 64 + 16 + 2)]
    assert BLOCK_SIZE == {q: qt.block_size for q, qt in QUANT_TYPES.items()}
    assert BLOCK_BYTES == {q: qt.type_size for q, qt in QUANT_TYPES.items()}
    assert quant_type("Q4_K") is Q4_K and quant_type(Q6_K) is Q6_K
    with pytest.raises(ValueError, match="supported: q8_0, q4_k, q6_k"):
        quant_type("q5_k")
    assert sorted(QUANT_TYPES.values(), key=lambda qt: qt.bits_per_weight) == [Q4_K, Q6_K, Q8_0]
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    for qt in (Q8_0, Q4_K, Q6_K):
        b = qt.quantize(x)
        assert np.array_equal(b, quantize(x, qt.name))
        assert b.shape == (2, qt.row_bytes(512))
        assert np.array_equal(qt.dequantize(b, x.shape), dequantize(b, qt.name, x.shape))


def test_cpu_kernel_hooks_bound_for_every_type():
    """moe.compute.cpu binds its numba kernels into every QuantType; the matrix finds them."""
    import moe.compute.cpu as cpu
    from moe.quant import QUANT_TYPES, QuantizedMatrix

    rng = np.random.default_rng(4)
    w = rng.standard_normal((4, 256)).astype(np.float32)
    for qt in QUANT_TYPES.values():
        assert qt.cpu_matmul is not None and qt.cpu_dequantize is not None, qt
        m = QuantizedMatrix.from_dense(w, qt.name)
        assert m.quant is qt
        assert np.array_equal(cpu.dequantize_matrix(m), m.dequantize())


def test_wire_codecs_are_byte_identical_to_the_reference_codecs():
    """The wire's compiled carrier codecs (Q8_0 encode/decode, bf16 encode/decode) give the bytes
    and bits of ``quant.Q8_0`` and ``codec.encode_bf16``: exact .5 ties, zero blocks, subnormal
    scales (x/d not finite → 0), magnitudes near the fp16 scale limit; errors for NaN/Inf and
    for a scale that overflows fp16."""
    from moe import wire
    from moe.codec import encode_bf16

    rng = np.random.default_rng(7)
    ties = np.zeros((2, 32), np.float32)
    ties[:, 0] = 127
    ties[:, 1:] = np.arange(31) + 0.5
    ties[1] *= -1
    cases = [rng.standard_normal((16, 2048)).astype(np.float32), ties,
             (rng.integers(-254, 255, (8, 256)) / 2).astype(np.float32), np.zeros((2, 64), np.float32),
             (rng.standard_normal((4, 64)) * 1e-38).astype(np.float32),
             (rng.standard_normal((4, 64)) * 1e-44).astype(np.float32),
             rng.uniform(-8.2e6, 8.2e6, (4, 64)).astype(np.float32)]
    for x in cases:
        n, h = x.shape
        data = wire.encode_rows(x, "q8_0")
        assert data == quant.Q8_0.quantize(x).tobytes()
        back = wire.decode_rows(data, "q8_0", h, n)
        assert back.tobytes() == quant.Q8_0.dequantize(np.frombuffer(data, np.uint8), (n, h)).tobytes()
        if np.abs(x).max() < 3e38:
            b16 = wire.encode_rows(x, "bf16")
            assert b16 == encode_bf16(x).astype("<u2").tobytes()
            assert np.array_equal(wire.decode_rows(b16, "bf16", h, n).view(np.uint32),
                                  encode_bf16(x).astype(np.uint32).reshape(n, h) << 16)
    for bad in (np.nan, np.inf, -np.inf):
        x = cases[0].copy()
        x[3, 5] = bad
        for kind in ("q8_0", "bf16"):
            with pytest.raises(wire.WireError, match="non-finite"):
                wire.encode_rows(x, kind)
    with pytest.raises(wire.WireError, match="overflows"):
        wire.encode_rows(np.full((1, 32), 1e7, np.float32), "q8_0")
    with pytest.raises(wire.WireError, match="bf16 range"):
        wire.encode_rows(np.full((1, 32), 3.4e38, np.float32), "bf16")
    scale_inf = bytearray(wire.encode_rows(cases[0][:1], "q8_0"))
    scale_inf[34 * 3:34 * 3 + 2] = np.float16(np.inf).tobytes()
    with pytest.raises(wire.WireError, match="non-finite"):
        wire.decode_rows(bytes(scale_inf), "q8_0", 2048, 1)
