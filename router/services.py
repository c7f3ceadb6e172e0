"""Router services of the site: gate lookup, ``tenzro_moeForward`` over the holders' transports,
and the execution methods (``moe.methods``) on the site's own runtime or relayed to an agent.

Transports (docs/DESIGN.md §6): experts held by the site's own runtime run in process (no wire,
no receipt); with ``TENZRO["DATA_TRANSPORT"]`` ``"iroh"`` a holder advertising an iroh
endpoint is dialed there (``moe/execute``), with ``"http"`` a holder advertising an HTTP
endpoint is reached there with binary frames; otherwise, and as the fallback when the
preferred path cannot connect, over its agent WebSocket through the channel layer, then
over its HTTP endpoint.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

import numpy as np
from channels.db import database_sync_to_async
from django.conf import settings

from moe import messages, methods, wire
from prepare.dense import dense_model_id, dense_routing
from router.fallback import fallback_for
from router.forward import ForwardError, distributed_forward
from moe.messages import BatchAnswer, BatchRequest, answer_to_batch
from moe.gating import Gate
from router.hooks import ForwardRecord, emit_forwards
from moe.runtime import ExpertRuntime, GateNotLoaded
from router.scoreboard import Scoreboard
from moe.transports import coalesce, iroh
from moe.transports.http import HttpHolderClient
from router.ws import AgentLink, AgentUnavailable
from router.admission import Admission, Busy, overloaded
from moe.blobs import BlobStore
from moe.content import blob_uri, parse_blob_uri
from moe.jsonrpc import EXECUTION_ERROR, INVALID_PARAMS, ParamError, RpcError
from registry.models import GateBlob
from registry.models import MoeModel, Provider
from registry.selectors import expected_experts, iroh_peers, provider_infos
from moe import placement as repair
from registry.services import placement_inputs, record_holder_outcomes
from moe.shardmap import ReplicationPolicy, ShardView


class UnknownModel(GateNotLoaded):
    """No gate of any layer is published for this model id on this site."""

    field = "model_id"


_gate_cache: dict[str, Gate] = {}
_gate_lock = threading.Lock()
_ttl_cache: dict[tuple, tuple[float, object]] = {}


def _fresh(key: tuple):
    """The value ``_cached`` holds for ``key`` while it is younger than ``VIEW_CACHE_S``, else
    None: lets a coroutine skip the thread hop to the DB thread on a hit."""
    hit = _ttl_cache.get(key)
    if hit is not None and time.monotonic() - hit[0] < settings.TENZRO["VIEW_CACHE_S"]:
        return hit[1]
    return None


def _cached(key: tuple, fn):
    """``fn()`` memoized for ``TENZRO["VIEW_CACHE_S"]`` seconds: per-forward DB reads of the
    shard view were most of a small forward's time; failover covers a view this stale."""
    ttl = settings.TENZRO["VIEW_CACHE_S"]
    hit = _ttl_cache.get(key)
    now = time.monotonic()
    if hit is not None and now - hit[0] < ttl:
        return hit[1]
    value = fn()
    _ttl_cache[key] = (now, value)
    return value


def load_gate(model_id: str, layer: int) -> Gate:
    """The gate of (model_id, layer) from its published blob, cached by content hash.

    Raises ``GateNotLoaded`` when no gate blob is published for that layer.
    """
    h = _cached(("gate", model_id, layer),
                lambda: GateBlob.objects.filter(model_id=model_id, layer=layer).values_list("blob_hash", flat=True)
                .first())
    if h is None:
        _ttl_cache.pop(("gate", model_id, layer), None)
        if not GateBlob.objects.filter(model_id=model_id).exists():
            raise UnknownModel(f"model {model_id!r} is not published on this site")
        layers = sorted(GateBlob.objects.filter(model_id=model_id).values_list("layer", flat=True))
        raise GateNotLoaded(f"no gate is loaded for model {model_id!r} layer {layer}; its MoE layers are {layers}")
    with _gate_lock:
        gate = _gate_cache.get(h)
        if gate is None:
            gate = Gate.from_blob(BlobStore(settings.TENZRO["BLOB_DIR"]).get(h, verify=True))
            _gate_cache[h] = gate
    return gate


