"""The Kvasir-compatible expert-coverage market (``kvasir_market_contract.md`` §1.0–1.7, §1.9,
§1.11–1.13, §2): wallet auth, node tokens, the coverage census with relay wiring (sessions and
sticky coordinator ports), demand, volunteer, and what external coordinators read: the
dispatch map, recruitment and the relay session list.

Services only (the thin views are ``registry.market_views``). State lives in the database:
``MarketChallenge`` (nonces, 5 min, single use, bound to a wallet), ``MarketWorker`` (last
coverage post per worker, live 120 s, evicted on every read), ``MarketClaim`` (pending
volunteer assignments, 120 s). Node tokens are stateless: base64url (no padding) of
``node|<wallet>|<exp>|<hex HMAC-SHA256(secret, "node|<wallet>|<exp>")>`` (contract §2.5).

Demand folds three sources into one replica count per (model, expert layer, expert): live
market workers' segments (same-worker overlaps count twice, as the contract says), pending
claims, and the heartbeat holdings of live providers (one per distinct provider), so market
workers and providers see one scarcity. Target replicas = the policy's ``min_replication``.
Every refusal raises ``MarketError(status, message)``; the views answer ``{"error": message}``.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
import secrets
import time
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone
from nacl.exceptions import BadSignatureError
from nacl.signing import VerifyKey

from registry import governance, ratelimit, selectors
from registry.models import (Holding, MarketChallenge, MarketClaim, MarketCredit, MarketFraud, MarketModel,
                             MarketWorker, MoeModel)
from moe.jsonrpc import ParamError
from registry.model_ids import validate_model_id

LIVE_S = 120
CHALLENGE_TTL_S = 300
MAX_CHALLENGES = 10_000
MAX_WORKERS = 4_096
MAX_SEGMENTS = 256
MAX_WALLET = 64
MAX_SHARD_EXPERTS = 64  # the shard download's cap (§1.10); assignments are clipped to it
RELAY_PORT_BASE = 52970  # coordinator ports handed to relay-wired workers (§1.5): 52970–53029
RELAY_PORTS = 60
RELAY_HOST = "127.0.0.1"
MAX_SESSION = 128
CLOSE_AUTH = 4401  # relay refusals (§1.8): 101, then these close codes
CLOSE_QUARANTINED = 4403
CLOSE_UNKNOWN_SESSION = 4404
RECRUIT_SATURATE_SLOTS = 2  # §1.11 item 6, reported by /api/moe/recruitment
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


class MarketError(Exception):
    """A refused market call: HTTP ``status`` and the contract's ``message``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


# --------------------------------------------------------------------------- auth (§1.1, §1.2, §2)

def b58decode(text: str) -> bytes:
    """Base58 (Bitcoin alphabet) → bytes; each leading ``1`` is a zero byte. Raises ``ValueError``."""
    n = 0
    for ch in text:
        i = _B58.find(ch)
        if i < 0:
            raise ValueError(f"{ch!r} is not a base58 character")
        n = n * 58 + i
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    return b"\0" * (len(text) - len(text.lstrip("1"))) + body


def b58encode(data: bytes) -> str:
    """Bytes → base58 (Bitcoin alphabet), the Solana address form of a 32-byte ed25519 key."""
    n = int.from_bytes(data, "big")
    out = ""
    while n:
        n, r = divmod(n, 58)
        out = _B58[r] + out
    return "1" * (len(data) - len(data.lstrip(b"\0"))) + out


def challenge_message(wallet: str, nonce: str) -> str:
    """The text a wallet signs (UTF-8): title, ``wallet: W``, ``nonce: N``; no trailing newline."""
    return f"Tenzro expert market \u2014 prove you operate this node.\nwallet: {wallet}\nnonce: {nonce}"


def issue_challenge(wallet, client: str = "?") -> dict:
    """``POST /api/auth/challenge``: ``{nonce, message}``. Raises ``MarketError`` 400 / 429.

    ``client`` (the caller's address) may ask ``TENZRO_MARKET_CHALLENGE_RATE`` challenges a
    minute, so one client cannot fill the site-wide ``MAX_CHALLENGES`` and lock every node out
    of login (issue 24 item 7)."""
    wallet = wallet.strip() if isinstance(wallet, str) else ""
    if not wallet:
        raise MarketError(400, "wallet is required")
    if len(wallet) > MAX_WALLET:
        raise MarketError(400, "that is not a wallet address")
    limit = int(settings.TENZRO.get("MARKET_CHALLENGE_RATE_PER_MINUTE") or 0)
    if ratelimit.over_rate("market-challenge", client, limit):
        raise MarketError(429, f"challenge rate limit of {limit} per minute for this client exceeded; "
                               f"retry in {ratelimit.retry_after_s()} s")
    now = timezone.now()
    MarketChallenge.objects.filter(created__lt=now - timedelta(seconds=CHALLENGE_TTL_S)).delete()
    if MarketChallenge.objects.count() >= MAX_CHALLENGES:
        raise MarketError(429, "too many challenges are outstanding; try again shortly")
    nonce = secrets.token_hex(16)
    MarketChallenge.objects.create(nonce=nonce, wallet=wallet, created=now)
    return {"nonce": nonce, "message": challenge_message(wallet, nonce)}


