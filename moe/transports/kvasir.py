"""Kvasir worker compute protocol (``kvasir_market_contract.md`` §3), router side, free of Django.

A Kvasir worker (``linkcpp-expert-worker --serve``) holds one layer's experts ``[begin, end)``
and answers one request with one response on a byte stream (here: the relay WebSocket, whose
binary frames carry the stream in arbitrary chunks). Little-endian, no padding, no error frame:
an invalid request closes the connection.

This site sends one planned batch (one expert, n token rows) per request:

* **v2f16** (first int32 −3): ``-3, n_rows, n_pairs, rows f16 [n][H], row_idx i32 [n],
  ids i32 [n], probs f16 [n]`` → ``out f16 [n][H]``. Each row is its own pair with weight 1.0,
  so the worker's weighted sum is the expert's plain output row.
* **v2** (−2): the same with f32 rows, probs and output.
* **v1** (first int32 = n_used ≥ 1): ``n_used=1, n_tokens=n, cur f32 [n][H], sel i32 [n][1]``
  → ``out f32 [n][1][H]``.

Expert ids on the wire are local to the worker's shard (global id − ``begin``). ``VARIANTS`` is
the order the router tries them in: a worker that closes the socket on its first request of
one variant is tried with the next one.
"""
from __future__ import annotations

import struct

import numpy as np

VARIANTS = ("v2f16", "v2", "v1")
MAX_ROWS = 8192  # the worker's bound on n_rows / n_tokens (§3)
PREFIX = "kvasir:"


class KvasirProtocolError(ValueError):
    """A request that cannot be encoded (bad variant, id, or row count) or a response of the
    wrong size."""


def provider_id(worker_id: str) -> str:
    """The holder id a relay-wired market worker has in shard views and results: ``kvasir:<worker_id>``."""
    return PREFIX + worker_id


def is_kvasir(provider: str) -> bool:
    """Whether a holder id names a Kvasir worker (``provider_id``)."""
    return provider.startswith(PREFIX)


def response_size(variant: str, n_rows: int, d_model: int) -> int:
    """Bytes of the worker's response to a request of ``n_rows`` rows of width ``d_model``."""
    if variant == "v2f16":
        return 2 * n_rows * d_model
    if variant in ("v2", "v1"):
        return 4 * n_rows * d_model
    raise KvasirProtocolError(f"unknown Kvasir protocol variant {variant!r} (known: {VARIANTS})")


def encode_request(variant: str, rows: np.ndarray, local_id: int) -> bytes:
    """The request bytes computing expert ``local_id`` (local to the shard) on ``rows`` f32 [n, H].

    Raises ``KvasirProtocolError`` for an unknown variant, n outside 1..8192, or a negative id.
    """
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if rows.ndim != 2 or not 1 <= rows.shape[0] <= MAX_ROWS:
        raise KvasirProtocolError(f"a Kvasir request holds 1..{MAX_ROWS} rows, got shape {rows.shape}")
    if local_id < 0:
        raise KvasirProtocolError(f"expert id {local_id} is below the worker's shard")
    n = rows.shape[0]
    ids = np.full(n, local_id, dtype="<i4")
    if variant == "v1":
        return struct.pack("<ii", 1, n) + rows.astype("<f4").tobytes() + ids.tobytes()
    if variant not in ("v2", "v2f16"):
        raise KvasirProtocolError(f"unknown Kvasir protocol variant {variant!r} (known: {VARIANTS})")
    half = variant == "v2f16"
    fdt = "<f2" if half else "<f4"
    return (struct.pack("<iii", -3 if half else -2, n, n) + rows.astype(fdt).tobytes()
            + np.arange(n, dtype="<i4").tobytes() + ids.tobytes() + np.ones(n, dtype=fdt).tobytes())