def live_view(model_id: str, exclude: frozenset = frozenset()) -> ShardView:
    """The live shard view of ``model_id`` without ``exclude`` (provider rows cached briefly)."""
    infos = _cached(("infos", model_id), lambda: (provider_infos(model_id), expected_experts(model_id)))
    return ShardView.build(model_id, [p for p in infos[0] if p.provider not in exclude],
                           policy=ReplicationPolicy(), expected=infos[1])


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
    try:
        answer, payload = await link.request(provider, header, req.payload, settings.TENZRO["BATCH_TIMEOUT_S"],
                                             req_id=req.request_id)
    except AgentUnavailable as exc:
        if exc.code in messages.SOCKET_REJECTIONS:  # the agent refused our malformed request: not its fault
            raise messages.Rejected(str(exc)) from exc
        raise
    # Bytes on the agent's socket: frame length prefix + JSON header + payload, each way.
    out = 4 + len(json.dumps(header, separators=(",", ":"))) + len(req.payload)
    back = 4 + len(json.dumps(answer, separators=(",", ":"))) + len(payload)
    return answer_to_batch(answer, payload, req, "ws", out, back)


async def _send_ws_many(link: AgentLink, provider: str, reqs: list[BatchRequest], deliver) -> list:
    """Outcomes of ``reqs`` sent as one streamed ``batch`` message: each answer goes to
    ``deliver(index, outcome)`` as it arrives (``messages.StreamedBatch``); an agent that
    answers the batch whole is read with ``messages.batch_answers``."""
    header, payload = messages.batch_frame(reqs, uuid.uuid4().hex)
    header["stream"] = coalesce.stream_answers()
    out = 4 + len(json.dumps(header, separators=(",", ":"))) + len(payload)
    stream = messages.StreamedBatch(reqs, "ws", out)

    def on_part(msg: dict) -> None:
        head, data = msg.get("header") or {}, msg.get("payload") or b""
        deliver(*stream.part(head, data, 4 + len(json.dumps(head, separators=(",", ":"))) + len(data)))

    answer, data = await link.request(provider, header, payload, settings.TENZRO["BATCH_TIMEOUT_S"],
                                      req_id=header["id"], on_part=on_part)
    back = 4 + len(json.dumps(answer, separators=(",", ":"))) + len(data)
    if "more" not in answer:  # answered whole
        return messages.batch_answers(answer, data, reqs, "ws", out, back)
    stream.part(answer, data, back)  # the last answer: its caller is resolved from finish()
    return stream.finish()


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


_http_clients: dict[int, HttpHolderClient] = {}


def _http_client() -> HttpHolderClient:
    loop = id(asyncio.get_running_loop())
    client = _http_clients.get(loop)
    if client is None:
        client = _http_clients[loop] = HttpHolderClient(settings.TENZRO["BATCH_TIMEOUT_S"])
    return client


_iroh_clients: dict[int, iroh.IrohHolderClient] = {}


def _iroh_client() -> iroh.IrohHolderClient:
    loop = id(asyncio.get_running_loop())
    client = _iroh_clients.get(loop)
    if client is None:
        client = _iroh_clients[loop] = iroh.IrohHolderClient(settings.TENZRO["BATCH_TIMEOUT_S"],
                                                             settings.TENZRO["IROH_BIND"])
    return client


async def send_iroh(provider: str, endpoint_id: str, req: BatchRequest) -> BatchAnswer:
    """One request to ``provider``'s iroh endpoint at the direct addresses of its last heartbeat.

    Raises ``ConnectionError`` (no addresses advertised for that endpoint id, cannot connect,
    stream broke), ``HolderFault`` or ``AuthRefusal``.
    """
    peers = _fresh(("iroh_peers",))
    if peers is None:
        peers = await database_sync_to_async(_cached)(("iroh_peers",), iroh_peers)
    eid, addrs = peers.get(provider, ("", []))
    if eid != endpoint_id or not addrs:
        raise ConnectionError(f"holder {provider[:12]}… advertises no direct address for iroh endpoint "
                              f"{endpoint_id[:12]}…")
    return await _iroh_client().execute(endpoint_id, addrs, req)


