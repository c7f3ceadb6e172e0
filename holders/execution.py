"""The agent's execution of batches: decode the carrier rows, run the expert FFN, encode the
output, sign a receipt (``moe.receipts``), on the agent's compute threads. Serves every
transport: the site socket (whole and streamed ``batch`` frames), the HTTP endpoint
(``moe.transports.http``: ``POST /rpc``, ``POST /frame``) and the iroh endpoint
(``moe.transports.iroh``), plus the relayed execution methods (``moe.methods``). Drill
faults (``moe.faults``) act here. Imports nothing from Django.
"""
from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import Executor
from typing import Callable

import numpy as np
from nacl.signing import SigningKey

from moe import messages, methods, wire
from moe.faults import FaultInjector
from moe.jsonrpc import EXECUTION_ERROR, INTERNAL_ERROR, INVALID_PARAMS, METHOD_NOT_FOUND, RpcError
from moe.receipts import make_entry, make_seal
from moe.runtime import ExpertNotLoaded, ExpertRuntime, RuntimeFault

log = logging.getLogger("tenzro.agent")


def _rpc_failure(exc: BaseException) -> tuple[int, str]:
    """(JSON-RPC code, message) answering one failed request of a ``batch``."""
    if isinstance(exc, RpcError):
        return exc.code, exc.message
    if isinstance(exc, ExpertNotLoaded):
        return EXECUTION_ERROR, str(exc)
    if isinstance(exc, (RuntimeFault, wire.WireError, KeyError, TypeError, ValueError)):
        return INVALID_PARAMS, str(exc)
    log.error("batch request failed", exc_info=exc)
    return INTERNAL_ERROR, f"internal error: {type(exc).__name__}"


def _row_count(req: dict) -> int:
    """Token rows of an execute request (0 when ``token_indices`` is not a list: it fails alone later)."""
    tokens = req.get("token_indices")
    return len(tokens) if isinstance(tokens, list) else 0


def message_work(reqs: list[dict], limit: int) -> bool:
    """Whether the execute headers ``reqs`` hold at most ``limit`` rows x d_model in all (a
    malformed ``d_model`` counts as more: it fails in a compute thread as before)."""
    work = 0
    for req in reqs:
        d = req.get("d_model") if isinstance(req, dict) else None
        if not isinstance(d, int) or isinstance(d, bool) or d <= 0:
            return False
        work += _row_count(req) * d
        if work > limit:
            return False
    return True


def _answer(header: dict, outcome) -> tuple[dict, bytes]:
    """One request's (reply or failure header, output bytes) from its ``execute_stream`` outcome."""
    if isinstance(outcome, BaseException):
        return messages.failure(header.get("id"), *_rpc_failure(outcome)), b""
    return messages.reply(header.get("id"), **outcome[0]), outcome[1]


