"""The Kvasir relay socket ``GET /api/expert-relay?session=<s>&token=<t>`` (contract §1.8), with this
site as the coordinator (issue 27 items 3–4).

A relay-wired market worker (its coverage post named ``url: "relay:<s>"``, ``registry.market``)
dials here; its side of the relay joins the socket to its loopback worker
(``linkcpp-expert-worker --serve``), so the binary frames carry the worker compute protocol's byte
stream (§3) in arbitrary chunks. The consumer is the holder ``kvasir:<worker_id>``
(``moe.transports.kvasir.provider_id``) to the routers: it registers as a local socket and joins
the channel group of that id (``router.ws``), takes requests (``relay`` in this process and loop,
``agent.request`` through the channel layer) whose header names the response size
(``{"type": "kvasir", "expect": n}``), writes their bytes, and answers each with the next ``n``
bytes of the stream (the worker answers strictly in order). A closed socket fails its pending
requests at once (a closed socket is a failed worker).

Refusals complete the 101 and then close, as the JS bridge does: 4401 (no valid node token or
service secret), 4404 (no coverage post created the session), 4403 (the worker is quarantined
for fraud). The newest socket of a session wins: an older one is closed with 4410. The site
sends binary frames only; a text frame from the worker closes with 1003.
Every ``MARKET_RELAY_CHECK_S`` the socket checks its session is still live (a worker quiet for
120 s is evicted and its socket closed with 4404); every ``MARKET_RELAY_CREDIT_S`` and on close
the bytes it carried are credited to the session owner (``registry.market.relay_credit``).
"""
from __future__ import annotations

import asyncio
import logging
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings

from moe import messages
from moe.transports.kvasir import KvasirProtocolError, ResponseStream, provider_id
from registry import market
from router.ws import ROUTERS_GROUP, agent_group, hand_reply, presence_event, register_local, unregister_local

log = logging.getLogger(__name__)

CLOSE_UNSUPPORTED = 1003  # a text frame: the relay carries a byte stream
CLOSE_SUPERSEDED = 4410  # a newer socket of the same session joined (as agent sockets, router.consumers)