async def send_batch(provider: str, holder, req: BatchRequest) -> BatchAnswer:
    """Send one request by the preferred transport the holder advertises (``DATA_TRANSPORT``),
    then over its agent socket, then over its HTTP endpoint, moving on only when a path cannot
    connect (a ``ConnectionError``); the last path's error propagates."""
    mode = settings.TENZRO["DATA_TRANSPORT"]
    endpoint = getattr(holder, "http_endpoint", None)
    iroh_id = getattr(holder, "iroh_endpoint_id", None)
    paths = []
    if mode == "iroh" and iroh_id and iroh.available():
        paths.append(lambda: send_iroh(provider, iroh_id, req))
    if mode == "http" and endpoint:
        paths.append(lambda: _http_client().execute_frame(endpoint, req))
    paths.append(lambda: send_ws(provider, req))
    if endpoint and mode != "http":
        paths.append(lambda: _http_client().execute_frame(endpoint, req))
    for path in paths[:-1]:
        try:
            return await path()
        except ConnectionError:
            continue
    return await paths[-1]()


async def forward(model_id: str, layer: int, d_model: int, hidden_states: np.ndarray, top_k: int | None = None,
                  allow_cold: bool = False, allow_partial: bool = False, carrier: str = "auto",
                  fallback: bool = False, outcomes: "ForwardOutcomes | None" = None) -> dict:
    """``tenzro_moeForward``: the reference's result fields plus ``holders``, ``failures``,
    ``wire`` (bytes each way, per element), ``receipts`` (verified count) and ``timings_ms``.
    ``fallback``: pairs every remote holder failed run on this site from its blob store
    (``router.fallback``; transport ``fallback``).

    Records each holder failure (reputation) and success (latency) through
    ``registry.services.record_holder_outcomes``, at once or, with ``outcomes`` (a
    generation's), batched there with the forward's settlement record. Raises
    ``GateNotLoaded``, ``ValueError`` (input does not fit the gate, bad carrier) and ``ForwardError``.
    """
    gate = await _gate(model_id, layer)
    if d_model != gate.d_model:
        raise ParamError(f"d_model is {d_model} but the gate of layer {layer} has d_model {gate.d_model}", "d_model")
    async def get_view(excluded):
        return await _view(model_id, excluded)

    rt = _site_runtime

    def local(expert: int, rows: np.ndarray) -> np.ndarray | None:
        """Experts this site's own runtime holds run here (no wire, no receipt)."""
        if rt is None or not rt.has(model_id, layer, expert):
            return None
        return rt.execute(model_id, layer, expert, rows, rows.shape[0], rows.shape[1])

    res = await _recorded_forward(gate=gate, model_id=model_id, layer=layer, hidden_states=hidden_states,
                                  get_view=get_view, top_k=top_k, allow_cold=allow_cold,
                                  local=local if rt is not None else None, allow_partial=allow_partial,
                                  carrier=carrier, fallback=fallback_for(model_id, layer) if fallback else None,
                                  outcomes=outcomes)
    r = res.routing
    elems = int(hidden_states.shape[0]) * d_model
    return {
        "model_id": model_id, "layer": layer, "d_model": d_model, "top_k": r.top_k,
        "tokens": int(hidden_states.shape[0]), "batches": res.batches, "replans": res.replans,
        "missing": res.missing, "transports": res.transports,
        "routed": r.routed(layer),
        "holders": res.holders, "failures": res.failures, "receipts": len(res.receipts),
        "wire": {"bytes_out": res.bytes_out, "bytes_back": res.bytes_back,
                 "routed_elements": int(sum(len(toks) for toks in r.tokens_by_expert().values())) * d_model,
                 "input_elements": elems},
        "timings_ms": res.timings_ms, "forward_id": res.forward_id,
        "outputs": wire.rows_to_b64(res.output),
    }