class Execution:
    """Executes batches for one agent and answers the execution methods.

    ``key``: the provider's signing key (receipts); ``provider``: its id; ``runtime``: the
    experts held; ``faults``: the drill injector; ``compute``: the pool batches run on, with
    ``compute_threads`` workers; ``fetch(uri) -> bytes``: blob source of the relayed
    ``load`` methods; ``inline_work``: ``AgentConfig.inline_work``.
    """

    def __init__(self, key: SigningKey, provider: str, runtime: ExpertRuntime, faults: FaultInjector,
                 compute: Executor, compute_threads: int, fetch: Callable[[str], bytes], inline_work: int = 0):
        self.key = key
        self.provider = provider
        self.runtime = runtime
        self.faults = faults
        self.compute = compute
        self.compute_threads = compute_threads
        self.fetch = fetch
        self.inline_work = inline_work

    def blob_identity(self, model_id: str, layer: int, expert: int) -> tuple[str, str]:
        """(blob hash, quant kind) of a held expert, for its receipts; ("", "unknown") when not held."""
        held = self.runtime._held.get((model_id, layer, expert))
        return (held.blob_hash, held.quant or "f32") if held is not None else ("", "unknown")

    def _execute_sync(self, req: dict, carrier: str, payload: bytes) -> tuple[dict, bytes]:
        """Execute one batch and sign its receipt, in the calling (compute) thread (``_execute``
        with a single receipt). Same returns and errors as ``_execute``, without the leaf."""
        return self._execute(req, carrier, payload)[:2]

    def _execute(self, req: dict, carrier: str, payload: bytes,
                 index: int | None = None) -> tuple[dict, bytes, bytes]:
        """Execute one batch and make its receipt, in the calling (compute) thread: a signed single
        receipt, or with ``index`` (its position in a sealed message) an unsigned message entry.

        ``req``: ``request_id, model_id, layer, expert, token_indices, d_model, output?,
        purpose?`` (``purpose`` other than "serve" is not metered); ``payload`` the carrier
        bytes (``carrier`` "f32", "f16" or "q8_0"). Returns (answer fields ``{rows, d_model,
        output, token_indices, receipt}``, output bytes, the receipt's leaf). Raises ``RpcError`` (-32602: a bad
        model_id, layer, expert, d_model or token index, ``methods.execute_key``), ``wire.WireError`` (also
        rows whose outputs overflow float32, field ``hidden_states``),
        ``RuntimeFault`` (``ExpertNotLoaded``, ``DimensionMismatch``, ...) or ``ValueError``.
        """
        model_id, layer, expert, d_model, tokens = methods.execute_key(req)
        if not isinstance(req.get("request_id"), str) or not req["request_id"]:
            raise wire.WireError("request_id must be a non-empty string", "request_id")
        output = req.get("output", "f32")
        purpose = req.get("purpose", "serve")
        if purpose not in methods.PURPOSES:  # any other value would run the batch unmetered
            raise wire.WireError(f"purpose must be one of {', '.join(methods.PURPOSES)}", "purpose")
        metered = purpose == "serve"  # disputes and self-tests are not metered
        if carrier not in wire.CARRIERS:
            raise wire.WireError(f"unsupported carrier {carrier!r}")
        if output not in wire.OUTPUTS:
            raise wire.WireError(f"unsupported output encoding {output!r}")
        self.faults.before_batch()
        rows = wire.decode_rows(payload, carrier, d_model, len(tokens))
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused just below, naming it
            out = self.runtime.execute(model_id, layer, expert, rows, len(tokens), d_model, metered)
        if not np.isfinite(out).all():
            # Finite rows of huge magnitude overflow any honest copy of the expert: refuse the
            # request (the router records a rejection) rather than answer Inf rows, which it
            # would count as this holder's fault.
            raise wire.WireError(f"expert {model_id} l{layer}/e{expert}'s outputs overflow float32 (NaN or Inf) "
                                 "for these rows: hidden_states' magnitude is too large", "hidden_states")
        lie = self.faults.corrupt(out) if metered else None
        out = out if lie is None else lie
        output = wire.output_encoding(out, output)  # f16 asked, a value beyond its range: f32
        data = wire.encode_rows(out, output)
        sent = out if output == "f32" else wire.decode_rows(data, output, d_model, len(tokens), "outputs")
        blob_hash, quant = self.blob_identity(model_id, layer, expert)
        receipt, leaf = make_entry(self.key, request_id=req["request_id"], model_id=model_id, layer=layer,
                                   expert=expert, tokens=tokens, carrier_kind=carrier, carrier=payload, rows=sent,
                                   blob_hash=blob_hash, quant=quant, index=index)
        return ({"rows": len(tokens), "d_model": d_model, "output": output, "token_indices": tokens,
                 "receipt": receipt}, data, leaf)

    async def execute_request(self, req: dict, carrier: str, payload: bytes) -> tuple[dict, bytes]:
        """``_execute_sync`` on the compute pool (socket and HTTP transports): numpy/BLAS
        releases the GIL, and off the event loop heartbeats keep flowing. Same returns and errors."""
        return await asyncio.get_running_loop().run_in_executor(self.compute, self._execute_sync, req, carrier,
                                                                payload)

    async def execute_stream(self, items: list[tuple[dict, str, bytes]], leaves: list | None = None):
        """Several batches (``execute_request``'s arguments each) in one hop to the compute pool
        per compute thread (round-robin, so several threads still run them side by side); an
        async iterator of (index, outcome) in the order they finish, the outcome being (answer
        fields, output bytes) or the exception it raised, so one failing request fails only
        itself and each answer can leave before the next batch is done. Under the
        ``blackhole`` drill it never answers.

        ``leaves`` (a list of ``len(items)`` Nones): the batches of one sealed message; each
        success gets an unsigned message entry (its index in ``items``) and its leaf is written
        to ``leaves[i]`` before its outcome is yielded, for ``make_seal`` once all are in.

        A small message (``small``: a decode step's few rows) runs on the event loop itself:
        two thread hand-offs per message cost more than its products on a loaded machine. A
        compute thread hands each outcome back as soon as it is done."""
        if self.faults.blackhole:
            await asyncio.Event().wait()
        # Largest batches first: the last to finish is a small one, whose answer the router
        # checks quickly, so less of the forward waits on one core after the rest are done.
        order = sorted(range(len(items)), key=lambda i: -_row_count(items[i][0]))

        def one(i: int):
            try:
                fields, data, leaf = self._execute(*items[i], index=None if leaves is None else i)
                if leaves is not None:
                    leaves[i] = leaf
                return i, (fields, data)
            except Exception as exc:  # noqa: BLE001 (each request gets its own answer)
                return i, exc

        if self.small([req for req, _carrier, _payload in items]):
            for i in order:
                yield one(i)
            return
        loop = asyncio.get_running_loop()
        done: asyncio.Queue = asyncio.Queue()

        def post(outcomes: list) -> bool:
            try:
                loop.call_soon_threadsafe(done.put_nowait, outcomes)
                return True
            except RuntimeError:  # the loop closed (agent stopping): nobody waits for it
                return False

        def run(indices: list[int]) -> None:
            # Each outcome goes back as soon as it is done: holding a fast answer for the next
            # batch's sake would make it wait on that batch's whole compute.
            for i in indices:
                if not post([one(i)]):
                    return

        hops = max(1, min(self.compute_threads, len(items)))
        for h in range(hops):
            loop.run_in_executor(self.compute, run, order[h::hops])
        left = len(items)
        while left:
            for outcome in await done.get():
                left -= 1
                yield outcome

    async def execute_many(self, items: list[tuple[dict, str, bytes]], leaves: list | None = None) -> list:
        """``execute_stream``'s outcomes collected in the order of ``items`` (``leaves`` as there)."""
        out: list = [None] * len(items)
        async for i, outcome in self.execute_stream(items, leaves):
            out[i] = outcome
        return out

    async def execute_batch(self, header: dict, payload: bytes) -> tuple[dict, bytes]:
        """A coalesced ``batch`` message (``messages.split_batch``) through ``execute_many``, each
        request answered on its own (reply with receipt, or failure with a JSON-RPC code: -32004
        expert not held, -32602 bad request, -32603 a bug). A batch asking for a message receipt
        (``messages.wants_seal``) gets message entries and one seal (``moe.receipts.make_seal``)
        in the reply. Returns ``messages.batch_reply``'s (header, payload). Raises
        ``wire.WireError`` when the batch itself is malformed."""
        subs = messages.split_batch(header, payload)
        leaves = [None] * len(subs) if messages.wants_seal(header) else None
        outcomes = await self.execute_many([({**h, "request_id": h.get("id")}, h.get("carrier", "f32"), data)
                                            for h, data in subs], leaves)
        return messages.batch_reply(header.get("id"), [_answer(h, o) for (h, _), o in zip(subs, outcomes)],
                                    seal=None if leaves is None else make_seal(self.key, leaves))

    def small(self, reqs: list[dict]) -> bool:
        """Whether a message of the execute headers ``reqs`` runs on the event loop
        (``inline_work``; never under a drill fault, which may stall)."""
        return self.inline_work > 0 and self.faults.fault is None and message_work(reqs, self.inline_work)

    def answers_whole(self, header: dict) -> bool:
        """Whether a ``batch`` asking for streamed answers is better answered whole: a small
        message (``small``) runs in one go on the event loop, so streaming would only
        add a frame, and the router's handling of it, per request (a router reads a whole
        answer to a streamed batch as such: ``moe.messages``). False for a malformed batch
        (``stream_batch`` reports it)."""
        reqs = header.get("requests")
        return isinstance(reqs, list) and bool(reqs) and self.small(reqs)

    async def stream_batch(self, header: dict, payload: bytes):
        """A coalesced ``batch`` answered request by request as each finishes: an async iterator
        of ``messages.batch_part`` (header, output bytes), ``more: false`` on the last, which
        carries the message's seal when the batch asks for one (``messages.wants_seal``: the seal
        needs every leaf, so it goes last). Raises ``wire.WireError`` (before yielding anything)
        when the batch is malformed."""
        subs = messages.split_batch(header, payload)
        left = len(subs)
        leaves = [None] * len(subs) if messages.wants_seal(header) else None
        async for i, outcome in self.execute_stream([({**h, "request_id": h.get("id")}, h.get("carrier", "f32"),
                                                      data) for h, data in subs], leaves):
            left -= 1
            seal = make_seal(self.key, leaves) if leaves is not None and not left else None
            yield messages.batch_part(header.get("id"), _answer(subs[i][0], outcome), more=left > 0, seal=seal)

    async def execute_stream_rpc(self, items: list[tuple[dict, str, bytes]], sealed: bool = False):
        """``execute_stream`` for the iroh endpoint: failures as ``RpcError`` (as ``execute_rpc``).
        ``sealed``: the items are one message asking for a message receipt: unsigned entries, then
        ``(None, seal)`` after the last answer (``moe.receipts.make_seal``)."""
        leaves = [None] * len(items) if sealed else None
        async for i, outcome in self.execute_stream(items, leaves):
            yield i, RpcError(*_rpc_failure(outcome)) if isinstance(outcome, BaseException) else outcome
        if leaves is not None:
            yield None, make_seal(self.key, leaves)

    async def execute_rpc(self, req: dict, carrier: str, payload: bytes) -> tuple[dict, bytes]:
        """``execute_request`` for the HTTP and iroh endpoints: its errors as ``RpcError``
        (-32004 the expert is not held here, -32602 anything wrong with the request, ``data.field``
        naming the parameter at fault, else "params"). Under the
        ``blackhole`` drill it never answers."""
        if self.faults.blackhole:
            await asyncio.Event().wait()
        try:
            return await self.execute_request(req, carrier, payload)
        except ExpertNotLoaded as exc:
            raise RpcError(EXECUTION_ERROR, str(exc), field="expert") from exc
        except (RuntimeFault, wire.WireError, KeyError, TypeError, ValueError) as exc:
            raise RpcError(INVALID_PARAMS, str(exc), field=getattr(exc, "field", None) or "params") from exc

    async def status(self) -> dict:
        """``moe/status``: this provider's id and its runtime's status."""
        return {"provider": self.provider, **await asyncio.to_thread(self.runtime.status)}

    async def http_frame(self, header: dict, payload: bytes) -> tuple[dict, bytes]:
        """Binary execute over HTTP (``POST /frame``): the socket's frame format, no base64.
        Raises ``RpcError`` (a malformed batch, an unknown type, ``execute_rpc``'s errors)."""
        if header.get("type") == "batch":
            try:
                batch_header, out = await self.execute_batch(header, payload)
            except wire.WireError as exc:
                raise RpcError(INVALID_PARAMS, str(exc), field="requests") from exc
            return {k: v for k, v in batch_header.items() if k not in ("id", "ok")}, out
        if header.get("type") != "execute":
            raise RpcError(METHOD_NOT_FOUND, f"unknown request type {header.get('type')!r}")
        return await self.execute_rpc({**header, "request_id": header.get("id")}, header.get("carrier", "f32"),
                                      payload)

    def http_stream(self, header: dict, payload: bytes):
        """Streamed binary batch over HTTP (``POST /frame`` with ``stream: true``): ``stream_batch``."""
        return self.stream_batch(header, payload)

    async def http_rpc(self, method: str, params: dict) -> dict:
        """JSON-RPC handler of the HTTP endpoint (``moe.transports.http``): ``tenzro_moeExecute`` /
        ``moe/execute`` and ``moe/status`` / ``tenzro_moeExpertStatus``. Raises ``RpcError``."""
        if method in ("tenzro_moeExecute", "moe/execute"):
            try:
                carrier, payload = wire.carrier_in_params(params)
            except wire.WireError as exc:
                raise RpcError(INVALID_PARAMS, str(exc), field=exc.field or "hidden_states") from exc
            answer, data = await self.execute_rpc(params, carrier, payload)
            return {"model_id": params["model_id"], "layer": params["layer"], "expert": params["expert"],
                    "token_indices": answer["token_indices"], "d_model": answer["d_model"],
                    "output": answer["output"], "outputs": wire.b64encode(data), "receipt": answer["receipt"]}
        if method in ("moe/status", "tenzro_moeExpertStatus"):
            return await self.status()
        raise RpcError(METHOD_NOT_FOUND, f"unknown method {method!r}", field="method")

    async def relayed_rpc(self, header: dict, payload: bytes) -> dict:
        """A relayed execution method (``rpc`` frame: ``method`` in the header, JSON params as the
        payload): ``{"result": ...}`` or ``{"error": {code, message, data}}``; never raises ``RpcError``."""
        method = header.get("method")
        try:
            if method not in methods.METHODS:
                raise RpcError(METHOD_NOT_FOUND, f"method {method!r} not found", field="method")
            try:
                params = json.loads(payload or b"{}")
            except json.JSONDecodeError as exc:
                raise RpcError(INVALID_PARAMS, f"params are not JSON: {exc}", field="params") from exc
            result = await asyncio.to_thread(methods.call, self.runtime, method, params, self.fetch)
        except RpcError as exc:
            return {"error": exc.to_json()}
        return {"result": result}
