"""The holder agent: a process that holds experts and executes the batches routers send it.

It connects to the site's ``/ws/agent/``, proves its ed25519 identity by signing the site's
nonce, sends signed heartbeats with its holdings every ``heartbeat_interval`` seconds (and
right after every change), loads the experts it is asked to hold (fetching
``tenzro://blob/<hash>`` from the site's ``/blobs/<hash>`` and checking the BLAKE3 hash),
and answers execute requests with the expert FFN's output rows. The site also relays the
execution methods (``moe.methods``: load/unload of experts and gates, status, route,
execute) as ``rpc`` frames, answered from this agent's runtime. The runtime's memory tier
is bounded (``memory_budget``) over a disk tier (``disk_dir``, default ``<blob_dir>/tier``);
every tier change triggers a heartbeat so residency (Warm/Cold) and per-expert
``committed_tps`` reach the shard map at once. The compute backend is selected at start
and ``moe_gpu`` advertised from it. Execute answers carry a signed receipt
(``moe.receipts``); with ``http_port`` the agent also serves its own HTTP endpoint
(``moe.transports.http``), with ``iroh_bind`` an iroh QUIC endpoint
(``moe.transports.iroh``) whose id and direct addresses ride every heartbeat. It
reconnects with backoff when the site goes away.
Imports nothing from Django.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import numpy as np
from nacl.signing import SigningKey
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from moe import compute, messages, methods, wire
from moe.handoff import FRAME_ROLES, HandoffError, RoleRunner
from moe.identity import DOMAIN_HEARTBEAT, DOMAIN_HELLO, provider_id, sign, sign_body
from moe.faults import Fault, FaultInjector
from moe.receipts import make_receipt
from moe.runtime import ExpertNotLoaded, ExpertRuntime, RuntimeFault
from moe.transports import iroh
from moe.transports.http import serve_http
from moe.blobs import MAX_BLOB_BYTES, BlobStore, fetch_blob
from holders.repair import RepairWorker
from moe.content import BlobError
from moe.jsonrpc import EXECUTION_ERROR, INTERNAL_ERROR, INVALID_PARAMS, METHOD_NOT_FOUND, RpcError

log = logging.getLogger("tenzro.agent")

CLOSE_AUTH = 4401
WARM_ROWS = 64  # above the native and numba small-batch limits: the decode + BLAS path


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


def _answer(header: dict, outcome) -> tuple[dict, bytes]:
    """One request's (reply or failure header, output bytes) from its ``execute_stream`` outcome."""
    if isinstance(outcome, BaseException):
        return messages.failure(header.get("id"), *_rpc_failure(outcome)), b""
    return messages.reply(header.get("id"), **outcome[0]), outcome[1]


class HeartbeatTooLarge(ValueError):
    """The holdings do not fit the site's message cap even in the coarsest compact form."""


class AuthRefused(RuntimeError):
    """The site refused this agent's identity (close code 4401), or its configuration (4422:
    a heartbeat field such as ``name`` or a price), or its key stayed in use by another live
    session (4409) past the site's ``retry_for_s``; retrying will not help."""


class KeyInUse(AuthRefused):
    """Another live agent session holds this key (close code 4409); ``retry_for_s``: the
    site's seconds until that session would count as dead if its heartbeats stopped."""

    def __init__(self, message: str, retry_for_s: int):
        super().__init__(message)
        self.retry_for_s = retry_for_s


CLOSE_KEY_IN_USE = 4409
CLOSE_REFUSED = 4422


def ws_url(site: str) -> str:
    """``http(s)://host:port`` → ``ws(s)://host:port/ws/agent/``; raises ``ValueError`` for other schemes."""
    parts = urlsplit(site)
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None or not parts.netloc or not parts.hostname:
        raise ValueError(f"--site must be an http(s):// URL, got {site!r}")
    try:
        parts.port  # noqa: B018 (urlsplit validates the port lazily)
    except ValueError as exc:
        raise ValueError(f"--site {site!r}: {exc}") from exc
    return urlunsplit((scheme, parts.netloc, "/ws/agent/", "", ""))


