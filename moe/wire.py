"""Wire formats of the data plane: activation carriers and binary WebSocket frames.

Frame (docs/DESIGN.md §6): ``u32 LE header length ‖ JSON header (UTF-8) ‖ raw payload``. The
payload is a carrier of rows ``[n, d_model]``: ``"f32"`` (little-endian float32),
``"f16"`` (IEEE half, round to nearest even; Kvasir's v2f16 rows), ``"q8_0"`` (GGUF Q8_0
blocks row after row, 34 bytes per 32 values, via ``moe.quant``) or, for outputs only,
``"bf16"`` (round to nearest even). Every request carries an
``id``; results are matched by it, never by fields the holder returns.

A message (header + payload) larger than the socket's frame cap travels as several part
frames ``{id, part, parts}`` whose payloads concatenate to the whole message packed as one
frame (``split_frames``); the receiver reassembles it (``Reassembler``) before acting, so a
batch is executed whole whatever the cap: frames are a transport detail.

Pure Python + numpy; imports nothing from Django.
"""
from __future__ import annotations

import base64
import binascii
import json
import struct

import numpy as np
from numba import njit

from moe import quant
from moe.jsonrpc import ParamError

try:  # the native base64 codec (native/_kernels.c, ~10x binascii's decode); binascii when not built
    from tenzro_kernels import b64decode as _b64decode_native, b64encode as _b64encode_native
except ImportError:
    _b64decode_native = _b64encode_native = None

FRAME_HEADER_MAX = 64 * 1024
# A whole message (HTTP /frame body, reassembled parts): its header may list ~1M token indices.
MESSAGE_HEADER_MAX = 16 * 1024 * 1024
MESSAGE_MAX = 256 * 1024 * 1024  # bytes of one reassembled message
PART_OVERHEAD = 1024  # room for a part frame's own header
CARRIERS = ("f32", "f16", "q8_0")
OUTPUTS = ("f32", "f16", "bf16", "q8_0")
BYTES_PER_VALUE = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": quant.Q8_0.type_size / quant.Q8_0.block_size}
CARRIER_CHOICES = ("auto", "f32", "f16", "q8_0")  # values of a forward's ``carrier`` parameter
F16_MAX = float(np.finfo(np.float16).max)  # 65504: larger magnitudes round to infinity
# The JSON member of each carrier in base64 execute params (iroh frames, a holder's HTTP /rpc):
# the reference's ``hidden_states`` (f32) and ``hidden_q8`` (Q8_0), and our ``hidden_f16``.
CARRIER_FIELDS = {"f32": "hidden_states", "f16": "hidden_f16", "q8_0": "hidden_q8"}
assert set(CARRIER_FIELDS) == set(CARRIERS)


class WireError(ParamError):
    """A frame or carrier is malformed (bad length, bad base64, wrong shape, non-finite);
    ``field`` names the parameter at fault when the caller gave one."""


def header_json(header: dict) -> bytes:
    """A frame header's bytes on the wire: compact JSON (what ``pack_frame`` writes and byte
    counts measure)."""
    return json.dumps(header, separators=(",", ":")).encode()


def pack_frame(header: dict, payload: bytes = b"", header_max: int = FRAME_HEADER_MAX) -> bytes:
    """Build a binary frame ``u32 LE len ‖ JSON header ‖ payload``.

    Raises ``WireError`` when the JSON header exceeds ``header_max`` bytes.
    """
    h = header_json(header)
    if len(h) > header_max:
        raise WireError(f"frame header is {len(h)} bytes; the limit is {header_max}")
    return struct.pack("<I", len(h)) + h + payload


def unpack_frame(data: bytes, header_max: int = FRAME_HEADER_MAX) -> tuple[dict, bytes]:
    """Split a binary frame into (header dict, payload bytes).

    Raises ``WireError`` for a truncated frame, a header over ``header_max`` bytes or not a JSON object.
    """
    if len(data) < 4:
        raise WireError("frame shorter than its 4-byte header length")
    (n,) = struct.unpack_from("<I", data)
    if n > header_max or 4 + n > len(data):
        raise WireError(f"frame header length {n} does not fit a {len(data)}-byte frame")
    try:
        header = json.loads(data[4:4 + n])
    except (ValueError, RecursionError) as exc:  # bad UTF-8/JSON, oversized ints, deep nesting
        raise WireError(f"frame header is not JSON: {str(exc)[:200]}") from exc
    if not isinstance(header, dict):
        raise WireError("frame header must be a JSON object")
    return header, data[4 + n:]