def _secret() -> bytes:
    s = settings.TENZRO.get("MARKET_TOKEN_SECRET") or ""
    return s.encode() if s else hashlib.sha256(b"tenzro/market/node-token\0" + settings.SECRET_KEY.encode()).digest()


def _mac(payload: str) -> str:
    return hmac.new(_secret(), payload.encode(), hashlib.sha256).hexdigest()


def make_token(wallet: str, now: float | None = None) -> tuple[str, int]:
    """A node token for ``wallet`` and its lifetime in seconds (contract §2.5)."""
    ttl = int(settings.TENZRO.get("MARKET_TOKEN_TTL_S") or 30 * 86400)
    exp = int((time.time() if now is None else now) + ttl)
    payload = f"node|{wallet}|{exp}"
    raw = f"{payload}|{_mac(payload)}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("="), ttl


def token_wallet(token: str, now: float | None = None) -> str | None:
    """The wallet of a valid, unexpired node token, else None (scope word, wallet, expiry, HMAC)."""
    if not isinstance(token, str) or not token or len(token) > 1000:
        return None
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return None
    parts = raw.split("|")
    if len(parts) != 4 or parts[0] != "node" or not parts[1] or not parts[2].isdigit():
        return None
    if int(parts[2]) < (time.time() if now is None else now):
        return None
    if not hmac.compare_digest(_mac("|".join(parts[:3])), parts[3]):
        return None
    return parts[1]


def issue_node_token(wallet, nonce, signature) -> dict:
    """``POST /api/auth/node-token``: ``{node_token, wallet, expires_in}``.

    The nonce is consumed by any attempt (a failed one burns it). Raises ``MarketError``:
    400 missing field, 401 unknown/expired/foreign nonce, 401 bad signature.
    """
    wallet = wallet.strip() if isinstance(wallet, str) else ""
    nonce = nonce.strip() if isinstance(nonce, str) else ""
    if not wallet or not nonce or not isinstance(signature, str) or not signature:
        raise MarketError(400, "wallet, nonce and signature are required")
    with transaction.atomic():
        ch = MarketChallenge.objects.select_for_update().filter(nonce=nonce).first()
        if ch is not None:
            ch.delete()
    if (ch is None or ch.wallet != wallet
            or ch.created < timezone.now() - timedelta(seconds=CHALLENGE_TTL_S)):
        raise MarketError(401, "that challenge is unknown, expired, or already used")
    try:
        key = b58decode(wallet)
        sig = base64.b64decode(signature.strip() + "=" * (-len(signature.strip()) % 4))
        if len(key) != 32 or len(sig) != 64:
            raise ValueError("bad lengths")
        VerifyKey(key).verify(challenge_message(wallet, nonce).encode("utf-8"), sig)
    except (ValueError, binascii.Error, BadSignatureError):
        raise MarketError(401, "the signature does not match that wallet") from None
    token, ttl = make_token(wallet)
    return {"node_token": token, "wallet": wallet, "expires_in": ttl}


def authenticate(headers, service_token: str | None = None) -> str:
    """The caller's wallet from ``Authorization: Bearer <token>`` (case-insensitive prefix) or a
    node token in ``X-Kvasir-Service-Token`` / ``X-Linkcpp-Service-Token``; ``""`` for the
    service secret (``TENZRO_MARKET_SERVICE_TOKEN``, no wallet), also accepted as
    ``service_token`` (the shard download's ``service_token`` query parameter, §1.10; only the
    secret, never a node token, since URLs end up in logs). Raises ``MarketError`` 401."""
    service = settings.TENZRO.get("MARKET_SERVICE_TOKEN") or ""
    if service and isinstance(service_token, str) and hmac.compare_digest(service_token.encode(), service.encode()):
        return ""
    candidates = []
    auth = headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        candidates.append(auth[7:].strip())
    for h in ("X-Kvasir-Service-Token", "X-Linkcpp-Service-Token"):
        if headers.get(h):
            candidates.append(headers[h].strip())
    for c in candidates:
        if service and hmac.compare_digest(c.encode(), service.encode()):
            return ""
        wallet = token_wallet(c)
        if wallet:
            return wallet
    raise MarketError(401, "authentication required")