class KvasirRelayConsumer(AsyncWebsocketConsumer):
    """One relay socket of one Kvasir worker (module docstring)."""

    provider: str | None = None

    async def connect(self):
        """Accept (the 101), then join the session or close with the refusal's code."""
        self.loop = asyncio.get_running_loop()
        self.stream = ResponseStream()
        self.waiting: list[tuple[str, object]] = []  # (request id, future or reply channel), in send order
        self.ws2tcp = self.tcp2ws = 0  # bytes not credited yet
        self._timer: asyncio.Task | None = None
        await self.accept()
        query = parse_qs((self.scope.get("query_string") or b"").decode("latin-1"))
        try:
            self.worker_id, self.owner = await database_sync_to_async(market.relay_open)(
                (query.get("token") or [""])[0], (query.get("session") or [""])[0], self.channel_name)
        except market.MarketError as exc:
            await self.close(code=exc.status, reason=exc.message)
            return
        self.provider = provider_id(self.worker_id)
        # The newest socket of a session wins: an older one (a redial before the old TCP died)
        # would otherwise get the same requests through the group.
        await self.channel_layer.group_send(agent_group(self.provider), {"type": "kvasir.superseded",
                                                                         "channel": self.channel_name})
        register_local(self.provider, self)
        await self.channel_layer.group_add(agent_group(self.provider), self.channel_name)
        await self.channel_layer.group_send(ROUTERS_GROUP, presence_event(self.provider, True))
        self._timer = self.loop.create_task(self._watch())

    async def _watch(self):
        """Credit bytes and check the session's liveness periodically; close when it is gone."""
        t = settings.TENZRO
        check_s, credit_s = float(t["MARKET_RELAY_CHECK_S"]), float(t["MARKET_RELAY_CREDIT_S"])
        since_credit = 0.0
        while True:
            await asyncio.sleep(check_s)
            since_credit += check_s
            if since_credit >= credit_s:
                since_credit = 0.0
                await self._credit(False)
            if not await database_sync_to_async(market.relay_live)(self.worker_id):
                await self.close(code=market.CLOSE_UNKNOWN_SESSION, reason="relay session expired or quarantined")
                return

    async def _credit(self, closed: bool) -> None:
        out, back, self.ws2tcp, self.tcp2ws = self.ws2tcp, self.tcp2ws, 0, 0
        await database_sync_to_async(market.relay_credit)(self.worker_id, self.owner, out, back, closed,
                                                          self.channel_name)

    async def disconnect(self, code):
        """Fail the pending requests at once, leave the group, tell the routers, credit the bytes."""
        if self.provider is None:
            return
        if self._timer is not None:
            self._timer.cancel()
        unregister_local(self.provider, self)
        waiting, self.waiting = self.waiting, []
        for req_id, reply_to in waiting:
            await self._reply(reply_to, req_id, messages.failure(req_id, "disconnected", "Kvasir worker disconnected"),
                              b"")
        await self.channel_layer.group_discard(agent_group(self.provider), self.channel_name)
        await self._credit(True)
        if await database_sync_to_async(market.relay_holder)(self.worker_id) in ("", self.channel_name):
            # the session's last socket: routers fail its pending requests at once (not when superseded)
            await self.channel_layer.group_send(ROUTERS_GROUP, presence_event(self.provider, False))

    async def receive(self, text_data=None, bytes_data=None):
        """Worker → site bytes: complete the oldest pending requests they answer."""
        if self.provider is None:
            return  # frames racing a refusal's close
        if bytes_data is None:
            await self.close(code=CLOSE_UNSUPPORTED, reason="the relay carries binary frames only")
            return
        self.tcp2ws += len(bytes_data)
        try:
            done = self.stream.feed(bytes_data)
        except KvasirProtocolError as exc:
            log.warning("Kvasir worker %s: %s; closing its relay", self.worker_id, exc)
            await self.close(code=1002, reason="unrequested bytes")
            return
        for data in done:
            req_id, reply_to = self.waiting.pop(0)
            await self._reply(reply_to, req_id, {"id": req_id, "ok": True, "transport": "kvasir"}, data)

    async def _reply(self, reply_to, req_id: str, header: dict, payload: bytes) -> None:
        await hand_reply(self.channel_layer, reply_to,
                         {"type": "agent.reply", "id": req_id, "header": header, "payload": payload})

    async def _write(self, req_id: str, header: dict, payload: bytes, reply_to) -> None:
        expect = header.get("expect")
        if header.get("type") != "kvasir" or not isinstance(expect, int) or expect <= 0:
            await self._reply(reply_to, req_id, messages.failure(req_id, "bad_request",
                                                                 "a Kvasir relay takes kvasir requests only"), b"")
            return
        self.stream.expect(expect)
        self.waiting.append((req_id, reply_to))
        self.ws2tcp += len(payload)
        await self.send(bytes_data=payload)

    async def relay(self, req_id: str, header: dict, payload: bytes, answer: asyncio.Future,
                    encoded: bytes | None = None) -> None:
        """A router in this process and loop (``router.ws.LocalSocket``): write the request bytes;
        ``answer`` resolves with the response bytes (``payload``). ``encoded`` (the header's
        JSON) is not written: only the payload goes to a Kvasir worker."""
        await self._write(req_id, header, payload, answer)

    async def agent_request(self, event):
        """Channel-layer event from a router in another process or loop: as ``relay``."""
        await self._write(event["id"], event.get("header") or {}, event.get("payload") or b"", event["reply_to"])

    async def kvasir_quarantined(self, event):
        """Channel-layer event: an audit caught this worker; close its relay."""
        await self.close(code=market.CLOSE_QUARANTINED, reason="quarantined for returning wrong rows")

    async def kvasir_superseded(self, event):
        """Channel-layer event: a newer socket joined this session; close this one."""
        if event.get("channel") != self.channel_name:
            await self.close(code=CLOSE_SUPERSEDED, reason="superseded by a newer relay socket of this session")

    async def agent_ping(self, event):
        """Answer a liveness ping (same contract as ``AgentConsumer.agent_ping``)."""
        await self.channel_layer.send(event["reply_to"], {"type": "agent.pong", "channel": event["channel"]})