def split_frames(header: dict, payload: bytes, max_message: int, encoded: bytes | None = None) -> list[bytes]:
    """The frames that carry one message ``header``/``payload`` over a socket capped at
    ``max_message`` bytes: the plain frame when it fits, else part frames ``{id, part, parts}``
    (``id`` = ``header["id"]``) whose payloads concatenate to the whole message packed as one
    frame (header up to ``MESSAGE_HEADER_MAX``). ``encoded``: ``header_json(header)``
    when the caller already has it (a
    batch's header lists every request's tokens: encoding it twice showed in the site's
    profile). Raises ``WireError`` for a message over ``MESSAGE_MAX`` or a cap too small for a part.
    """
    h = encoded if encoded is not None else header_json(header)
    if len(h) <= FRAME_HEADER_MAX and 4 + len(h) + len(payload) <= max_message:
        return [struct.pack("<I", len(h)) + h + payload]
    whole = pack_frame(header, payload, MESSAGE_HEADER_MAX)
    if len(whole) > MESSAGE_MAX:
        raise WireError(f"message of {len(whole)} bytes; the limit is {MESSAGE_MAX}")
    chunk = max_message - PART_OVERHEAD
    if chunk < PART_OVERHEAD:
        raise WireError(f"a {max_message}-byte message cap leaves no room for a part frame")
    n = -(-len(whole) // chunk)
    return [pack_frame({"id": header.get("id"), "part": i, "parts": n}, whole[i * chunk:(i + 1) * chunk])
            for i in range(n)]


class Reassembler:
    """Receiver side of ``split_frames``: ``feed`` part frames in any order, get the whole message.

    At most ``max_bytes`` are buffered over all unfinished messages (a sender that never finishes
    cannot grow it further). Not thread-safe; one per socket.
    """

    def __init__(self, max_bytes: int = MESSAGE_MAX):
        self.max_bytes = max_bytes
        self.buffered = 0
        self._parts: dict[str, dict[int, bytes]] = {}

    def feed(self, header: dict, payload: bytes) -> tuple[dict, bytes] | None:
        """A frame's (header, payload): the message when it is whole (a plain frame at once, a part
        frame when it was the last one missing), None while parts are outstanding. Raises
        ``WireError`` for a malformed part, one over the buffer bound (its message is dropped),
        or a reassembled message whose id differs from its parts'."""
        if "parts" not in header:
            return header, payload
        key, part, parts = str(header.get("id")), header.get("part"), header.get("parts")
        if not (type(parts) is int and type(part) is int and 0 <= part < parts):  # bools are not counts
            self.discard(key)
            raise WireError(f"part frame of message {key!r}: part {part!r} of {parts!r}")
        got = self._parts.setdefault(key, {})
        if part in got or self.buffered + len(payload) > self.max_bytes:
            self.discard(key)
            raise WireError(f"part {part} of message {key!r} repeated or over the {self.max_bytes}-byte buffer; "
                            "message dropped")
        got[part] = payload
        self.buffered += len(payload)
        if len(got) < parts:
            return None
        self.discard(key)
        whole, body = unpack_frame(b"".join(got[i] for i in range(parts)), MESSAGE_HEADER_MAX)
        if str(whole.get("id")) != key:
            raise WireError(f"reassembled message has id {whole.get('id')!r}, its parts {key!r}")
        return whole, body

    def discard(self, key: str) -> None:
        """Forget the parts of message ``key`` received so far."""
        self.buffered -= sum(len(p) for p in self._parts.pop(key, {}).values())


def encode_f32(rows: np.ndarray) -> bytes:
    """Little-endian float32 bytes of ``rows`` (any shape, C order)."""
    return np.ascontiguousarray(rows, dtype="<f4").tobytes()


def decode_f32(data: bytes, d_model: int, n_rows: int | None = None, field: str = "hidden_states") -> np.ndarray:
    """Decode little-endian float32 bytes into a ``[n, d_model]`` float32 array.

    Raises ``WireError`` naming ``field`` when the byte length is not a multiple of
    ``4 * d_model``, the row count differs from ``n_rows``, or a value is not finite.
    """
    if d_model <= 0:
        raise WireError(f"d_model must be positive, got {d_model}", "d_model")
    if len(data) % (4 * d_model):
        raise WireError(f"{field}: {len(data)} bytes is not a whole number of f32 rows of d_model={d_model}", field)
    arr = np.frombuffer(data, dtype="<f4").reshape(-1, d_model).astype(np.float32, copy=False)
    if n_rows is not None and arr.shape[0] != n_rows:
        raise WireError(f"{field}: {arr.shape[0]} rows but {n_rows} token indices", "token_indices")
    if not np.isfinite(arr).all():
        raise WireError(f"{field} holds non-finite values (NaN or Inf)", field)
    return arr


def b64decode(text: str | bytes | memoryview, field: str) -> bytes:
    """Strict standard base64 decode (RFC 4648 §4) of ``text``: a str, or the ASCII bytes of
    one (iroh's frame parser hands a big member over as a view of the frame). Raises
    ``WireError`` naming ``field`` (not a string, a character outside the alphabet, bad padding).

    The native codec decodes the canonical form; anything else goes to ``base64.b64decode``
    (``validate=True``), which decides and words the error, so both accept the same texts.
    """
    if not isinstance(text, (str, bytes, memoryview)):
        raise WireError(f"{field} must be a base64 string", field)
    if _b64decode_native is not None:
        out = _b64decode_native(text)
        if out is not None:
            return out
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise WireError(f"{field} is not valid base64: {exc}", field) from exc


def carrier_in_params(params: dict) -> tuple[str, bytes]:
    """(carrier kind, carrier bytes) of base64 execute params holding exactly one member of
    ``CARRIER_FIELDS``. Raises ``WireError`` naming the member (none or several given, bad base64)."""
    given = [k for k, f in CARRIER_FIELDS.items() if params.get(f) is not None]
    if len(given) != 1:
        raise WireError(f"give exactly one of {', '.join(CARRIER_FIELDS.values())}", "hidden_states")
    field = CARRIER_FIELDS[given[0]]
    return given[0], b64decode(params[field], field)


def b64encode(data: bytes) -> str:
    """Standard padded base64 text of ``data`` (RFC 4648 §4)."""
    return b64encode_bytes(data).decode()


def b64encode_bytes(data: bytes | memoryview) -> bytes:
    """Standard padded base64 of ``data`` as ASCII bytes (RFC 4648 §4; native codec when built)."""
    return _b64encode_native(data) if _b64encode_native is not None else base64.b64encode(data)


def rows_to_b64(rows: np.ndarray) -> str:
    """Base64 of f32 rows as little-endian float32 (the JSON form of ``hidden_states``/``outputs``)."""
    return b64encode(encode_f32(rows))


def rows_from_b64(text: str, d_model: int, n_rows: int | None = None, field: str = "hidden_states") -> np.ndarray:
    """f32 rows ``[n, d_model]`` from base64 little-endian float32 ``text``; raises ``WireError``
    naming ``field`` (or ``token_indices`` when the row count differs from ``n_rows``)."""
    return decode_f32(b64decode(text, field), d_model, n_rows=n_rows, field=field)


def choose_carrier(requested: str, d_model: int, rows: np.ndarray | None = None) -> tuple[str, str]:
    """(input carrier, output encoding) for a forward's ``carrier`` parameter.

    ``"auto"``: Q8_0 rows when ``d_model % 32 == 0`` (f32 otherwise) and bf16 outputs — the
    fewest bytes (1.0625 per value out), ~5e-3 relative error per value (one int8 scale per
    32 values); ``"f16"`` (a generation's ``auto``): f16 rows (~3e-4 per value, 2 bytes;
    Kvasir's v2f16 rows), f32 rows instead when ``rows`` holds a value beyond f16's range, and
    f16 outputs (a holder answers f32 for a batch beyond f16's range: ``output_encoding``).
    bf16 outputs (8 mantissa bits, ~2e-3 per value) flipped near-tie routing choices a
    generation's later layers make (prompt-logit cosine 0.9962 on a Kimi-K2-like model,
    0.9999998 with f16 outputs: ``bench/carrier_error.py``);
    ``"f32"``: exact rows both ways; ``"q8_0"``: Q8_0 both ways. Raises ``WireError`` for an
    unknown value or ``"q8_0"`` with ``d_model % 32 != 0``.
    """
    if requested == "auto":
        return ("q8_0" if d_model % 32 == 0 else "f32"), "bf16"
    if requested == "f16":
        if rows is not None and rows.size and float(np.max(np.abs(rows))) >= F16_MAX:
            return "f32", "f16"
        return "f16", "f16"
    if requested == "f32":
        return "f32", "f32"
    if requested == "q8_0":
        if d_model % 32:
            raise WireError(f"carrier q8_0 needs d_model divisible by 32, got {d_model}", "carrier")
        return "q8_0", "q8_0"
    raise WireError(f"carrier must be one of {', '.join(CARRIER_CHOICES)}; got {requested!r}", "carrier")


def output_encoding(rows: np.ndarray, requested: str) -> str:
    """The encoding a holder answers ``rows`` (f32 ``[n, H]``) in for a request's ``output``:
    ``requested``, except ``"f32"`` for ``"f16"`` when a finite value is beyond f16's range
    (the answer's ``output`` field names it; non-finite values stay refused by
    ``encode_rows``)."""
    if requested == "f16" and rows.size:
        peak = float(np.max(np.abs(rows)))
        if np.isfinite(peak) and peak >= F16_MAX:
            return "f32"
    return requested


def encode_rows(rows: np.ndarray, kind: str) -> bytes:
    """Encode f32 rows ``[n, H]`` as ``kind`` ("f32", "f16", "bf16" or "q8_0"); raises
    ``WireError`` (also for a value beyond the range of ``kind``)."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if kind == "f32":
        return rows.astype("<f4", copy=False).tobytes()
    if kind == "f16":
        with np.errstate(over="ignore"):  # overflow is reported below, naming the range
            half = rows.astype("<f2")
        if not np.isfinite(half).all():
            raise WireError(f"rows hold a value beyond the f16 range (±{F16_MAX:g}) or a non-finite value")
        return half.tobytes()
    if kind == "bf16":
        out = np.empty(rows.shape, dtype="<u2")
        status = _bf16_round(rows.reshape(-1).view(np.uint32), out.reshape(-1))
        if status == 1:
            raise WireError("cannot encode non-finite values as bf16")
        if status == 2:
            raise WireError("value beyond the bf16 range (rounds to infinity)")
        return out.tobytes()
    if kind == "q8_0":
        if rows.shape[-1] % quant.Q8_0.block_size:
            raise WireError(f"q8_0 rows need d_model divisible by 32, got {rows.shape[-1]}")
        blocks = rows.reshape(-1, 32)
        d = np.empty(blocks.shape[0], dtype=np.float32)
        if not _q8_0_scales(blocks, d):
            raise WireError("cannot encode non-finite values as q8_0")
        with np.errstate(over="ignore"):  # overflow is reported below, as quant.quantize words it
            h = d.astype("<f2")
        if not np.isfinite(h).all():
            raise WireError("q8_0 quantization: the fp16 block scale d overflows (input magnitude too large "
                            "for q8_0; ggml would reject the block)")
        out = np.empty((blocks.shape[0], 34), dtype=np.uint8)
        out[:, :2] = h.view(np.uint8).reshape(-1, 2)
        _q8_0_narrow(blocks, d, out)
        return out.tobytes()
    raise WireError(f"unknown row encoding {kind!r}")


def decode_rows(data: bytes, kind: str, d_model: int, n_rows: int, field: str = "hidden_states") -> np.ndarray:
    """Decode ``n_rows`` rows of ``d_model`` encoded as ``kind`` into float32 ``[n_rows, d_model]``.

    Raises ``WireError`` naming ``field`` for a byte length that is not exactly
    ``n_rows`` rows, an unknown kind, or non-finite values.
    """
    if kind == "f32":
        return decode_f32(data, d_model, n_rows, field)
    if d_model <= 0 or n_rows < 0:
        raise WireError(f"{field}: bad shape [{n_rows}, {d_model}]", field)
    if kind == "f16":
        if len(data) != 2 * n_rows * d_model:
            raise WireError(f"{field}: {len(data)} bytes is not {n_rows} f16 rows of d_model={d_model}", field)
        arr = np.frombuffer(data, dtype="<f2").astype(np.float32).reshape(n_rows, d_model)
    elif kind == "bf16":
        if len(data) != 2 * n_rows * d_model:
            raise WireError(f"{field}: {len(data)} bytes is not {n_rows} bf16 rows of d_model={d_model}", field)
        arr = np.empty((n_rows, d_model), dtype=np.float32)
        if not _bf16_widen(np.frombuffer(data, dtype="<u2"), arr.reshape(-1).view(np.uint32)):
            raise WireError(f"{field} holds non-finite values (NaN or Inf)", field)
        return arr
    elif kind == "q8_0":
        if d_model % quant.Q8_0.block_size:
            raise WireError(f"{field}: q8_0 rows need d_model divisible by 32, got {d_model}", field)
        want = n_rows * quant.Q8_0.row_bytes(d_model)
        if len(data) != want:
            raise WireError(f"{field}: {len(data)} bytes of q8_0 blocks; {n_rows} rows of d_model={d_model} "
                            f"take {want}", field)
        arr = np.empty((n_rows, d_model), dtype=np.float32)
        if not _q8_0_widen(np.frombuffer(data, dtype=np.uint8), _F16_TABLE, arr.reshape(-1)):
            raise WireError(f"{field} holds non-finite values (NaN or Inf)", field)
        return arr
    else:
        raise WireError(f"{field}: unknown row encoding {kind!r}", field)
    if not np.isfinite(arr).all():
        raise WireError(f"{field} holds non-finite values (NaN or Inf)", field)
    return arr


# Every IEEE half bit pattern → float32 (exact), for the Q8_0 block scales.
_F16_TABLE = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@njit(cache=True, nogil=True)
def _bf16_round(u, out):
    """``out`` uint16 ``[m]`` ← float32 bit patterns ``u`` uint32 ``[m]`` rounded to bf16 (nearest,
    ties to even: ``codec.encode_bf16``'s arithmetic). Returns 0, or 1 when a value is NaN/Inf,
    else 2 when one rounds past the bf16 range (flags OR-ed, so the loop vectorizes)."""
    nonfinite = 0
    overflow = 0
    for i in range(u.shape[0]):
        b = u[i]
        nonfinite |= (b & np.uint32(0x7F800000)) == np.uint32(0x7F800000)
        r = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        overflow |= (r & np.uint32(0x7F80)) == np.uint32(0x7F80)
        out[i] = np.uint16(r)
    return 1 if nonfinite else (2 if overflow else 0)


@njit(cache=True, nogil=True)
def _bf16_widen(h, out):
    """``out`` uint32 (float32 bits) ``[m]`` ← bf16 ``h`` uint16 ``[m]`` shifted up 16 bits (exact);
    returns False when a value is NaN or ±Inf."""
    bad = 0
    for i in range(h.shape[0]):
        v = np.uint32(h[i])
        bad |= (v & np.uint32(0x7F80)) == np.uint32(0x7F80)
        out[i] = v << np.uint32(16)
    return not bad


@njit(cache=True, nogil=True)
def _q8_0_scales(blocks, d):
    """``d`` float32 ``[m]`` ← per block of 32 the Q8_0 scale ``amax / 127`` (ggml
    ``quantize_row_q8_0_ref``, f32 arithmetic); returns False when a value is NaN or ±Inf."""
    bad = False
    for b in range(blocks.shape[0]):
        amax = np.float32(0.0)
        for j in range(32):
            v = abs(blocks[b, j])
            bad |= not (v - v == 0.0)
            if v > amax:
                amax = v
        d[b] = amax / np.float32(127.0)
    return not bad


@njit(cache=True, nogil=True)
def _q8_0_narrow(blocks, d, out):
    """``out[:, 2:]`` ← the int8 quants of f32 ``blocks`` ``[m, 32]`` with scales ``d``: ``roundf(x *
    (1/d))`` (half away from zero; 0 where d is 0, or subnormal so x/d is not finite), as ggml's
    ``quantize_row_q8_0_ref`` and ``quant.Q8_0.quantize`` (byte-identical)."""
    for b in range(blocks.shape[0]):
        idv = np.float32(1.0) / d[b] if d[b] != 0 else np.float32(0.0)
        for j in range(32):
            v = blocks[b, j] * idv
            if not (v - v == 0.0):
                v = np.float32(0.0)
            r = np.float32(np.rint(v))
            if abs(v - r) == np.float32(0.5):
                r = v + (np.float32(0.5) if v > 0 else np.float32(-0.5))
            q = np.int32(r)
            out[b, 2 + j] = np.uint8(q & 0xFF)


@njit(cache=True, nogil=True)
def _q8_0_widen(b, f16, out):
    """``out`` float32 ``[32 m]`` ← Q8_0 blocks ``b`` uint8 ``[34 m]`` (``qs * d``, as
    ``quant.Q8_0.dequantize``: one f32 product per value, bit-identical); returns False when a
    block scale is NaN or ±Inf (the only way a decoded value can be non-finite)."""
    bad = False
    for blk in range(b.shape[0] // 34):
        o = blk * 34
        d = f16[np.int64(b[o]) | (np.int64(b[o + 1]) << 8)]
        bad |= not (d - d == 0.0)
        for j in range(32):
            q = np.int32(b[o + 2 + j])
            out[blk * 32 + j] = np.float32(q - ((q & 128) << 1)) * d  # the byte as int8
    return not bad


def encoded_nbytes(kind: str, n_rows: int, d_model: int) -> int:
    """Bytes of ``n_rows`` rows of ``d_model`` encoded as ``kind``."""
    return int(round(BYTES_PER_VALUE[kind] * n_rows * d_model))