def decode_response(variant: str, data: bytes, n_rows: int, d_model: int) -> np.ndarray:
    """The worker's response as f32 [n_rows, d_model]. Raises ``KvasirProtocolError`` on a size
    mismatch or non-finite values (fp16 overflow: the worker's rows cannot be used)."""
    want = response_size(variant, n_rows, d_model)
    if len(data) != want:
        raise KvasirProtocolError(f"a {variant} response of {n_rows}×{d_model} is {want} bytes, got {len(data)}")
    out = np.frombuffer(data, dtype="<f2" if variant == "v2f16" else "<f4").astype(np.float32)
    out = out.reshape(n_rows, d_model)
    if not np.isfinite(out).all():
        raise KvasirProtocolError("the worker answered non-finite values")
    return out


class ResponseStream:
    """Reassembles responses from the relay's binary frames, in request order (the worker answers
    strictly one request after another on its stream). ``expect(n)`` queues a response of ``n``
    bytes; ``feed(chunk)`` returns the responses completed by it, oldest first."""

    def __init__(self):
        self._buf = bytearray()
        self._sizes: list[int] = []

    def expect(self, nbytes: int) -> None:
        """Queue the size of the next request's response."""
        self._sizes.append(nbytes)

    @property
    def waiting(self) -> int:
        """Responses queued and not complete yet."""
        return len(self._sizes)

    def feed(self, chunk: bytes) -> list[bytes]:
        """Add stream bytes; returns the completed responses. Raises ``KvasirProtocolError`` when
        bytes arrive that no request asked for (the peer is not a worker)."""
        self._buf += chunk
        done = []
        while self._sizes and len(self._buf) >= self._sizes[0]:
            n = self._sizes.pop(0)
            done.append(bytes(self._buf[:n]))
            del self._buf[:n]
        if self._buf and not self._sizes:
            raise KvasirProtocolError(f"{len(self._buf)} bytes arrived that answer no request")
        return done


def compare_rows(claimed: np.ndarray, redone: np.ndarray, min_overlap: float, max_rel_delta: float,
                 min_rows_passed: float, top_k: int = 16) -> dict:
    """Audit of a receiptless batch: a worker's ``claimed`` rows against a trusted re-execution
    ``redone`` (both f32 [n, H]), under the dispute tolerances (``registry.models.ReplicationPolicy``).

    Per row: ``overlap`` = share of the re-executed row's top-``top_k`` |features| found in the
    claimed row's; ``rel_delta`` = ‖claimed − redone‖₂ / ‖redone‖₂ (0 when both are 0, ∞ when
    only the re-execution is 0). A row passes iff ``overlap ≥ min_overlap`` and ``rel_delta ≤
    max_rel_delta``; the batch passes iff ``rows_passed / rows_total ≥ min_rows_passed``.
    Returns ``{rows_total, rows_passed, failing_rows: [{row, overlap, rel_delta}] (≤ 32), pass}``
    (∞ reported as None). Raises ``ValueError`` for different shapes."""
    a = np.asarray(claimed, dtype=np.float64)
    b = np.asarray(redone, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"claimed rows {a.shape} and re-executed rows {b.shape} differ")
    n, h = a.shape
    k = max(1, min(top_k, h))
    top_a = np.argpartition(-np.abs(a), k - 1, axis=1)[:, :k]
    top_b = np.argpartition(-np.abs(b), k - 1, axis=1)[:, :k]
    diff = np.linalg.norm(a - b, axis=1)
    norm = np.linalg.norm(b, axis=1)
    passed, failing = 0, []
    for i in range(n):
        overlap = len(set(top_a[i].tolist()) & set(top_b[i].tolist())) / k
        rel = 0.0 if diff[i] == 0 else (float(diff[i] / norm[i]) if norm[i] > 0 else float("inf"))
        if overlap >= min_overlap and rel <= max_rel_delta:
            passed += 1
        elif len(failing) < 32:
            failing.append({"row": i, "overlap": round(overlap, 6),
                            "rel_delta": round(rel, 9) if np.isfinite(rel) else None})
    return {"rows_total": n, "rows_passed": passed, "failing_rows": failing,
            "pass": bool(n > 0 and passed / n >= min_rows_passed)}