# --------------------------------------------------------------------------- census and fold (§1.5, §1.11)

def _evict(now) -> None:
    cutoff = now - timedelta(seconds=LIVE_S)
    MarketWorker.objects.filter(ts__lt=cutoff).delete()
    MarketClaim.objects.filter(ts__lt=cutoff).delete()


def basename(ref: str) -> str:
    """The last ``/`` component of a model reference (how workers name models, §1.5)."""
    return ref.rstrip("/").rsplit("/", 1)[-1]


def _seg_number(v) -> int | None:
    """One segment field as an int: a finite number, or a numeric string (``"4"``, ``" 4.0 "``)
    as the Kvasir coordinator converts them; None for anything else (bool, "x", NaN, ±inf)."""
    if isinstance(v, str) and len(v) <= 32:
        try:
            v = float(v.strip())
        except ValueError:
            return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return int(v) if math.isfinite(v) else None


def _segments(raw) -> list[list[int]]:
    """Keep 3-element arrays of finite numbers or numeric strings (first 256), silently dropping
    the rest (§1.5)."""
    out = []
    for seg in (raw if isinstance(raw, list) else [])[:MAX_SEGMENTS]:
        if not isinstance(seg, list) or len(seg) != 3:
            continue
        vals = [_seg_number(v) for v in seg]
        if None in vals:
            continue
        out.append(vals)
    return out


def post_coverage(wallet: str, body: dict) -> dict:
    """``POST /api/expert-coverage`` (the worker heartbeat). Raises ``MarketError`` 400 / 503.

    A ``url`` of ``relay:<session>`` wires the worker (§1.5): the session (``expert-<worker_id>``
    when empty, cut to 128 chars) and a coordinator port from 52970–53029, sticky to the worker
    until it is evicted; all 60 taken → ``wired: false, listen_port: null`` but still the
    session (the JS bridge's answer). Any other ``url`` answers ``wired: false`` and leaves an
    earlier wiring to age out of the dispatch map (``relay_ts`` is not refreshed).
    """
    worker_id = body.get("worker_id").strip() if isinstance(body.get("worker_id"), str) else ""
    model = body.get("model").strip() if isinstance(body.get("model"), str) else ""
    if not worker_id or not model:
        raise MarketError(400, "worker_id and model are required")
    worker_id = worker_id[:200]
    now = timezone.now()
    segs = _segments(body.get("segments"))
    _evict(now)
    for _ in range(3):  # a lost race for a relay port (unique column) retries with the next free one
        try:
            w, wiring = _store_coverage(wallet, worker_id, model, segs, body, now)
            break
        except IntegrityError:
            continue
    else:
        raise MarketError(503, "the coverage census is busy; try again shortly")
    wired = wiring is not None and w.listen_port is not None
    return {"ok": True, "workers": MarketWorker.objects.count(), "wired": wired,
            "listen_port": w.listen_port if wired else None, "session": wiring}


def _store_coverage(wallet: str, worker_id: str, model: str, segs: list, body: dict, now):
    """One attempt at storing a coverage post: ``(worker, session or None)``. Raises
    ``IntegrityError`` when a concurrent post took the same worker id or relay port."""
    with transaction.atomic():
        w = MarketWorker.objects.select_for_update().filter(worker_id=worker_id).first()
        if w is None and MarketWorker.objects.count() >= MAX_WORKERS:
            raise MarketError(503, "the coverage census is full; try again shortly")
        w = w or MarketWorker(worker_id=worker_id)
        w.wallet = wallet or w.wallet
        w.model = basename(model)[:200]
        w.n_layer = int(body["n_layer"]) if isinstance(body.get("n_layer"), int) else 0
        w.n_expert = int(body["n_expert"]) if isinstance(body.get("n_expert"), int) else 0
        w.segments = segs
        w.url = body["url"][:300] if isinstance(body.get("url"), str) else ""
        if isinstance(body.get("owner"), str) and body["owner"].strip():
            w.owner = body["owner"].strip()[:64]
        platform = dict(w.platform or {})
        for k in ("os", "device_kind", "accelerator", "backend"):
            if isinstance(body.get(k), str):
                platform[k] = body[k][:64]
        w.platform = platform
        w.ts = now
        banned_ids, banned_wallets = quarantined(now)
        banned = worker_id in banned_ids or bool(w.wallet and w.wallet in banned_wallets)
        wiring = _wire(w, worker_id, now) if w.url.startswith("relay:") and not banned else None
        w.save()
        if wallet:  # a claim ends once its wallet reports a segment covering the range
            for c in MarketClaim.objects.filter(wallet=wallet):
                if any(s[0] == c.layer and s[1] <= c.begin and s[2] >= c.end for s in segs):
                    c.delete()
    return w, wiring


