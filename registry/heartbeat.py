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

Storage admission (issue 24 item 5): a heartbeat names at most ``MAX_MODELS`` models, and
every (layer, expert) of a model the site knows (published here, or in the seed catalog with a
known layer map) must be one of that model's expert slots. A REST heartbeat (``client`` given:
anyone can post one from a fresh key) is held to more: models the site does not know are
refused; a key the site has never seen counts against ``TENZRO_NEW_KEY_RATE`` new keys per
client address per minute (HTTP 429 above); and a key that has served no batch yet is on
probation, declaring at most ``TENZRO_PROBATION_HOLDINGS`` experts (proven keys:
``MAX_HOLDINGS``). Agent sockets keep the socket's own bounds (one session per key).

Rejected, changing nothing: a bad signature, a timestamp more than ``CLOCK_SKEW_S`` from
the site's clock, and a timestamp not newer than the last accepted one (replay). The
holdings set is replaced as a whole in one transaction. Pure expert holders (roles without
``Replica``, serving no full model) are admitted like any other provider.
"""
from __future__ import annotations

import ipaddress
import time
from datetime import datetime, timezone

from django.conf import settings
from django.db import connection, transaction

from moe.identity import DOMAIN_HEARTBEAT, PROVIDER_RE, SignatureError, verify_body
from moe.content import URI_PREFIX, BlobError, parse_blob_uri
from registry.models import Holding, Provider, new_holdings_version
from moe import ranges
from moe.messages import MAX_NAME
from moe.shardmap import RESIDENCIES, ROLES




class HeartbeatError(ValueError):
    """A heartbeat was refused; ``field`` names the offending part; ``status`` is the HTTP
    status a REST caller gets (400, or 429 over the new-key rate)."""

    def __init__(self, message: str, field: str = "body", status: int = 400):
        super().__init__(message)
        self.field = field
        self.status = status


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
MAX_EXPERT = 1_000_000
MAX_HOLDINGS = ranges.MAX_VALUES  # bounds the expansion of compact ranges
MAX_MODELS = 256  # distinct models one heartbeat may name (each costs a shape lookup)


def parse_ranges(spec, field: str, hi: int) -> list[int]:
    """``moe.ranges.parse_ranges`` (at most ``MAX_HOLDINGS`` values) raising ``HeartbeatError`` naming ``field``."""
    try:
        return ranges.parse_ranges(spec, field, hi, MAX_HOLDINGS)
    except ranges.RangeError as exc:
        raise HeartbeatError(str(exc), exc.field) from None


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


def _model_slots(model_ids: set[str]) -> dict[str, frozenset | None]:
    """Each model's (layer, expert) slots: the published model's, else the seed catalog's when
    its layer map is known, else None (a model this site does not know)."""
    from registry import catalog
    from registry.models import MoeModel

    out: dict[str, frozenset | None] = {m.model_id: frozenset(m.expert_keys())
                                        for m in MoeModel.objects.filter(model_id__in=sorted(model_ids))}
    for model_id in model_ids - out.keys():
        try:
            shape = catalog.get(model_id)
        except catalog.UnknownModelError:
            out[model_id] = None
            continue
        out[model_id] = frozenset(shape.expert_keys()) if shape.is_moe and shape.moe_layers_known else None
    return out


def _admit_storage(provider: str, holdings: list[dict], client: str | None) -> None:
    """The storage bounds of the module doc; raises ``HeartbeatError`` (400, or 429)."""
    models = {h["model_id"] for h in holdings}
    if len(models) > MAX_MODELS:
        raise HeartbeatError(f"holdings name {len(models)} models; at most {MAX_MODELS}", "holdings")
    slots = _model_slots(models)
    for h in holdings:
        known = slots[h["model_id"]]
        if known is None:
            if client is not None:
                raise HeartbeatError(f"holdings: model {h['model_id'][:80]!r} is neither published on this site nor "
                                     "in its catalog", "holdings")
        elif (h["layer"], h["expert"]) not in known:
            raise HeartbeatError(f"holdings: {h['model_id'][:80]} has no expert slot l{h['layer']}/e{h['expert']}",
                                 "holdings")
    if client is None:
        return
    from registry import ratelimit

    tenzro = settings.TENZRO
    row = Provider.objects.filter(provider=provider).values_list("batches_served", flat=True).first()
    rate = int(tenzro.get("NEW_KEY_RATE_PER_MINUTE") or 0)
    if row is None and ratelimit.over_rate("new-key", client, rate):
        raise HeartbeatError(f"too many new provider keys from this client (at most {rate} a minute); "
                             f"retry in {ratelimit.retry_after_s()} s", "body.provider", status=429)
    cap = int(tenzro.get("PROBATION_HOLDINGS") or MAX_HOLDINGS) if not row else MAX_HOLDINGS
    if len(holdings) > cap:
        raise HeartbeatError(f"holdings: {len(holdings)} experts; a provider that has served no batch yet may "
                             f"declare at most {cap}", "holdings")


def ingest(message: dict, expected_provider: str | None = None, now_ms: int | None = None,
           client: str | None = None) -> Provider:
    """Verify and apply one signed heartbeat; returns the updated ``Provider``.

    ``expected_provider`` (the key proven on the agent socket) must match the body's
    provider when given. ``client``: the REST caller's address (the stricter storage
    admission of the module doc); None on agent sockets. Raises ``HeartbeatError`` (bad
    structure, stale, replayed, wrong provider, storage bounds) or ``SignatureError``; on any
    error nothing is written.
    """
    if not isinstance(message, dict):
        raise HeartbeatError("heartbeat must be an object with body and signature")
    body, signature = message.get("body"), message.get("signature")
    if not isinstance(body, dict):
        raise HeartbeatError("body must be an object", "body")
    provider = body.get("provider")
    if not isinstance(provider, str) or not PROVIDER_RE.match(provider):  # the body's field, not the signature
        raise HeartbeatError("body.provider must be 64 lowercase hex characters (an ed25519 public key)",
                             "body.provider")
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
    _admit_storage(provider, holdings, client)
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
