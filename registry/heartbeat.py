"""Signed heartbeats: verify, then ingest atomically (docs/DESIGN.md §2, §6).

A heartbeat is ``{"body": {...}, "signature": hex}``; the body is signed with the provider's
ed25519 key under ``identity.DOMAIN_HEARTBEAT`` over its canonical JSON:

    {"provider": hex64, "timestamp_ms": int, "nonce": hex, "name": str, "roles": [str],
     "http_endpoint": str, "iroh_endpoint_id": str, "iroh_addrs": ["ip:port"], "moe_gpu": bool,
     "price_per_input_token": int, "minimum_price": int,
     "holdings": [entry, ...]}

Each ``holdings`` entry is one of two forms (they may be mixed in one list):

- expanded, one expert (reference §1.1 ``MoeExpertHolding``):
  ``{"model_id", "layer", "expert", "residency", "committed_tps", "blob_uri"}``;
- compact, a set of experts in one or more layers:
  ``{"model_id", "layer": L | "layers": RANGES, "experts": RANGES, "residency", "committed_tps"}``.
  ``RANGES`` is either a string of comma-separated integers and inclusive ``lo-hi`` ranges
  (``"0-127,130"``) or a JSON list whose items are integers or inclusive ``[lo, hi]`` pairs
  (``[[0, 127], 130]``). The entry expands to every (layer, expert) of the cross product,
  all with the entry's residency and committed_tps. A compact entry carries no per-expert
  ``blob_uri``: the site fills it from its own published blob of that expert (empty when
  the site has none). A provider holding all 61 × 385 slots of Kimi K2 sends 61 (or one)
  short entries instead of 23,485 objects.

Limits: layer ≤ 100,000, expert ≤ 1,000,000, at most ``MAX_HOLDINGS`` expanded holdings per
heartbeat. Declaring one (model, layer, expert) twice, in either form, is an error.

Rejected, changing nothing: a bad signature, a timestamp more than ``CLOCK_SKEW_S`` from
the site's clock, and a timestamp not newer than the last accepted one (replay). The
holdings set is replaced as a whole in one transaction. Pure expert holders (roles without
``Replica``, serving no full model) are admitted like any other provider.
"""
from __future__ import annotations

import ipaddress
import re
import time
from datetime import datetime, timezone

from django.conf import settings
from django.db import connection, transaction

from moe.identity import DOMAIN_HEARTBEAT, SignatureError, verify_body
from moe.content import URI_PREFIX, BlobError, parse_blob_uri
from registry.models import Holding, Provider, new_holdings_version
from moe.messages import MAX_NAME
from moe.shardmap import RESIDENCIES, ROLES




class HeartbeatError(ValueError):
    """A heartbeat was refused; ``field`` names the offending part."""

    def __init__(self, message: str, field: str = "body"):
        super().__init__(message)
        self.field = field


def _int(body: dict, field: str, lo: int = 0, hi: int = 2**63 - 1, prefix: str = "") -> int:
    value = body.get(field, 0)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise HeartbeatError(f"{prefix}{field} must be an integer in [{lo}, {hi}]", f"{prefix}{field}")
    return value


def _str(body: dict, field: str, max_len: int = 500) -> str:
    value = body.get(field, "")
    if value is None:
        value = ""
    if not isinstance(value, str) or len(value) > max_len or "\x00" in value:
        raise HeartbeatError(f"{field} must be a string of at most {max_len} characters without NUL", field)
    return value


MAX_ADDRS = 16


def _socket_addrs(body: dict, field: str) -> list[str]:
    """A list of at most ``MAX_ADDRS`` direct socket addresses (``1.2.3.4:5`` or ``[::1]:5``)."""
    value = body.get(field, [])
    if not isinstance(value, list) or len(value) > MAX_ADDRS:
        raise HeartbeatError(f"{field} must be a list of at most {MAX_ADDRS} ip:port strings", field)
    for i, addr in enumerate(value):
        host, sep, port = addr.rpartition(":") if isinstance(addr, str) else ("", "", "")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        try:
            ok = bool(sep) and ipaddress.ip_address(host) is not None and port.isdigit() and 0 < int(port) < 65536
        except ValueError:
            ok = False
        if not ok:
            raise HeartbeatError(f"{field}[{i}] must be an ip:port socket address, got {str(addr)[:60]!r}",
                                 f"{field}[{i}]")
    return list(value)


MAX_LAYER = 100_000
_RANGE = re.compile(r"([0-9]{1,7})(?:-([0-9]{1,7}))?")
MAX_EXPERT = 1_000_000
MAX_HOLDINGS = 262_144  # > 10 × a whole Kimi K2 (61 × 385); bounds the expansion of compact ranges


