"""Router side of the agent WebSocket: requests go straight to a socket this process
holds, or through the Channels layer to the process that holds it.

Each socket belongs to an ``AgentConsumer`` in some site process. When that consumer runs
in the requesting process and event loop (always with the in-memory layer, and with one
daphne in Redis mode), the request is written to its socket directly and the answer
resolves the waiting future: no layer, so no channel capacity to overflow (the in-memory
layer drops group messages past its capacity silently) and no Redis connection per request
(channels-redis's pool ran out under load). Otherwise the request is ``group_send`` to the
group ``agent.<provider>``; that consumer writes it to the socket and routes the agent's
answer back to the requesting process's reply channel, where one reader task per process
matches answers to waiting requests by request id (never by fields the holder returns). A
layer that refuses a send (full, or out of connections) is an immediate ``AgentUnavailable``
(code ``"backpressure"``), not a timeout later.

Every link's reply channel is also in the group ``ROUTERS_GROUP``: when an agent's last
socket closes, its consumer tells every router (``agent.gone``), which fails that provider's
pending requests at once instead of letting them wait out the deadline (a request sent to
a group whose socket left is dropped by the layer without a word), and refuses new ones
for ``GONE_GRACE_S`` (until the shard view has dropped the provider) unless the agent
says ``agent.back`` first. Presence listeners (``AgentLink.presence_listeners``) hear both.
A process that holds a socket of the provider itself (behind a balancer every process holds a
side socket of every agent, ``router.consumers``) ignores ``agent.gone``: requests go over its own
socket, whose close fails them.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
import uuid
from typing import Callable, Protocol

from channels.exceptions import ChannelFull
from channels.layers import get_channel_layer
from redis.exceptions import RedisError

from moe import wire
from moe.transports.coalesce import Coalescer

log = logging.getLogger(__name__)

# Layer sends in flight per process: below redis-py's default pool of 100 connections, which
# the consumers' own receives and group operations share.
LAYER_CONCURRENCY = 32


class AgentUnavailable(ConnectionError):
    """The agent did not answer in time, disconnected, or refused the request (``code`` kept)."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.code = code


ROUTERS_GROUP = "tenzro.routers"
GONE_GRACE_S = 3.0


_GROUP_SAFE = re.compile(r"[A-Za-z0-9_.\-]{1,90}")


def agent_group(provider: str) -> str:
    """Channel-layer group of a provider's agent socket(s): ``agent.<provider>``; a holder id that
    is not a valid group name (a Kvasir worker's ``kvasir:<worker_id>``: Channels allows only
    ``[A-Za-z0-9_.-]``, under 100 characters) is named by its BLAKE2b digest instead."""
    if _GROUP_SAFE.fullmatch(provider):
        return f"agent.{provider}"
    return "agent.h" + hashlib.blake2b(provider.encode(), digest_size=16).hexdigest()


class LocalSocket(Protocol):
    """An agent socket held by this process (``AgentConsumer``): its event loop and a direct relay."""

    loop: asyncio.AbstractEventLoop

    async def relay(self, req_id: str, header: dict, payload: bytes, answer: asyncio.Future,
                    encoded: bytes | None = None) -> None:
        """Write the request frame to the socket; ``answer`` gets ``{"header", "payload"}`` (and
        ``"bytes"``, the answer's size on the socket, when one frame carried it). ``encoded``:
        ``header``'s compact JSON when the caller already has it (written as is)."""


_local: dict[str, list[LocalSocket]] = {}


def register_local(provider: str, sock: LocalSocket) -> None:
    """Record that ``provider``'s agent socket ``sock`` is open in this process."""
    _local.setdefault(provider, []).append(sock)


def unregister_local(provider: str, sock: LocalSocket) -> None:
    """Forget ``sock`` (closed)."""
    socks = _local.get(provider, [])
    if sock in socks:
        socks.remove(sock)
    if not socks:
        _local.pop(provider, None)


def _local_socket(provider: str) -> LocalSocket | None:
    """The newest socket of ``provider`` held by this process on the running loop, or None."""
    loop = asyncio.get_running_loop()
    return next((s for s in reversed(_local.get(provider, ())) if s.loop is loop), None)


def held_here(provider: str) -> bool:
    """Whether this process holds a socket of ``provider`` on the running loop (a request to it
    skips the channel layer); False outside an event loop."""
    try:
        return _local_socket(provider) is not None
    except RuntimeError:  # no running loop
        return False


