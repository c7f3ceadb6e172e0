"""Router services of the site without state of their own: requests over an agent's socket,
the execution methods (``moe.methods``) on the site's own runtime or relayed to an agent, and
model placement. The forward and the state it keeps live in ``router.state.Router``.
"""
from __future__ import annotations

import asyncio
import json
import uuid

import numpy as np
from channels.db import database_sync_to_async
from django.conf import settings

from moe import messages, methods, wire
from moe import placement as repair
from moe.blobs import BlobStore
from moe.content import blob_uri, parse_blob_uri
from moe.jsonrpc import EXECUTION_ERROR, INVALID_PARAMS, RpcError
from moe.messages import BatchAnswer, BatchRequest, answer_to_batch
from moe.runtime import GateNotLoaded
from moe.transports import coalesce
from registry.models import GateBlob, Provider
from registry.services import placement_inputs
from router.apps import current
from router.ws import AgentLink, AgentUnavailable


async def send_ws(provider: str, req: BatchRequest) -> BatchAnswer:
    """One request over ``provider``'s agent socket (binary frame through the channel layer);
    requests to the same provider in the same loop turn go as one ``batch`` frame
    (``AgentLink.coalescer``), each still answered on its own.

    Raises ``AgentUnavailable`` (a ``ConnectionError``), ``Rejected`` (the agent refused the
    request as malformed), ``HolderFault`` or ``AuthRefusal``.
    """
    link = await AgentLink.get()
    return await link.coalescer.submit(provider, req, lambda r: _send_ws_one(link, provider, r),
                                       lambda reqs, deliver: _send_ws_many(link, provider, reqs, deliver),
                                       streaming=True)


async def _send_ws_one(link: AgentLink, provider: str, req: BatchRequest) -> BatchAnswer:
    header = messages.request_header(req)
    encoded = wire.header_json(header)  # counted here, written as is
    try:
        msg = await link.request_message(provider, header, req.payload, settings.TENZRO["BATCH_TIMEOUT_S"],
                                         req_id=req.request_id, encoded=encoded)
    except AgentUnavailable as exc:
        if exc.code in messages.SOCKET_REJECTIONS:  # the agent refused our malformed request: not its fault
            raise messages.Rejected(str(exc)) from exc
        raise
    answer, payload = msg.get("header") or {}, msg.get("payload") or b""
    # Bytes on the agent's socket: frame length prefix + JSON header + payload, each way.
    out = 4 + len(encoded) + len(req.payload)
    return answer_to_batch(answer, payload, req, "ws", out, _reply_bytes(msg, answer, payload))


async def _send_ws_many(link: AgentLink, provider: str, reqs: list[BatchRequest], deliver) -> list:
    """Outcomes of ``reqs`` sent as one streamed ``batch`` message: each answer goes to
    ``deliver(index, outcome)`` as it arrives (``messages.StreamedBatch``); an agent that
    answers the batch whole is read with ``messages.batch_answers``."""
    header, payload = messages.batch_frame(reqs, uuid.uuid4().hex, seal=coalesce.message_receipts())
    header["stream"] = coalesce.stream_answers()
    encoded = wire.header_json(header)  # counted here, written as is
    out = 4 + len(encoded) + len(payload)
    stream = messages.StreamedBatch(reqs, "ws", out)

    def on_part(msg: dict) -> None:
        head, data = msg.get("header") or {}, msg.get("payload") or b""
        deliver(*stream.part(head, data, _reply_bytes(msg, head, data)))

    try:
        msg = await link.request_message(provider, header, payload, settings.TENZRO["BATCH_TIMEOUT_S"],
                                         req_id=header["id"], on_part=on_part, encoded=encoded)
        answer, data = msg.get("header") or {}, msg.get("payload") or b""
        back = _reply_bytes(msg, answer, data)
        if "more" not in answer:  # answered whole
            return messages.batch_answers(answer, data, reqs, "ws", out, back)
        stream.part(answer, data, back)  # the last answer (with the seal): its caller is resolved from finish()
        return stream.finish()
    finally:
        stream.close()  # answers delivered before a break stop waiting for the seal