class HolderAgent:
    """One holder process. ``run()`` runs until ``stop()`` or an authentication refusal.

    ``http_port``: also serve ``POST /rpc`` and ``POST /frame`` on ``http_host:http_port``
    and advertise it. ``iroh_bind``: also serve ``moe/execute``/``moe/status`` on an iroh
    endpoint bound to this ``host:port`` (its secret key derived from ``key``) and advertise
    its id and direct addresses; None = off. ``compute_threads``: threads running batches
    (decode, FFN, encode, receipt); one per core is plenty, and more only contend."""

    def __init__(self, site: str, key: SigningKey, blob_dir: str | Path, name: str = "",
                 heartbeat_interval: float = 15.0, roles: tuple[str, ...] = ("ExpertHolder",),
                 memory_budget: int | None = None, disk_dir: str | Path | None = None,
                 http_port: int | None = None, http_host: str = "127.0.0.1", iroh_bind: str | None = None,
                 compute_threads: int = 1,
                 fault: Fault | None = None, price_per_input_token: int = 10, minimum_price: int = 100):
        self.site = site.rstrip("/")
        self.url = ws_url(site)
        self.key = key
        self.provider = provider_id(key)
        self.store = BlobStore(blob_dir)
        self.name = name
        self.heartbeat_interval = heartbeat_interval
        self.roles = roles
        # Advertised pricing (signed in every heartbeat; settlement charges from it).
        self.price_per_input_token, self.minimum_price = int(price_per_input_token), int(minimum_price)
        self.backend = compute.backend()
        self.kernels_warm = threading.Event()
        self._warming: set[tuple[str, int, int]] = set()
        self._warmed_kinds: set[str | None] = set()  # quant kinds whose large-batch path ran once
        self._site_holdings: list[dict] = []  # what others declare (blackhole drill only)
        self.runtime = ExpertRuntime(memory_budget, Path(disk_dir) if disk_dir else Path(blob_dir) / "tier",
                                     backend=self.backend)
        self.runtime.add_listener(self._tier_changed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed = asyncio.Event()
        self._stop = asyncio.Event()
        self._ws = None
        self._send_lock = asyncio.Lock()
        self._last_ts = 0
        self._site_error: str | None = None  # the site's last error message (named in a 4422 refusal)
        self.max_message = 1 << 20  # the site's frame cap, updated from its welcome
        self.http_port = http_port
        self.http_host = http_host
        self.http_endpoint = f"http://{http_host}:{http_port}/rpc" if http_port else ""
        if iroh_bind is not None and not iroh.available():
            raise ValueError(f"--iroh: {iroh.UNAVAILABLE}")
        self.iroh_bind = iroh_bind
        self.iroh: iroh.IrohServer | None = None
        self.compute_threads = compute_threads
        self._compute = ThreadPoolExecutor(max_workers=compute_threads, thread_name_prefix="compute")
        # Repair (DESIGN §8): passes on the site's offers, and on its own timer without them.
        self.repair = RepairWorker(self.site, self.provider, self.runtime, self.store,
                                   interval_s=float(os.environ.get("TENZRO_REPAIR_INTERVAL") or 120),
                                   release_grace_s=float(os.environ.get("TENZRO_REPAIR_RELEASE_GRACE") or 600))
        self.faults = FaultInjector(fault)  # drill mode (moe.faults): off unless asked for
        if fault is not None:
            log.warning("DRILL FAULT ENABLED: this agent will %s", {
                "corrupt": f"sign perturbed rows for {fault.value:.0%} of its batches",
                "stall": f"stall {fault.value:g} s per batch",
                "blackhole": "declare every expert Warm and never answer a batch"}[fault.kind])
        # Prefill/Decode frames (moe.handoff): the backbone runs here, MLP layers on the site.
        self.generation = RoleRunner(roles, self.site, self.fetch, lambda: self.max_message)
        # JIT the quantized kernels while connecting, not on the first batch (heartbeat_message:
        # what is declared meanwhile).
        threading.Thread(target=self._warm_kernels, name="compute-warm", daemon=True).start()

    def _warm_kernels(self) -> None:
        try:
            if hasattr(self.backend, "warm") and not self.faults.blackhole:  # a black hole never computes
                self.backend.warm()
        except Exception:  # a failed warm-up only means the first batch compiles
            log.exception("compute warm-up failed")
        finally:
            self.kernels_warm.set()
            self._tier_changed()

    def stop(self) -> None:
        """Ask ``run()`` to return after closing the socket."""
        self._stop.set()

    async def run(self) -> None:
        """Connect, serve, and reconnect with exponential backoff (1 s … 30 s).

        Raises ``AuthRefused`` when the site closes with 4401.
        """
        self._loop = asyncio.get_running_loop()
        server = (await serve_http(self._http_rpc, self.http_host, self.http_port, self._http_frame,
                                        self._http_stream)
                  if self.http_port else None)
        if self.iroh_bind is not None:
            self.iroh = await iroh.IrohServer(iroh.endpoint_secret(self.key.encode()), self.iroh_bind,
                                              self.execute_rpc, self.status, self.execute_stream_rpc).start()
            log.info("iroh endpoint %s on %s", self.iroh.endpoint_id, ", ".join(self.iroh.addrs))
        own_repair = asyncio.create_task(self._repair_timer())
        try:
            await self._run_socket()
        finally:
            own_repair.cancel()
            if server is not None:
                server.close()
            if self.iroh is not None:
                await self.iroh.close()

    async def _repair_timer(self) -> None:
        """Own repair passes, every interval, when the site sent no offer for 1.5 intervals."""
        while not self._stop.is_set():
            await asyncio.sleep(self.repair.interval_s)
            if self.repair.due():
                try:
                    outcome = await asyncio.to_thread(self.repair.run_pass, None)
                    if outcome["accepted"] or outcome["released"]:
                        log.info("own repair pass: %s", outcome)
                except Exception:  # a failed pass must not stop the timer
                    log.exception("own repair pass failed")

    async def _run_socket(self) -> None:
        """Connect and serve until stopped, reconnecting with backoff. A 4409 refusal (the key
        is in use by another live session) is retried only until the site's ``retry_for_s``
        has passed since the first refusal: that covers a reconnect after a network drop the
        site has not noticed (the old session stops heartbeating and is then replaced), not
        a second agent started with the same key."""
        backoff = 1.0
        in_use_until: float | None = None
        while not self._stop.is_set():
            try:
                async with connect(self.url, max_size=None, ping_interval=20, ping_timeout=60,
                                   open_timeout=10) as ws:
                    self._ws = ws
                    backoff = 1.0
                    await self._session(ws)
            except KeyInUse as exc:
                now = time.monotonic()
                if in_use_until is None:
                    in_use_until = now + min(exc.retry_for_s, 300)
                if now >= in_use_until:
                    raise
                log.warning("%s; retrying until %.0f s from now (a stale session of ours may still be open)",
                            exc, in_use_until - now)
            except ConnectionClosed as exc:
                code = exc.rcvd.code if exc.rcvd is not None else None
                if code == CLOSE_AUTH:
                    raise AuthRefused(f"site refused this agent's identity: {exc.rcvd.reason or 'code 4401'}") from exc
                if code == CLOSE_REFUSED:
                    raise AuthRefused(f"site refused this agent: {self._site_error or exc.rcvd.reason}") from exc
                log.warning("socket closed: %s", exc)
            except (OSError, InvalidStatus, asyncio.TimeoutError) as exc:
                log.warning("cannot reach %s: %s", self.url, exc)
            finally:
                self._ws = None
            if self._stop.is_set():
                break
            try:
                await asyncio.wait_for(self._stop.wait(), backoff)
            except asyncio.TimeoutError:
                pass
            backoff = min(backoff * 2, 30.0)

    async def _session(self, ws) -> None:
        challenge = json.loads(await ws.recv())
        if challenge.get("type") != "challenge":
            raise ConnectionError(f"expected a challenge, got {challenge.get('type')!r}")
        nonce = bytes.fromhex(challenge["nonce"])
        await ws.send(json.dumps(messages.hello(self.provider, sign(self.key, DOMAIN_HELLO, nonce))))
        welcome = json.loads(await ws.recv())
        if welcome.get("type") == "error" and welcome.get("code") == CLOSE_KEY_IN_USE:
            retry_for = welcome.get("retry_for_s")
            raise KeyInUse(f"site refused this agent: {welcome.get('message')}",
                           retry_for if isinstance(retry_for, int) and retry_for > 0 else 60)
        if welcome.get("type") == "error" and welcome.get("code") == CLOSE_AUTH:
            raise AuthRefused(f"site refused this agent's identity: {welcome.get('message')}")
        if welcome.get("type") != "welcome":
            raise ConnectionError(f"site refused hello: {welcome.get('message', welcome)}")
        if isinstance(welcome.get("max_message"), int) and welcome["max_message"] > 0:
            self.max_message = welcome["max_message"]
        log.info("connected to %s as %s", self.site, self.provider)
        beat = asyncio.create_task(self._heartbeat_loop())
        stopper = asyncio.create_task(self._stop.wait())
        parts = wire.Reassembler()  # a request above the frame cap arrives in parts: act on it whole
        try:
            async for frame in ws:
                if isinstance(frame, bytes):
                    try:
                        msg = parts.feed(*wire.unpack_frame(frame))
                    except wire.WireError as exc:
                        log.warning("bad frame from site: %s", exc)
                        continue
                    if msg is not None:
                        asyncio.create_task(self._handle(*msg))
                else:
                    self._control(frame)
                if self._stop.is_set():
                    break
        finally:
            beat.cancel()
            stopper.cancel()

    def _control(self, text: str) -> None:
        msg = json.loads(text)
        if msg.get("type") == "error":
            self._site_error = msg.get("message")
            log.warning("site says: %s", msg.get("message"))

    def heartbeat_message(self) -> dict:
        """A freshly signed heartbeat with the current holdings in compact form
        (``messages.compact_holdings``), below the site's message cap: committed_tps is
        coarsened (rounded down) only when the exact figures would not fit. Timestamps
        strictly increase. Raises ``HeartbeatTooLarge`` when not even the coarsest form fits.

        An expert loaded but not yet run once (``_load``'s warm-up batch) is not declared
        yet, and while the kernels compile every holding is declared Cold, so no router plans
        a first-call compile inside its deadline; the ``blackhole`` drill declares everything
        (``FaultInjector.advertise``).
        """
        held = self.runtime.holdings()
        warming = set(self._warming)
        if warming:
            held = [h for h in held if (h["model_id"], h["layer"], h["expert"]) not in warming]
        if not self.kernels_warm.is_set():
            held = [{**h, "residency": "Cold"} for h in held]
        held = self.faults.advertise(held, self._site_holdings)
        for precision in range(len(messages.TPS_PRECISIONS)):
            ts = max(int(time.time() * 1000), self._last_ts + 1)
            body = {"provider": self.provider, "timestamp_ms": ts, "nonce": secrets.token_hex(16),
                    "name": self.name, "roles": list(self.roles), "http_endpoint": self.http_endpoint,
                    "iroh_endpoint_id": self.iroh.endpoint_id if self.iroh else "",
                    "iroh_addrs": list(self.iroh.addrs) if self.iroh else [],
                    "moe_gpu": bool(self.backend.gpu), "price_per_input_token": self.price_per_input_token,
                    "minimum_price": self.minimum_price, "holdings": messages.compact_holdings(held, precision)}
            msg = messages.heartbeat(body, sign_body(self.key, DOMAIN_HEARTBEAT, body))
            size = len(json.dumps(msg))
            if size <= self.max_message:
                self._last_ts = ts
                return msg
        raise HeartbeatTooLarge(f"the holdings of {len(held)} experts take {size} bytes even in compact form, over "
                                f"the site's {self.max_message}-byte message cap; not sent")

    async def send_heartbeat(self) -> None:
        """Send one signed heartbeat now (an over-cap one is logged, not sent: the site would close)."""
        if self._ws is not None:
            try:
                text = json.dumps(self.heartbeat_message())
            except HeartbeatTooLarge as exc:
                log.error("%s", exc)
                return
            async with self._send_lock:
                await self._ws.send(text)

    def _tier_changed(self) -> None:
        """Runtime listener (any thread): wake the heartbeat loop."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._changed.set)

    async def _heartbeat_loop(self) -> None:
        """Heartbeat on the timer and soon after every tier change (bursts coalesced)."""
        while True:
            self._changed.clear()
            if self.faults.blackhole:
                self._site_holdings = await asyncio.to_thread(self._declared_on_site)
            await self.send_heartbeat()
            try:
                await asyncio.wait_for(self._changed.wait(), self.heartbeat_interval)
                await asyncio.sleep(0.05)  # coalesce a burst of loads/evictions into one heartbeat
            except asyncio.TimeoutError:
                pass

    def _declared_on_site(self) -> list[dict]:
        """Holdings every provider declares on the site (``GET /api/v1/holdings``); ``[]`` when
        unreachable. Only the ``blackhole`` drill reads it."""
        import httpx

        try:
            r = httpx.get(f"{self.site}/api/v1/holdings", params={"limit": 100_000}, timeout=10)
            return [h for h in r.json().get("holdings", []) if h.get("provider") != self.provider]
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            log.warning("blackhole drill: cannot read the site's holdings: %s", exc)
            return []

    async def _reply(self, header: dict, payload: bytes = b"") -> None:
        """Send one answer, in part frames when it is above the site's cap (``wire.split_frames``);
        dropped with one log line when the socket has closed meanwhile."""
        frames = wire.split_frames(header, payload, self.max_message)
        async with self._send_lock:
            ws = self._ws
            if ws is None:  # the socket closed while this request ran: nobody to answer
                log.info("answer %r dropped: the site's socket is closed", header.get("id"))
                return
            for frame in frames:
                await ws.send(frame)

    async def _handle(self, header: dict, payload: bytes) -> None:
        """Answer one (reassembled) request from the site; every request gets a reply."""
        req_id = header.get("id")
        try:
            kind = header.get("type")
            if kind in ("execute", "batch") and self.faults.blackhole:
                return  # the drill: never answer
            if kind == "batch" and header.get("stream"):
                async for part in self.stream_batch(header, payload):
                    await self._reply(*part)
                return
            if kind == "batch":
                await self._reply(*await self.execute_batch(header, payload))
                return
            if kind == "execute":
                answer, out = await self.execute_request({**header, "request_id": req_id},
                                                         header.get("carrier", "f32"), payload)
                await self._reply(messages.reply(req_id, **answer), out)
            elif kind == "load":
                await self._load(header)
                await self._reply(messages.reply(req_id))
            elif kind == "repair":
                outcome = await asyncio.to_thread(self.repair.run_pass, json.loads(payload or b"{}"))
                await self._reply(messages.reply(req_id), json.dumps(outcome).encode())
            elif kind in FRAME_ROLES:
                fields, out = await asyncio.to_thread(self.generation.handle, kind, header, payload)
                await self._reply(messages.reply(req_id, **fields), out)
            elif kind == "rpc":
                await self._reply(messages.reply(req_id), json.dumps(await self._rpc(header, payload)).encode())
            else:
                await self._reply(messages.failure(req_id, "bad_request", f"unknown request type {kind!r}"))
        except (RuntimeFault, wire.WireError, BlobError, HandoffError, ValueError, KeyError, TypeError) as exc:
            await self._reply(messages.failure(req_id, type(exc).__name__, str(exc)))
        except RpcError as exc:
            await self._reply(messages.failure(req_id, type(exc).__name__, exc.message))
        except ConnectionClosed:
            pass
        except Exception as exc:  # noqa: BLE001 (a request must be answered, not left to its caller's timeout)
            log.exception("request %r failed", req_id)
            await self._reply(messages.failure(req_id, "internal", f"{type(exc).__name__}: {exc}"))

    async def _rpc(self, header: dict, payload: bytes) -> dict:
        """A relayed execution method: ``{"result": ...}`` or ``{"error": {code, message, data}}``."""
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

    def fetch(self, uri: str) -> bytes:
        """Blob bytes for ``tenzro://blob/<hash>``: the local store, else the site's ``/blobs/``
        (``moe.blobs.fetch_blob``: hash checked, at most ``MAX_BLOB_BYTES``).

        Raises ``BlobError`` (bad URI, hash mismatch, not served, too large).
        """
        return fetch_blob(uri, self.store, [self.site], max_bytes=MAX_BLOB_BYTES)

    def _blob_identity(self, model_id: str, layer: int, expert: int) -> tuple[str, str]:
        """(blob hash, quant kind) of a held expert, for its receipts."""
        held = self.runtime._held.get((model_id, layer, expert))
        return (held.blob_hash, held.quant or "f32") if held is not None else ("", "unknown")

    def _execute_sync(self, req: dict, carrier: str, payload: bytes) -> tuple[dict, bytes]:
        """Execute one batch and sign its receipt, in the calling (compute) thread.

        ``req``: ``request_id, model_id, layer, expert, token_indices, d_model, output?,
        purpose?`` (``purpose`` other than "serve" is not metered); ``payload`` the carrier
        bytes (``carrier`` "f32", "f16" or "q8_0"). Returns (answer fields ``{rows, d_model,
        output, token_indices, receipt}``, output bytes). Raises ``RpcError`` (-32602: a bad
        model_id, layer, expert, d_model or token index, ``methods.execute_key``), ``wire.WireError``,
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
        out = self.runtime.execute(model_id, layer, expert, rows, len(tokens), d_model, metered)
        lie = self.faults.corrupt(out) if metered else None
        out = out if lie is None else lie
        data = wire.encode_rows(out, output)
        sent = out if output == "f32" else wire.decode_rows(data, output, d_model, len(tokens), "outputs")
        blob_hash, quant = self._blob_identity(model_id, layer, expert)
        receipt = make_receipt(self.key, request_id=req["request_id"], model_id=model_id, layer=layer,
                               expert=expert, tokens=tokens, carrier_kind=carrier, carrier=payload, rows=sent,
                               blob_hash=blob_hash, quant=quant)
        return ({"rows": len(tokens), "d_model": d_model, "output": output, "token_indices": tokens,
                 "receipt": receipt}, data)

    async def execute_request(self, req: dict, carrier: str, payload: bytes) -> tuple[dict, bytes]:
        """``_execute_sync`` on the compute pool (socket and HTTP transports): numpy/BLAS
        releases the GIL, and off the event loop heartbeats keep flowing. Same returns and errors."""
        return await asyncio.get_running_loop().run_in_executor(self._compute, self._execute_sync, req, carrier,
                                                                payload)

    async def execute_stream(self, items: list[tuple[dict, str, bytes]]):
        """Several batches (``execute_request``'s arguments each) in one hop to the compute pool
        per compute thread (round-robin, so several threads still run them side by side); an
        async iterator of (index, outcome) in the order they finish, the outcome being (answer
        fields, output bytes) or the exception it raised, so one failing request fails only
        itself and each answer can leave before the next batch is done. Under the
        ``blackhole`` drill it never answers."""
        if self.faults.blackhole:
            await asyncio.Event().wait()
        loop = asyncio.get_running_loop()
        done: asyncio.Queue = asyncio.Queue()

        def run(indices: list[int]) -> None:
            for i in indices:
                try:
                    outcome = self._execute_sync(*items[i])
                except Exception as exc:  # noqa: BLE001 (each request gets its own answer)
                    outcome = exc
                try:
                    loop.call_soon_threadsafe(done.put_nowait, (i, outcome))
                except RuntimeError:  # the loop closed (agent stopping): nobody waits for it
                    return

        # Largest batches first: the last to finish is a small one, whose answer the router
        # checks quickly, so less of the forward waits on one core after the rest are done.
        order = sorted(range(len(items)), key=lambda i: -_row_count(items[i][0]))
        hops = max(1, min(self.compute_threads, len(items)))
        for h in range(hops):
            loop.run_in_executor(self._compute, run, order[h::hops])
        for _ in range(len(items)):
            yield await done.get()

    async def execute_many(self, items: list[tuple[dict, str, bytes]]) -> list:
        """``execute_stream``'s outcomes collected in the order of ``items``."""
        out: list = [None] * len(items)
        async for i, outcome in self.execute_stream(items):
            out[i] = outcome
        return out

    async def execute_batch(self, header: dict, payload: bytes) -> tuple[dict, bytes]:
        """A coalesced ``batch`` message (``messages.split_batch``) through ``execute_many``, each
        request answered on its own (reply with receipt, or failure with a JSON-RPC code: -32004
        expert not held, -32602 bad request, -32603 a bug). Returns ``messages.batch_reply``'s
        (header, payload). Raises ``wire.WireError`` when the batch itself is malformed."""
        subs = messages.split_batch(header, payload)
        outcomes = await self.execute_many([({**h, "request_id": h.get("id")}, h.get("carrier", "f32"), data)
                                            for h, data in subs])
        return messages.batch_reply(header.get("id"), [_answer(h, o) for (h, _), o in zip(subs, outcomes)])

    async def stream_batch(self, header: dict, payload: bytes):
        """A coalesced ``batch`` answered request by request as each finishes: an async iterator
        of ``messages.batch_part`` (header, output bytes), ``more: false`` on the last. Raises
        ``wire.WireError`` (before yielding anything) when the batch is malformed."""
        subs = messages.split_batch(header, payload)
        left = len(subs)
        async for i, outcome in self.execute_stream([({**h, "request_id": h.get("id")}, h.get("carrier", "f32"),
                                                      data) for h, data in subs]):
            left -= 1
            yield messages.batch_part(header.get("id"), _answer(subs[i][0], outcome), more=left > 0)

    async def execute_stream_rpc(self, items: list[tuple[dict, str, bytes]]):
        """``execute_stream`` for the iroh endpoint: failures as ``RpcError`` (as ``execute_rpc``)."""
        async for i, outcome in self.execute_stream(items):
            yield i, RpcError(*_rpc_failure(outcome)) if isinstance(outcome, BaseException) else outcome

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

    async def _http_frame(self, header: dict, payload: bytes) -> tuple[dict, bytes]:
        """Binary execute over HTTP (``POST /frame``): the socket's frame format, no base64."""
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

    def _http_stream(self, header: dict, payload: bytes):
        """Streamed binary batch over HTTP (``POST /frame`` with ``stream: true``): ``stream_batch``."""
        return self.stream_batch(header, payload)

    async def _http_rpc(self, method: str, params: dict) -> dict:
        """JSON-RPC handler of the HTTP endpoint (``moe.transports.http``)."""
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

    async def _load(self, header: dict) -> None:
        uri = header["uri"]
        key = (str(header["model_id"]), int(header["layer"]), int(header["expert"]))
        data = await asyncio.to_thread(self.fetch, uri)
        self._warming.add(key)
        try:
            row = await asyncio.to_thread(self.runtime.load_expert, *key, data, uri)
            await asyncio.get_running_loop().run_in_executor(self._compute, self._warm_expert, key, row["d_model"])
        finally:
            self._warming.discard(key)
            self._tier_changed()

    def _warm_expert(self, key: tuple[str, int, int], d_model: int) -> None:
        """Unmetered warm-up batches of a freshly loaded expert before it is declared Warm: one
        row (kernel dispatch, page faults), and for the first expert of each quant kind also
        ``WARM_ROWS`` rows, the decode + BLAS path of larger batches, whose numba kernels
        compile again for read-only blob buffers (measured: 5-6 s on the first 48-row
        DeepSeek Q4_K_M batch at load 18, after ``backend.warm``)."""
        self.kernels_warm.wait(600)
        held = self.runtime._held.get(key)
        kind = held.quant if held is not None else None
        sizes = (1,) if kind in self._warmed_kinds else (1, WARM_ROWS)
        try:
            for n in sizes:
                self.runtime.execute(*key, np.zeros((n, d_model), dtype=np.float32), n, d_model, False)
            self._warmed_kinds.add(kind)
        except (RuntimeFault, ValueError) as exc:
            log.warning("warm-up batch of %s failed: %s", key, exc)