async def dense_forward(model_id: str, layer: int, d_model: int, hidden_states: np.ndarray,
                        carrier: str = "auto", fallback: bool = False,
                        outcomes: "ForwardOutcomes | None" = None) -> dict:
    """``tenzro_moeDenseForward``: a dense MLP layer split by intermediate slices over holders
    (``prepare.dense``), recombined in slice order. ``model_id`` is the checkpoint's model;
    its slices are the experts of ``dense_model_id(model_id)``. Returns ``{model_id, layer,
    d_model, tokens, parts, batches, replans, transports, holders, failures, receipts, wire,
    timings_ms, outputs}``. ``outcomes``: as ``forward``'s. Raises ``GateNotLoaded`` when no
    dense slices are published for the layer, ``ValueError`` and ``ForwardError``.
    """
    dense_id = dense_model_id(model_id)

    def parts_of() -> int | None:
        m = MoeModel.objects.filter(model_id=dense_id).first()
        return m.num_experts if m is not None and layer in m.moe_layers and m.hidden_size == d_model else None

    parts = _fresh(("dense_parts", dense_id, layer, d_model))
    if parts is None:
        parts = await database_sync_to_async(_cached)(("dense_parts", dense_id, layer, d_model), parts_of)
    if parts is None:
        raise GateNotLoaded(f"no dense slices of model {model_id!r} layer {layer} with d_model {d_model} are "
                            f"published")
    async def get_view(excluded):
        return await _view(dense_id, excluded)

    res = await _recorded_forward(gate=None, routing=dense_routing(int(hidden_states.shape[0]), parts),
                                  model_id=dense_id, layer=layer, hidden_states=hidden_states,
                                  get_view=get_view, carrier=carrier,
                                  fallback=fallback_for(dense_id, layer) if fallback else None,
                                  outcomes=outcomes)
    return {"model_id": model_id, "layer": layer, "d_model": d_model, "tokens": int(hidden_states.shape[0]),
            "parts": parts, "batches": res.batches, "replans": res.replans, "transports": res.transports,
            "holders": res.holders, "failures": res.failures, "receipts": len(res.receipts),
            "wire": {"bytes_out": res.bytes_out, "bytes_back": res.bytes_back,
                     "routed_elements": int(hidden_states.shape[0]) * parts * d_model},
            "timings_ms": res.timings_ms, "forward_id": res.forward_id, "outputs": wire.rows_to_b64(res.output)}


_recording: set[asyncio.Task] = set()

# The router's observations of holders (router.scoreboard: why per process). Socket presence
# from the agent consumers reaches it through the agent link.
scoreboard = Scoreboard()


def _presence(provider: str, connected: bool) -> None:
    (scoreboard.connected if connected else scoreboard.disconnected)(provider)


AgentLink.presence_listeners.append(_presence)


class ForwardOutcomes:
    """Holder outcomes (failure counts, latencies) and finished-forward records of many
    forwards (a generation's layer forwards), handed on together: one
    ``record_holder_outcomes`` transaction and one ``router.hooks.emit_forwards`` (receipt
    sampling, settlement) per ``flush`` instead of one of each per layer and decode step,
    which competed with the decode for the site's cores and its database thread.

    ``add`` flushes by itself once ``flush_s`` seconds passed since the last flush, so a long
    generation's reputations and settlements lag by at most that; the owner calls ``close``
    at the end (also when the generation failed or was cancelled): it flushes, and any forward
    still finishing afterwards (a cancelled generation's worker thread runs on) is handed on at
    once. Used on the event loop only.
    """

    def __init__(self, flush_s: float = 5.0):
        self.flush_s = flush_s
        self.failures: dict[str, int] = {}
        self.latencies: dict[str, list[float]] = {}
        self.records: list[ForwardRecord] = []
        self.closed = False
        self._flushed_at = time.monotonic()

    def add(self, failures: list[dict], latencies: dict[str, list[float]], record: ForwardRecord | None) -> None:
        """Add one forward's ``failures`` (those with ``fault`` count), ``latencies`` (ms per
        provider) and its ``record`` (None: the forward failed)."""
        for f in failures:
            if f.get("fault"):
                self.failures[f["provider"]] = self.failures.get(f["provider"], 0) + 1
        for p, ms in latencies.items():
            self.latencies.setdefault(p, []).extend(ms)
        if record is not None:
            self.records.append(record)
        if self.closed or time.monotonic() - self._flushed_at >= self.flush_s:
            self.flush()

    def flush(self) -> None:
        """Start recording what was added (background tasks on the running loop) and empty it."""
        self._flushed_at = time.monotonic()
        failures, latencies, records = self.failures, self.latencies, self.records
        self.failures, self.latencies, self.records = {}, {}, []
        _record_counts_later(failures, latencies)
        emit_forwards(records)

    def close(self) -> None:
        """Flush, and from now on hand every added forward on at once."""
        self.closed = True
        self.flush()


async def _gate(model_id: str, layer: int) -> Gate:
    """``load_gate`` without a thread hop while its blob hash is fresh in the TTL cache."""
    h = _fresh(("gate", model_id, layer))
    if h is not None:
        with _gate_lock:
            gate = _gate_cache.get(h)
        if gate is not None:
            return gate
    return await database_sync_to_async(load_gate)(model_id, layer)