def _reply_bytes(msg: dict, header: dict, payload: bytes) -> int:
    """An answer message's size on the agent's socket: as the consumer counted it (``bytes``),
    else the frame it came in re-encoded (a reassembled or relayed answer). Re-encoding the
    last answer of a batch, whose seal lists every batch, was 1 % of the site's CPU."""
    n = msg.get("bytes")
    return n if isinstance(n, int) else 4 + len(wire.header_json(header)) + len(payload)


async def send_to_agent(model_id: str, provider: str, layer: int, expert: int, tokens: list[int],
                        rows: np.ndarray, purpose: str = "serve") -> np.ndarray:
    """Execute one batch, whole, on ``provider``'s agent over its socket (frames below the cap:
    ``AgentConsumer`` splits, the agent reassembles).

    Returns f32 rows [n, H]. Raises ``AgentUnavailable`` (a ``ConnectionError``) or
    ``wire.WireError`` (a ``ValueError``) for a malformed answer.
    """
    link = await AgentLink.get()
    d_model = rows.shape[1]
    header = messages.execute_header(model_id=model_id, layer=layer, expert=expert, token_indices=list(tokens),
                                     d_model=d_model, carrier="f32", purpose=purpose)
    _answer, payload = await link.request(provider, header, wire.encode_f32(rows), settings.TENZRO["BATCH_TIMEOUT_S"])
    return wire.decode_f32(payload, d_model, n_rows=len(tokens), field="outputs")


def site_fetch(uri: str) -> bytes:
    """Blob bytes of ``tenzro://blob/<hash>`` from the site's store (hash verified).

    Raises ``BlobError`` for a malformed URI, a missing blob or a content mismatch.
    """
    return BlobStore(settings.TENZRO["BLOB_DIR"]).get(parse_blob_uri(uri), verify=True)


def _published_gate_on_demand(p: dict) -> None:
    """Load the published gate of ``tenzro_moeRoute``'s (model_id, layer) into the site's runtime
    when it holds none for that layer (a gate an operator loaded stays). Params that are not a
    string model_id and an integer layer are left for ``methods.call`` to report; a layer with
    no published gate keeps its "no gate is loaded" error."""
    model_id, layer = p.get("model_id"), p.get("layer")
    if not isinstance(model_id, str) or isinstance(layer, bool) or not isinstance(layer, int) \
            or not 0 <= layer < 2**31:
        return
    rt = current().site_runtime
    try:
        rt.gate(model_id, layer)
        return
    except GateNotLoaded:
        pass
    h = GateBlob.objects.filter(model_id=model_id, layer=layer).values_list("blob_hash", flat=True).first()
    if h is not None:
        rt.load_gate(model_id, layer, BlobStore(settings.TENZRO["BLOB_DIR"]).get(h, verify=True), blob_uri(h))


def _connected(provider: str) -> bool:
    return Provider.objects.filter(provider=provider, connected=True).exists()


