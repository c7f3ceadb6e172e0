"""The agent's session with the site: its ``/ws/agent/`` WebSocket.

It connects, proves the agent's ed25519 identity by signing the site's nonce, sends signed
heartbeats with its holdings every ``heartbeat_interval`` seconds and soon after every tier
change (so residency and ``committed_tps`` reach the shard map at once), hands each
(reassembled) request frame to the agent's handler, sends answers back in frames below the
site's cap, and reconnects with backoff when the site goes away. Imports nothing from Django.

Behind a balancer of several site processes the welcome names the answering process
(``site``) and every process (``sites``): the session then also holds a *side socket* to each
other process, ``/ws/agent/?site=<id>`` (the balancer steers it there), which carries only
requests and their answers, so every process's routers reach this agent over a socket of their
own instead of relaying through the one holding the main socket. Each side socket reconnects
on its own (a process that dies takes only its sockets); heartbeats stay on the main socket.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from typing import Awaitable, Callable
from urllib.parse import quote, urlsplit, urlunsplit

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from holders.config import AgentConfig
from moe import messages, wire
from moe.faults import FaultInjector
from moe.identity import DOMAIN_HEARTBEAT, DOMAIN_HELLO, provider_id, sign, sign_body

log = logging.getLogger("tenzro.agent")

CLOSE_AUTH = 4401
CLOSE_KEY_IN_USE = 4409
CLOSE_MISDIRECTED = 4421  # a side socket reached another site process than it names
CLOSE_REFUSED = 4422


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


Reply = Callable[[dict, bytes], Awaitable[None]]
Handler = Callable[[dict, bytes, Reply], Awaitable[None]]


class SiteSession:
    """One agent's socket to the site; ``run()`` until ``stopping`` is set or a refusal.

    ``config``: the agent's settings (site, key, name, roles, heartbeat interval, prices).
    ``holdings()``: the rows to declare now (``runtime.holdings`` as ``ExpertLoader.declarable``
    filters them). ``advertised()``: the heartbeat's endpoint fields, ``http_endpoint``,
    ``iroh_endpoint_id``, ``iroh_addrs``, ``moe_gpu``, read at each heartbeat (the iroh
    endpoint starts after the agent is built). ``faults``: the drill injector (``blackhole``
    declares what others hold). ``handle(header, payload, reply)``: answers one request frame
    by awaiting ``reply(header, payload)`` (bound to the socket the request came on).
    ``stopping``: the agent's stop event. Raises ``ValueError`` for a malformed ``site``.
    """

    def __init__(self, config: AgentConfig, holdings: Callable[[], list[dict]], advertised: Callable[[], dict],
                 faults: FaultInjector, handle: Handler, stopping: asyncio.Event):
        self.site = config.site_base
        self.url = ws_url(config.site)
        self.key = config.key
        self.provider = provider_id(config.key)
        self.name = config.name
        self.roles = config.roles
        self.heartbeat_interval = config.heartbeat_interval
        self.price_per_input_token, self.minimum_price = int(config.price_per_input_token), int(config.minimum_price)
        self.holdings = holdings
        self.advertised = advertised
        self.faults = faults
        self.handle = handle
        self.stopping = stopping
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ws = None
        self.max_message = 1 << 20  # the site's frame cap, updated from its welcome
        self._changed = asyncio.Event()
        self._send_lock = asyncio.Lock()
        self._last_ts = 0
        self._site_error: str | None = None  # the site's last error message (named in a 4422 refusal)
        self._site_holdings: list[dict] = []  # what others declare (blackhole drill only)
        self._side: dict[str, asyncio.Task] = {}  # site process id → its side socket's task

    async def run(self) -> None:
        """Connect and serve until stopped, reconnecting with backoff (1 s … 30 s).

        Raises ``AuthRefused`` when the site refuses this agent's identity (4401) or its
        configuration (4422), ``KeyInUse`` once a 4409 refusal (the key is in use by another
        live session) outlasts the site's ``retry_for_s`` since the first refusal: retrying
        covers a reconnect after a network drop the site has not noticed (the old session
        stops heartbeating and is then replaced), not a second agent started with the same key.
        Side sockets (module docstring) close when it returns.
        """
        self.loop = asyncio.get_running_loop()
        try:
            await self._main_socket()
        finally:
            for task in self._side.values():
                task.cancel()
            self._side.clear()

    async def _main_socket(self) -> None:
        backoff = 1.0
        in_use_until: float | None = None
        while not self.stopping.is_set():
            try:
                async with connect(self.url, max_size=None, ping_interval=20, ping_timeout=60,
                                   open_timeout=10) as ws:
                    self.ws = ws
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
                self.ws = None
            if not await self._pause(backoff):
                break
            backoff = min(backoff * 2, 30.0)

    async def _pause(self, seconds: float) -> bool:
        """Wait ``seconds`` before a reconnect; False when the agent is stopping (now or meanwhile)."""
        if self.stopping.is_set():
            return False
        try:
            await asyncio.wait_for(self.stopping.wait(), seconds)
        except asyncio.TimeoutError:
            return True
        return False

    async def _handshake(self, ws) -> dict:
        """Challenge, signed hello, welcome; returns the welcome. Raises ``KeyInUse``,
        ``AuthRefused`` or ``ConnectionError`` (any other refusal)."""
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
        return welcome

    async def _session(self, ws) -> None:
        welcome = await self._handshake(ws)
        log.info("connected to %s as %s", self.site, self.provider)
        self._open_side_sockets(welcome)
        beat = asyncio.create_task(self._heartbeat_loop())
        try:
            await self._serve(ws, self.reply)
        finally:
            beat.cancel()

    async def _serve(self, ws, reply: Reply) -> None:
        """Hand each (reassembled) request frame of ``ws`` to ``handle`` with ``reply``; until the
        socket closes or the agent stops."""
        parts = wire.Reassembler()  # a request above the frame cap arrives in parts: act on it whole
        async for frame in ws:
            if isinstance(frame, bytes):
                try:
                    msg = parts.feed(*wire.unpack_frame(frame))
                except wire.WireError as exc:
                    log.warning("bad frame from site: %s", exc)
                    continue
                if msg is not None:
                    asyncio.create_task(self.handle(*msg, reply))
            else:
                self._control(frame)
            if self.stopping.is_set():
                break

    def _open_side_sockets(self, welcome: dict) -> None:
        """Start a side socket (module docstring) for each site process the welcome lists that has
        none yet, other than the one this main socket reached; stop those no longer listed."""
        own, ids = welcome.get("site"), welcome.get("sites")
        if not isinstance(own, str) or not isinstance(ids, list):
            ids = []
        ids = [i for i in ids if isinstance(i, str) and i]
        for sid in set(self._side) - set(ids):
            self._side.pop(sid).cancel()
        for sid in ids:
            if sid != own and (sid not in self._side or self._side[sid].done()):
                self._side[sid] = asyncio.create_task(self._side_socket(sid))

    async def _side_socket(self, sid: str) -> None:
        """Hold the side socket to site process ``sid`` until stopped, reconnecting with backoff
        (1 s … 30 s; a process that is down answers through another one, which refuses with 4421).
        Ends when the site refuses this agent's identity (4401: the main socket reports it)."""
        url = f"{self.url}?site={quote(sid)}"
        backoff = 1.0
        while not self.stopping.is_set():
            try:
                async with connect(url, max_size=None, ping_interval=20, ping_timeout=60, open_timeout=10) as ws:
                    welcome = await self._handshake(ws)
                    if welcome.get("site") != sid:
                        raise ConnectionError(f"side socket for site process {sid!r} reached {welcome.get('site')!r}")
                    backoff = 1.0
                    log.info("side socket to site process %s open", sid)
                    lock = asyncio.Lock()
                    cap = welcome["max_message"] if isinstance(welcome.get("max_message"), int) else self.max_message

                    async def reply(header: dict, payload: bytes = b"", ws=ws, lock=lock, cap=cap) -> None:
                        await self._send_frames(ws, lock, cap, header, payload)

                    await self._serve(ws, reply)
            except AuthRefused as exc:
                log.warning("side socket to site process %s: %s", sid, exc)
                return
            except ConnectionClosed as exc:
                if exc.rcvd is not None and exc.rcvd.code == CLOSE_AUTH:
                    return
                log.info("side socket to site process %s closed: %s", sid, exc)
            except (OSError, InvalidStatus, asyncio.TimeoutError, ValueError, KeyError) as exc:
                log.info("side socket to site process %s: %s", sid, exc)
            if not await self._pause(backoff):
                break
            backoff = min(backoff * 2, 30.0)

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

        What is declared is ``holdings()`` (no expert before its warm-up batch ran, every one
        Cold while the kernels compile); the ``blackhole`` drill declares everything
        (``FaultInjector.advertise``).
        """
        held = self.faults.advertise(self.holdings(), self._site_holdings)
        advertised = self.advertised()
        for precision in range(len(messages.TPS_PRECISIONS)):
            ts = max(int(time.time() * 1000), self._last_ts + 1)
            body = {"provider": self.provider, "timestamp_ms": ts, "nonce": secrets.token_hex(16),
                    "name": self.name, "roles": list(self.roles), **advertised,
                    "price_per_input_token": self.price_per_input_token,
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
        if self.ws is not None:
            try:
                text = json.dumps(self.heartbeat_message())
            except HeartbeatTooLarge as exc:
                log.error("%s", exc)
                return
            async with self._send_lock:
                await self.ws.send(text)

    def tier_changed(self) -> None:
        """What may be declared changed (runtime listener, warm-ups; any thread): wake the heartbeat loop."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._changed.set)

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

    async def reply(self, header: dict, payload: bytes = b"") -> None:
        """Send one answer, in part frames when it is above the site's cap (``wire.split_frames``);
        dropped with one log line when the socket has closed meanwhile."""
        await self._send_frames(None, self._send_lock, self.max_message, header, payload)

    async def _send_frames(self, ws, lock: asyncio.Lock, cap: int, header: dict, payload: bytes) -> None:
        """Send one answer on ``ws`` (None: the main socket as it is now) under ``lock``, in part
        frames above ``cap``; dropped with a log line when the main socket has closed, raises
        ``ConnectionClosed`` when ``ws`` closes meanwhile."""
        frames = wire.split_frames(header, payload, cap)
        async with lock:
            ws = self.ws if ws is None else ws
            if ws is None:  # the main socket closed while this request ran: nobody to answer
                log.info("answer %r dropped: the site's socket is closed", header.get("id"))
                return
            for frame in frames:
                await ws.send(frame)