def _wire(w: MarketWorker, worker_id: str, now) -> str:
    """Give a relay-wired worker its session and a coordinator port (kept while it stays live);
    returns the session. Runs inside ``_store_coverage``'s transaction, the worker row locked;
    the port column is unique, so two workers racing for one port cannot both get it (the
    loser's transaction fails and ``post_coverage`` retries it)."""
    session = (w.url[len("relay:"):].strip() or f"expert-{worker_id}")[:MAX_SESSION]
    if w.session != session or w.relay_claimed is None:
        w.relay_claimed = now
    w.session = session
    w.relay_ts = now
    if w.listen_port is None:
        taken = set(MarketWorker.objects.exclude(worker_id=worker_id).filter(listen_port__isnull=False)
                    .values_list("listen_port", flat=True))
        w.listen_port = next((p for p in range(RELAY_PORT_BASE, RELAY_PORT_BASE + RELAY_PORTS) if p not in taken),
                             None)
    return session


def _require_service(wallet: str, what: str) -> None:
    """Service-only endpoints: ``authenticate`` returned a wallet, so a node token was used."""
    if wallet:
        raise MarketError(403, f"a service token is required to {what}")


def _first_segment(w: MarketWorker) -> tuple[int, list[int]]:
    """The relay target's layer and experts: the first segment's, else layer 0, experts [0, 0] (§1.5)."""
    if w.segments:
        layer, b, e = w.segments[0]
        return layer, [b, e]
    return 0, [0, 0]


def _query_number(query, field: str, default: float, lo: float) -> float:
    """A query parameter as a finite number ≥ ``lo`` (``default`` when absent or empty);
    raises ``MarketError`` 400 naming the field."""
    raw = query.get(field)
    if raw is None or not raw.strip():
        return default
    try:
        v = float(raw.strip())
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v < lo:
        raise MarketError(400, f"{field} must be a number ≥ {lo:g}")
    return v


def dispatch_map(wallet: str, query) -> dict:
    """``GET /api/expert-dispatch-map?model=<m>&layer=<L|-1>&stale=<s=120>`` (§1.6), service token
    only (rows name the relay sessions a worker's socket joins).

    ``{"model": <basename>, "rows": [{"worker_id", "layer", "experts": [a, b], "listen_port",
    "session", "node_id"}]}``: one row per relay-wired worker with a port whose last relay-wired
    coverage post is at most ``stale`` seconds old (and live, §1.11), its stored model equal to
    ``model``'s basename and, for ``layer`` ≥ 0, its first segment on that layer; rows sorted by
    worker_id. For the backbone's hand-written parser, which finds rows by the text
    ``"worker_id"``: that key comes first in each row with a string value, and a row whose JSON
    would hold that text a second time (a worker or session named so) is left out, as is a
    ``model`` containing it (400). Integers are JSON integers. ``stale`` may be fractional.
    Raises ``MarketError`` 400 (``model`` missing, ``layer`` not an integer ≥ -1, ``stale``
    not a number ≥ 0), 403 (node token)."""
    _require_service(wallet, "read the dispatch map")
    ref = query.get("model")
    model = basename(ref.strip()) if isinstance(ref, str) else ""
    if not model:
        raise MarketError(400, "model is required")
    if "worker_id" in model:
        raise MarketError(400, "model must not contain the text worker_id (the dispatch parser keys rows on it)")
    layer = _query_number(query, "layer", -1, -1)
    if layer != int(layer):
        raise MarketError(400, "layer must be an integer ≥ -1")
    layer = int(layer)
    stale = _query_number(query, "stale", LIVE_S, 0)
    now = timezone.now()
    _evict(now)
    rows = []
    for w in (MarketWorker.objects.filter(model=model, listen_port__isnull=False, relay_ts__isnull=False,
                                          relay_ts__gte=now - timedelta(seconds=stale)).order_by("worker_id")):
        w_layer, experts = _first_segment(w)
        if layer >= 0 and w_layer != layer:
            continue
        row = {"worker_id": w.worker_id, "layer": w_layer, "experts": experts, "listen_port": w.listen_port,
               "session": w.session, "node_id": w.worker_id}
        if json.dumps(row).count('"worker_id"') == 1:
            rows.append(row)
    return {"model": model, "rows": rows}


