"""Inline execution receipts: carrier hash, output commitment, signing and verification (docs/DESIGN.md §7).

A holder that executed one batch signs, with its provider key, the request identity
(request id, model, layer, expert, token indices), the SHA-256 of the exact carrier bytes
it received, a commitment to the output rows it returned, ``d_model``, the hash of the
blob it executed and its quant kind. The router checks the receipt inline before folding
the rows into the combine; any failure is a holder failure.

Commitment (reference §7.1 with §14 fix 2): per output row the top-8 features by
``|value|`` (descending, ties to the lower index; ``(index u32, value f32)``) as the
reference does, plus ``SKETCH_PROJECTIONS`` random ±1 projections of the whole row, the
signs expanded with SHAKE-256 from the input hash (so the holder cannot choose them
before it has the input, and every machine derives the same signs). Projections are
float64 sums; BLAS summation order may differ between machines, so the holder ships its
projection values in the receipt (``sketch``) and the router accepts them when they agree
with its own within ``SKETCH_RTOL × Σ|row|`` (far below one f32 ulp of any element that
matters), then hashes the holder's canonical bytes. Changing any output element by more
than that moves every projection and fails the check.

Canonical commitment bytes: ``b"tenzro/moe/activation/v2" ‖ k:u8 ‖ p:u8 ‖ n:u32 ‖ per row:
token:u32 ‖ k × (index:u32 ‖ value:f32) ‖ p × projection:f64`` (all little-endian);
commitment = SHA-256 of those bytes. Carrier hash (reference §7.2):
``SHA-256(b"tenzro/moe/carrier" ‖ tag ‖ payload)`` with tag 0 = f32, 1 = Q8_0 blocks.

Two signed forms (both verify forever; the router accepts either):

- **Single receipt** (one batch alone): ``signature`` = ed25519 by the provider over
  ``DOMAIN_RECEIPT ‖ 0x00 ‖ canonical_json(body)`` (``moe.identity``: sorted keys, compact,
  ASCII, integers and strings only), ``DOMAIN_RECEIPT = b"tenzro/moe/receipt/v2"``, body
  ``{request_id, model_id, layer, expert, tokens: [u32...], input_hash, commitment, d_model,
  blob_hash, quant, provider}`` (hashes 64 lowercase hex).
- **Message receipt** (the batches of one coalesced message, one signature for all): each
  batch's answer carries an *entry*: the single receipt's fields without ``signature``, plus
  ``index`` (its request's position in the message). Its *leaf* is
  ``SHA-256(DOMAIN_RECEIPT ‖ 0x00 ‖ canonical_json(body))``, the digest of exactly the bytes
  a single receipt would sign. The message's *seal* ``{provider, leaves: [hex64...],
  signature}`` carries one leaf per request of the message in request order (32 zero bytes
  for a request that failed) and ``signature`` = ed25519 by the provider over
  ``DOMAIN_MESSAGE ‖ 0x00 ‖ n:u32 LE ‖ n × leaf:32 bytes``,
  ``DOMAIN_MESSAGE = b"tenzro/moe/receipt-message/v1"``. The router recomputes a batch's
  leaf from what it sent and received, checks ``leaves[index]`` equals it and verifies the
  seal's signature once per message. The stored (*sealed*) form of a batch's receipt is its
  entry plus ``message: {leaves, signature}``: anyone with the provider's key re-checks it
  alone (``verify_stored_receipt``), so sampling, audits and disputes stay per batch.

Python + numpy (+ one numba kernel) + PyNaCl; imports nothing from Django.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import struct
import sys

import numpy as np
from nacl.signing import SigningKey
from numba import njit

from moe.identity import SignatureError, canonical_json, provider_id, sign, verify

DOMAIN_RECEIPT = b"tenzro/moe/receipt/v2"
DOMAIN_MESSAGE = b"tenzro/moe/receipt-message/v1"
NO_LEAF = bytes(32)  # the leaf of a message's request that failed (no entry)
ACTIVATION_DOMAIN = b"tenzro/moe/activation/v2"
CARRIER_DOMAIN = b"tenzro/moe/carrier"
SKETCH_DOMAIN = b"tenzro/moe/sketch"
TOP_K = 8
SKETCH_PROJECTIONS = 4
SKETCH_RTOL = 1e-9
CARRIER_TAGS = {"f32": 0, "q8_0": 1, "f16": 2}
_HEX32 = re.compile(r"^[0-9a-f]{64}$")


class ReceiptError(ValueError):
    """A receipt is missing, malformed, or does not match the request, the rows or the key."""


def carrier_hash(kind: str, payload: bytes) -> bytes:
    """SHA-256 (32 bytes) of ``b"tenzro/moe/carrier" ‖ tag ‖ payload``; ``kind`` "f32", "f16" or "q8_0".

    Raises ``ReceiptError`` for another kind.
    """
    tag = CARRIER_TAGS.get(kind)
    if tag is None:
        raise ReceiptError(f"unknown carrier kind {kind!r}")
    h = hashlib.sha256(CARRIER_DOMAIN + bytes([tag]))
    h.update(payload)  # not concatenated: no copy of the carrier
    return h.digest()


def _sign_bits(input_hash: bytes, d_model: int, p: int = SKETCH_PROJECTIONS) -> np.ndarray:
    """The SHAKE-256 bytes uint8 ``[ceil(p·d_model / 8)]`` whose bits (little-endian within each
    byte) are the sketch signs, projection-major: bit 1 → +1, bit 0 → −1."""
    return np.frombuffer(hashlib.shake_256(SKETCH_DOMAIN + input_hash).digest((p * d_model + 7) // 8), dtype=np.uint8)


def sketch_signs(input_hash: bytes, d_model: int, p: int = SKETCH_PROJECTIONS) -> np.ndarray:
    """The ±1 projection matrix float64 ``[p, d_model]`` expanded from ``input_hash`` with SHAKE-256."""
    bits = np.unpackbits(_sign_bits(input_hash, d_model, p), bitorder="little")[:p * d_model]
    return (bits.astype(np.float64) * 2.0 - 1.0).reshape(p, d_model)


@njit(cache=True, nogil=True)
def _expand_signs(bits, p, h):
    """``sketch_signs`` from ``_sign_bits`` inside compiled code: float64 ``[p, h]``."""
    signs = np.empty((p, h), np.float64)
    for q in range(p):
        for j in range(h):
            b = q * h + j
            signs[q, j] = 1.0 if (bits[b >> 3] >> (b & 7)) & 1 else -1.0
    return signs


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _sums(rows, signs, proj, abssum):
    """``proj`` f64 ``[n, p]`` ← rows @ signs.T and ``abssum`` f64 ``[n]`` ← Σ|row|, in one pass
    (reassociated, so vectorized: the sketch is compared within a tolerance, never bit-exact).
    Returns False when a row holds NaN or ±Inf."""
    n, h = rows.shape
    p = signs.shape[0]
    finite = True
    for r in range(n):
        s = 0.0
        bad = 0.0
        for j in range(h):
            v = np.float64(rows[r, j])
            s += abs(v)
            bad += v - v  # 0 for finite v, NaN for NaN or ±Inf
        abssum[r] = s
        if bad != 0.0:  # NaN compares unequal to everything, 0.0 included
            finite = False
        for q in range(p):
            acc = 0.0
            for j in range(h):
                acc += np.float64(rows[r, j]) * signs[q, j]
            proj[r, q] = acc
    return finite


def sketch(rows: np.ndarray, input_hash: bytes) -> np.ndarray:
    """Projections float64 ``[n, p]`` of rows f32 ``[n, H]`` onto the signs of ``input_hash``."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    proj = np.empty((rows.shape[0], SKETCH_PROJECTIONS), np.float64)
    _sums(rows, sketch_signs(input_hash, rows.shape[1]), proj, np.empty(rows.shape[0], np.float64))
    return proj


