"""The holder agent: a process that holds experts and executes the batches routers send it.

``HolderAgent`` composes parts with one job each:

- ``holders.session.SiteSession``: the ``/ws/agent/`` socket (nonce-signed hello, signed
  heartbeats on a timer and after every tier change, reconnect with backoff);
- ``holders.execution.Execution``: batches in, expert FFN outputs and signed receipts out,
  for the socket, the HTTP endpoint (``http_port``) and the iroh endpoint (``iroh_bind``);
- ``holders.fetch.ExpertLoader``: ``tenzro://blob/<hash>`` fetches (BLAKE3 checked), loads
  the site asks for, and kernel and per-expert warm-up before an expert is declared;
- ``holders.repair.RepairWorker``: pull-based repair, on the site's offers and on its own timer;
- ``moe.handoff.RoleRunner``: Prefill/Decode frames (the backbone runs here, MLP layers on
  the site).

The runtime's memory tier is bounded (``memory_budget``) over a disk tier; the compute
backend is the one selected at start (``moe.compute``) and ``moe_gpu`` is advertised from it.
Imports nothing from Django.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from holders.config import AgentConfig
from holders.execution import Execution
from holders.fetch import ExpertLoader
from holders.repair import RepairWorker
from holders.session import AuthRefused, HeartbeatTooLarge, KeyInUse, SiteSession, ws_url
from moe import compute, messages, wire
from moe.blobs import BlobStore
from moe.content import BlobError
from moe.faults import FaultInjector
from moe.handoff import FRAME_ROLES, PEER_CHUNK, HandoffError, RoleRunner, kv_chunk_message
from moe.identity import DOMAIN_KV_HANDOFF, provider_id, sign
from moe.jsonrpc import INVALID_PARAMS, RpcError
from moe.messages import HolderFault
from moe.runtime import ExpertRuntime, RuntimeFault
from moe.transports import iroh
from moe.transports.http import HttpHolderClient, serve_http
from websockets.exceptions import ConnectionClosed

__all__ = ["AgentConfig", "AuthRefused", "HeartbeatTooLarge", "HolderAgent", "KeyInUse", "ws_url"]

log = logging.getLogger("tenzro.agent")


class HolderAgent:
    """One holder process. ``run()`` runs until ``stop()`` or a refusal by the site.

    ``config``: its settings (``AgentConfig``). ``runtime``: the expert runtime to use
    (default: a new ``ExpertRuntime`` with ``config.memory_budget`` over ``config.tier_dir``
    on the selected compute backend; benches pass a memory-only one). Raises ``ValueError``
    (a malformed ``site``, ``iroh_bind`` without the iroh package, a malformed
    ``TENZRO_MEMORY_BUDGET``) or ``OSError`` (a blob or disk directory that cannot be made).

    Parts (shared objects, not copies): ``session``, ``execution``, ``loader``, ``repair``,
    ``generation``; ``runtime``, ``store``, ``backend``, ``faults``. ``iroh``: the iroh
    server while ``run()`` serves one.
    """

    def __init__(self, config: AgentConfig, runtime: ExpertRuntime | None = None):
        self.config = config
        self.key = config.key
        self.provider = provider_id(config.key)
        if config.iroh_bind is not None and not iroh.available():
            raise ValueError(f"--iroh: {iroh.UNAVAILABLE}")
        self.iroh: iroh.IrohServer | None = None
        self.store = BlobStore(config.blob_dir)
        self.backend = compute.backend()
        self.runtime = runtime if runtime is not None else ExpertRuntime(config.memory_budget, config.tier_dir,
                                                                         backend=self.backend)
        self.faults = FaultInjector(config.fault)  # drill mode (moe.faults): off unless asked for
        if config.fault is not None:
            log.warning("DRILL FAULT ENABLED: this agent will %s", {
                "corrupt": f"sign perturbed rows for {config.fault.value:.0%} of its batches",
                "stall": f"stall {config.fault.value:g} s per batch",
                "blackhole": "declare every expert Warm and never answer a batch"}[config.fault.kind])
        self._stopping = asyncio.Event()
        self.session = SiteSession(config, self._declarable, self._advertised, self.faults, self.handle,
                                   self._stopping)
        self._compute = ThreadPoolExecutor(max_workers=config.compute_threads, thread_name_prefix="compute")
        self.loader = ExpertLoader(config.site_base, self.store, self.runtime, self.backend, self._compute,
                                   self.session.tier_changed)
        self.execution = Execution(self.key, self.provider, self.runtime, self.faults, self._compute,
                                   config.compute_threads, self.loader.fetch, config.inline_work)
        self.runtime.add_listener(self.session.tier_changed)
        # Repair (docs/DESIGN.md §8): passes on the site's offers, and on its own timer without them.
        self.repair = RepairWorker(config.site_base, self.provider, self.runtime, self.store,
                                   interval_s=config.repair_interval_s, release_grace_s=config.repair_release_grace_s)
        self.generation = RoleRunner(config.roles, config.site_base, self.loader.fetch,
                                     lambda: self.session.max_message)
        self._peer_http: HttpHolderClient | None = None  # KV handoffs sent peer to peer (kv_send)
        self._peer_iroh: iroh.IrohHolderClient | None = None
        # Compile while connecting (what is declared meanwhile: ExpertLoader.declarable); a black
        # hole never computes.
        self.loader.start_kernel_warmup(skip=self.faults.blackhole)

    def _declarable(self) -> list[dict]:
        return self.loader.declarable(self.runtime.holdings())

    def _advertised(self) -> dict:
        """The heartbeat's endpoint fields (the iroh endpoint exists only while ``run()`` serves it)."""
        return {"http_endpoint": self.config.http_endpoint,
                "iroh_endpoint_id": self.iroh.endpoint_id if self.iroh else "",
                "iroh_addrs": (list(self.config.advertise_iroh) or list(self.iroh.addrs)) if self.iroh else [],
                "moe_gpu": bool(self.backend.gpu)}

    def stop(self) -> None:
        """Ask ``run()`` to return after closing the socket."""
        self._stopping.set()

    async def run(self) -> None:
        """Serve the HTTP and iroh endpoints (when configured), run own repair passes, and hold
        the site session (``SiteSession.run``: reconnects with backoff) until ``stop()``.

        Raises ``AuthRefused`` / ``KeyInUse`` (the site refused this agent) and ``OSError``
        (the HTTP or iroh address is taken).
        """
        cfg = self.config
        server = (await serve_http(self.execution.http_rpc, cfg.http_host, cfg.http_port, self.http_frame,
                                   self.execution.http_stream)
                  if cfg.http_port else None)
        if cfg.iroh_bind is not None:
            self.iroh = await iroh.IrohServer(iroh.endpoint_secret(self.key.encode()), cfg.iroh_bind,
                                              self.execution.execute_rpc, self.execution.status,
                                              self.execution.execute_stream_rpc,
                                              methods={"moe/kv_put": self.iroh_kv_put}).start()
            log.info("iroh endpoint %s on %s", self.iroh.endpoint_id, ", ".join(self.iroh.addrs))
        own_repair = asyncio.create_task(self.repair.own_passes(self._stopping))
        try:
            await self.session.run()
        finally:
            own_repair.cancel()
            if server is not None:
                server.close()
            if self.iroh is not None:
                await self.iroh.close()
            for client in (self._peer_http, self._peer_iroh):
                if client is not None:
                    await client.close()

    # -- KV handoff peer to peer (moe.handoff) ---------------------------------------------------

    async def http_frame(self, header: dict, payload: bytes) -> tuple[dict, bytes]:
        """``POST /frame``: a Prefill agent's signed ``kv_put`` chunk (``RoleRunner.peer_put``),
        else the execution frames. Raises ``RpcError``."""
        if header.get("type") != "kv_put":
            return await self.execution.http_frame(header, payload)
        try:
            return await asyncio.to_thread(self.generation.peer_put, header, payload), b""
        except HandoffError as exc:
            raise RpcError(INVALID_PARAMS, str(exc), field="kv_put") from exc

    async def iroh_kv_put(self, params: dict, peer: str) -> dict:
        """iroh ``moe/kv_put``: ``params`` as the HTTP frame's header plus ``data`` (base64 of the
        chunk). Raises ``RpcError``."""
        try:
            chunk = wire.b64decode(params.get("data") or "", "data")
            return await asyncio.to_thread(self.generation.peer_put, params, chunk)
        except (HandoffError, wire.WireError) as exc:
            raise RpcError(INVALID_PARAMS, str(exc), field="kv_put") from exc

    async def kv_send(self, header: dict) -> dict:
        """The site's ``kv_send``: send the handoff of ``header["session"]`` to the Decode agent
        ``header["to"]`` (``{provider, http_endpoint, iroh_endpoint_id, iroh_addrs}``) in signed
        chunks of at most ``PEER_CHUNK`` bytes, over iroh when both ends serve it (HTTP when iroh
        cannot connect), else HTTP. Returns ``{bytes, frames, transport, ms}``. Raises
        ``HandoffError`` (nothing to send, no reachable endpoint, the peer refused a chunk)."""
        session, to = str(header.get("session") or ""), header.get("to") or {}
        data = self.generation.outgoing(session)
        size = max(1, min(int(header.get("chunk") or PEER_CHUNK), PEER_CHUNK))
        frames = max(1, -(-len(data) // size))
        chunks = [data[i * size:(i + 1) * size] for i in range(frames)]
        heads = [{"type": "kv_put", "session": session, "index": i, "frames": frames, "from": self.provider,
                  "sig": sign(self.key, DOMAIN_KV_HANDOFF, kv_chunk_message(session, i, frames, c))}
                 for i, c in enumerate(chunks)]
        eid, addrs, http = to.get("iroh_endpoint_id"), list(to.get("iroh_addrs") or []), to.get("http_endpoint")
        t0 = time.perf_counter()
        transport = None
        if eid and addrs and self.iroh is not None and iroh.available():
            if self._peer_iroh is None:
                self._peer_iroh = iroh.IrohHolderClient(300.0, self.config.iroh_bind or "127.0.0.1:0")
            try:
                answers = await asyncio.gather(*(self._peer_iroh.call(eid, addrs, [iroh.pack(
                    {"jsonrpc": "2.0", "id": h["index"], "method": "moe/kv_put",
                     "params": {**h, "data": wire.b64encode(c)}})]) for h, c in zip(heads, chunks)))
                for msgs, _ in answers:
                    if "error" in msgs[0]:
                        raise HandoffError(f"the Decode agent refused a chunk: {msgs[0]['error'].get('message')}")
                transport = "iroh"
            except (ConnectionError, HolderFault) as exc:
                if not http:
                    raise HandoffError(f"cannot reach the Decode agent over iroh: {exc}") from exc
        if transport is None:
            if not http:
                raise HandoffError("the Decode agent advertises no HTTP or iroh endpoint to send the KV cache to")
            if self._peer_http is None:
                self._peer_http = HttpHolderClient(300.0)
            try:
                answers = await asyncio.gather(*(self._peer_http.frame(http, h, c) for h, c in zip(heads, chunks)))
            except (ConnectionError, HolderFault) as exc:
                raise HandoffError(f"cannot reach the Decode agent at {http}: {exc}") from exc
            for answer, _ in answers:
                if not answer.get("ok", True):
                    raise HandoffError(f"the Decode agent refused a chunk: {answer.get('message')}")
            transport = "http"
        self.generation.sent(session)
        return {"bytes": len(data), "frames": frames, "transport": transport,
                "ms": round((time.perf_counter() - t0) * 1e3, 3)}

    async def handle(self, header: dict, payload: bytes, reply=None) -> None:
        """Answer one (reassembled) request frame from the site through the part it is for
        (``execute``/``batch``: execution, ``load``: loader, ``repair``, Prefill/Decode roles,
        ``rpc``: relayed methods); every request gets a reply (a failure names the error class),
        except under the ``blackhole`` drill, which never answers a batch. ``reply(header,
        payload)``: sends on the socket the request came on (default: the main socket)."""
        reply = reply or self.session.reply
        req_id = header.get("id")
        try:
            kind = header.get("type")
            if kind in ("execute", "batch") and self.faults.blackhole:
                return  # the drill: never answer
            if kind == "batch" and header.get("stream") and not self.execution.answers_whole(header):
                async for part in self.execution.stream_batch(header, payload):
                    await reply(*part)
                return
            if kind == "batch":
                await reply(*await self.execution.execute_batch(header, payload))
                return
            if kind == "execute":
                answer, out = await self.execution.execute_request({**header, "request_id": req_id},
                                                                   header.get("carrier", "f32"), payload)
                await reply(messages.reply(req_id, **answer), out)
            elif kind == "load":
                await self.loader.load(header)
                await reply(messages.reply(req_id))
            elif kind == "repair":
                outcome = await asyncio.to_thread(self.repair.run_pass, json.loads(payload or b"{}"))
                await reply(messages.reply(req_id), json.dumps(outcome).encode())
            elif kind == "kv_send":
                if not any(r in self.generation.roles for r in FRAME_ROLES[kind]):
                    raise HandoffError(f"this agent's roles {list(self.generation.roles)} do not take 'kv_send' frames")
                await reply(messages.reply(req_id, **await self.kv_send(header)))
            elif kind in FRAME_ROLES:
                fields, out = await asyncio.to_thread(self.generation.handle, kind, header, payload)
                await reply(messages.reply(req_id, **fields), out)
            elif kind == "rpc":
                await reply(messages.reply(req_id),
                            json.dumps(await self.execution.relayed_rpc(header, payload)).encode())
            else:
                await reply(messages.failure(req_id, "bad_request", f"unknown request type {kind!r}"))
        except (RuntimeFault, wire.WireError, BlobError, HandoffError, ValueError, KeyError, TypeError) as exc:
            await reply(messages.failure(req_id, type(exc).__name__, str(exc)))
        except RpcError as exc:
            await reply(messages.failure(req_id, type(exc).__name__, exc.message))
        except ConnectionClosed:
            pass
        except Exception as exc:  # noqa: BLE001 (a request must be answered, not left to its caller's timeout)
            log.exception("request %r failed", req_id)
            await reply(messages.failure(req_id, "internal", f"{type(exc).__name__}: {exc}"))