def relay_sessions(wallet: str) -> dict:
    """``GET /api/expert-relay/sessions`` (§1.9, JS shape), service token only: the relay
    sessions of live relay-wired workers, sorted by session. ``claimed_at`` = when the session
    was first named (epoch ms, as the JS bridge reports times); ``connected``: whether a relay
    socket holds the session now; ``bytes``: ``{ws2tcp, tcp2ws}`` carried since its socket first
    joined (null before). Raises ``MarketError`` 403."""
    _require_service(wallet, "list relay sessions")
    _evict(timezone.now())
    out = []
    for w in MarketWorker.objects.exclude(session="").filter(relay_claimed__isnull=False).order_by("session"):
        layer, experts = _first_segment(w)
        out.append({"session": w.session, "node_id": w.worker_id, "owner": w.owner or None,
                    "model": w.model, "layer": layer, "experts": experts,
                    "listen_host": RELAY_HOST if w.listen_port is not None else None,
                    "listen_port": w.listen_port, "claimed_at": int(w.relay_claimed.timestamp() * 1000),
                    "connected": w.relay_connected,
                    "bytes": ({"ws2tcp": w.relay_ws2tcp, "tcp2ws": w.relay_tcp2ws}
                              if w.relay_connected or w.relay_ws2tcp or w.relay_tcp2ws else None)})
    return {"sessions": out}


def relay_register(wallet: str, body: dict) -> dict:
    """``POST /api/expert-relay/register`` (§1.9, Py hub), service token only: refused with 501.
    A registration names a host:port this site would dial on a worker's behalf; this site's
    relay joins sessions only to the coordinator ports its coverage census hands out (§1.5),
    so it accepts no outside listener. Raises ``MarketError`` 403 (node token) or 501."""
    _require_service(wallet, "register a relay listener")
    raise MarketError(501, "this site does not register relay listeners: a relay session joins the coordinator "
                           "port its coverage post was given (see /api/expert-dispatch-map)")


def recruitment(wallet: str) -> dict:
    """``GET /api/moe/recruitment`` (§1.7), node or service token, read-only.

    The Py hub's recruitment boosts a model's target while an external coordinator's
    llama-server reports ``busy ≥ saturate_at`` slots. This site reads no coordinator's
    ``/slots`` (§1.12 item 7: a constant target), so ``boost`` is 0, every model's
    ``effective_target`` equals ``base_target`` (the policy's ``min_replication``),
    ``recruiting`` is true as in ``/api/expert-demand``, and ``busy``/``slots``/``age_s`` are
    null (no reading). ``expert_workers`` counts the live market workers reporting the model."""
    _evict(timezone.now())
    target = governance.current_policy().min_replication
    models = []
    for m in _models(None):
        names = {basename(m.model_id), m.model_id} | ({m.name, basename(m.name)} if m.name else set())
        models.append({"model": m.model_id, "busy": None, "slots": None, "saturated": False, "recruiting": True,
                       "base_target": target, "effective_target": target,
                       "expert_workers": MarketWorker.objects.filter(model__in=names).count(), "age_s": None})
    return {"saturate_at": RECRUIT_SATURATE_SLOTS, "boost": 0, "target_base": target, "models": models}


def _models(ref: str | None) -> list[MarketModel]:
    ms = list(MarketModel.objects.all())
    if ref:
        ms = [m for m in ms if m.model_id == ref or m.name == ref or m.model_id.endswith(ref)]
    return ms


def fold(m: MarketModel) -> dict[int, list[int]]:
    """Replica counts ``{layer: [r_0 … r_{n_expert-1}]}`` of a market model (§1.11 items 2–3)."""
    n = m.n_expert
    layers = sorted({int(x) for x in m.expert_layers})
    r = {layer: [0] * n for layer in layers}
    names = {basename(m.model_id), m.model_id} | ({m.name, basename(m.name)} if m.name else set())
    banned_ids, banned_wallets = quarantined(timezone.now())
    for wid, wallet, segs in MarketWorker.objects.filter(model__in=names).values_list("worker_id", "wallet",
                                                                                     "segments"):
        if wid in banned_ids or (wallet and wallet in banned_wallets):
            continue  # a quarantined worker's coverage is not counted (issue 27 item 5)
        for layer, b, e in segs:
            if layer in r:
                for i in range(max(0, b), min(e, n)):
                    r[layer][i] += 1
    for c in MarketClaim.objects.filter(model=m.model_id):
        if c.layer in r:
            for i in range(max(0, c.begin), min(c.end, n)):
                r[c.layer][i] += 1
    for layer, expert in _provider_counts(m):
        if layer in r and expert < n:
            r[layer][expert] += 1
    return r


def _provider_counts(m: MarketModel):
    """(layer, expert) once per live provider holding it (heartbeat holdings)."""
    return Holding.objects.filter(model_id=m.model_id, provider__in=selectors.live_providers()).values_list(
        "layer", "expert")


