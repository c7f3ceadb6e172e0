"""Reads of the receipts economy: kept receipts, disputes, settlements (list shapes of the RPC methods)."""
from __future__ import annotations

from django.db.models import Count, Sum

from settlement.models import Dispute, ReceiptSample, Settlement
from settlement.services import EconomyError, dispute_json, sample_json
from moe.jsonrpc import EXECUTION_ERROR


def list_receipts(model_id: str | None = None, provider: str | None = None, layer: int | None = None,
                  expert: int | None = None, limit: int = 100, before: str | None = None) -> dict:
    """``tenzro_moeListReceipts``: newest first, ``before`` = a key (rows kept before it).

    Returns ``{receipts: [sample_json], count}`` (``count`` = rows returned). Raises
    ``EconomyError`` (-32004, field ``before``) for an unknown ``before`` key.
    """
    qs = ReceiptSample.objects.select_related("dispute").defer("commitment_rows", "carrier_inline", "receipt")
    for name, value in (("model_id", model_id), ("provider", provider), ("layer", layer), ("expert", expert)):
        if value is not None:
            qs = qs.filter(**{name: value})
    if before is not None:
        pivot = ReceiptSample.objects.filter(key=before).values_list("id", flat=True).first()
        if pivot is None:
            raise EconomyError(EXECUTION_ERROR, f"no kept receipt with key {before!r}", "before")
        qs = qs.filter(id__lt=pivot)
    rows = [sample_json(s, _dispute_of(s)) for s in qs.order_by("-id")[:limit]]
    return {"receipts": rows, "count": len(rows)}


def _dispute_of(s: ReceiptSample) -> Dispute | None:
    try:
        return s.dispute
    except Dispute.DoesNotExist:
        return None


def get_receipt(key: str) -> dict:
    """``tenzro_moeGetReceipt``: the list row plus the request header, the signed receipt, the
    commitment rows (``[{token, features: [[index, value]], sketch: [p floats]}]``), the carrier
    size and where it is kept, and the dispute outcome when there is one. Raises ``EconomyError``."""
    from moe.receipts import parse_commitment_bytes

    s = ReceiptSample.objects.select_related("dispute").filter(key=key).first()
    if s is None:
        raise EconomyError(EXECUTION_ERROR, f"no kept receipt with key {key!r}", "key")
    toks, idx, val, proj = parse_commitment_bytes(bytes(s.commitment_rows))
    d = _dispute_of(s)
    return {**sample_json(s, d),
            "header": {"model_id": s.model_id, "layer": s.layer, "expert": s.expert, "tokens": list(s.tokens),
                       "d_model": s.d_model, "carrier": s.carrier_kind, "output": s.output_kind,
                       "blob_hash": s.blob_hash, "quant": s.quant, "request_id": s.request_id},
            "receipt": s.receipt,
            "commitment_rows": [{"token": int(t), "features": [[int(i), float(v)] for i, v in zip(ii, vv)],
                                 "sketch": [float(x) for x in pp]} for t, ii, vv, pp in zip(toks, idx, val, proj)],
            "carrier_bytes": s.carrier_bytes, "carrier_stored": "inline" if s.carrier_inline is not None else "file",
            "audit_state": s.audit_state, "dispute_outcome": dispute_json(d, s) if d is not None else None}


def list_disputes(provider: str | None = None, upheld: bool | None = None, limit: int = 100,
                  automatic: bool | None = None) -> dict:
    """``tenzro_moeListDisputes``: newest first, ``{disputes: [dispute_json], count}`` (fraud proofs included).
    ``automatic``: True keeps the automatic audits only, False the operators' disputes only."""
    qs = Dispute.objects.select_related("sample")
    if provider is not None:
        qs = qs.filter(provider=provider)
    if upheld is not None:
        qs = qs.filter(upheld=upheld)
    if automatic is not None:
        qs = qs.filter(automatic=automatic)
    rows = [dispute_json(d, d.sample) for d in qs.order_by("-id")[:limit]]
    return {"disputes": rows, "count": len(rows)}


def settlement_json(s: Settlement) -> dict:
    """``{forward_id, model_id, provider, tokens, batches, gross, holder_amount, network_fee,
    commitments_digest, settled_at_ms, state}``."""
    return {"forward_id": s.forward_id, "model_id": s.model_id, "provider": s.provider, "tokens": s.tokens,
            "batches": s.batches, "gross": s.gross, "holder_amount": s.holder_amount, "network_fee": s.network_fee,
            "commitments_digest": s.commitments_digest, "settled_at_ms": s.settled_at_ms, "state": s.state}


def list_settlements(model_id: str | None = None, provider: str | None = None, forward_id: str | None = None,
                     limit: int = 100) -> dict:
    """``tenzro_moeListSettlements``: settled records, newest first, ``{settlements, count, total,
    holder_amount_total}``: ``count`` rows listed (at most ``limit``), ``total`` settled records
    matching the filters and ``holder_amount_total`` the sum paid to holders over all of them, so a
    ledger check does not depend on the listing's limit."""
    qs = Settlement.objects.filter(state=Settlement.State.SETTLED)
    for name, value in (("model_id", model_id), ("provider", provider), ("forward_id", forward_id)):
        if value is not None:
            qs = qs.filter(**{name: value})
    rows = [settlement_json(s) for s in qs.order_by("-id")[:limit]]
    agg = qs.aggregate(total=Count("id"), paid=Sum("holder_amount"))
    return {"settlements": rows, "count": len(rows), "total": agg["total"],
            "holder_amount_total": agg["paid"] or 0}