@njit(cache=True, nogil=True)
def _top_k_scan(rows, k, out, values):
    """``out`` uint32 ``[n, k]`` ← per row of finite f32 ``rows`` the indices of the k largest
    |values|, descending, ties to the lower index, and ``values`` f32 ``[n, k]`` ← those values:
    one pass per row keeping a sorted list of k; a value enters only when strictly larger than
    the list's last (an equal one has a higher index, so it loses the tie) and moves ahead of
    strictly smaller ones only. Once the list is full, a span of 16 values none of which beats
    the list's last is skipped
    after one branch-free (vectorized) compare."""
    n, h = rows.shape
    mags = np.empty(k, np.float32)
    for r in range(n):
        filled = 0
        j0 = 0
        while j0 < h:
            j1 = min(j0 + 16, h)
            if filled == k:
                floor = mags[k - 1]
                beats = 0
                for j in range(j0, j1):
                    beats |= abs(rows[r, j]) > floor
                if not beats:
                    j0 = j1
                    continue
            for j in range(j0, j1):
                m = abs(rows[r, j])
                if filled == k:
                    if not m > mags[k - 1]:
                        continue
                    p = k - 1
                else:
                    p = filled
                    filled += 1
                while p > 0 and mags[p - 1] < m:
                    mags[p] = mags[p - 1]
                    out[r, p] = out[r, p - 1]
                    p -= 1
                mags[p] = m
                out[r, p] = j
            j0 = j1
        for p in range(k):
            values[r, p] = rows[r, out[r, p]]


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _digest_rows(rows, bits, idx, values, proj, abssum):
    """Everything a receipt needs of rows f32 ``[n, H]`` in one compiled call: ``proj`` and
    ``abssum`` (``_sums`` over the signs expanded from ``bits``), then, when every row is
    finite, the top ``idx.shape[1]`` features into ``idx``/``values`` (``_top_k_scan``).
    Returns whether every row was finite (if not, ``idx``/``values`` are not written)."""
    finite = _sums(rows, _expand_signs(bits, proj.shape[1], rows.shape[1]), proj, abssum)
    if finite and idx.shape[1] > 0:
        _top_k_scan(rows, idx.shape[1], idx, values)
    return finite