def segments_of(r: list[int], target: int) -> list[dict]:
    """Maximal runs of equal replica count with their scarcity ``round3(max(0, (T-r)/T))``."""
    out, i = [], 0
    while i < len(r):
        j = i
        while j < len(r) and r[j] == r[i]:
            j += 1
        out.append({"experts": [i, j], "replicas": r[i], "target": target,
                    "scarcity": round(max(0.0, (target - r[i]) / target), 3)})
        i = j
    return out


def demand(ref: str | None) -> dict:
    """``GET /api/expert-demand[?model=]`` (§1.3): every expert layer of every matching model."""
    _evict(timezone.now())
    target = governance.current_policy().min_replication
    models = []
    for m in _models(ref):
        r = fold(m)
        models.append({"model": m.model_id, "n_layer": m.n_layer, "n_expert": m.n_expert, "target_replicas": target,
                       "recruiting": True,
                       "layers": [{"layer": layer, "segments": segments_of(r[layer], target)} for layer in sorted(r)]})
    return {"target_replicas": target, "recruiting": True, "models": models}


def volunteer(wallet: str, body: dict) -> dict:
    """``POST /api/expert-volunteer`` (§1.4, §1.11 item 5): the scarcest run (ties: wider before
    clipping, then first), clipped to ``max_experts`` and to ``MAX_SHARD_EXPERTS`` (the shard
    download's 413 cap, as §1.10 advises; ``max_experts`` ≤ 0 or missing: that cap alone); a wallet's
    assignment is claimed as one replica for 120 s (a repeat refreshes it)."""
    now = timezone.now()
    _evict(now)
    ref = body.get("model") if isinstance(body.get("model"), str) else ""
    cap = body.get("max_experts")
    cap = int(cap) if isinstance(cap, (int, float)) and not isinstance(cap, bool) and math.isfinite(cap) else 0
    target = governance.current_policy().min_replication
    best = None
    for m in _models(ref.strip() or None):
        r = fold(m)
        for layer in sorted(r):
            for seg in segments_of(r[layer], target):
                if seg["scarcity"] <= 0:
                    continue
                width = seg["experts"][1] - seg["experts"][0]
                if best is None or (seg["scarcity"], width) > (best[2]["scarcity"], best[3]):
                    best = (m, layer, seg, width)
    if best is None:
        return {"assigned": False, "reason": "expert coverage at target"}
    m, layer, seg, _ = best
    begin, end = seg["experts"]
    # clipped to what one shard download may hold, so an assignment can always be downloaded
    cap = min(cap, MAX_SHARD_EXPERTS) if cap > 0 else MAX_SHARD_EXPERTS
    end = min(end, begin + cap)
    if wallet:
        try:
            with transaction.atomic():
                MarketClaim.objects.update_or_create(wallet=wallet, model=m.model_id, layer=layer, begin=begin,
                                                     end=end, defaults={"ts": now})
        except IntegrityError:  # a concurrent identical claim: it exists, which is all we need
            pass
    return {"assigned": True, "model": m.model_id, "layer": layer, "experts": [begin, end],
            "scarcity": seg["scarcity"], "replicas": seg["replicas"], "target": target, "n_embd": m.n_embd,
            "n_layer": m.n_layer, "n_expert": m.n_expert}


SHAPE_FIELDS = ("n_embd", "n_layer", "n_expert", "expert_layers")


def published_shape(model_id: str) -> dict | None:
    """The market shape of a model published on this site (``MoeModel``), or None when none is:
    ``n_embd`` = hidden size, ``n_layer`` = the config's block count (else last MoE layer + 1),
    ``n_expert`` = routed experts (the shared slot is not offered), ``expert_layers`` = the MoE
    layers whose experts are published. Raises ``ValueError("model_id", …)`` for a dense-slice
    set (``prepare.dense``), which has no routed experts to offer."""
    pub = MoeModel.objects.filter(model_id=model_id).first()
    if pub is None:
        return None
    if pub.family == "dense":
        raise ValueError("model_id", f"{model_id!r} is a set of dense-layer slices, not an MoE model; "
                                     "list the MoE model it belongs to")
    layers = sorted({int(x) for x in pub.moe_layers})
    n_layer = int((pub.config or {}).get("num_hidden_layers") or 0) or (layers[-1] + 1 if layers else 0)
    return {"n_embd": pub.hidden_size, "n_layer": n_layer, "n_expert": pub.num_experts, "expert_layers": layers}