def parse_ranges(spec, field: str, hi: int) -> list[int]:
    """Expand a compact range spec (``"0-127,130"`` or ``[[0, 127], 130]``) to sorted unique ints.

    Ranges are inclusive; every value must lie in ``[0, hi]``; the total may not exceed
    ``MAX_HOLDINGS``. Raises ``HeartbeatError`` naming ``field``.
    """
    parts: list[tuple[int, int]] = []
    if isinstance(spec, str):
        for piece in spec.split(","):
            piece = piece.strip()
            m = _RANGE.fullmatch(piece)
            if m is None:
                raise HeartbeatError(f"{field}: {piece[:40]!r} is not an integer or an inclusive lo-hi range", field)
            parts.append((int(m[1]), int(m[2] or m[1])))
    elif isinstance(spec, list) and spec:
        for item in spec:
            if isinstance(item, int) and not isinstance(item, bool):
                parts.append((item, item))
            elif (isinstance(item, list) and len(item) == 2
                  and all(isinstance(v, int) and not isinstance(v, bool) for v in item)):
                parts.append((item[0], item[1]))
            else:
                raise HeartbeatError(f"{field}: items must be integers or [lo, hi] pairs, got {item!r}", field)
    else:
        raise HeartbeatError(f"{field} must be a range string like \"0-127,130\" or a non-empty list "
                             "of integers and [lo, hi] pairs", field)
    total = 0
    for lo, up in parts:
        if not 0 <= lo <= up <= hi:
            raise HeartbeatError(f"{field}: range {lo}-{up} must satisfy 0 <= lo <= hi <= {hi}", field)
        total += up - lo + 1
        if total > MAX_HOLDINGS:
            raise HeartbeatError(f"{field} expands to more than {MAX_HOLDINGS} values", field)
    values = sorted({v for lo, up in parts for v in range(lo, up + 1)})
    if len(values) != total:
        raise HeartbeatError(f"{field} lists a value twice (overlapping ranges)", field)
    return values


def parse_holdings(raw) -> list[dict]:
    """Validate a heartbeat's ``holdings`` (expanded or compact entries, see the module doc).

    Returns expanded dicts ``{model_id, layer, expert, residency, committed_tps, blob_uri}``
    in declaration order; ``blob_uri`` is None for experts declared in compact form (the
    caller fills it in). Raises ``HeartbeatError`` naming the entry (``holdings[i].field``).
    """
    if not isinstance(raw, list):
        raise HeartbeatError("holdings must be a list", "holdings")
    seen, out = set(), []
    for i, h in enumerate(raw):
        f = f"holdings[{i}]"
        if not isinstance(h, dict):
            raise HeartbeatError(f"{f} must be an object", f)
        model_id = h.get("model_id")
        if not isinstance(model_id, str) or not 0 < len(model_id) <= 200 or "\x00" in model_id:
            raise HeartbeatError(f"{f}.model_id must be a non-empty string of at most 200 characters "
                                 "without NUL", f"{f}.model_id")
        residency = h.get("residency", "Warm")
        if residency not in RESIDENCIES:
            raise HeartbeatError(f"{f}.residency must be one of {', '.join(RESIDENCIES)}", f"{f}.residency")
        tps = _int(h, "committed_tps", 0, 2**31 - 1, prefix=f"{f}.")
        if "experts" in h:  # compact form
            if "expert" in h or "blob_uri" in h:
                raise HeartbeatError(f"{f}: a compact entry (experts) takes neither expert nor blob_uri", f)
            if ("layer" in h) == ("layers" in h):
                raise HeartbeatError(f"{f}: a compact entry needs exactly one of layer and layers", f)
            layers = ([_int(h, "layer", 0, MAX_LAYER, prefix=f"{f}.")] if "layer" in h
                      else parse_ranges(h["layers"], f"{f}.layers", MAX_LAYER))
            experts = parse_ranges(h["experts"], f"{f}.experts", MAX_EXPERT)
            if len(out) + len(layers) * len(experts) > MAX_HOLDINGS:
                raise HeartbeatError(f"holdings expand to more than {MAX_HOLDINGS} experts", f)
            for layer in layers:
                for expert in experts:
                    key = (model_id, layer, expert)
                    if key in seen:
                        raise HeartbeatError(f"{f} declares {model_id} l{layer}/e{expert} twice", f)
                    seen.add(key)
                    out.append({"model_id": model_id, "layer": layer, "expert": expert, "residency": residency,
                                "committed_tps": tps, "blob_uri": None})
            continue
        if "layer" not in h or "expert" not in h:
            raise HeartbeatError(f"{f} needs layer and expert (or layer/layers and experts)", f)
        layer = _int(h, "layer", 0, MAX_LAYER, prefix=f"{f}.")
        expert = _int(h, "expert", 0, MAX_EXPERT, prefix=f"{f}.")
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
        if len(out) >= MAX_HOLDINGS:
            raise HeartbeatError(f"holdings expand to more than {MAX_HOLDINGS} experts", f)
        out.append({"model_id": model_id, "layer": layer, "expert": expert, "residency": residency,
                    "committed_tps": tps, "blob_uri": blob})
    return out