def _digest(rows: np.ndarray, input_hash: bytes, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What a receipt needs of rows f32 ``[n, H]``, in one compiled call (``_digest_rows``):
    (top-k indices uint32 ``[n, k']``, their values float32, sketch projections float64
    ``[n, p]``, Σ|row| float64 ``[n]``), ``k' = min(k, H)``. Rows holding NaN or ±Inf take
    ``_top_features_partition`` for the top-k (NaN first, as numpy orders it)."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    n, h = rows.shape
    kk = min(k, h)
    idx = np.empty((n, kk), np.uint32)
    val = np.empty((n, kk), np.float32)
    proj = np.empty((n, SKETCH_PROJECTIONS), np.float64)
    abssum = np.empty(n, np.float64)
    if not _digest_rows(rows, _sign_bits(input_hash, h), idx, val, proj, abssum):
        idx, val = _top_features_partition(rows, kk)
    return idx, val, proj, abssum


@njit(cache=True, nogil=True)
def _sketch_agrees(theirs, ours, abssum):
    """Whether every projection of ``theirs`` f64 ``[n, p]`` is finite and within
    ``SKETCH_RTOL × abssum[row] + 1e-30`` of ``ours``: the router's sketch check, element for
    element as numpy computes it (no fastmath here: the tolerance is rounded the same way)."""
    n, p = theirs.shape
    for r in range(n):
        tol = SKETCH_RTOL * abssum[r]
        tol = tol + 1e-30
        for q in range(p):
            t = theirs[r, q]
            if not np.isfinite(t) or abs(t - ours[r, q]) > tol:
                return False
    return True


@njit(cache=True, nogil=True)
def _check_rows(rows, bits, theirs, raw, tokens, k, out):
    """The router's whole per-batch check of finite rows f32 ``[n, H]`` in one compiled call:
    the sketch over the signs of ``bits`` (``_sign_bits``) against the holder's ``theirs`` f64
    ``[n, p]`` (``_sketch_agrees``), then the canonical commitment rows (module docstring)
    into ``out`` uint8 ``[n × (4 + 8k + 8p)]``: each row's token (``tokens`` uint32 ``[n]``),
    its top ``k`` features (``_top_k_scan``) and the holder's projections copied byte for byte
    from ``raw`` (uint8, the decoded sketch). Little-endian hosts only (bytes are copied from
    native arrays). Returns 0 (checked, ``out`` written), 1 (a row holds NaN or ±Inf: nothing
    decided, the caller takes the numpy path) or 2 (the sketch disagrees)."""
    n, h = rows.shape
    p = theirs.shape[1]
    proj = np.empty((n, p), np.float64)
    abssum = np.empty(n, np.float64)
    if not _sums(rows, _expand_signs(bits, p, h), proj, abssum):
        return 1
    if not _sketch_agrees(theirs, proj, abssum):
        return 2
    idx = np.empty((n, k), np.uint32)
    val = np.empty((n, k), np.float32)
    if k > 0:
        _top_k_scan(rows, k, idx, val)
    tb = tokens.view(np.uint8)
    ib = idx.reshape(n * k).view(np.uint8)
    vb = val.reshape(n * k).view(np.uint8)
    o = 0
    for r in range(n):
        for b in range(4):
            out[o + b] = tb[4 * r + b]
        o += 4
        for j in range(k):
            e = 4 * (r * k + j)
            for b in range(4):
                out[o + b] = ib[e + b]
                out[o + 4 + b] = vb[e + b]
            o += 8
        for b in range(8 * p):
            out[o + b] = raw[8 * p * r + b]
        o += 8 * p
    return 0


def top_features(rows: np.ndarray, k: int = TOP_K) -> tuple[np.ndarray, np.ndarray]:
    """Per row the top-``k`` features by |value| (descending, ties to the lower index).

    Returns (indices uint32 ``[n, k]``, values float32 ``[n, k]``); ``k`` is clamped to H.
    Finite rows: one compiled pass per row (``_top_k_scan``, O(H), about 10x the numpy
    partition on a 32 x 2048 batch); rows holding NaN take ``_top_features_partition``
    (numpy's NaN ordering). Both give the same answer on finite rows.
    """
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    n, h = rows.shape
    k = min(k, h)
    if n == 0 or k == 0 or np.isnan(rows).any():
        return _top_features_partition(rows, k)
    idx = np.empty((n, k), dtype=np.uint32)
    val = np.empty((n, k), dtype=np.float32)
    _top_k_scan(rows, k, idx, val)
    return idx, val


def _top_features_partition(rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``top_features`` for any f32 rows, NaN and ±Inf included, by a full stable sort per row:
    NaN first (numpy's sort puts NaN above every magnitude), then |value| descending, ties to
    the lower index. O(H log H) per row; only rows that are not all finite come here."""
    n, h = rows.shape
    if n == 0 or k == 0:
        return np.zeros((n, k), np.uint32), np.zeros((n, k), np.float32)
    mag = np.abs(rows)
    idx = np.lexsort((-mag, ~np.isnan(mag)), axis=-1)[:, :k]  # last key is the primary; lexsort is stable
    return idx.astype(np.uint32), np.take_along_axis(rows, idx, axis=1)


def commitment_bytes(tokens: list[int], rows: np.ndarray, projections: np.ndarray, k: int = TOP_K) -> bytes:
    """Canonical commitment bytes (module docstring) of rows f32 ``[n, H]`` and projections f64 ``[n, p]``.

    Raises ``ReceiptError`` when the shapes disagree with the token count.
    """
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if rows.ndim != 2 or rows.shape[0] != len(tokens) or rows.shape[1] == 0:
        raise ReceiptError(f"output rows have shape {rows.shape}; expected [{len(tokens)}, d_model]")
    return _pack_commitment(tokens, *top_features(rows, k), projections)


def _pack_commitment(tokens: list[int], idx: np.ndarray, val: np.ndarray, projections: np.ndarray) -> bytes:
    """Canonical commitment bytes from the top features (uint32 / float32 ``[n, k]``) and projections."""
    n = len(tokens)
    projections = np.ascontiguousarray(projections, dtype="<f8")
    if projections.ndim != 2 or projections.shape[0] != n:
        raise ReceiptError(f"sketch has shape {projections.shape}; expected [{n}, p]")
    kk, p = idx.shape[1], projections.shape[1]
    rec = np.zeros(n, dtype=[("t", "<u4"), ("f", [("i", "<u4"), ("v", "<f4")], (kk,)), ("s", "<f8", (p,))])
    rec["t"] = np.asarray(tokens, dtype=np.uint32)
    rec["f"]["i"] = idx
    rec["f"]["v"] = val
    rec["s"] = projections
    return ACTIVATION_DOMAIN + struct.pack("<BBI", kk, p, n) + rec.tobytes()


def _body(*, request_id: str, model_id: str, layer: int, expert: int, tokens: list[int], input_hash: str,
          commitment: str, d_model: int, blob_hash: str, quant: str, provider: str) -> dict:
    return {"request_id": request_id, "model_id": model_id, "layer": int(layer), "expert": int(expert),
            "tokens": [int(t) for t in tokens], "input_hash": input_hash, "commitment": commitment,
            "d_model": int(d_model), "blob_hash": blob_hash, "quant": quant, "provider": provider}


def _message_bytes(leaves: list[bytes]) -> bytes:
    """What a seal signs after its domain: ``n:u32 LE ‖ n × leaf``."""
    return struct.pack("<I", len(leaves)) + b"".join(leaves)


def make_entry(key: SigningKey, *, request_id: str, model_id: str, layer: int, expert: int, tokens: list[int],
               carrier_kind: str, carrier: bytes, rows: np.ndarray, blob_hash: str, quant: str,
               index: int | None = None) -> tuple[dict, bytes]:
    """A batch's receipt fields and its leaf (holder side), signed only when ``index`` is None.

    Arguments as ``make_receipt``. ``index`` None: (the single receipt, its leaf). ``index``
    an int: (the message entry: the same fields with ``index`` instead of ``signature``, its
    leaf); ``make_seal`` then signs the message's leaves once.
    """
    ih = carrier_hash(carrier_kind, carrier)
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if rows.ndim != 2 or rows.shape[0] != len(tokens) or rows.shape[1] == 0:
        raise ReceiptError(f"output rows have shape {rows.shape}; expected [{len(tokens)}, d_model]")
    idx, val, proj, _ = _digest(rows, ih, TOP_K)
    commit = hashlib.sha256(_pack_commitment(tokens, idx, val, proj)).hexdigest()
    provider = provider_id(key)
    out = {"provider": provider, "request_id": request_id, "input_hash": ih.hex(), "commitment": commit,
           "d_model": int(rows.shape[1]), "blob_hash": blob_hash, "quant": quant,
           "sketch": base64.b64encode(np.ascontiguousarray(proj, dtype="<f8").tobytes()).decode()}
    # The body's canonical JSON written directly (_body_json, the router's verifier does the
    # same): json.dumps of the body was half of a batch's receipt work on the holder.
    data = DOMAIN_RECEIPT + b"\x00" + _body_json(
        request_id=request_id, model_id=model_id, layer=layer, expert=expert, tokens=tokens,
        input_hash=out["input_hash"], commitment=commit, d_model=rows.shape[1], blob_hash=blob_hash, quant=quant,
        provider=provider)
    if index is None:
        out["signature"] = sign(key, DOMAIN_RECEIPT, data[len(DOMAIN_RECEIPT) + 1:])
    else:
        out["index"] = int(index)
    return out, hashlib.sha256(data).digest()


def make_receipt(key: SigningKey, *, request_id: str, model_id: str, layer: int, expert: int, tokens: list[int],
                 carrier_kind: str, carrier: bytes, rows: np.ndarray, blob_hash: str, quant: str) -> dict:
    """Sign a single receipt for one executed batch (holder side).

    ``carrier`` is the exact payload received (kind "f32", "f16" or "q8_0"), ``rows`` f32 ``[n, H]``
    the output rows exactly as the router will decode them. Returns
    ``{provider, request_id, input_hash, commitment, d_model, blob_hash, quant, sketch, signature}``
    (hashes hex, ``sketch`` base64 of f64 LE ``[n, p]``).
    """
    return make_entry(key, request_id=request_id, model_id=model_id, layer=layer, expert=expert, tokens=tokens,
                      carrier_kind=carrier_kind, carrier=carrier, rows=rows, blob_hash=blob_hash, quant=quant)[0]


def make_seal(key: SigningKey, leaves: list[bytes | None]) -> dict:
    """The seal of one message (holder side): ``{provider, leaves: [hex], signature}`` over the
    leaves of its requests in order (None for a request that failed: ``NO_LEAF``)."""
    leaves = [NO_LEAF if x is None else x for x in leaves]
    return {"provider": provider_id(key), "leaves": [x.hex() for x in leaves],
            "signature": sign(key, DOMAIN_MESSAGE, _message_bytes(leaves))}


def verify_seal(seal, provider: str) -> list[bytes]:
    """Check a message seal's shape, signer and signature; returns its leaves (32 bytes each).

    One call per message: each batch's entry is then checked with ``entry_in_seal``. Raises
    ``ReceiptError`` naming what is wrong.
    """
    if not isinstance(seal, dict) or not isinstance(seal.get("leaves"), list) \
            or not isinstance(seal.get("signature"), str):
        raise ReceiptError("the message seal is missing or malformed")
    if seal.get("provider", provider) != provider:
        raise ReceiptError("the message seal is signed by another key than the provider's registered key")
    if not seal["leaves"] or not all(isinstance(x, str) and _HEX32.match(x) for x in seal["leaves"]):
        raise ReceiptError("the message seal's leaves must be 64 hex characters each")
    leaves = [bytes.fromhex(x) for x in seal["leaves"]]
    try:
        verify(provider, DOMAIN_MESSAGE, _message_bytes(leaves), seal["signature"])
    except SignatureError as exc:
        raise ReceiptError(f"message seal signature: {exc}") from exc
    return leaves


def entry_in_seal(entry: dict, leaf: bytes, leaves: list[bytes]) -> None:
    """Check that a batch's ``leaf`` is the seal's leaf at the entry's ``index``; raises ``ReceiptError``."""
    i = entry.get("index")
    if type(i) is not int or not 0 <= i < len(leaves):
        raise ReceiptError(f"receipt.index {i!r} is not a request of the sealed message")
    if leaf == NO_LEAF or leaves[i] != leaf:
        raise ReceiptError("the message seal does not sign this batch's receipt")


def sealed(entry: dict, seal: dict) -> dict:
    """The stored form of a message entry: the entry plus ``message: {leaves, signature}``."""
    return {**entry, "message": {"leaves": list(seal["leaves"]), "signature": seal["signature"]}}


def is_entry(receipt) -> bool:
    """Whether ``receipt`` is a message entry (``index``, no ``signature``): it needs its message's seal."""
    return isinstance(receipt, dict) and "signature" not in receipt and "index" in receipt


def verify_entry(receipt: dict | None, *, provider: str, request_id: str, model_id: str, layer: int, expert: int,
                 tokens: list[int], carrier_kind: str, carrier: bytes, rows: np.ndarray) -> bytes:
    """Every check of ``verify_receipt`` but the signature; returns the batch's leaf.

    For a message entry (``is_entry``) the caller then checks the leaf against the message's
    verified seal (``verify_seal`` once, ``entry_in_seal`` per batch). Raises ``ReceiptError``.
    """
    return hashlib.sha256(DOMAIN_RECEIPT + b"\x00" + _checked_body(
        receipt, provider=provider, request_id=request_id, model_id=model_id, layer=layer, expert=expert,
        tokens=tokens, carrier_kind=carrier_kind, carrier=carrier, rows=rows)).digest()


def _checked_body(receipt, *, provider: str, request_id: str, model_id: str, layer: int, expert: int,
                  tokens: list[int], carrier_kind: str, carrier: bytes, rows: np.ndarray) -> bytes:
    """``verify_entry``'s checks; returns the canonical JSON of the signed body."""
    if not isinstance(receipt, dict):
        raise ReceiptError("the holder sent no receipt")
    for name in ("provider", "request_id", "input_hash", "commitment", "blob_hash", "quant", "sketch"):
        if not isinstance(receipt.get(name), str):
            raise ReceiptError(f"receipt.{name} is missing or not a string")
    if receipt["provider"] != provider:
        raise ReceiptError("receipt is signed by another key than the provider's registered key")
    if receipt["request_id"] != request_id:
        raise ReceiptError("receipt is for another request")
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if receipt.get("d_model") != rows.shape[1]:
        raise ReceiptError(f"receipt.d_model is {receipt.get('d_model')!r}, rows have {rows.shape[1]}")
    ih = carrier_hash(carrier_kind, carrier)
    if receipt["input_hash"] != ih.hex():
        raise ReceiptError("receipt.input_hash is not the hash of the carrier that was sent")
    if not _HEX32.match(receipt["commitment"]):
        raise ReceiptError("receipt.commitment must be 64 hex characters")
    try:
        raw = base64.b64decode(receipt["sketch"], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ReceiptError(f"receipt.sketch is not base64: {exc}") from exc
    n = len(tokens)
    if len(raw) != n * SKETCH_PROJECTIONS * 8:
        raise ReceiptError(f"receipt.sketch holds {len(raw)} bytes; expected {n * SKETCH_PROJECTIONS * 8}")
    theirs = np.frombuffer(raw, dtype="<f8").reshape(n, SKETCH_PROJECTIONS)
    if rows.shape[0] != n:
        raise ReceiptError(f"{rows.shape[0]} output rows for {n} tokens")
    if rows.shape[1] == 0:
        raise ReceiptError(f"output rows have shape {rows.shape}; expected [{n}, d_model]")
    if _commitment_of(rows, ih, theirs, raw, tokens) != receipt["commitment"]:
        raise ReceiptError("output rows do not match the receipt's commitment")
    return _body_json(request_id=request_id, model_id=model_id, layer=layer, expert=expert, tokens=tokens,
                      input_hash=ih.hex(), commitment=receipt["commitment"], d_model=rows.shape[1],
                      blob_hash=receipt["blob_hash"], quant=receipt["quant"], provider=provider)


_LITTLE_ENDIAN = sys.byteorder == "little"  # _check_rows copies native bytes into little-endian records


def _commitment_of(rows: np.ndarray, ih: bytes, theirs: np.ndarray, raw: bytes, tokens: list[int]) -> str:
    """The commitment (64 hex) of f32 C-contiguous ``rows`` ``[n, H]`` with the holder's sketch
    ``theirs`` f64 ``[n, p]`` (decoded from ``raw``), once the sketch agrees with the rows
    (``_checked_body``'s last row check). Finite rows on a little-endian host: one compiled call
    (``_check_rows``); otherwise the numpy steps (``_digest``, ``_pack_commitment``), which
    decide the same. Raises ``ReceiptError`` when the sketch disagrees."""
    tok = np.ascontiguousarray(tokens, dtype=np.uint32)
    if _LITTLE_ENDIAN:
        n, h = rows.shape
        kk = min(TOP_K, h)
        out = np.empty(n * (4 + 8 * kk + 8 * theirs.shape[1]), np.uint8)
        code = _check_rows(rows, _sign_bits(ih, h), theirs, np.frombuffer(raw, np.uint8), tok, kk, out)
        if code == 2:
            raise ReceiptError("output rows do not match the receipt's sketch")
        if code == 0:
            digest = hashlib.sha256(ACTIVATION_DOMAIN + struct.pack("<BBI", kk, theirs.shape[1], n))
            digest.update(out)
            return digest.hexdigest()
    idx, val, ours, abssum = _digest(rows, ih, TOP_K)  # rows holding NaN or ±Inf: numpy's ordering
    tol = SKETCH_RTOL * abssum[:, None] + 1e-30
    if not np.isfinite(theirs).all() or (np.abs(theirs - ours) > tol).any():
        raise ReceiptError("output rows do not match the receipt's sketch")
    return hashlib.sha256(_pack_commitment(tok, idx, val, theirs)).hexdigest()


_json_str = json.encoder.encode_basestring_ascii  # a string as json.dumps(ensure_ascii=True) writes it


def _body_json(*, request_id, model_id, layer, expert, tokens, input_hash, commitment, d_model, blob_hash, quant,
               provider) -> bytes:
    """``canonical_json(_body(...))``, byte for byte, written directly (keys in sorted order,
    compact, ASCII) when every string field is a ``str``; ``canonical_json`` otherwise. The
    receipt leaf of every verified batch is this body's digest: json.dumps of a dict with a
    token list cost about as much as the rest of the body's checks."""
    if not (type(request_id) is str and type(model_id) is str and type(input_hash) is str
            and type(commitment) is str and type(blob_hash) is str and type(quant) is str and type(provider) is str):
        return canonical_json(_body(request_id=request_id, model_id=model_id, layer=layer, expert=expert,
                                    tokens=tokens, input_hash=input_hash, commitment=commitment, d_model=d_model,
                                    blob_hash=blob_hash, quant=quant, provider=provider))
    return (f'{{"blob_hash":{_json_str(blob_hash)},"commitment":{_json_str(commitment)},"d_model":{int(d_model)},'
            f'"expert":{int(expert)},"input_hash":{_json_str(input_hash)},"layer":{int(layer)},'
            f'"model_id":{_json_str(model_id)},"provider":{_json_str(provider)},"quant":{_json_str(quant)},'
            f'"request_id":{_json_str(request_id)},"tokens":[{",".join(map(str, map(int, tokens)))}]}}').encode()


def verify_receipt(receipt: dict | None, *, provider: str, request_id: str, model_id: str, layer: int, expert: int,
                   tokens: list[int], carrier_kind: str, carrier: bytes, rows: np.ndarray,
                   seal: dict | None = None) -> dict:
    """Check a holder's receipt inline (router side); returns the verified receipt (a message
    entry in its stored form, ``sealed``).

    ``provider`` is the registered key of the holder the batch was sent to; the other
    arguments are what the router sent (its own request id, tokens and carrier bytes) and
    the rows it decoded. Checks, in order: present and well formed; signer == ``provider``;
    request id; ``d_model``; input hash == hash of the sent carrier; sketch shape and
    agreement with the rows; commitment recomputed from the rows; then the signature: a
    single receipt's own, or for a message entry the ``seal`` of its message (required) and
    its leaf in it. Raises ``ReceiptError`` naming the first check that failed.
    """
    body = _checked_body(receipt, provider=provider, request_id=request_id, model_id=model_id, layer=layer,
                         expert=expert, tokens=tokens, carrier_kind=carrier_kind, carrier=carrier, rows=rows)
    if is_entry(receipt):
        if seal is None:
            raise ReceiptError("a message receipt entry came without its message's seal")
        entry_in_seal(receipt, hashlib.sha256(DOMAIN_RECEIPT + b"\x00" + body).digest(), verify_seal(seal, provider))
        return sealed(receipt, seal)
    if not isinstance(receipt.get("signature"), str):
        raise ReceiptError("receipt.signature is missing or not a string")
    try:
        verify(provider, DOMAIN_RECEIPT, body, receipt["signature"])
    except SignatureError as exc:
        raise ReceiptError(f"receipt signature: {exc}") from exc
    return receipt


def parse_commitment_bytes(data: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Inverse of ``commitment_bytes``: (tokens uint32 ``[n]``, indices uint32 ``[n, k]``,
    values float32 ``[n, k]``, projections float64 ``[n, p]``).

    Raises ``ReceiptError`` for bytes that are not canonical commitment bytes.
    """
    head = len(ACTIVATION_DOMAIN) + 6
    if len(data) < head or not data.startswith(ACTIVATION_DOMAIN):
        raise ReceiptError("not canonical commitment bytes (domain)")
    k, p, n = struct.unpack_from("<BBI", data, len(ACTIVATION_DOMAIN))
    dt = np.dtype([("t", "<u4"), ("f", [("i", "<u4"), ("v", "<f4")], (k,)), ("s", "<f8", (p,))])
    if len(data) != head + n * dt.itemsize:
        raise ReceiptError(f"commitment bytes hold {len(data) - head} row bytes; expected {n * dt.itemsize}")
    rec = np.frombuffer(data, dtype=dt, offset=head, count=n)
    return (rec["t"].copy(), rec["f"]["i"].reshape(n, k).copy(), rec["f"]["v"].reshape(n, k).copy(),
            rec["s"].reshape(n, p).copy())


def verify_stored_receipt(receipt: dict, *, provider: str, request_id: str, model_id: str, layer: int, expert: int,
                          tokens: list[int], d_model: int, carrier_kind: str, carrier: bytes,
                          commitment: bytes) -> None:
    """Re-verify a kept receipt without the output rows (disputes; reference §7.5 step 2).

    ``commitment`` is the canonical commitment bytes that were stored with it. Checks the
    signer, that the carrier hashes to the signed input hash, that the stored rows hash to
    the signed commitment, the rows' tokens, and the signature over the request identity:
    a single receipt's own, or for a sealed message entry (``message: {leaves, signature}``)
    the message's signature over its leaves and this batch's leaf at ``index``. A tampered
    store therefore cannot manufacture a fraud proof. Raises ``ReceiptError``.
    """
    if not isinstance(receipt, dict) or not all(isinstance(receipt.get(f), str) for f in
                                                ("provider", "commitment", "blob_hash", "quant")):
        raise ReceiptError("the stored receipt is malformed")
    if receipt["provider"] != provider:
        raise ReceiptError("the stored receipt is signed by another key than the accused provider's")
    ih = carrier_hash(carrier_kind, carrier)
    if receipt.get("input_hash") != ih.hex():
        raise ReceiptError("the stored carrier does not hash to the receipt's input_hash")
    if hashlib.sha256(commitment).hexdigest() != receipt["commitment"]:
        raise ReceiptError("the stored commitment rows do not hash to the receipt's commitment")
    toks = parse_commitment_bytes(commitment)[0]
    if toks.tolist() != [int(t) for t in tokens]:
        raise ReceiptError("the stored commitment rows are for other tokens")
    body = canonical_json(_body(request_id=request_id, model_id=model_id, layer=layer, expert=expert, tokens=tokens,
                                input_hash=ih.hex(), commitment=receipt["commitment"], d_model=d_model,
                                blob_hash=receipt["blob_hash"], quant=receipt["quant"], provider=provider))
    if "signature" not in receipt and isinstance(receipt.get("message"), dict):
        entry_in_seal(receipt, hashlib.sha256(DOMAIN_RECEIPT + b"\x00" + body).digest(),
                      verify_seal({"provider": provider, **receipt["message"]}, provider))
        return
    if not isinstance(receipt.get("signature"), str):
        raise ReceiptError("the stored receipt is malformed")
    try:
        verify(provider, DOMAIN_RECEIPT, body, receipt["signature"])
    except SignatureError as exc:
        raise ReceiptError(f"stored receipt signature: {exc}") from exc