async def hand_reply(channel_layer, reply_to, msg: dict) -> None:
    """Hand a holder's answer ``msg`` (``{"type": "agent.reply", "id", ...}``) to the waiting
    router: its future (a router in this process) or its reply channel (another process). A
    channel layer that refuses it (the router process is gone or its channel is full) drops the
    answer, logged; that router's request then times out."""
    if not isinstance(reply_to, str):
        if not reply_to.done():
            reply_to.set_result(msg)
        return
    try:
        await channel_layer.send(reply_to, msg)
    except Exception:  # nothing left to hand the answer to
        log.warning("answer %s to %s dropped by the channel layer", msg.get("id"), reply_to, exc_info=True)


def presence_event(provider: str, connected: bool) -> dict:
    """The ``ROUTERS_GROUP`` message a consumer sends when ``provider``'s socket opens or closes."""
    return {"type": "agent.back" if connected else "agent.gone", "provider": provider}


class AnswerStream:
    """The pending entry of a streamed ``batch`` (``messages.batch_part``): each answer message
    with ``more: true`` goes to ``on_part(message)`` as it arrives, the last one (or a failure,
    or a disconnect) resolves ``final``. Duck-types the future a consumer resolves."""

    def __init__(self, on_part: Callable[[dict], None]):
        self.on_part = on_part
        self.final: asyncio.Future = asyncio.get_running_loop().create_future()

    def done(self) -> bool:
        return self.final.done()

    def set_result(self, msg: dict) -> None:
        """One answer message ``{id, header, payload}`` of the stream. When ``on_part`` raises (a
        malformed answer), the whole request ends with that exception."""
        if self.final.done():
            return
        if not (msg.get("header") or {}).get("more"):
            self.final.set_result(msg)
            return
        try:
            self.on_part(msg)
        except Exception as exc:  # noqa: BLE001 (the waiting request raises it, not the consumer or reader)
            self.final.set_exception(exc)