def add_model(model_id: str, n_embd: int | None = None, n_layer: int | None = None, n_expert: int | None = None,
              expert_layers: list[int] | None = None, name: str = "") -> dict:
    """List (or update) a model on the market; returns its row plus ``created`` and ``published``.

    A model published on this site (``MoeModel``) takes its shape from the publication
    (``published_shape``): its MoE layers are the market's expert layers, so demand and
    volunteering cover them. Shape fields given for it must agree with the publication. A model
    not published here needs all four shape fields (an external catalog listing).

    Raises ``ValueError(field, message)``: ``model_id`` outside ``registry.model_ids``' rule, a
    dense-slice set, or an unpublished model without a full shape; a shape field that disagrees
    with the publication; an expert layer outside ``[0, n_layer)``."""
    try:
        validate_model_id(model_id, hub=True)
    except ParamError as exc:
        raise ValueError("model_id", str(exc)) from None
    given = {"n_embd": n_embd, "n_layer": n_layer, "n_expert": n_expert,
             "expert_layers": sorted(set(expert_layers)) if expert_layers is not None else None}
    shape = published_shape(model_id)
    if shape is not None:
        if not shape["expert_layers"]:
            raise ValueError("model_id", f"published model {model_id!r} has no published MoE layer")
        for f in SHAPE_FIELDS:
            if given[f] is not None and given[f] != shape[f]:
                raise ValueError(f, f"{model_id!r} is published with {f} {shape[f]}; leave {f} out or give that")
    else:
        missing = [f for f in SHAPE_FIELDS if given[f] is None]
        if missing:
            raise ValueError("model_id", f"no model {model_id!r} is published on this site; publish it first, "
                                         f"or give its shape ({', '.join(missing)} missing)")
        shape = given
    bad = [x for x in shape["expert_layers"] if not 0 <= x < shape["n_layer"]]
    if bad:
        raise ValueError("expert_layers", f"expert layers {bad} are outside [0, {shape['n_layer']})")
    m, created = MarketModel.objects.update_or_create(model_id=model_id, defaults={"name": name, **shape})
    return {"model_id": m.model_id, "name": m.name, "n_embd": m.n_embd, "n_layer": m.n_layer,
            "n_expert": m.n_expert, "expert_layers": m.expert_layers, "created": created,
            "published": MoeModel.objects.filter(model_id=model_id).exists()}


# --------------------------------------------------------------------------- relay sockets (§1.8) and audits

def quarantined(now) -> tuple[set[str], set[str]]:
    """(worker ids, wallets) under a fraud proof's quarantine at ``now`` (``MarketFraud``)."""
    rows = MarketFraud.objects.filter(quarantined_until__gt=now).values_list("worker_id", "wallet")
    return {r[0] for r in rows}, {r[1] for r in rows if r[1]}


def relay_open(token, session, channel: str = "") -> tuple[str, str]:
    """A relay socket dialed ``/api/expert-relay?session=&token=``: ``(worker_id, owner)`` of the
    session once the socket may join it. A session without an owner gets the dialing token's
    wallet (how phones get paid, §1.8); the worker is marked connected, held by ``channel`` (the
    socket's channel name: a newer socket of the same session supersedes it).

    Raises ``MarketError`` with a close code as status: ``CLOSE_AUTH`` (no valid node token or
    service secret), ``CLOSE_UNKNOWN_SESSION`` (no live coverage post created the session),
    ``CLOSE_QUARANTINED`` (the worker or its wallet is quarantined for fraud)."""
    token = token.strip() if isinstance(token, str) else ""
    service = settings.TENZRO.get("MARKET_SERVICE_TOKEN") or ""
    if service and token and hmac.compare_digest(token.encode(), service.encode()):
        wallet = ""
    else:
        wallet = token_wallet(token)
        if not wallet:
            raise MarketError(CLOSE_AUTH, "authentication required")
    session = session.strip() if isinstance(session, str) else ""
    now = timezone.now()
    _evict(now)
    with transaction.atomic():
        w = (MarketWorker.objects.select_for_update().filter(session=session, relay_claimed__isnull=False).first()
             if session else None)
        if w is None:
            raise MarketError(CLOSE_UNKNOWN_SESSION, "unknown relay session")
        banned_ids, banned_wallets = quarantined(now)
        if w.worker_id in banned_ids or (w.wallet and w.wallet in banned_wallets):
            raise MarketError(CLOSE_QUARANTINED, "this worker is quarantined for returning wrong rows")
        if not w.owner and wallet:
            w.owner = wallet
        w.relay_connected = True
        w.relay_channel = channel[:200]
        w.save(update_fields=["owner", "relay_connected", "relay_channel"])
    return w.worker_id, w.owner or w.wallet


def relay_live(worker_id: str) -> bool:
    """Whether the relay socket of ``worker_id`` may stay open: its worker is live (a coverage
    post in the last 120 s; a quiet one is evicted here, freeing its port and session) and not
    quarantined."""
    now = timezone.now()
    _evict(now)
    w = MarketWorker.objects.filter(worker_id=worker_id, relay_claimed__isnull=False).first()
    if w is None:
        return False
    banned_ids, banned_wallets = quarantined(now)
    return not (worker_id in banned_ids or (w.wallet and w.wallet in banned_wallets))


