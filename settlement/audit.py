"""Pure comparison of committed rows with re-executed rows (disputes; no Django).

Sampling (docs/DESIGN.md §7, reference §14 fix 1): a verified batch is kept when
``int(HMAC-SHA256(router secret, commitment hash)) mod N == 0`` — the holder signs the
commitment but does not know the router's secret, so it cannot tell which batches are kept.

Verification of a commitment against re-executed rows (reference §7.5 with §14 fix 2). Per
row, with the committed top-k ``(index, value)`` pairs and ``p`` sketch projections:

- ``overlap``: the share of committed indices found in the re-executed row's top k;
- ``rel_delta``: mean |committed − re-executed value| over the shared indices divided by the
  mean |committed value| (∞ when nothing is shared, 0 when the magnitude is 0);
- ``sketch_rel``: ‖Δ projections‖₂ / (√p · ‖re-executed row‖₂). For ±1 projections
  ``E‖Δs‖² = p‖e‖²`` for an error vector e, so this estimates the whole-row relative error
  ‖e‖₂/‖row‖₂ (Johnson–Lindenstrauss): a lie in any of the d_model − k unlisted
  dimensions moves it;
- the row passes iff ``overlap ≥ min_overlap`` and ``rel_delta ≤ max_rel_delta`` and
  ``sketch_rel ≤ max_rel_delta``; the commitment passes iff rows_total > 0 and
  rows_passed / rows_total ≥ ``min_rows_passed``. ``failing_rows`` lists at most 32 rows.
"""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

import numpy as np

from moe.receipts import parse_commitment_bytes, sketch, top_features

MAX_FAILING_ROWS = 32


def is_sampled(secret: bytes, commitment_hex: str, one_in: int) -> bool:
    """Whether a batch with this commitment (64 hex) is kept: HMAC-SHA256(secret, commitment)
    read as a big-endian integer, mod ``one_in`` == 0. ``one_in`` ≥ 1 (1 keeps every batch).

    Raises ``ValueError`` for a malformed commitment or ``one_in`` < 1.
    """
    if one_in < 1:
        raise ValueError(f"receipt_sample_one_in must be >= 1, got {one_in}")
    mac = hmac.new(secret, bytes.fromhex(commitment_hex), hashlib.sha256).digest()
    return int.from_bytes(mac, "big") % one_in == 0


@dataclass(frozen=True)
class Tolerances:
    """Governance tolerances of a dispute (``registry.models.ReplicationPolicy``)."""

    min_overlap: float = 0.75
    max_rel_delta: float = 0.05
    min_rows_passed: float = 0.9


def verify_rows(commitment: bytes, rows: np.ndarray, input_hash: bytes, tol: Tolerances) -> dict:
    """Compare canonical commitment bytes with re-executed rows f32 ``[n, H]`` (module docstring).

    ``input_hash``: the carrier hash (32 bytes) that seeds the sketch signs. Returns
    ``{rows_total, rows_passed, failing_rows: [{row, token, overlap, rel_delta, sketch_rel}],
    pass}``. Raises ``ReceiptError`` for malformed commitment bytes and ``ValueError`` when
    the row count differs.
    """
    tokens, idx_c, val_c, proj_c = parse_commitment_bytes(commitment)
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    n, k = idx_c.shape
    if rows.ndim != 2 or rows.shape[0] != n:
        raise ValueError(f"re-executed rows have shape {rows.shape}; the commitment has {n} rows")
    idx_r, val_r = top_features(rows, k)
    proj_r = sketch(rows, input_hash)
    norms = np.linalg.norm(rows.astype(np.float64), axis=1)
    passed = 0
    failing: list[dict] = []
    for i in range(n):
        shared = [j for j, c in enumerate(idx_c[i]) if c in set(idx_r[i].tolist())]
        overlap = len(shared) / k if k else 0.0
        if shared:
            committed = val_c[i, shared].astype(np.float64)
            redone = rows[i, idx_c[i, shared].astype(np.int64)].astype(np.float64)
            mag = float(np.mean(np.abs(committed)))
            rel = 0.0 if mag == 0 else float(np.mean(np.abs(committed - redone)) / mag)
        else:
            rel = float("inf")
        p = proj_c.shape[1]
        if p and proj_r.shape[1] == p:
            dn = float(np.linalg.norm(proj_c[i] - proj_r[i]))
            sk = 0.0 if dn == 0 else (dn / (np.sqrt(p) * norms[i]) if norms[i] > 0 else float("inf"))
        else:
            sk = float("inf") if p else 0.0
        ok = overlap >= tol.min_overlap and rel <= tol.max_rel_delta and sk <= tol.max_rel_delta
        if ok:
            passed += 1
        elif len(failing) < MAX_FAILING_ROWS:
            failing.append({"row": i, "token": int(tokens[i]), "overlap": round(overlap, 6),
                            "rel_delta": _finite(rel), "sketch_rel": _finite(sk)})
    return {"rows_total": n, "rows_passed": passed, "failing_rows": failing,
            "pass": bool(n > 0 and passed / n >= tol.min_rows_passed)}


def _finite(x: float) -> float | None:
    """JSON has no ∞: None stands for it."""
    return round(float(x), 9) if np.isfinite(x) else None