async def call_method(method: str, params: dict, provider: str | None = None) -> dict:
    """Run execution method ``method`` (one of ``moe.methods.METHODS``) with ``params``.

    Without ``provider`` on the site's own runtime; with one, relayed to that provider's
    agent over its socket and answered from the agent's runtime (``blob_base64`` loads are
    first stored in the site's blob store so the agent fetches them by URI; execute rows
    travel as binary frames split below the socket's message cap).
    Raises ``RpcError`` (code, message, data.field).
    """
    if provider is None:
        if method == "tenzro_moeRoute":
            await database_sync_to_async(_published_gate_on_demand)(params)
        return await asyncio.to_thread(methods.call, current().site_runtime, method, params, site_fetch)
    if not await database_sync_to_async(_connected)(provider):
        raise RpcError(EXECUTION_ERROR, f"provider {provider[:12]}… has no agent connected", field="provider")
    if method == "tenzro_moeExecute":
        return await _relay_execute(provider, params)
    if method in ("tenzro_moeExpertLoad", "tenzro_moeGateLoad") and params.get("blob_base64"):
        if params.get("uri"):
            raise RpcError(INVALID_PARAMS, "give exactly one of uri or blob_base64", field="uri")
        try:
            data = wire.b64decode(params["blob_base64"], "blob_base64")
        except wire.WireError as exc:
            raise RpcError(INVALID_PARAMS, str(exc), field="blob_base64") from exc
        h = await asyncio.to_thread(BlobStore(settings.TENZRO["BLOB_DIR"]).put, data)
        params = {**{k: v for k, v in params.items() if k != "blob_base64"}, "uri": blob_uri(h)}
    body = json.dumps(params).encode()
    timeout = 120.0 if method in methods.MANAGEMENT else settings.TENZRO["BATCH_TIMEOUT_S"]
    link = await AgentLink.get()
    try:
        _answer, payload = await link.request(provider, messages.rpc_header(method), body, timeout)
        reply = json.loads(payload)
    except AgentUnavailable as exc:
        raise RpcError(EXECUTION_ERROR, str(exc), field="provider") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RpcError(EXECUTION_ERROR, f"agent answered malformed JSON: {exc}", field="provider") from exc
    if "error" in reply:
        err = RpcError.from_json(reply["error"])
        err.data.setdefault("field", "provider")
        raise err
    return reply["result"]


async def _relay_execute(provider: str, p: dict) -> dict:
    tokens = p["token_indices"]
    rows = methods.request_rows(p, len(tokens), p["d_model"])
    try:
        out = await send_to_agent(p["model_id"], provider, p["layer"], p["expert"], tokens, rows,
                                  p.get("purpose", "serve"))
    except AgentUnavailable as exc:
        field = {"ExpertNotLoaded": "expert", "DimensionMismatch": "d_model"}.get(str(exc.code), "provider")
        raise RpcError(EXECUTION_ERROR, str(exc), {"kind": exc.code}, field=field) from exc
    except wire.WireError as exc:
        raise RpcError(EXECUTION_ERROR, f"agent answered malformed rows: {exc}", field="provider") from exc
    return methods.execute_result(p["model_id"], p["layer"], p["expert"], tokens, p["d_model"], out)


async def place_model(model_id: str, replication: int = 2, timeout: float = 120.0) -> dict:
    """Ask live agents to load ``model_id``'s experts, each on its top-``replication`` providers by HRW.

    Returns ``{model_id, replication, assignments: {provider: count}, failed: [...]}``.
    Raises ``PlacementError``. Agents fetch the blobs themselves and declare them on their
    next heartbeat; this waits for every load to be acknowledged (or fail).
    """
    blobs, providers = await database_sync_to_async(placement_inputs)(model_id)
    uri_of = {(layer, expert): uri for layer, expert, uri in blobs}
    plan = repair.place(model_id, sorted(uri_of), providers, replication)
    link = await AgentLink.get()
    failed: list[dict] = []

    async def load(provider: str, layer: int, expert: int):
        try:
            await link.request(provider, messages.load_header(model_id, layer, expert, uri_of[(layer, expert)]),
                               timeout=timeout)
        except AgentUnavailable as exc:
            failed.append({"provider": provider, "layer": layer, "expert": expert, "error": str(exc)})

    sem = asyncio.Semaphore(16)

    async def bounded(*args):
        async with sem:
            await load(*args)

    await asyncio.gather(*(bounded(p, layer, e) for p, keys in plan.items() for layer, e in keys))
    warnings = ([f"replication {replication} asked, but only {len(providers)} live agents: each expert is on "
                 f"{len(providers)}"] if replication > len(providers) else [])
    return {"model_id": model_id, "replication": min(replication, len(providers)), "warnings": warnings,
            "assignments": {p: len(keys) for p, keys in sorted(plan.items())}, "failed": failed,
            "heartbeat_interval_s": settings.TENZRO["HEARTBEAT_INTERVAL_S"]}
