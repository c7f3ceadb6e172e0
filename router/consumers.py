"""Site side of the agent WebSocket ``/ws/agent/`` (docs/DESIGN.md §6).

Handshake: the site sends ``{"type": "challenge", "nonce": hex}``; the agent answers
``{"type": "hello", "provider": hex64, "signature": hex}`` signed over the nonce bytes
under ``identity.DOMAIN_HELLO``. A bad signature, a malformed hello, or no hello within
``AGENT_HELLO_TIMEOUT_S`` closes the socket with code 4401. Then: JSON text frames for
control (``heartbeat`` → ``heartbeat_ack`` or ``error``; a heartbeat refused for a configuration field, one of
``PERMANENT_FIELDS``, also closes with 4422) and binary frames
(``wire.pack_frame``) for requests to the agent and its answers; either above the
socket's cap travels as part frames (``wire.split_frames``, reassembled on arrival).

One live session per key (``registry.services.agent_connected``): a second hello for a key
whose session is live (heartbeating, and its consumer answers an ``agent.ping`` within
``SESSION_PING_S``) is refused with 4409 and ``retry_for_s`` (when the old session would count
as dead); a hello after the old session stopped heartbeating, or whose consumer is gone (the
site restarted after a crash), replaces it, and the old socket, if still open, is closed
with 4410.

Several site processes behind a balancer (``TENZRO_SITE_ID`` / ``TENZRO_SITE_IDS``): the welcome
names the answering process and every process, and the agent opens one more socket per process,
``/ws/agent/?site=<id>`` (the balancer's ``use-server`` steers it). Such a *side socket*
authenticates like the main one but carries only requests and answers: no heartbeats, no agent
session in the database, no channel-layer group and no presence events (the main socket has
those), so it does not count against one live session per key. Routers of that process find it
as a local socket (``router.ws.register_local``) and reach the agent without the relay. A side
socket that reaches another process than the one it names (that one is down and the balancer
fell back to another) is closed with 4421: the agent retries it later.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.exceptions import ChannelFull
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings

from moe import messages, wire

from router import repair as repair_site
from moe.identity import DOMAIN_HELLO, SignatureError, loads_signed, verify
from router.ws import ROUTERS_GROUP, agent_group, hand_reply, presence_event, register_local, unregister_local
from registry import services as registry_services
from registry.heartbeat import HeartbeatError

log = logging.getLogger(__name__)

CLOSE_AUTH = 4401
CLOSE_KEY_IN_USE = 4409  # another live session holds this key
CLOSE_SUPERSEDED = 4410  # a stale session replaced by a newer one of the same key
CLOSE_MISDIRECTED = 4421  # a side socket for another site process (that one is down)
CLOSE_REFUSED = 4422  # a heartbeat field from the agent's configuration (name, pricing...) is invalid
SESSION_PING_S = 2.0  # how long a live-looking session of the same key has to answer a ping
# Heartbeat fields set by the agent's configuration, not by its state: refusing one is permanent.
PERMANENT_FIELDS = frozenset({"name", "http_endpoint", "iroh_endpoint_id", "iroh_addrs", "body.roles",
                              "price_per_input_token", "minimum_price"})


class AgentConsumer(AsyncWebsocketConsumer):
    """One holder agent's socket: authenticates it, ingests heartbeats, relays requests."""

    provider: str | None = None
    side: str | None = None  # the site process id a side socket names (``?site=``); None: the main socket

    async def connect(self):
        """Accept, send the challenge nonce, and arm the hello timeout."""
        sites = parse_qs(self.scope.get("query_string", b"").decode("latin-1")).get("site")
        self.side = sites[0] if sites else None
        self.nonce = secrets.token_bytes(32)
        # request id → the router's reply channel, or its future when the router is in this process
        self.pending: dict[str, str | asyncio.Future] = {}
        self.loop = asyncio.get_running_loop()
        self.parts = wire.Reassembler()  # answers above the frame cap arrive in parts
        await self.accept()
        await self.send(text_data=json.dumps(messages.challenge(self.nonce)))
        self._hello_timer = asyncio.get_running_loop().create_task(self._hello_timeout())
        repair_site.ensure_timer()  # without Redis, this site process runs the repair schedule

    async def _hello_timeout(self):
        await asyncio.sleep(settings.TENZRO["AGENT_HELLO_TIMEOUT_S"])
        if self.provider is None:
            await self.close(code=CLOSE_AUTH)

    async def disconnect(self, code):
        """Fail the requests relayed here, leave the group, mark the session closed, and when it
        was the provider's last socket tell every router (``agent.gone``): they fail its
        requests still pending at once instead of letting them wait out the deadline."""
        self._hello_timer.cancel()
        if self.provider is None:
            return
        unregister_local(self.provider, self)
        pending, self.pending = self.pending, {}
        for req_id, reply_to in pending.items():  # fail in-flight requests at once, before any slow step
            await self._reply(reply_to, {"type": "agent.reply", "id": req_id, "payload": b"",
                                         "header": messages.failure(req_id, "disconnected", "agent disconnected")})
        if self.side is not None:
            return  # a side socket has no group, session or presence of its own
        await self.channel_layer.group_discard(agent_group(self.provider), self.channel_name)
        still = await database_sync_to_async(registry_services.agent_disconnected)(self.provider, self.channel_name)
        if not still:
            await self.channel_layer.group_send(ROUTERS_GROUP, presence_event(self.provider, False))

    async def dispatch(self, message):
        """Data-plane messages (binary answers, relayed requests) skip channels' per-message
        ``close_old_connections`` thread hop: they never touch the database, and that hop
        was a large share of a small forward's time."""
        kind = message.get("type")
        if kind == "agent.request" or (kind == "websocket.receive" and self.provider is not None
                                       and message.get("bytes") is not None):
            if kind == "agent.request":
                await self.agent_request(message)
            else:
                await self._answer(message["bytes"])
            return
        await super().dispatch(message)

    async def receive(self, text_data=None, bytes_data=None):
        """Dispatch one frame: the hello first, then heartbeats (text) and answers (binary)."""
        if self.provider is None:
            await self._hello(text_data)
            return
        if bytes_data is not None:
            await self._answer(bytes_data)
            return
        if self.side is not None:
            await self._send_error("heartbeats go on the agent's main socket (this is a side socket: ?site=)")
            return
        try:
            msg = loads_signed(text_data)  # heartbeats are signed: a repeated key is refused first
        except SignatureError as exc:
            await self._send_error(str(exc), field="body", ref="heartbeat")
            return
        except (TypeError, ValueError, RecursionError):
            await self._send_error("frame is not JSON (or nests too deeply / holds an oversized number)")
            return
        if not isinstance(msg, dict):
            await self._send_error("frame must be a JSON object")
        elif msg.get("type") == "heartbeat":
            await self._heartbeat(msg)
        else:
            await self._send_error(f"unknown message type {msg.get('type')!r}")

    async def _hello(self, text_data):
        try:
            try:
                msg = json.loads(text_data or "")
            except (ValueError, RecursionError) as exc:
                raise SignatureError("hello must be a JSON object {type: hello, provider, signature}") from exc
            if not isinstance(msg, dict) or msg.get("type") != "hello":
                raise SignatureError("expected a hello message")
            verify(msg.get("provider"), DOMAIN_HELLO, self.nonce, msg.get("signature"))
        except SignatureError as exc:
            log.info("agent hello refused: %s", exc)
            await self.send(text_data=json.dumps(messages.socket_error(str(exc), code=CLOSE_AUTH)))
            await self.close(code=CLOSE_AUTH)
            return
        self._hello_timer.cancel()
        if self.side is not None:
            await self._side_hello(msg["provider"])
            return
        connect = database_sync_to_async(registry_services.agent_connected)
        silent: set[str] = set()
        try:
            try:
                dead = await connect(msg["provider"], self.channel_name)
            except registry_services.KeyInUse as exc:
                # Sessions whose consumer does not answer belong to a site process that is gone.
                silent = await self._silent(exc.channels)
                if len(silent) < len(exc.channels):
                    raise
                dead = await connect(msg["provider"], self.channel_name, silent)
        except registry_services.KeyInUse as exc:
            log.warning("agent hello refused: %s; this second session is closed with %d (retry for %d s)",
                        exc, CLOSE_KEY_IN_USE, exc.retry_for_s)
            await self.send(text_data=json.dumps({**messages.socket_error(str(exc), code=CLOSE_KEY_IN_USE),
                                                  "retry_for_s": exc.retry_for_s}))
            await self.close(code=CLOSE_KEY_IN_USE, reason="key already connected")
            return
        for channel in dead:  # the same key's earlier socket stopped heartbeating: close it if still open
            log.warning("agent %s reconnected; closing its stale session %s", msg["provider"][:16], channel)
            await self.channel_layer.send(channel, {"type": "agent.superseded"})
            # Out of the agent's group now: a dead process's channel would swallow relayed requests.
            await self.channel_layer.group_discard(agent_group(msg["provider"]), channel)
        self.provider = msg["provider"]
        if silent:
            # The old socket died with its site process (SIGKILL: no disconnect ran there): requests
            # routers sent to it wait for nobody. "gone" fails them at once (they fail over), the
            # "back" below admits new ones to this socket.
            await self.channel_layer.group_send(ROUTERS_GROUP, presence_event(self.provider, False))
        register_local(self.provider, self)
        await self.channel_layer.group_add(agent_group(self.provider), self.channel_name)
        await self.channel_layer.group_send(ROUTERS_GROUP, presence_event(self.provider, True))
        await self._welcome()

    async def _welcome(self):
        t = settings.TENZRO
        await self.send(text_data=json.dumps(messages.welcome(self.provider, t["WS_MAX_MESSAGE"],
                                                              t["HEARTBEAT_INTERVAL_S"], t["DEPLOYMENT"],
                                                              t["SITE_ID"], t["SITE_IDS"])))

    async def _side_hello(self, provider: str):
        """A proven side socket (module docstring): usable by this process's routers at once, or
        closed with 4421 when it names another process (or this one runs without site ids)."""
        if self.side != settings.TENZRO["SITE_ID"]:
            message = (f"this is site process {settings.TENZRO['SITE_ID']!r}, not {self.side!r}"
                       if settings.TENZRO["SITE_ID"] else "this site runs no site processes by id (?site= unused)")
            await self.send(text_data=json.dumps(messages.socket_error(message, code=CLOSE_MISDIRECTED)))
            await self.close(code=CLOSE_MISDIRECTED)
            return
        self.provider = provider
        register_local(provider, self)
        await self._welcome()

    async def _silent(self, channels: list[str]) -> set[str]:
        """The ``channels`` whose consumer does not answer an ``agent.ping`` within
        ``SESSION_PING_S`` (an answering one is alive in some site process)."""
        reply = await self.channel_layer.new_channel("ping.")
        for channel in channels:
            try:
                await self.channel_layer.send(channel, {"type": "agent.ping", "reply_to": reply, "channel": channel})
            except ChannelFull:  # nobody drains it: no answer will come
                pass
        answered: set[str] = set()
        deadline = self.loop.time() + SESSION_PING_S
        while len(answered) < len(channels) and (left := deadline - self.loop.time()) > 0:
            try:
                answered.add((await asyncio.wait_for(self.channel_layer.receive(reply), left))["channel"])
            except asyncio.TimeoutError:
                break
        return set(channels) - answered

    async def agent_ping(self, event):
        """Channel-layer event: a new session of this key asks whether this one is alive."""
        await self.channel_layer.send(event["reply_to"], {"type": "agent.pong", "channel": event["channel"]})

    async def agent_superseded(self, event):
        """Channel-layer event: a newer session of this key replaced this stale one."""
        await self.close(code=CLOSE_SUPERSEDED, reason="superseded by a newer session of this key")

    async def _heartbeat(self, msg):
        try:
            await database_sync_to_async(registry_services.ingest_heartbeat)(msg, self.provider)
        except (HeartbeatError, SignatureError) as exc:
            field = getattr(exc, "field", "signature")
            await self._send_error(str(exc), field=field, ref="heartbeat")
            if field in PERMANENT_FIELDS:  # the agent's configuration: resending will not help
                log.warning("agent %s refused: %s", self.provider[:16], exc)
                await self.close(code=CLOSE_REFUSED, reason=field)
            return
        await self.send(text_data=json.dumps(messages.HEARTBEAT_ACK))

    async def _answer(self, data: bytes):
        try:
            header, payload = wire.unpack_frame(data)
            if str(header.get("id")) not in self.pending:
                await self._send_error(f"answer for unknown request id {header.get('id')!r}")
                return
            single = "parts" not in header  # the answer is this one frame: its size is len(data)
            whole = self.parts.feed(header, payload)
        except wire.WireError as exc:
            await self._send_error(str(exc))
            return
        if whole is None:
            return  # more parts to come
        header, payload = whole
        key = str(header.get("id"))  # a streamed batch's answers keep it pending until the last
        reply_to = self.pending.get(key) if header.get("more") else self.pending.pop(key, None)
        if reply_to is None:
            await self._send_error(f"answer for unknown request id {header.get('id')!r}")
            return
        msg = {"type": "agent.reply", "id": header["id"], "header": header, "payload": payload}
        if single:
            msg["bytes"] = len(data)
        await self._reply(reply_to, msg)

    async def _reply(self, reply_to: str | asyncio.Future, msg: dict) -> None:
        """Hand an answer to the waiting router (``router.ws.hand_reply``)."""
        await hand_reply(self.channel_layer, reply_to, msg)

    async def _send_error(self, message: str, field: str = "frame", ref: str | None = None):
        await self.send(text_data=json.dumps(messages.socket_error(message, field=field, ref=ref)))

    async def agent_request(self, event):
        """Channel-layer event from a router: write the request to the agent, in part frames when
        it is above the socket's cap (the agent executes it whole)."""
        try:
            frames = wire.split_frames(event["header"], event.get("payload") or b"", settings.TENZRO["WS_MAX_MESSAGE"])
        except wire.WireError as exc:
            await self.channel_layer.send(event["reply_to"], {
                "type": "agent.reply", "id": event["id"],
                "header": messages.failure(event["id"], "too_large", str(exc)), "payload": b""})
            return
        self.pending[event["id"]] = event["reply_to"]
        for frame in frames:
            await self.send(bytes_data=frame)

    async def relay(self, req_id: str, header: dict, payload: bytes, answer: asyncio.Future,
                    encoded: bytes | None = None) -> None:
        """A router in this process and loop: write the request (in part frames above the socket's
        cap); the answer resolves ``answer`` directly (``router.ws.LocalSocket``). ``encoded``:
        ``header``'s compact JSON when the router already has it (``wire.split_frames``).

        Raises ``wire.WireError`` when the message cannot be split below the cap."""
        frames = wire.split_frames(header, payload, settings.TENZRO["WS_MAX_MESSAGE"], encoded)
        self.pending[req_id] = answer
        for frame in frames:
            await self.send(bytes_data=frame)
