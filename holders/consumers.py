"""Site side of the agent WebSocket ``/ws/agent/`` (DESIGN §6).

Handshake: the site sends ``{"type": "challenge", "nonce": hex}``; the agent answers
``{"type": "hello", "provider": hex64, "signature": hex}`` signed over the nonce bytes
under ``identity.DOMAIN_HELLO``. A bad signature, a malformed hello, or no hello within
``AGENT_HELLO_TIMEOUT_S`` closes the socket with code 4401. Then: JSON text frames for
control (``heartbeat`` → ``heartbeat_ack`` or ``error``) and binary frames
(``wire.pack_frame``) for requests to the agent and its answers.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings

from holders import messages, repair_site, wire
from registry.identity import DOMAIN_HELLO, SignatureError, verify
from holders.transports.ws import ROUTERS_GROUP, agent_group, presence_event
from registry import services as registry_services
from registry.heartbeat import HeartbeatError

log = logging.getLogger(__name__)

CLOSE_AUTH = 4401


class AgentConsumer(AsyncWebsocketConsumer):
    """One holder agent's socket: authenticates it, ingests heartbeats, relays requests."""

    provider: str | None = None

    async def connect(self):
        """Accept, send the challenge nonce, and arm the hello timeout."""
        self.nonce = secrets.token_bytes(32)
        self.pending: dict[str, str] = {}  # request id → reply channel
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
        for req_id, reply_to in list(self.pending.items()):
            await self.channel_layer.send(reply_to, {
                "type": "agent.reply", "id": req_id,
                "header": messages.failure(req_id, "disconnected", "agent disconnected"),
                "payload": b""})
        self.pending.clear()
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
        try:
            msg = json.loads(text_data)
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
        self.provider = msg["provider"]
        self._hello_timer.cancel()
        await self.channel_layer.group_add(agent_group(self.provider), self.channel_name)
        await database_sync_to_async(registry_services.agent_connected)(self.provider, self.channel_name)
        await self.channel_layer.group_send(ROUTERS_GROUP, presence_event(self.provider, True))
        await self.send(text_data=json.dumps(messages.welcome(self.provider, settings.TENZRO["WS_MAX_MESSAGE"],
                                                              settings.TENZRO["HEARTBEAT_INTERVAL_S"])))

    async def _heartbeat(self, msg):
        try:
            await database_sync_to_async(registry_services.ingest_heartbeat)(msg, self.provider)
        except (HeartbeatError, SignatureError) as exc:
            await self._send_error(str(exc), field=getattr(exc, "field", "signature"), ref="heartbeat")
            return
        await self.send(text_data=json.dumps(messages.HEARTBEAT_ACK))

    async def _answer(self, data: bytes):
        try:
            header, payload = wire.unpack_frame(data)
        except wire.WireError as exc:
            await self._send_error(str(exc))
            return
        reply_to = self.pending.pop(str(header.get("id")), None)
        if reply_to is None:
            await self._send_error(f"answer for unknown request id {header.get('id')!r}")
            return
        await self.channel_layer.send(reply_to, {"type": "agent.reply", "id": header["id"],
                                                 "header": header, "payload": payload})

    async def _send_error(self, message: str, field: str = "frame", ref: str | None = None):
        await self.send(text_data=json.dumps(messages.socket_error(message, field=field, ref=ref)))

    async def agent_request(self, event):
        """Channel-layer event from a router: write the request frame to the agent."""
        self.pending[event["id"]] = event["reply_to"]
        await self.send(bytes_data=wire.pack_frame(event["header"], event.get("payload") or b""))