async def _view(model_id: str, excluded: frozenset) -> ShardView:
    """``live_view``, without a thread hop while the provider rows are fresh in the TTL cache
    (building the view from them is pure and cheap); a DB read on the site's DB thread else."""
    infos = _fresh(("infos", model_id))
    if infos is None:
        return await database_sync_to_async(live_view)(model_id, excluded)
    return ShardView.build(model_id, [p for p in infos[0] if p.provider not in excluded],
                           policy=ReplicationPolicy(), expected=infos[1])


async def _recorded_forward(outcomes: ForwardOutcomes | None = None, **kwargs):
    """``distributed_forward`` over ``send_batch`` with the site's deadlines and holder scoreboard
    (a request past ``BATCH_DEADLINE`` may still answer first until ``BATCH_TIMEOUT``), under a
    forward slot of ``router.admission`` (``Busy`` when none is free in time, or when the forward
    failed only because deadlines expired while this router was saturated); each
    holder's failures and latencies are recorded afterwards, also when the forward fails.
    A successful forward gets a fresh ``forward_id`` (set on the result) and is handed to the
    forward listeners (``router.hooks``: receipt sampling, settlement) in the background.
    With ``outcomes`` the outcomes and the record are added there instead (``ForwardOutcomes``)."""
    t = settings.TENZRO
    admission = Admission.current()
    try:
        async with admission.slot():  # raises Busy (-32005) at once past the concurrency and queue bounds
            res = await distributed_forward(send=send_batch, deadline_s=t["BATCH_DEADLINE_S"],
                                            attempt_timeout_s=t["BATCH_TIMEOUT_S"], scoreboard=scoreboard,
                                            saturated=admission.saturated_since,
                                            split_threshold=t["PLAN_SPLIT_THRESHOLD"], **kwargs)
    except ForwardError as exc:
        failures = exc.data.get("failures", [])
        if outcomes is not None:
            outcomes.add(failures, {}, None)
        else:
            _record_later(failures, {})
        if exc.kind == "execution" and overloaded(failures):
            raise Busy(f"the router is saturated: {exc.message}", "capacity", max(1.0, t["BATCH_DEADLINE_S"])) \
                from exc
        raise
    res.forward_id = uuid.uuid4().hex
    record = ForwardRecord(res.forward_id, kwargs["model_id"], kwargs["layer"], res.verified)
    if outcomes is not None:
        outcomes.add(res.failures, res.latencies_ms, record)
    else:
        _record_later(res.failures, res.latencies_ms)
        emit_forwards([record])
    return res


def _record_later(failures: list[dict], latencies: dict) -> None:
    """Record holder outcomes in the background: the caller's answer does not wait on the DB."""
    counts: dict[str, int] = {}
    for f in failures:
        if f.get("fault"):
            counts[f["provider"]] = counts.get(f["provider"], 0) + 1
    _record_counts_later(counts, latencies)


def _record_counts_later(counts: dict[str, int], latencies: dict) -> None:
    """``record_holder_outcomes(counts, latencies)`` as a background task of the running loop."""
    if counts or latencies:
        task = asyncio.get_running_loop().create_task(database_sync_to_async(record_holder_outcomes)(counts, latencies))
        _recording.add(task)
        task.add_done_callback(_recording.discard)


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


def _published_gate_on_demand(p: dict) -> None:
    """Load the published gate of ``tenzro_moeRoute``'s (model_id, layer) into the site's runtime
    when it holds none for that layer (a gate an operator loaded stays). Params that are not a
    string model_id and an integer layer are left for ``methods.call`` to report; a layer with
    no published gate keeps its "no gate is loaded" error."""
    model_id, layer = p.get("model_id"), p.get("layer")
    if not isinstance(model_id, str) or isinstance(layer, bool) or not isinstance(layer, int) \
            or not 0 <= layer < 2**31:
        return
    rt = site_runtime()
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
        return await asyncio.to_thread(methods.call, site_runtime(), method, params, site_fetch)
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


__all__ = ["ForwardError", "ForwardOutcomes", "GateNotLoaded", "call_method", "dense_forward", "forward", "live_view", "load_gate",
           "send_batch", "send_to_agent", "send_ws", "site_fetch", "site_runtime"]


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