def _fill_blob_uris(holdings: list[dict]) -> None:
    """Set ``blob_uri`` of compact-form holdings from the site's published blobs ("" when none)."""
    wanted: dict[str, set[int]] = {}
    for h in holdings:
        if h["blob_uri"] is None:
            wanted.setdefault(h["model_id"], set()).add(h["layer"])
    if not wanted:
        return
    from registry.models import ExpertBlob

    known: dict[tuple, str] = {}
    for model_id, layers in wanted.items():
        rows = ExpertBlob.objects.filter(model_id=model_id, layer__in=sorted(layers))
        for layer, expert, blob_hash in rows.values_list("layer", "expert", "blob_hash"):
            known[(model_id, layer, expert)] = URI_PREFIX + blob_hash
    for h in holdings:
        if h["blob_uri"] is None:
            h["blob_uri"] = known.get((h["model_id"], h["layer"], h["expert"]), "")


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
    try:
        verify_body(provider, DOMAIN_HEARTBEAT, body, signature if isinstance(signature, str) else "")
    except RecursionError:
        raise HeartbeatError("body is nested too deeply", "body") from None
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
        "name": _str(body, "name", MAX_NAME),
        "http_endpoint": _str(body, "http_endpoint"),
        "iroh_endpoint_id": _str(body, "iroh_endpoint_id", 200),
        "iroh_addrs": _socket_addrs(body, "iroh_addrs"),
        "roles": sorted(set(roles)),
        "moe_gpu": body.get("moe_gpu", False),
        "price_per_input_token": _int(body, "price_per_input_token") if "price_per_input_token" in body else 10,
        "minimum_price": _int(body, "minimum_price") if "minimum_price" in body else 100,
        "last_heartbeat": datetime.fromtimestamp(now_ms / 1000, tz=timezone.utc),
        "last_heartbeat_ms": ts,
    }
    with transaction.atomic():
        _fill_blob_uris(holdings)
        Provider.objects.get_or_create(provider=provider)
        # Conditional update: only a strictly newer timestamp wins, so a replay changes nothing.
        if not Provider.objects.filter(provider=provider, last_heartbeat_ms__lt=ts).update(**fields):
            raise HeartbeatError("heartbeat replayed or out of order (timestamp_ms not newer than the last one)",
                                 "body.timestamp_ms")
        _replace_holdings(provider, holdings)
    return Provider.objects.get(provider=provider)


def _replace_holdings(provider: str, holdings: list[dict]) -> None:
    """Make ``provider``'s holding rows equal ``holdings`` (inside the caller's transaction).

    Diffs against the stored rows and writes only the difference with ``executemany``
    (delete removed keys, update changed residency/tps/blob, insert new keys) and then renews
    the provider's ``holdings_version``: a steady-state heartbeat repeating its holdings costs
    one SELECT and keeps the cached shard views valid. Raw SQL because building 1,000 ORM
    instances costs more than the writes themselves (see bench/bench_registry_db.py).
    """
    existing = {(m, layer, e): (pk, res, tps, blob) for pk, m, layer, e, res, tps, blob in
                Holding.objects.filter(provider_id=provider).values_list(
                    "pk", "model_id", "layer", "expert", "residency", "committed_tps", "blob_uri")}
    inserts, updates = [], []
    for h in holdings:
        key = (h["model_id"], h["layer"], h["expert"])
        old = existing.pop(key, None)
        if old is None:
            inserts.append((provider, *key, h["residency"], h["committed_tps"], h["blob_uri"]))
        elif old[1:] != (h["residency"], h["committed_tps"], h["blob_uri"]):
            updates.append((h["residency"], h["committed_tps"], h["blob_uri"], old[0]))
    q = connection.ops.quote_name
    table = q(Holding._meta.db_table)
    with connection.cursor() as cur:
        if existing:
            cur.executemany(f"DELETE FROM {table} WHERE {q('id')} = %s", [(v[0],) for v in existing.values()])
        if updates:
            cur.executemany(f"UPDATE {table} SET {q('residency')} = %s, {q('committed_tps')} = %s, "
                            f"{q('blob_uri')} = %s WHERE {q('id')} = %s", updates)
        if inserts:
            cols = ", ".join(q(c) for c in ("provider_id", "model_id", "layer", "expert", "residency",
                                            "committed_tps", "blob_uri"))
            cur.executemany(f"INSERT INTO {table} ({cols}) VALUES (%s, %s, %s, %s, %s, %s, %s)", inserts)
    if existing or updates or inserts:
        Provider.objects.filter(provider=provider).update(holdings_version=new_holdings_version())


__all__ = ["HeartbeatError", "SignatureError", "ingest", "parse_holdings", "parse_ranges", "MAX_HOLDINGS"]