class AgentLink:
    """Per-event-loop client of the channel layer for request/response calls to agents."""

    _by_loop: dict[int, "AgentLink"] = {}
    # Called with (provider, connected: bool) on agent.gone / agent.back (the router's scoreboard).
    presence_listeners: list[Callable[[str, bool], None]] = []
    # Called with "local" or "relay" per request sent (the router's metrics).
    path_listeners: list[Callable[[str], None]] = []

    def __init__(self):
        self.layer = get_channel_layer()
        self.reply_channel: str | None = None
        self.pending: dict[str, asyncio.Future] = {}
        self.provider_of: dict[str, str] = {}  # request id → provider
        self.gone_at: dict[str, float] = {}  # provider → monotonic time its socket closed
        self._reader: asyncio.Task | None = None
        self._sends = asyncio.Semaphore(LAYER_CONCURRENCY)
        # This loop's per-provider queues of execute requests (``router.services.send_ws``).
        self.coalescer = Coalescer()

    @classmethod
    async def get(cls) -> "AgentLink":
        """The link of the running event loop, started on first use."""
        loop = asyncio.get_running_loop()
        link = cls._by_loop.get(id(loop))
        if link is None or link._reader is None or link._reader.done():
            link = cls()
            # The layer's default prefix: channels-redis polls one key per process for all
            # process-specific channels, and a custom prefix would be a second, unpolled key.
            link.reply_channel = await link.layer.new_channel()
            await link.layer.group_add(ROUTERS_GROUP, link.reply_channel)
            link._reader = loop.create_task(link._read())
            cls._by_loop[id(loop)] = link
        return link

    async def _read(self) -> None:
        while True:
            try:
                msg = await self.layer.receive(self.reply_channel)
            except asyncio.CancelledError:
                raise
            except Exception:  # a broken layer connection must not strand waiting requests
                log.exception("channel layer receive failed; retrying")
                await asyncio.sleep(0.5)
                continue
            if msg.get("type") in ("agent.gone", "agent.back"):
                self._presence(str(msg.get("provider")), msg["type"] == "agent.back")
                continue
            key = msg.get("id", "")
            more = (msg.get("header") or {}).get("more")  # a streamed batch: more answers to come
            fut = self.pending.get(key) if more else self.pending.pop(key, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    async def _group_send(self, provider: str, message: dict) -> None:
        """``group_send`` bounded to ``LAYER_CONCURRENCY`` at once per process (the layer's
        connection pool); a refusal by the layer raises ``AgentUnavailable("backpressure")``."""
        async with self._sends:
            try:
                await self.layer.group_send(agent_group(provider), message)
            except (ChannelFull, ConnectionError, OSError, RedisError) as exc:
                raise AgentUnavailable(f"channel layer refused the request to holder {provider[:12]}…: "
                                       f"{type(exc).__name__}: {exc}", "backpressure") from exc

    def _presence(self, provider: str, connected: bool) -> None:
        if not connected and _local.get(provider):
            # Its main socket closed elsewhere, but this process holds a (side) socket of it: the
            # agent is reachable here, and a close of that socket fails its own requests.
            connected = True
        if connected:
            self.gone_at.pop(provider, None)
        else:
            self.gone_at[provider] = time.monotonic()
            for req_id, p in list(self.provider_of.items()):
                fut = self.pending.pop(req_id, None) if p == provider else None
                if fut is not None and not fut.done():
                    fut.set_result({"id": req_id, "header": {"ok": False, "code": "disconnected",
                                                             "message": "agent disconnected"}})
        for fn in list(self.presence_listeners):
            try:
                fn(provider, connected)
            except Exception:  # a listener must not stop the reader
                log.exception("presence listener failed")

    async def request(self, provider: str, header: dict, payload: bytes = b"",
                      timeout: float = 30.0, req_id: str | None = None,
                      on_part: Callable[[dict], None] | None = None) -> tuple[dict, bytes]:
        """Send ``header``/``payload`` to ``provider``'s agent and wait for its answer.

        ``req_id``: the caller's request id (default: a fresh one); answers are matched by it.
        ``on_part``: for a streamed batch, called with each answer message ``{id, header,
        payload}`` marked ``more`` as it arrives (``AnswerStream``); the last one is returned.
        Returns (answer header, answer payload). Raises ``AgentUnavailable`` on timeout,
        disconnect, or an answer with ``ok: false`` (its ``code`` and ``message`` kept).
        """
        msg = await self.request_message(provider, header, payload, timeout, req_id, on_part)
        return msg.get("header") or {}, msg.get("payload") or b""

    async def request_message(self, provider: str, header: dict, payload: bytes = b"",
                              timeout: float = 30.0, req_id: str | None = None,
                              on_part: Callable[[dict], None] | None = None,
                              encoded: bytes | None = None) -> dict:
        """``request``, returning the whole answer message ``{id, header, payload}``, with
        ``bytes`` (its size on the agent's socket) when the consumer counted it. ``encoded``:
        ``header`` as ``wire.header_json(header)``, when the caller
        encoded it already (to count its bytes) and its ``id`` is ``req_id``: a socket of this
        process writes it as is instead of encoding the header again. Same errors."""
        req_id = req_id or uuid.uuid4().hex
        if req_id in self.pending:
            raise ValueError(f"request id {req_id} is already in flight")
        sock = _local_socket(provider)
        gone = self.gone_at.get(provider)
        if sock is None and gone is not None and time.monotonic() - gone < GONE_GRACE_S:
            raise AgentUnavailable(f"holder {provider[:12]}…: agent disconnected", "disconnected")
        fut = asyncio.get_running_loop().create_future() if on_part is None else AnswerStream(on_part)
        self.pending[req_id] = fut
        if sock is None:  # a local socket's own close fails what it carries (AgentConsumer.disconnect)
            self.provider_of[req_id] = provider
        try:
            for fn in self.path_listeners:
                fn("relay" if sock is None else "local")
            if sock is not None:
                try:
                    if encoded is not None and header.get("id") == req_id:
                        await sock.relay(req_id, header, payload, fut, encoded)
                    else:
                        await sock.relay(req_id, {**header, "id": req_id}, payload, fut)
                except wire.WireError as exc:
                    raise AgentUnavailable(f"request to holder {provider[:12]}… cannot be framed: {exc}",
                                           "too_large") from exc
            else:
                await self._group_send(provider, {
                    "type": "agent.request", "id": req_id, "reply_to": self.reply_channel,
                    "header": {**header, "id": req_id}, "payload": payload,
                })
            msg = await asyncio.wait_for(fut if on_part is None else fut.final, timeout)
        except asyncio.TimeoutError as exc:
            raise AgentUnavailable(f"holder {provider[:12]}… did not answer within {timeout:g} s") from exc
        finally:
            self.pending.pop(req_id, None)
            self.provider_of.pop(req_id, None)
        answer = msg.get("header") or {}
        if not answer.get("ok"):
            raise AgentUnavailable(f"holder {provider[:12]}…: {answer.get('message', 'request failed')}",
                                   answer.get("code"))
        return msg
