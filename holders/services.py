"""Router services of the site: gate lookup and ``tenzro_moeForward`` over agent sockets."""
from __future__ import annotations

import asyncio
import threading

import numpy as np
from channels.db import database_sync_to_async
from django.conf import settings

from holders import wire
from holders.forward import ForwardError, distributed_forward
from holders.gating import Gate
from holders.transports.ws import AgentLink
from prepare.blobs import BlobStore
from prepare.models import GateBlob
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
                        rows: np.ndarray) -> np.ndarray:
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
                  "token_indices": chunk, "d_model": d_model, "carrier": "f32"}
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


__all__ = ["ForwardError", "GateNotLoaded", "forward", "load_gate", "send_to_agent"]
