"""Router services of the site: gate lookup, ``tenzro_moeForward`` over agent sockets, and the
execution methods (``holders.methods``) on the site's own runtime or relayed to an agent."""
from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
from channels.db import database_sync_to_async
from django.conf import settings

from holders import methods, wire
from holders.forward import ForwardError, distributed_forward
from holders.gating import Gate
from holders.runtime import ExpertRuntime
from holders.transports.ws import AgentLink, AgentUnavailable
from prepare.blobs import BlobStore, parse_blob_uri
from prepare.models import GateBlob
from registry.models import Provider
from registry.selectors import shard_view


class GateNotLoaded(LookupError):
    """No gate is published for (model_id, layer) on this site."""


_gate_cache: dict[str, Gate] = {}
_gate_lock = threading.Lock()


def load_gate(model_id: str, layer: int) -> Gate:
    """The gate of (model_id, layer) from its published blob, cached by content hash.

    Raises ``GateNotLoaded`` when no gate blob is published for that layer.
    """
    row = GateBlob.objects.filter(model_id=model_id, layer=layer).first()
    if row is None:
        raise GateNotLoaded(f"no gate is loaded for model {model_id!r} layer {layer}")
    with _gate_lock:
        gate = _gate_cache.get(row.blob_hash)
        if gate is None:
            gate = Gate.from_blob(BlobStore(settings.TENZRO["BLOB_DIR"]).get(row.blob_hash, verify=True))
            _gate_cache[row.blob_hash] = gate
    return gate


async def send_to_agent(model_id: str, provider: str, layer: int, expert: int, tokens: list[int],
                        rows: np.ndarray, purpose: str = "serve") -> np.ndarray:
    """Execute one batch on ``provider``'s agent over its socket, split into frames below the cap.

    Returns f32 rows [n, H]. Raises ``AgentUnavailable`` (a ``ConnectionError``) or
    ``wire.WireError`` (a ``ValueError``) for a malformed answer.
    """
    link = await AgentLink.get()
    d_model = rows.shape[1]
    per = wire.rows_per_frame(d_model, settings.TENZRO["WS_MAX_MESSAGE"])
    timeout = settings.TENZRO["BATCH_TIMEOUT_S"]

    async def one(lo: int):
        chunk = tokens[lo:lo + per]
        header = {"type": "execute", "model_id": model_id, "layer": layer, "expert": expert,
                  "token_indices": chunk, "d_model": d_model, "carrier": "f32", "purpose": purpose}
        answer, payload = await link.request(provider, header, wire.encode_f32(rows[lo:lo + per]), timeout)
        return wire.decode_f32(payload, d_model, n_rows=len(chunk), field="outputs")

    parts = await asyncio.gather(*(one(lo) for lo in range(0, len(tokens), per)))
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


async def forward(model_id: str, layer: int, d_model: int, hidden_states: np.ndarray, top_k: int | None = None,
                  allow_cold: bool = False) -> dict:
    """``tenzro_moeForward``: returns the reference's result fields plus ``holders`` and ``timings_ms``.

    Raises ``GateNotLoaded``, ``ValueError`` (input does not fit the gate) and ``ForwardError``.
    """
    gate = await database_sync_to_async(load_gate)(model_id, layer)
    if d_model != gate.d_model:
        raise ValueError(f"d_model is {d_model} but the gate of layer {layer} has d_model {gate.d_model}")
    view = await database_sync_to_async(shard_view)(model_id)

    async def send(provider, lyr, expert, tokens, rows):
        return await send_to_agent(model_id, provider, lyr, expert, tokens, rows)

    res = await distributed_forward(gate=gate, layer=layer, hidden_states=hidden_states, view=view, send=send,
                                    top_k=top_k, allow_cold=allow_cold)
    r = res.routing
    return {
        "model_id": model_id, "layer": layer, "d_model": d_model, "top_k": r.top_k,
        "tokens": int(hidden_states.shape[0]), "batches": len(res.plan.batches), "replans": 0, "missing": [],
        "transports": {"local": 0, "ws": len(res.plan.batches), "http": 0, "iroh": 0},
        "routed": [{"token_index": t, "slots": [{"layer": layer, "expert": int(e), "weight": float(w)}
                                                for e, w in zip(r.expert_ids[t], r.weights[t])]}
                   for t in range(r.expert_ids.shape[0])],
        "holders": res.holders, "failures": res.failures, "timings_ms": res.timings_ms,
        "outputs": wire.b64encode(wire.encode_f32(res.output)),
    }


_site_runtime: ExpertRuntime | None = None
_site_runtime_lock = threading.Lock()


