"""GGUF block quantization (Q8_0, Q4_K, Q6_K) in pure numpy, one small class per type.

Each supported type is a ``QuantType`` subclass (``Q8_0``, ``Q4_K``, ``Q6_K``) holding its
block size, bytes per block, fp16 scale offsets, encoder, decoder and the compute kernel
hooks, registered in ``QUANT_TYPES`` (name → instance), in the manner of gguf-py's
``gguf/quants.py`` (``__Quant`` subclasses keyed by ``GGMLQuantizationType``). The runtime,
the compute backends and the wire read sizes and kernels from that table; ``BLOCK_SIZE``,
``BLOCK_BYTES`` and ``QTYPES`` are views of it kept for callers.

Encoders are byte-identical to llama.cpp / ggml's reference quantizers
(``ggml-quants.c``: ``quantize_row_q8_0_ref``, ``quantize_row_q4_K_ref`` with
``make_qkx2_quants``, ``quantize_row_q6_K_ref`` with ``make_qx_quants``) as built
for x86-64 without FMA contraction.  Decoders are bit-identical to gguf-py's
``gguf.quants.dequantize`` (``Q8_0/Q4_K/Q6_K.dequantize_blocks``), which in
turn match ggml's ``dequantize_row_*``.

How the bit-exactness is kept while staying vectorised:

* Every value is float32 and every operation is a separate numpy ufunc call on
  float32 operands with float32 scalars (numpy never fuses ``a*b+c``), in the
  same evaluation order as the C expressions.
* Every C sum is a sequential float32 accumulation in index order.  Blocks are
  laid out transposed (``[elements_per_block, n_blocks]``, C-contiguous) and
  summed with ``np.add.reduce(axis=0)``, which accumulates row by row, i.e.
  sequentially per block.  (numpy's pairwise summation only applies when the
  reduced axis is the contiguous inner one, which happens if there is a single
  block; that case is run with the block duplicated.)
* ``nearest_int`` (the ``1.5*2**23`` magic-add trick) is emulated exactly on
  the float32 bit pattern where its argument is not provably small.  Inside
  the candidate searches ``np.rint`` (round half to even, identical for
  ``|v| < 2**22``) is used after checking, per chunk, from each block's extremes
  that the argument is in range; the clamps to the quant range are skipped
  when those bounds show they cannot act.
* Q8_0 uses C ``roundf`` (half away from zero): ``rint`` plus an exact fix of
  the half-way cases.
* Searches loop over the candidate scales in Python (21 for Q4_K, 19 for
  Q6_K); each iteration is vectorised across all blocks of a chunk.  The
  per-element quants chosen by the search are only stored when a sub-block's
  integer scale ends up 0 (otherwise the block is re-quantized against the
  stored scales); those few sub-blocks are found afterwards and their search
  is re-run with quant tracking.

Policy (docs/DESIGN.md §5, reference section 6): non-finite input raises; an
input whose fp16 block scale would overflow (``|x|`` of roughly 8e6 and more
for Q8_0) raises instead of writing an infinite scale (ggml's
``ggml_validate_row_data`` would reject such a block).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

__all__ = [
    "BLOCK_SIZE",
    "BLOCK_BYTES",
    "QTYPES",
    "QUANT_TYPES",
    "QuantType",
    "Q8_0",
    "Q4_K",
    "Q6_K",
    "quant_type",
    "quantize",
    "dequantize",
    "quantize_q8_0_rows",
    "dequantize_rows",
    "quantized_nbytes",
    "normalize_qtype",
    "QuantizedMatrix",
]

QK_K = 256

_F32 = np.float32
_MAGIC = _F32(12582912.0)  # 1.5 * 2**23, ggml nearest_int
_NEAREST_SAFE = _F32(4194303.0)  # |v| <= this: nearest_int == round half even
_GROUP_MAX_EPS = _F32(1e-15)

# Super-blocks per vectorised chunk: amortises the per-call overhead of numpy
# while bounding the temporaries (a few MB).
_Q4K_CHUNK = 1024
_Q6K_CHUNK = 1024
_Q8_CHUNK_BLOCKS = 4096


# --------------------------------------------------------------------------
# helpers


def normalize_qtype(qtype: str) -> str:
    """Return the canonical lower-case name of ``qtype``.

    Accepts ``"q8_0"``, ``"q4_k"``, ``"q6_k"`` in any case (``"Q4_K"`` ...).
    Raises ``ValueError`` (listing the supported names) for anything else.
    """
    if isinstance(qtype, str):
        q = qtype.strip().lower()
        if q in QUANT_TYPES:
            return q
    raise ValueError(
        f"unsupported quantization type {qtype!r}; supported: {', '.join(QTYPES)}"
    )


def _shape_tuple(shape) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        return (int(shape),)
    try:
        t = tuple(int(s) for s in shape)
    except TypeError:
        raise ValueError(f"shape must be an int or a sequence of ints, got {shape!r}") from None
    if any(s < 0 for s in t):
        raise ValueError(f"shape must not have negative dimensions, got {t}")
    return t


def _check_row_length(n: int, q: str) -> None:
    bs = QUANT_TYPES[q].block_size
    if n % bs != 0:
        raise ValueError(
            f"row length {n} is not a multiple of the {q} block size {bs}"
        )


def quantized_nbytes(shape, qtype: str) -> int:
    """Number of bytes of ``shape`` float values quantized as ``qtype``.

    ``shape`` is an int (one row) or a sequence ``(..., n)``; rows are the last
    axis.  Returns ``prod(shape[:-1]) * (n // BLOCK_SIZE[q]) * BLOCK_BYTES[q]``.
    Raises ``ValueError`` for an unknown ``qtype``, an empty shape or a row
    length ``n`` that is not a multiple of the block size (32 for q8_0, 256
    for q4_k / q6_k).
    """
    q = normalize_qtype(qtype)
    s = _shape_tuple(shape)
    if len(s) == 0:
        raise ValueError("shape must have at least one dimension (the row length)")
    _check_row_length(s[-1], q)
    rows = 1
    for d in s[:-1]:
        rows *= d
    return rows * QUANT_TYPES[q].row_bytes(s[-1])


def _as_f32_rows(x, q: str) -> np.ndarray:
    """Validate an input array and return it as C-contiguous float32."""
    a = np.asarray(x)
    if a.dtype.kind in "bcUSOMm":
        raise TypeError(f"quantize expects a real float array, got dtype {a.dtype}")
    if a.ndim == 0:
        raise ValueError("quantize expects an array of shape (..., n), got a scalar")
    _check_row_length(a.shape[-1], q)
    try:
        a = np.ascontiguousarray(a, dtype=np.float32)  # also bf16 (ml_dtypes), f16, f64
    except (TypeError, ValueError):
        raise TypeError(f"quantize expects a real float array, got dtype {a.dtype}") from None
    if a.size and not np.isfinite(a).all():
        bad = np.argwhere(~np.isfinite(a))[0]
        raise ValueError(
            f"input to {q} quantization contains non-finite values (NaN or Inf), "
            f"first at index {tuple(int(i) for i in bad)}"
        )
    return a


def _nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml ``nearest_int`` exactly: low 23 bits of ``v + 1.5*2**23`` (float32)
    minus ``2**22``, as int32 (round half to even for |v| < 2**22, the same bit
    trick - wrap-around included - beyond)."""
    t = np.add(v, _MAGIC, dtype=np.float32)
    i = t.view(np.int32)
    np.bitwise_and(i, 0x7FFFFF, out=i)
    np.subtract(i, 0x400000, out=i)
    return i


def _seqsum(a: np.ndarray) -> np.ndarray:
    """Sequential float32 sum over axis 0 (in index order) of a [n, B] array."""
    if a.shape[1] >= 2 and a.strides[1] == a.itemsize:
        return np.add.reduce(a, axis=0)
    acc = a[0].copy()
    for i in range(1, a.shape[0]):
        acc = np.add(acc, a[i], dtype=np.float32)
    return acc


def _check_scale_overflow(h16: np.ndarray, q: str, what: str) -> None:
    if not np.isfinite(h16).all():
        raise ValueError(
            f"{q} quantization: the fp16 block scale {what} overflows (input magnitude "
            f"too large for {q}; ggml would reject the block)"
        )


# --------------------------------------------------------------------------
# Q8_0


def _quantize_q8_0(a: np.ndarray) -> np.ndarray:
    """a: float32 C-contiguous [..., n] (validated, finite) -> uint8 [..., n//32*34]."""
    n = a.shape[-1]
    out = np.empty(a.shape[:-1] + (n // 32 * 34,), dtype=np.uint8)
    xb = a.reshape(-1, 32)
    ob = out.reshape(-1, 34)
    half = _F32(0.5)
    for s in range(0, xb.shape[0], _Q8_CHUNK_BLOCKS):
        x = xb[s:s + _Q8_CHUNK_BLOCKS]
        nb = x.shape[0]
        # amax = fold(MAX, 0, |x|): on finite input the exact max of |x|; the bit
        # patterns of non-negative floats order like int32, and reduceat over
        # the flat array is much faster than a reduction over a 32-long axis.
        bits = np.bitwise_and(x.view(np.int32), 0x7FFFFFFF).reshape(-1)
        amax = np.maximum.reduceat(bits, np.arange(0, bits.size, 32)).view(np.float32)
        d = np.divide(amax, _F32(127))
        idv = np.zeros_like(d)
        np.divide(_F32(1), d, out=idv, where=d != 0)  # id = d ? 1/d : 0
        with np.errstate(over="ignore"):
            h = d.astype("<f2")
        _check_scale_overflow(h, "q8_0", "d")
        v = np.multiply(x, np.repeat(idv, 32).reshape(nb, 32))  # x*id (f32)
        if np.isinf(idv).any():
            # d subnormal (amax < ~3.7e-37): id = inf and x*id is +-inf or NaN;
            # the C float -> int8 store (cvttss2si, low byte) yields 0 there.
            v[~np.isfinite(v)] = 0
        # roundf (half away from zero) = rint (half to even) except on exact ties
        r = np.rint(v)
        t = np.subtract(v, r)
        np.abs(t, out=t)
        ties = t == half
        if ties.any():
            r = np.where(ties, v + np.copysign(half, v), r)
        ob[s:s + nb, 0:2] = h.view(np.uint8).reshape(nb, 2)
        ob[s:s + nb, 2:] = r.astype(np.int8).view(np.uint8)
    return out


def quantize_q8_0_rows(x: np.ndarray) -> np.ndarray:
    """Q8_0-encode activation rows (the wire carrier fast path).

    x: float32 ``[n, H]`` (any leading shape is accepted, rows are the last
    axis) with ``H % 32 == 0``.  Returns uint8 ``[n, H // 32 * 34]``: per block
    of 32 values an fp16 ``d = amax/127`` then 32 int8 ``roundf(x * (1/d))``.
    Byte-identical to ggml ``quantize_row_q8_0_ref`` and gguf-py
    ``Q8_0.quantize_blocks``.

    Raises ValueError if ``H`` is not a multiple of 32, the input holds NaN/Inf
    ("non-finite"), or a block's fp16 scale would overflow (|x| >~ 8.3e6).
    """
    a = _as_f32_rows(x, "q8_0")
    with np.errstate(all="ignore"):  # IEEE special values are part of the algorithm
        return _quantize_q8_0(a)


# --------------------------------------------------------------------------
# Q4_K: make_qkx2_quants + quantize_row_q4_K_ref


# candidate numerators (rmin + rdelta*is) + nmax of make_qkx2_quants, float32 as in C
_QKX2_NUMS = [
    _F32(_F32(_F32(-1.0) + _F32(_F32(0.1) * _F32(i))) + _F32(15)) for i in range(21)
]


def _make_qkx2(X: np.ndarray, W: np.ndarray, track_L: bool):
    """Vectorised ``make_qkx2_quants(n=32, nmax=15, rmin=-1, rdelta=0.1,
    nstep=20, use_mad=false)`` for B blocks.

    X, W: float32 C-contiguous [32, B] (values, weights), B >= 1.
    Returns (scale [B], the_min [B], L uint8 [32, B] or None, degenerate [B]);
    degenerate blocks (max == min after clamping min to <= 0) have L = 0.
    """
    B = X.shape[1]
    if B == 1:  # the axis-0 reduction must not collapse into a pairwise sum
        r = _make_qkx2(np.repeat(X, 2, axis=1), np.repeat(W, 2, axis=1), track_L)
        return r[0][:1], r[1][:1], (None if r[2] is None else r[2][:, :1]), r[3][:1]
    f32 = np.float32
    nmax = _F32(15)
    zero = _F32(0)
    add_reduce = np.add.reduce
    mx = X.max(axis=0)
    dmin_raw = X.min(axis=0)
    sum_w = add_reduce(W, axis=0)
    T = np.multiply(W, X)
    sum_x = add_reduce(T, axis=0)
    mn = np.minimum(dmin_raw, zero)  # if (min > 0) min = 0
    degen = mx == mn
    # Degenerate blocks return early in C; give them a harmless non-zero range
    # here (their results are discarded) so they never force the slow path.
    mx_eff = np.where(degen, mn + np.abs(mn) + _F32(1), mx).astype(f32)
    iscale = np.divide(nmax, np.subtract(mx_eff, mn))
    scale = np.divide(_F32(1), iscale)

    LA = np.empty_like(X)
    WL = np.empty_like(X)
    # initial quants: with iscale finite the argument is within [0, 15*(1+eps)],
    # so rint == nearest_int; a subnormal range makes iscale inf (exact path)
    np.subtract(X, mn, out=T)
    np.multiply(T, iscale, out=T)
    if np.isfinite(iscale).all():
        np.rint(T, out=T)
        np.clip(T, zero, nmax, out=LA)
    else:
        li = _nearest_int(T)
        np.clip(li, 0, 15, out=li)
        LA[...] = li
    L = LA.copy() if track_L else None
    np.multiply(LA, scale, out=T)
    np.add(T, mn, out=T)
    np.subtract(T, X, out=T)
    np.multiply(T, T, out=T)
    np.multiply(W, T, out=T)
    best = add_reduce(T, axis=0)

    C15 = None
    C0 = None
    cur_min = mn.copy()
    dlo = np.subtract(dmin_raw, cur_min)  # lowest x - min of each block
    dlo_neg = False
    lim = -_NEAREST_SAFE
    half = _F32(-0.5)
    S = np.empty((3, B), f32)  # sum_l, sum_l2, sum_xl
    sum_l, sum_l2, sum_xl = S[0], S[1], S[2]
    A1 = np.empty((3, B), f32)
    A2 = np.empty((3, B), f32)
    A3 = np.empty((3, B), f32)
    NUM = np.empty((2, B), f32)
    D = np.empty(B, f32)
    den = np.empty(B, f32)
    isc = np.empty(B, f32)
    err = np.empty(B, f32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for is_ in range(21):
            num = _QKX2_NUMS[is_]
            np.subtract(mx_eff, cur_min, out=den)
            np.divide(num, den, out=isc)
            np.subtract(X, cur_min, out=T)
            np.multiply(T, isc, out=T)
            # v = isc*(x - min) is monotone in x; with isc > 0 finite (den > 0)
            # its maximum is isc*den ~= num <= 16 and its minimum isc*dlo (>= 0
            # when dlo >= 0).  Within those bounds rint == nearest_int and the
            # clamps are only needed when the bounds can leave [0, 15].
            if dlo_neg:
                lo = np.multiply(isc, dlo).min()
            else:
                lo = zero
            if lo >= lim and isc.min() > zero and isc.max() < np.inf:
                np.rint(T, out=LA)
                if num >= _F32(15.5):
                    if C15 is None:
                        C15 = np.full_like(X, nmax)
                    np.minimum(LA, C15, out=LA)
                if lo < half:
                    if C0 is None:
                        C0 = np.zeros_like(X)
                    np.maximum(LA, C0, out=LA)
            else:
                li = _nearest_int(T)
                np.clip(li, 0, 15, out=li)
                LA[...] = li
            np.multiply(W, LA, out=WL)
            add_reduce(WL, axis=0, out=sum_l)
            np.multiply(WL, LA, out=T)
            add_reduce(T, axis=0, out=sum_l2)
            np.multiply(WL, X, out=WL)
            add_reduce(WL, axis=0, out=sum_xl)
            # D = sum_w*sum_l2 - sum_l*sum_l
            # this_scale = (sum_w*sum_xl - sum_x*sum_l)/D
            # this_min   = (sum_l2*sum_x - sum_l*sum_xl)/D   (products commute exactly)
            np.multiply(S, sum_w, out=A1)  # w*l, w*l2, w*xl
            np.multiply(S, sum_l, out=A2)  # l*l, l2*l, xl*l
            np.multiply(S, sum_x, out=A3)  # l*x, l2*x, xl*x
            np.subtract(A1[1], A2[0], out=D)
            np.subtract(A1[2], A3[0], out=NUM[0])
            np.subtract(A3[1], A2[2], out=NUM[1])
            np.divide(NUM, D, out=NUM)
            ts, tm = NUM[0], NUM[1]
            cm = tm > zero
            if cm.any():
                tm[cm] = zero
                ts[cm] = np.divide(sum_xl[cm], sum_l2[cm])
            np.multiply(LA, ts, out=T)
            np.add(T, tm, out=T)
            np.subtract(T, X, out=T)
            np.multiply(T, T, out=T)
            np.multiply(W, T, out=T)
            add_reduce(T, axis=0, out=err)
            better = err < best
            better &= D > zero
            if better.any():
                np.putmask(best, better, err)
                np.putmask(scale, better, ts)
                np.putmask(cur_min, better, tm)
                np.subtract(dmin_raw, cur_min, out=dlo)
                dlo_neg = bool(dlo.min() < zero)
                if track_L:
                    np.copyto(L, LA, where=better[None, :])
    scale[degen] = zero
    the_min = np.negative(np.where(degen, mn, cur_min))
    if track_L:
        L[:, degen] = 0
        L = L.astype(np.uint8)
    return scale, the_min, L, degen


def _q4k_weights(X: np.ndarray) -> np.ndarray:
    """weights[l] = sqrtf(sum_x2/32) + |x[l]| for X [32, B] (quantize_row_q4_K_ref)."""
    sq = np.multiply(X, X)
    sum_x2 = _seqsum(sq)
    av_x = np.sqrt(np.divide(sum_x2, _F32(32), dtype=np.float32))
    W = np.abs(X)
    np.add(av_x, W, out=W)
    return W


def _quantize_q4_k_chunk(xs: np.ndarray) -> np.ndarray:
    """xs: float32 [nb, 256] -> uint8 [nb, 144]."""
    nb = xs.shape[0]
    S = nb * 8
    X = np.ascontiguousarray(xs.reshape(S, 32).T)  # [32, S]
    W = _q4k_weights(X)
    scales, mins, _, degen = _make_qkx2(X, W, track_L=False)
    scales = scales.reshape(nb, 8)
    mins = mins.reshape(nb, 8)

    max_scale = np.where(scales > 0, scales, _F32(0)).max(axis=1).astype(np.float32)
    max_min = np.where(mins > 0, mins, _F32(0)).max(axis=1).astype(np.float32)
    c63 = _F32(63)
    inv_scale = np.where(max_scale > 0, np.divide(c63, max_scale), _F32(0)).astype(np.float32)
    inv_min = np.where(max_min > 0, np.divide(c63, max_min), _F32(0)).astype(np.float32)
    # uint8_t ls = nearest_int(...): wraps mod 256, then MIN(63, ls)
    ls = np.minimum(_nearest_int(np.multiply(inv_scale[:, None], scales)) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(_nearest_int(np.multiply(inv_min[:, None], mins)) & 0xFF, 63).astype(np.uint8)
    with np.errstate(over="ignore"):
        d16 = np.divide(max_scale, _F32(63), dtype=np.float32).astype("<f2")
        m16 = np.divide(max_min, _F32(63), dtype=np.float32).astype("<f2")
    _check_scale_overflow(d16, "q4_k", "d")
    _check_scale_overflow(m16, "q4_k", "dmin")

    # re-quantize against the stored (fp16, 6-bit) scales and mins
    dj = np.multiply(d16.astype(np.float32)[:, None], ls.astype(np.float32), dtype=np.float32)  # [nb, 8]
    dmj = np.multiply(m16.astype(np.float32)[:, None], lm.astype(np.float32), dtype=np.float32)
    djT = dj.reshape(S)
    dmjT = dmj.reshape(S)
    keep = djT == 0
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        v = np.divide(np.add(X, dmjT, dtype=np.float32), djT, dtype=np.float32)
    Li = _nearest_int(v)
    np.clip(Li, 0, 15, out=Li)
    L = Li.astype(np.uint8)  # [32, S]
    L[:, keep & degen] = 0  # make_qkx2's early return: all quants 0
    redo = keep & ~degen  # keep the search's quants: recompute them for these only
    if redo.any():
        idx = np.nonzero(redo)[0]
        Xk = np.ascontiguousarray(X[:, idx])
        Wk = np.ascontiguousarray(W[:, idx])
        _, _, Lk, _ = _make_qkx2(Xk, Wk, track_L=True)
        L[:, idx] = Lk
    L = L.T.reshape(nb, 4, 2, 32)

    out = np.empty((nb, 144), dtype=np.uint8)
    out[:, 0:2] = d16.view(np.uint8).reshape(nb, 2)
    out[:, 2:4] = m16.view(np.uint8).reshape(nb, 2)
    sc = out[:, 4:16]
    sc[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    sc[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    sc[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    out[:, 16:144] = (L[:, :, 0, :] | (L[:, :, 1, :] << 4)).reshape(nb, 128)
    return out


# --------------------------------------------------------------------------
# Q6_K: make_qx_quants(rmse_type=1) + quantize_row_q6_K_ref


# candidate -(nmax + 0.1f*is) of make_qx_quants for is = -9..9, is != 0 (float32 as in C)
_QX_NUMS = [
    np.negative(_F32(_F32(32) + _F32(_F32(0.1) * _F32(i)))) for i in range(-9, 10) if i != 0
]


def _make_qx(X: np.ndarray, track_L: bool):
    """Vectorised ``make_qx_quants(n=16, nmax=32, rmse_type=1, qw=NULL)``.

    X: float32 C-contiguous [16, B].  Returns (scale [B], L uint8 [16, B] or None).
    L holds the stored quants ``l + 32`` (all 0 for an all-zero sub-block).
    """
    B = X.shape[1]
    if B == 1:  # the axis-0 reduction must not collapse into a pairwise sum
        sc, L = _make_qx(np.repeat(X, 2, axis=1), track_L)
        return sc[:1], (None if L is None else L[:, :1])
    f32 = np.float32
    nmax = _F32(32)
    zero = _F32(0)
    add_reduce = np.add.reduce
    AX = np.abs(X)
    im = AX.argmax(axis=0)  # first index of the largest |x| (strict '>' scan)
    cols = np.arange(B)
    amax = AX[im, cols]
    mxv = X[im, cols]
    zero_blk = amax < _GROUP_MAX_EPS
    maxs = np.where(zero_blk, _F32(1), mxv).astype(f32)
    xhi = X.max(axis=0)
    xlo = X.min(axis=0)

    W = np.multiply(X, X)  # w = x*x (rmse_type 1)
    Wx = np.multiply(W, X)  # w*x
    Lf = np.empty_like(X)
    T = np.empty_like(X)
    C31 = None
    Cm32 = None
    sumlx = np.empty(B, f32)
    suml2 = np.empty(B, f32)
    isc = np.empty(B, f32)
    e1 = np.empty(B, f32)
    e2 = np.empty(B, f32)

    def quants():
        # iscale*x: |.| <= 33, so rint is exactly nearest_int; v = isc*x is
        # monotone in x, so the block extremes tell whether a clamp can act.
        nonlocal C31, Cm32
        np.multiply(X, isc, out=T)
        np.rint(T, out=Lf)
        np.multiply(isc, xhi, out=e1)
        np.multiply(isc, xlo, out=e2)
        hi = max(e1.max(), e2.max())
        lo = min(e1.min(), e2.min())
        if hi >= _F32(31.5):
            if C31 is None:
                C31 = np.full_like(X, _F32(31))
            np.minimum(Lf, C31, out=Lf)
        if lo < _F32(-32.5):
            if Cm32 is None:
                Cm32 = np.full_like(X, -nmax)
            np.maximum(Lf, Cm32, out=Lf)
        np.multiply(Wx, Lf, out=T)
        add_reduce(T, axis=0, out=sumlx)
        np.multiply(W, Lf, out=T)
        np.multiply(T, Lf, out=T)
        add_reduce(T, axis=0, out=suml2)

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        np.divide(-nmax, maxs, out=isc)
        quants()
        L = (Lf + nmax).astype(np.uint8) if track_L else None
        scale = np.where(suml2 != 0, np.divide(sumlx, suml2), zero).astype(f32)
        best = np.multiply(scale, sumlx)
        for num in _QX_NUMS:
            np.divide(num, maxs, out=isc)
            quants()
            better = np.multiply(sumlx, sumlx) > np.multiply(best, suml2)
            better &= suml2 > zero
            if better.any():
                ns = np.divide(sumlx, suml2)
                np.putmask(scale, better, ns)
                np.putmask(best, better, np.multiply(ns, sumlx))
                if track_L:
                    np.copyto(L, (Lf + nmax).astype(np.uint8), where=better[None, :])
    scale[zero_blk] = zero
    if track_L:
        L[:, zero_blk] = 0
    return scale, L


def _quantize_q6_k_chunk(xs: np.ndarray) -> np.ndarray:
    """xs: float32 [nb, 256] -> uint8 [nb, 210]."""
    nb = xs.shape[0]
    S = nb * 16
    X = np.ascontiguousarray(xs.reshape(S, 16).T)  # [16, S]
    scales, _ = _make_qx(X, track_L=False)
    scales = scales.reshape(nb, 16)
    a = np.abs(scales)
    a = np.where(np.isnan(a), _F32(0), a)
    ib = a.argmax(axis=1)
    rows = np.arange(nb)
    max_abs = a[rows, ib]
    max_scale = scales[rows, ib]
    zero_blk = max_abs < _GROUP_MAX_EPS
    ms = np.where(zero_blk, _F32(1), max_scale).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = np.divide(_F32(-128), ms, dtype=np.float32)
        d16 = np.divide(_F32(1), iscale, dtype=np.float32).astype("<f2")
        d16[zero_blk] = 0
        _check_scale_overflow(d16, "q6_k", "d")
        sci = np.minimum(_nearest_int(np.multiply(iscale[:, None], scales, dtype=np.float32)), 127)
        sc8 = sci.astype(np.int8)  # wraps like the C int -> int8_t store
        sc8[zero_blk] = 0
        dj = np.multiply(d16.astype(np.float32)[:, None], sc8.astype(np.float32), dtype=np.float32)
        djT = dj.reshape(S)
        keep = (djT == 0) & ~np.repeat(zero_blk, 16)
        v = np.divide(X, djT, dtype=np.float32)
    Li = _nearest_int(v)
    np.clip(Li, -32, 31, out=Li)
    Li += 32
    L = Li.astype(np.uint8)  # [16, S]
    if keep.any():
        idx = np.nonzero(keep)[0]
        _, Lk = _make_qx(np.ascontiguousarray(X[:, idx]), track_L=True)
        L[:, idx] = Lk
    L = L.T.reshape(nb, 2, 4, 32)

    out = np.empty((nb, 210), dtype=np.uint8)
    ql = out[:, 0:128].reshape(nb, 2, 2, 32)
    ql[:, :, 0, :] = (L[:, :, 0, :] & 0xF) | ((L[:, :, 2, :] & 0xF) << 4)
    ql[:, :, 1, :] = (L[:, :, 1, :] & 0xF) | ((L[:, :, 3, :] & 0xF) << 4)
    out[:, 128:192] = ((L[:, :, 0, :] >> 4) | ((L[:, :, 1, :] >> 4) << 2)
                       | ((L[:, :, 2, :] >> 4) << 4) | ((L[:, :, 3, :] >> 4) << 6)).reshape(nb, 64)
    out[:, 192:208] = sc8.view(np.uint8)
    out[:, 208:210] = d16.view(np.uint8).reshape(nb, 2)
    out[zero_blk] = 0
    return out


def _quantize_k(a: np.ndarray, chunk_fn, block_bytes: int, chunk: int) -> np.ndarray:
    n = a.shape[-1]
    out = np.empty(a.shape[:-1] + (n // QK_K * block_bytes,), dtype=np.uint8)
    xb = a.reshape(-1, QK_K)
    ob = out.reshape(-1, block_bytes)
    for s in range(0, xb.shape[0], chunk):
        ob[s:s + chunk] = chunk_fn(xb[s:s + chunk])
    return out


# --------------------------------------------------------------------------
# public API


def quantize(x: np.ndarray, qtype: str) -> np.ndarray:
    """Quantize float rows to GGUF blocks, byte-identical to llama.cpp.

    x: array of shape ``(..., n)`` (float32; other real dtypes are converted to
    float32 first).  Each row (last axis) is quantized on its own.
    qtype: ``"q8_0"``, ``"q4_k"`` or ``"q6_k"`` (case-insensitive).
    Returns uint8 of shape ``(..., n // BLOCK_SIZE[q] * BLOCK_BYTES[q])``:
    the GGUF tensor data of those rows.

    Source algorithms (``ggml-quants.c``): ``quantize_row_q8_0_ref``;
    ``quantize_row_q4_K_ref`` (``make_qkx2_quants(32, 15, ..., -1, 0.1, 20,
    false)`` per sub-block, 6-bit scales/mins via ``nearest_int``, fp16
    ``d``/``dmin``, ``get_scale_min_k4`` packing, re-quantization against the
    stored scales); ``quantize_row_q6_K_ref`` (``make_qx_quants(16, 32, ...,
    rmse_type=1, NULL)``, int8 sub-block scales, fp16 ``d``).  This is the
    ``llama-quantize`` path without an imatrix.

    Raises ValueError for an unknown qtype (listing the supported ones), a row
    length that is not a multiple of the block size (32 for q8_0, 256 for
    q4_k/q6_k), non-finite input (NaN/Inf), or input so large that an fp16
    block scale would overflow; TypeError for non-numeric input.
    """
    qt = quant_type(qtype)
    a = _as_f32_rows(x, qt.name)
    with np.errstate(all="ignore"):  # IEEE special values are part of the algorithm
        return qt.quantize_rows(a)


def _as_u8(blocks) -> np.ndarray:
    if isinstance(blocks, (bytes, bytearray, memoryview)):
        return np.frombuffer(blocks, dtype=np.uint8)
    b = np.asarray(blocks)
    if b.dtype == np.uint8:
        return b
    if b.dtype == np.int8:
        return b.view(np.uint8)
    raise TypeError(f"quantized data must be uint8 bytes, got dtype {b.dtype}")


def _f16_field(b: np.ndarray, off: int) -> np.ndarray:
    """The little-endian fp16 at byte offset ``off`` of each block, as float32 [N, 1]."""
    return np.ascontiguousarray(b[:, off:off + 2]).view("<f2").astype(np.float32)


def _deq_q8_0(b: np.ndarray, out: np.ndarray) -> None:
    """b: uint8 [N, 34] -> out float32 [N, 32] (gguf-py Q8_0.dequantize_blocks:
    ``qs * d``)."""
    d = _f16_field(b, 0)  # [N, 1]
    out[...] = b[:, 2:].view(np.int8)
    np.multiply(out, np.repeat(d, 32, axis=1), out=out)


def _deq_q4_k(b: np.ndarray, out: np.ndarray) -> None:
    """b: uint8 [N, 144] -> out float32 [N, 256] (gguf-py Q4_K.dequantize_blocks:
    ``(d*sc) * q - (dmin*m)`` per sub-block of 32, get_scale_min_k4 unpacking)."""
    N = b.shape[0]
    d = _f16_field(b, 0)
    dmin = _f16_field(b, 2)
    s = b[:, 4:16]
    sc = np.empty((N, 8), dtype=np.uint8)
    mn = np.empty((N, 8), dtype=np.uint8)
    np.bitwise_and(s[:, 0:4], 0x3F, out=sc[:, 0:4])
    sc[:, 4:8] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 2) & 0x30)
    np.bitwise_and(s[:, 4:8], 0x3F, out=mn[:, 0:4])
    mn[:, 4:8] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 2) & 0x30)
    dl = np.multiply(d, sc.astype(np.float32))  # [N, 8]
    ml = np.multiply(dmin, mn.astype(np.float32))
    qs = b[:, 16:144].reshape(N, 4, 32)
    y = out.reshape(N, 4, 2, 32)
    y[:, :, 0, :] = qs & 0x0F
    y[:, :, 1, :] = qs >> 4
    np.multiply(out, np.repeat(dl, 32, axis=1), out=out)
    np.subtract(out, np.repeat(ml, 32, axis=1), out=out)


def _deq_q6_k(b: np.ndarray, out: np.ndarray) -> None:
    """b: uint8 [N, 210] -> out float32 [N, 256] (gguf-py Q6_K.dequantize_blocks:
    ``(d*scales) * (q - 32)`` per sub-block of 16, int8 scales)."""
    N = b.shape[0]
    ql = b[:, 0:128].reshape(N, 2, 2, 32)
    qh = b[:, 128:192].reshape(N, 2, 32)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16_field(b, 208)
    dl = np.multiply(d, sc)  # [N, 16]
    q = np.empty((N, 2, 4, 32), dtype=np.uint8)
    q[:, :, 0, :] = (ql[:, :, 0, :] & 0x0F) | ((qh & 0x03) << 4)
    q[:, :, 1, :] = (ql[:, :, 1, :] & 0x0F) | (((qh >> 2) & 0x03) << 4)
    q[:, :, 2, :] = (ql[:, :, 0, :] >> 4) | (((qh >> 4) & 0x03) << 4)
    q[:, :, 3, :] = (ql[:, :, 1, :] >> 4) | ((qh >> 6) << 4)
    out[...] = q.reshape(N, 256)
    np.subtract(out, _F32(32), out=out)
    np.multiply(out, np.repeat(dl, 16, axis=1), out=out)


_DEQ_CHUNK_BYTES = 1 << 18  # bytes of blocks decoded per step (output ~7x that)


# --------------------------------------------------------------------------
# the quant types


class QuantType(ABC):
    """One GGUF block quantization type (gguf-py ``quants.py`` ``__Quant`` in spirit).

    Class attributes: ``name`` (canonical lower-case, as in blob metadata), ``ggml_type``
    (the ``GGMLQuantizationType`` id), ``block_size`` (values per block), ``type_size``
    (bytes per block), ``scale_offsets`` (byte offsets of the fp16 scale fields in a block),
    ``native_activation`` (how the native kernel quantizes activation rows for this weight
    type: ``"q8_0"`` or ``"q8_k"``, ggml's ``vec_dot_type``).

    Kernel hooks: ``native_name`` is the type name the ``tenzro_kernels`` extension dispatches
    on (``moe.kernels``); ``cpu_matmul`` / ``cpu_dequantize`` are the numba kernels of
    ``moe.compute.cpu``, bound there with ``bind_cpu_kernels`` (this module stays free of
    numba). Subclasses implement ``quantize_rows`` and ``dequantize_blocks``.
    """

    name: str = ""
    ggml_type: int = -1
    block_size: int = 0
    type_size: int = 0
    scale_offsets: tuple[int, ...] = ()
    native_activation: str = ""

    def __init__(self):
        self.cpu_matmul = None
        self.cpu_dequantize = None

    @property
    def native_name(self) -> str:
        """The type name ``tenzro_kernels.matmul_xt`` takes (the canonical name)."""
        return self.name

    @property
    def bits_per_weight(self) -> float:
        """Storage bits per value, ``8 * type_size / block_size`` (Q4_K 4.5, Q6_K 6.5625, Q8_0 8.5)."""
        return 8 * self.type_size / self.block_size

    def row_bytes(self, cols: int) -> int:
        """Bytes of one row of ``cols`` values (``cols`` a multiple of ``block_size``, unchecked)."""
        return cols // self.block_size * self.type_size

    @abstractmethod
    def quantize_rows(self, a: np.ndarray) -> np.ndarray:
        """Encode validated float32 C-contiguous finite rows ``[..., n]`` (``n`` a multiple of
        ``block_size``) → uint8 ``[..., row_bytes(n)]``, byte-identical to ggml's reference
        quantizer. Raises ``ValueError`` when an fp16 block scale would overflow. Call with
        floating-point warnings silenced (IEEE specials are part of the algorithms)."""

    @abstractmethod
    def dequantize_blocks(self, b: np.ndarray, out: np.ndarray) -> None:
        """Decode uint8 blocks ``[N, type_size]`` into float32 ``out`` ``[N, block_size]``,
        bit-identical to gguf-py's ``dequantize_blocks`` of this type."""

    def quantize(self, x) -> np.ndarray:
        """``quantize(x, self.name)``: validated public encoder (see :func:`quantize`)."""
        return quantize(x, self.name)

    def dequantize(self, blocks, shape) -> np.ndarray:
        """``dequantize(blocks, self.name, shape)`` (see :func:`dequantize`)."""
        return dequantize(blocks, self.name, shape)

    def bind_cpu_kernels(self, matmul, dequantize) -> None:
        """Attach the CPU backend's compiled kernels: ``matmul(blocks u8 [rows, row_bytes],
        x f32 [n, cols], y f32 [n, rows])`` writing ``x · Wᵀ`` into ``y``, and
        ``dequantize(blocks, out f32 [rows, cols])`` bit-identical to ``dequantize_blocks``."""
        self.cpu_matmul = matmul
        self.cpu_dequantize = dequantize

    def __repr__(self) -> str:
        return f"<QuantType {self.name}: {self.block_size} values in {self.type_size} bytes>"


class _Q8_0(QuantType):
    """Q8_0: blocks of 32, an fp16 scale ``d = amax/127`` then 32 int8 (ggml ``block_q8_0``)."""

    name, ggml_type, block_size, type_size = "q8_0", 8, 32, 34
    scale_offsets = (0,)
    native_activation = "q8_0"

    def quantize_rows(self, a):
        """ggml ``quantize_row_q8_0_ref`` (see :func:`_quantize_q8_0`)."""
        return _quantize_q8_0(a)

    def dequantize_blocks(self, b, out):
        """gguf-py ``Q8_0.dequantize_blocks``: ``qs * d``."""
        _deq_q8_0(b, out)


class _Q4_K(QuantType):
    """Q4_K: super-blocks of 256 = 8 sub-blocks of 32 with 6-bit scales and mins, fp16 ``d`` and
    ``dmin``, 4-bit quants (ggml ``block_q4_K``, 144 bytes)."""

    name, ggml_type, block_size, type_size = "q4_k", 12, QK_K, 144
    scale_offsets = (0, 2)
    native_activation = "q8_k"

    def quantize_rows(self, a):
        """ggml ``quantize_row_q4_K_ref`` with ``make_qkx2_quants``."""
        return _quantize_k(a, _quantize_q4_k_chunk, self.type_size, _Q4K_CHUNK)

    def dequantize_blocks(self, b, out):
        """gguf-py ``Q4_K.dequantize_blocks``."""
        _deq_q4_k(b, out)


class _Q6_K(QuantType):
    """Q6_K: super-blocks of 256 = 16 sub-blocks of 16 with int8 scales, fp16 ``d``, 6-bit
    quants split in low nibbles and high 2-bit pairs (ggml ``block_q6_K``, 210 bytes)."""

    name, ggml_type, block_size, type_size = "q6_k", 14, QK_K, 210
    scale_offsets = (208,)
    native_activation = "q8_k"

    def quantize_rows(self, a):
        """ggml ``quantize_row_q6_K_ref`` with ``make_qx_quants(rmse_type=1)``."""
        return _quantize_k(a, _quantize_q6_k_chunk, self.type_size, _Q6K_CHUNK)

    def dequantize_blocks(self, b, out):
        """gguf-py ``Q6_K.dequantize_blocks``."""
        _deq_q6_k(b, out)


Q8_0 = _Q8_0()
Q4_K = _Q4_K()
Q6_K = _Q6_K()
# The one table of supported types, in this order (the order error messages list them).
QUANT_TYPES: dict[str, QuantType] = {qt.name: qt for qt in (Q8_0, Q4_K, Q6_K)}
QTYPES = tuple(QUANT_TYPES)
BLOCK_SIZE = {q: qt.block_size for q, qt in QUANT_TYPES.items()}
BLOCK_BYTES = {q: qt.type_size for q, qt in QUANT_TYPES.items()}


def quant_type(qtype) -> QuantType:
    """The ``QuantType`` of ``qtype`` (a name in any case, or a ``QuantType``).

    Raises ``ValueError`` (listing the supported names) for anything else.
    """
    if isinstance(qtype, QuantType):
        return qtype
    return QUANT_TYPES[normalize_qtype(qtype)]


def dequantize(blocks, qtype: str, shape) -> np.ndarray:
    """Decode GGUF blocks to float32, bit-identical to gguf-py's ``dequantize``.

    blocks: uint8 array (any shape; int8 arrays and bytes-like objects are
    accepted) holding exactly ``quantized_nbytes(shape, qtype)`` bytes, rows
    stored one after another.
    qtype: ``"q8_0"``, ``"q4_k"`` or ``"q6_k"`` (case-insensitive).
    shape: int or sequence ``(..., n)``: the element shape to return.
    Returns float32 of ``shape``.

    Source: gguf-py ``gguf/quants.py`` ``Q8_0/Q4_K/Q6_K.dequantize_blocks``
    (same float32 operations in the same order, hence bit-identical), which
    equal ggml ``dequantize_row_q8_0/q4_K/q6_K``.

    Raises ValueError for an unknown qtype, a row length not a multiple of
    the block size, or a byte count that does not match ``shape``; TypeError
    for non-byte data.
    """
    qt = quant_type(qtype)
    q = qt.name
    s = _shape_tuple(shape)
    want = quantized_nbytes(s, q)
    b = _as_u8(blocks)
    if b.size != want:
        raise ValueError(
            f"{q} data for shape {s} must be {want} bytes, got {b.size}"
        )
    bb = qt.type_size
    flat = np.ascontiguousarray(b).reshape(-1, bb)
    nblk = flat.shape[0]
    out = np.empty((nblk, qt.block_size), dtype=np.float32)
    step = max(1, _DEQ_CHUNK_BYTES // bb)
    for i in range(0, nblk, step):
        qt.dequantize_blocks(flat[i:i + step], out[i:i + step])
    return out.reshape(s)


def dequantize_rows(blocks, qtype: str, cols: int | None = None) -> np.ndarray:
    """Decode a quantized matrix ``[rows, row_bytes]`` to float32 ``[rows, cols]``.

    blocks: uint8 ``[rows, cols // BLOCK_SIZE[q] * BLOCK_BYTES[q]]`` (a 1-D
    buffer is accepted when ``cols`` is given).  ``cols`` defaults to the value
    implied by the row byte length.  Vectorised over all blocks; the result is
    bit-identical to gguf-py's ``dequantize`` (see :func:`dequantize`).

    Raises ValueError for an unknown qtype, a row byte length that is not a
    whole number of blocks, or a byte count that does not match ``cols``.
    """
    qt = quant_type(qtype)
    q = qt.name
    b = _as_u8(blocks)
    bb, bs = qt.type_size, qt.block_size
    if cols is None:
        if b.ndim != 2:
            raise ValueError("dequantize_rows needs a 2-D [rows, row_bytes] array or cols")
        if b.shape[1] % bb != 0:
            raise ValueError(
                f"{q} row of {b.shape[1]} bytes is not a whole number of {bb}-byte blocks"
            )
        cols = b.shape[1] // bb * bs
    cols = int(cols)
    _check_row_length(cols, q)
    row_bytes = cols // bs * bb
    if row_bytes == 0 or b.size % row_bytes != 0:
        if not (row_bytes == 0 and b.size == 0):
            raise ValueError(
                f"{q} data of {b.size} bytes is not a whole number of {row_bytes}-byte rows "
                f"({cols} columns)"
            )
    rows = b.size // row_bytes if row_bytes else (b.shape[0] if b.ndim == 2 else 0)
    return dequantize(b, q, (rows, cols))


# --------------------------------------------------------------------------
# A quantized weight matrix (shared with the runtime / compute seam)


class QuantizedMatrix:
    """A weight matrix ``[rows, cols]`` (HF ``[out, in]``) stored as GGUF blocks.

    ``qtype`` (``"q8_0"``, ``"q4_k"`` or ``"q6_k"``; normalised to lower case), ``shape`` (rows,
    cols) with ``cols`` a multiple of the block size, ``blocks`` uint8 ``[rows, row_bytes]`` with
    ``row_bytes = cols // BLOCK_SIZE * BLOCK_BYTES``: each row quantized on its own, as a GGUF
    tensor of ggml ``ne = [cols, rows]`` stores it.

    A compute backend may replace the GGUF bytes in memory by a kernel layout of its own
    (``adopt_layout``: the CPU's x8 rows, ``moe.kernels.native_weights``) that keeps every bit;
    ``blocks`` then rebuilds the GGUF bytes from it on each read (a new read-only array, byte
    for byte the original), so blob writers, exports and decoders see the same bytes, while
    memory holds one copy (``nbytes``).

    Raises ``ValueError`` for an unknown qtype, a non-2-D or empty shape, a row length that
    is not a whole number of blocks, a byte count that does not match the shape, or an fp16
    block scale that is NaN or infinite (ggml ``ggml_validate_row_data`` rejects those).
    """

    __slots__ = ("_qtype", "_shape", "_gguf", "_source", "native_layouts", "__weakref__")

    def __init__(self, qtype: str, shape, blocks):
        q = normalize_qtype(qtype)
        s = _shape_tuple(shape)
        if len(s) != 2 or 0 in s:
            raise ValueError(f"a quantized matrix needs a non-empty 2-D shape (rows, cols), got {s}")
        rows, cols = s
        row_bytes = quantized_nbytes(cols, q)
        b = _as_u8(blocks)
        if b.size != rows * row_bytes:
            raise ValueError(f"{q} matrix {rows}x{cols} needs {rows * row_bytes} bytes, got {b.size}")
        b = np.ascontiguousarray(b).reshape(rows, row_bytes)
        qt = QUANT_TYPES[q]
        flat = b.reshape(-1, qt.type_size)
        for off in qt.scale_offsets:
            d = np.ascontiguousarray(flat[:, off:off + 2]).view("<f2")
            if not np.isfinite(d).all():
                raise ValueError(f"{q} matrix {rows}x{cols} has a NaN or infinite fp16 block scale "
                                 f"(at byte offset {off} of a block)")
        self._qtype, self._shape, self._gguf = q, (rows, cols), b
        self._source = None  # (layout name, unpack) once the GGUF bytes are dropped
        # Kernel layouts made from the GGUF bytes (moe.kernels.native_weights: name -> uint8 array).
        self.native_layouts: dict[str, np.ndarray] = {}

    @property
    def qtype(self) -> str:
        """``"q8_0"``, ``"q4_k"`` or ``"q6_k"``."""
        return self._qtype

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, cols)."""
        return self._shape

    @property
    def blocks(self) -> np.ndarray:
        """The GGUF bytes, uint8 ``[rows, row_bytes]``: the array held, or (after
        ``adopt_layout``) a new read-only array rebuilt bit for bit from the kernel layout."""
        g = self._gguf
        if g is not None:
            return g
        name, unpack = self._source
        out = unpack(self.native_layouts[name]).reshape(self._shape[0], -1)
        out.flags.writeable = False
        return out

    @property
    def holds_gguf(self) -> bool:
        """Whether the GGUF bytes themselves are in memory (False once a layout was adopted)."""
        return self._gguf is not None

    def adopt_layout(self, name: str, array: np.ndarray, unpack) -> np.ndarray:
        """Keep ``array`` (uint8, kernel layout ``name`` made from ``blocks``) and drop the GGUF
        bytes: ``unpack(array)`` must give them back byte for byte (uint8, ``rows * row_bytes``).
        A layout already adopted under ``name`` wins (two threads packing at once): that one
        is returned, else ``array``."""
        have = self.native_layouts.setdefault(name, array)
        if self._source is None:
            self._source = (name, unpack)
            self._gguf = None
        return have

    @classmethod
    def from_dense(cls, x: np.ndarray, qtype: str) -> QuantizedMatrix:
        """Quantize float ``x`` ``[rows, cols]`` with ``quantize`` (llama.cpp reference bytes).

        Raises ``ValueError`` as ``quantize`` does (row length, non-finite values, fp16
        scale overflow) and for a non-2-D input.
        """
        x = np.asarray(x)
        if x.ndim != 2:
            raise ValueError(f"a quantized matrix needs a 2-D input, got shape {x.shape}")
        return cls(qtype, tuple(x.shape), quantize(x, qtype))

    @property
    def quant(self) -> QuantType:
        """This matrix's ``QuantType`` (sizes and kernel hooks) from ``QUANT_TYPES``."""
        return QUANT_TYPES[self.qtype]

    def dequantize(self) -> np.ndarray:
        """The matrix decoded to float32 ``[rows, cols]``, bit-identical to gguf-py."""
        return dequantize(self.blocks, self.qtype, self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes held in memory: the GGUF blocks while they are kept, plus every kernel layout
        (``native_layouts``), so the memory tier counts what a host really keeps."""
        g = self._gguf
        return (int(g.nbytes) if g is not None else 0) + sum(int(a.nbytes) for a in self.native_layouts.values())

    @property
    def gguf_nbytes(self) -> int:
        """Bytes of the GGUF blocks (the blob's tensor), held or not."""
        return self._shape[0] * quantized_nbytes(self._shape[1], self._qtype)

    def __repr__(self) -> str:
        return (f"QuantizedMatrix({self._qtype!r}, {self._shape}, "
                f"layouts={sorted(self.native_layouts) or ['gguf']})")

    @property
    def ndim(self) -> int:
        """Always 2 (so shape checks read like those of an ndarray)."""
        return 2
