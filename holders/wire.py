"""Wire formats of the data plane: activation carriers and binary WebSocket frames.

Frame (DESIGN §6): ``u32 LE header length ‖ JSON header (UTF-8) ‖ raw payload``. The
payload is a carrier: little-endian float32 rows ``[n, d_model]`` (``"f32"``). Every
request carries an ``id``; results are matched by it, never by fields the holder returns.

Pure Python + numpy; imports nothing from Django.
"""
from __future__ import annotations

import base64
import binascii
import json
import struct

import numpy as np

FRAME_HEADER_MAX = 64 * 1024


class WireError(ValueError):
    """A frame or carrier is malformed (bad length, bad base64, wrong shape, non-finite)."""


def pack_frame(header: dict, payload: bytes = b"") -> bytes:
    """Build a binary frame ``u32 LE len ‖ JSON header ‖ payload``.

    Raises ``WireError`` when the JSON header exceeds ``FRAME_HEADER_MAX`` bytes.
    """
    h = json.dumps(header, separators=(",", ":")).encode()
    if len(h) > FRAME_HEADER_MAX:
        raise WireError(f"frame header is {len(h)} bytes; the limit is {FRAME_HEADER_MAX}")
    return struct.pack("<I", len(h)) + h + payload


def unpack_frame(data: bytes) -> tuple[dict, bytes]:
    """Split a binary frame into (header dict, payload bytes).

    Raises ``WireError`` for a truncated frame, an oversized or non-JSON header.
    """
    if len(data) < 4:
        raise WireError("frame shorter than its 4-byte header length")
    (n,) = struct.unpack_from("<I", data)
    if n > FRAME_HEADER_MAX or 4 + n > len(data):
        raise WireError(f"frame header length {n} does not fit a {len(data)}-byte frame")
    try:
        header = json.loads(data[4:4 + n])
    except (ValueError, RecursionError) as exc:  # bad UTF-8/JSON, oversized ints, deep nesting
        raise WireError(f"frame header is not JSON: {str(exc)[:200]}") from exc
    if not isinstance(header, dict):
        raise WireError("frame header must be a JSON object")
    return header, data[4 + n:]


def encode_f32(rows: np.ndarray) -> bytes:
    """Little-endian float32 bytes of ``rows`` (any shape, C order)."""
    return np.ascontiguousarray(rows, dtype="<f4").tobytes()


def decode_f32(data: bytes, d_model: int, n_rows: int | None = None, field: str = "hidden_states") -> np.ndarray:
    """Decode little-endian float32 bytes into a ``[n, d_model]`` float32 array.

    Raises ``WireError`` naming ``field`` when the byte length is not a multiple of
    ``4 * d_model``, the row count differs from ``n_rows``, or a value is not finite.
    """
    if d_model <= 0:
        raise WireError(f"d_model must be positive, got {d_model}")
    if len(data) % (4 * d_model):
        raise WireError(f"{field}: {len(data)} bytes is not a whole number of f32 rows of d_model={d_model}")
    arr = np.frombuffer(data, dtype="<f4").reshape(-1, d_model).astype(np.float32, copy=False)
    if n_rows is not None and arr.shape[0] != n_rows:
        raise WireError(f"{field}: {arr.shape[0]} rows but {n_rows} token indices")
    if not np.isfinite(arr).all():
        raise WireError(f"{field} holds non-finite values (NaN or Inf)")
    return arr


def b64decode(text: str, field: str) -> bytes:
    """Strict standard base64 decode; raises ``WireError`` naming ``field``."""
    if not isinstance(text, str):
        raise WireError(f"{field} must be a base64 string")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise WireError(f"{field} is not valid base64: {exc}") from exc


def b64encode(data: bytes) -> str:
    """Standard padded base64 text of ``data``."""
    return base64.b64encode(data).decode()


def rows_per_frame(d_model: int, max_message: int, bytes_per_value: int = 4) -> int:
    """How many rows of ``d_model`` values fit one frame below ``max_message`` bytes.

    Leaves room for the header. Raises ``WireError`` when not even one row fits.
    """
    budget = max_message - FRAME_HEADER_MAX - 1024
    n = budget // (d_model * bytes_per_value)
    if n < 1:
        raise WireError(f"one row of d_model={d_model} does not fit a {max_message}-byte message")
    return int(n)