def site_runtime() -> ExpertRuntime:
    """This site process's own expert runtime (a router may hold experts itself), created on
    first use: budget ``TENZRO_MEMORY_BUDGET`` (or 60 % of available memory), disk tier
    ``$TENZRO_VAR_DIR/site-tier`` (re-indexed when the site restarts)."""
    global _site_runtime
    with _site_runtime_lock:
        if _site_runtime is None:
            _site_runtime = ExpertRuntime(disk_dir=settings.VAR_DIR / "site-tier")
    return _site_runtime


def site_fetch(uri: str) -> bytes:
    """Blob bytes of ``tenzro://blob/<hash>`` from the site's store (hash verified).

    Raises ``BlobError`` for a malformed URI, a missing blob or a content mismatch.
    """
    return BlobStore(settings.TENZRO["BLOB_DIR"]).get(parse_blob_uri(uri), verify=True)


def _connected(provider: str) -> bool:
    return Provider.objects.filter(provider=provider, connected=True).exists()


async def call_method(method: str, params: dict, provider: str | None = None) -> dict:
    """Run execution method ``method`` (one of ``holders.methods.METHODS``) with ``params``.

    Without ``provider`` on the site's own runtime; with one, relayed to that provider's
    agent over its socket and answered from the agent's runtime (``blob_base64`` loads are
    first stored in the site's blob store so the agent fetches them by URI; execute rows
    travel as binary frames split below the socket's message cap).
    Raises ``methods.MethodError`` (code, message, data.field).
    """
    if provider is None:
        return await asyncio.to_thread(methods.call, site_runtime(), method, params, site_fetch)
    if not await database_sync_to_async(_connected)(provider):
        raise methods.MethodError(methods.EXECUTION_ERROR, f"provider {provider[:12]}… has no agent connected",
                                  "provider")
    if method == "tenzro_moeExecute":
        return await _relay_execute(provider, params)
    if method in ("tenzro_moeExpertLoad", "tenzro_moeGateLoad") and params.get("blob_base64"):
        if params.get("uri"):
            raise methods.MethodError(methods.INVALID_PARAMS, "give exactly one of uri or blob_base64", "uri")
        try:
            data = wire.b64decode(params["blob_base64"], "blob_base64")
        except wire.WireError as exc:
            raise methods.MethodError(methods.INVALID_PARAMS, str(exc), "blob_base64") from exc
        h = await asyncio.to_thread(BlobStore(settings.TENZRO["BLOB_DIR"]).put, data)
        params = {**{k: v for k, v in params.items() if k != "blob_base64"}, "uri": f"tenzro://blob/{h}"}
    body = json.dumps(params).encode()
    if len(body) > settings.TENZRO["WS_MAX_MESSAGE"] - wire.FRAME_HEADER_MAX:
        raise methods.MethodError(methods.INVALID_PARAMS, f"params of {len(body)} bytes are too large to relay "
                                  "to an agent; send fewer rows per call", "hidden_states")
    timeout = 120.0 if method in methods.MANAGEMENT else settings.TENZRO["BATCH_TIMEOUT_S"]
    link = await AgentLink.get()
    try:
        _answer, payload = await link.request(provider, {"type": "rpc", "method": method}, body, timeout)
        reply = json.loads(payload)
    except AgentUnavailable as exc:
        raise methods.MethodError(methods.EXECUTION_ERROR, str(exc), "provider") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise methods.MethodError(methods.EXECUTION_ERROR, f"agent answered malformed JSON: {exc}", "provider") from exc
    if "error" in reply:
        err = reply["error"]
        data = err.get("data") or {}
        raise methods.MethodError(int(err.get("code", methods.EXECUTION_ERROR)), str(err.get("message")),
                                  str(data.get("field", "provider")),
                                  **{k: v for k, v in data.items() if k != "field"})
    return reply["result"]


async def _relay_execute(provider: str, p: dict) -> dict:
    tokens = p["token_indices"]
    rows = methods.decode_rows(p, len(tokens), p["d_model"])
    try:
        out = await send_to_agent(p["model_id"], provider, p["layer"], p["expert"], tokens, rows,
                                  p.get("purpose", "serve"))
    except AgentUnavailable as exc:
        field = {"ExpertNotLoaded": "expert", "DimensionMismatch": "d_model"}.get(str(exc.code), "provider")
        raise methods.MethodError(methods.EXECUTION_ERROR, str(exc), field, kind=exc.code) from exc
    except wire.WireError as exc:
        raise methods.MethodError(methods.EXECUTION_ERROR, f"agent answered malformed rows: {exc}",
                                  "provider") from exc
    return {"model_id": p["model_id"], "layer": p["layer"], "expert": p["expert"], "token_indices": tokens,
            "d_model": p["d_model"], "outputs": wire.b64encode(wire.encode_f32(out))}


__all__ = ["ForwardError", "GateNotLoaded", "call_method", "forward", "load_gate", "send_to_agent", "site_fetch",
           "site_runtime"]