def relay_credit(worker_id: str, owner: str, ws2tcp: int, tcp2ws: int, closed: bool = False,
                 channel: str = "") -> float:
    """Record ``ws2tcp`` / ``tcp2ws`` fresh bytes a relay socket carried since its last credit and
    credit the fresh part of max(ws→tcp, tcp→ws) / 1e6 × ``MARKET_RELAY_UNITS_PER_MB`` to the
    session owner (the worker row's owner, else ``owner`` known when the socket opened; no
    owner, no credit). ``closed``: the socket ``channel`` ended (the worker is marked not connected
    unless a newer socket holds it).
    Returns the units credited."""
    with transaction.atomic():
        w = MarketWorker.objects.select_for_update().filter(worker_id=worker_id).first()
        fresh = 0
        if w is not None:
            w.relay_ws2tcp += max(0, ws2tcp)
            w.relay_tcp2ws += max(0, tcp2ws)
            fresh = max(w.relay_ws2tcp, w.relay_tcp2ws) - w.relay_credited
            w.relay_credited += fresh
            owner = w.owner or owner
            if closed and w.relay_channel == channel[:200]:
                w.relay_connected = False
                w.relay_channel = ""
            w.save(update_fields=["relay_ws2tcp", "relay_tcp2ws", "relay_credited", "relay_connected",
                                  "relay_channel"])
        else:  # evicted meanwhile: credit what this socket carried
            fresh = max(ws2tcp, tcp2ws, 0)
        units = fresh / 1e6 * float(settings.TENZRO.get("MARKET_RELAY_UNITS_PER_MB", 1.0))
        if owner and fresh > 0:
            c, _ = MarketCredit.objects.select_for_update().get_or_create(wallet=owner[:64])
            c.bytes += fresh
            c.units += units
            c.save()
    return units if owner else 0.0


def relay_holder(worker_id: str) -> str:
    """The channel name of the relay socket holding ``worker_id``'s session ("" when none)."""
    return MarketWorker.objects.filter(worker_id=worker_id).values_list("relay_channel", flat=True).first() or ""


def kvasir_workers(model_id: str) -> list[tuple[str, int, int, int]]:
    """The relay-connected, live, unquarantined market workers holding experts of ``model_id``
    (stored model equal to its id or basename): ``(worker_id, layer, begin, end)`` of each one's
    first segment (the shard its worker process serves, §1.5), ``end > begin``; sorted by id."""
    now = timezone.now()
    banned_ids, banned_wallets = quarantined(now)
    out = []
    for wid, wallet, segs in (MarketWorker.objects.filter(
            model__in={model_id, basename(model_id)}, relay_connected=True,
            ts__gte=now - timedelta(seconds=LIVE_S)).order_by("worker_id")
            .values_list("worker_id", "wallet", "segments")):
        if wid in banned_ids or (wallet and wallet in banned_wallets) or not segs:
            continue
        layer, b, e = segs[0]
        if e > b >= 0:
            out.append((wid, layer, b, e))
    return out


def quarantine_worker(worker_id: str, model_id: str, layer: int, expert: int, tokens: list[int],
                      verification: dict, executed_by: str) -> dict:
    """Record a fraud proof against ``worker_id`` (an audited batch failed) and quarantine it and
    its wallet for the policy's ``quarantine_ms``: its coverage leaves the fold, its relay is
    refused. Returns the proof as JSON."""
    now = timezone.now()
    until = now + timedelta(milliseconds=governance.current_policy().quarantine_ms)
    w = MarketWorker.objects.filter(worker_id=worker_id).first()
    f = MarketFraud.objects.create(worker_id=worker_id, wallet=(w.wallet if w else ""), model_id=model_id,
                                   layer=layer, expert=expert, tokens=[int(t) for t in tokens],
                                   verification=verification, executed_by=executed_by[:64], created=now,
                                   quarantined_until=until)
    MarketWorker.objects.filter(worker_id=worker_id).update(relay_connected=False)
    return fraud_json(f)


def fraud_json(f: MarketFraud) -> dict:
    """A fraud proof as the API lists it."""
    return {"id": f.id, "worker_id": f.worker_id, "wallet": f.wallet, "model_id": f.model_id, "layer": f.layer,
            "expert": f.expert, "tokens": f.tokens, "verification": f.verification, "executed_by": f.executed_by,
            "created_ms": int(f.created.timestamp() * 1000),
            "quarantined_until_ms": int(f.quarantined_until.timestamp() * 1000)}
