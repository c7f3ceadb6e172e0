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
from moe.handoff import FRAME_ROLES, HandoffError, RoleRunner
from moe.identity import provider_id
from moe.jsonrpc import RpcError
from moe.runtime import ExpertRuntime, RuntimeFault
from moe.transports import iroh
from moe.transports.http import serve_http
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
        # Compile while connecting (what is declared meanwhile: ExpertLoader.declarable); a black
        # hole never computes.
        self.loader.start_kernel_warmup(skip=self.faults.blackhole)

    def _declarable(self) -> list[dict]:
        return self.loader.declarable(self.runtime.holdings())

    def _advertised(self) -> dict:
        """The heartbeat's endpoint fields (the iroh endpoint exists only while ``run()`` serves it)."""
        return {"http_endpoint": self.config.http_endpoint,
                "iroh_endpoint_id": self.iroh.endpoint_id if self.iroh else "",
                "iroh_addrs": list(self.iroh.addrs) if self.iroh else [],
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
        server = (await serve_http(self.execution.http_rpc, cfg.http_host, cfg.http_port, self.execution.http_frame,
                                   self.execution.http_stream)
                  if cfg.http_port else None)
        if cfg.iroh_bind is not None:
            self.iroh = await iroh.IrohServer(iroh.endpoint_secret(self.key.encode()), cfg.iroh_bind,
                                              self.execution.execute_rpc, self.execution.status,
                                              self.execution.execute_stream_rpc).start()
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

    async def handle(self, header: dict, payload: bytes) -> None:
        """Answer one (reassembled) request frame from the site through the part it is for
        (``execute``/``batch``: execution, ``load``: loader, ``repair``, Prefill/Decode roles,
        ``rpc``: relayed methods); every request gets a reply (a failure names the error class),
        except under the ``blackhole`` drill, which never answers a batch."""
        reply = self.session.reply
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
