"""Signed heartbeats: verify, then ingest atomically (DESIGN §2, §6).

A heartbeat is ``{"body": {...}, "signature": hex}``; the body is signed with the provider's
ed25519 key under ``identity.DOMAIN_HEARTBEAT`` over its canonical JSON:

    {"provider": hex64, "timestamp_ms": int, "nonce": hex, "name": str, "roles": [str],
     "http_endpoint": str, "iroh_endpoint_id": str, "moe_gpu": bool,
     "price_per_input_token": int, "minimum_price": int,
     "holdings": [{"model_id", "layer", "expert", "residency", "committed_tps", "blob_uri"}]}

Rejected, changing nothing: a bad signature, a timestamp more than ``CLOCK_SKEW_S`` from
the site's clock, and a timestamp not newer than the last accepted one (replay). The
holdings set is replaced as a whole in one transaction.
"""
from __future__ import annotations

import time
from datetime import datetime, timezone

from django.conf import settings
from django.db import transaction

from holders.identity import DOMAIN_HEARTBEAT, SignatureError, verify_body
from prepare.blobs import BlobError, parse_blob_uri
from registry.models import Holding, Provider
from registry.shardmap import RESIDENCIES, ROLES


class HeartbeatError(ValueError):
    """A heartbeat was refused; ``field`` names the offending part."""

    def __init__(self, message: str, field: str = "body"):
        super().__init__(message)
        self.field = field


def _int(body: dict, field: str, lo: int = 0, hi: int = 2**63 - 1) -> int:
    value = body.get(field, 0)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise HeartbeatError(f"{field} must be an integer in [{lo}, {hi}]", field)
    return value


def _str(body: dict, field: str, max_len: int = 500) -> str:
    value = body.get(field, "")
    if value is None:
        value = ""
    if not isinstance(value, str) or len(value) > max_len:
        raise HeartbeatError(f"{field} must be a string of at most {max_len} characters", field)
    return value


def parse_holdings(raw) -> list[dict]:
    """Validate a heartbeat's ``holdings`` list; raises ``HeartbeatError`` naming the entry."""
    if not isinstance(raw, list):
        raise HeartbeatError("holdings must be a list", "holdings")
    seen, out = set(), []
    for i, h in enumerate(raw):
        f = f"holdings[{i}]"
        if not isinstance(h, dict):
            raise HeartbeatError(f"{f} must be an object", f)
        model_id = h.get("model_id")
        if not isinstance(model_id, str) or not 0 < len(model_id) <= 200:
            raise HeartbeatError(f"{f}.model_id must be a non-empty string", f"{f}.model_id")
        layer = _int(h, "layer", 0, 100_000) if "layer" in h else None
        expert = _int(h, "expert", 0, 1_000_000) if "expert" in h else None
        if layer is None or expert is None:
            raise HeartbeatError(f"{f} needs layer and expert", f)
        residency = h.get("residency", "Warm")
        if residency not in RESIDENCIES:
            raise HeartbeatError(f"{f}.residency must be one of {', '.join(RESIDENCIES)}", f"{f}.residency")
        tps = _int(h, "committed_tps", 0, 2**31 - 1)
        blob = h.get("blob_uri") or ""
        if blob:
            try:
                parse_blob_uri(blob)
            except BlobError as exc:
                raise HeartbeatError(f"{f}.blob_uri: {exc}", f"{f}.blob_uri") from exc
        key = (model_id, layer, expert)
        if key in seen:
            raise HeartbeatError(f"{f} declares {model_id} l{layer}/e{expert} twice", f)
        seen.add(key)
        out.append({"model_id": model_id, "layer": layer, "expert": expert, "residency": residency,
                    "committed_tps": tps, "blob_uri": blob})
    return out


def ingest(message: dict, expected_provider: str | None = None, now_ms: int | None = None) -> Provider:
    """Verify and apply one signed heartbeat; returns the updated ``Provider``.

    ``expected_provider`` (the key proven on the agent socket) must match the body's
    provider when given. Raises ``HeartbeatError`` (bad structure, stale, replayed,
    wrong provider) or ``SignatureError``; on any error nothing is written.
    """
    if not isinstance(message, dict):
        raise HeartbeatError("heartbeat must be an object with body and signature")
    body, signature = message.get("body"), message.get("signature")
    if not isinstance(body, dict):
        raise HeartbeatError("body must be an object", "body")
    provider = body.get("provider")
    verify_body(provider, DOMAIN_HEARTBEAT, body, signature if isinstance(signature, str) else "")
    if expected_provider is not None and provider != expected_provider:
        raise HeartbeatError("heartbeat provider differs from the key proven on this socket", "body.provider")
    ts = _int(body, "timestamp_ms")
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    skew = settings.TENZRO["CLOCK_SKEW_S"] * 1000
    if abs(now_ms - ts) > skew:
        raise HeartbeatError(f"timestamp_ms is {abs(now_ms - ts) / 1000:.1f} s from the site clock "
                             f"(limit {skew // 1000} s)", "body.timestamp_ms")
    roles = body.get("roles", [])
    if not isinstance(roles, list) or any(r not in ROLES for r in roles):
        raise HeartbeatError(f"roles must be a list drawn from {', '.join(ROLES)}", "body.roles")
    holdings = parse_holdings(body.get("holdings", []))
    if not isinstance(body.get("moe_gpu", False), bool):
        raise HeartbeatError("moe_gpu must be a boolean", "body.moe_gpu")
    fields = {
        "name": _str(body, "name", 200),
        "http_endpoint": _str(body, "http_endpoint"),
        "iroh_endpoint_id": _str(body, "iroh_endpoint_id", 200),
        "roles": sorted(set(roles)),
        "moe_gpu": body.get("moe_gpu", False),
        "price_per_input_token": _int(body, "price_per_input_token") if "price_per_input_token" in body else 10,
        "minimum_price": _int(body, "minimum_price") if "minimum_price" in body else 100,
        "last_heartbeat": datetime.fromtimestamp(now_ms / 1000, tz=timezone.utc),
        "last_heartbeat_ms": ts,
    }
    with transaction.atomic():
        Provider.objects.get_or_create(provider=provider)
        # Conditional update: only a strictly newer timestamp wins, so a replay changes nothing.
        if not Provider.objects.filter(provider=provider, last_heartbeat_ms__lt=ts).update(**fields):
            raise HeartbeatError("heartbeat replayed or out of order (timestamp_ms not newer than the last one)",
                                 "body.timestamp_ms")
        Holding.objects.filter(provider_id=provider).delete()
        Holding.objects.bulk_create([Holding(provider_id=provider, **h) for h in holdings])
    return Provider.objects.get(provider=provider)


__all__ = ["HeartbeatError", "SignatureError", "ingest", "parse_holdings"]
