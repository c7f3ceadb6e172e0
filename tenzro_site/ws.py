"""WebSocket paths no consumer serves: refused with a close frame, never an HTTP 500.

Channels' ``URLRouter`` raises ``ValueError("No route found for path …")`` for an unknown path,
which daphne turns into an HTTP 500 handshake answer. ``UnknownPathConsumer`` is the router's
last route instead: it completes the 101 handshake and closes with 4404 and a reason naming the
path, the way the Kvasir relay refuses (contract §1.8, §1.12 row 12: "101 then close"), so a
client sees a deliberate refusal rather than a server fault.
"""
from __future__ import annotations

from channels.generic.websocket import AsyncWebsocketConsumer

CLOSE_UNKNOWN_PATH = 4404


class UnknownPathConsumer(AsyncWebsocketConsumer):
    """Accepts, then closes with ``CLOSE_UNKNOWN_PATH`` and reason ``no WebSocket endpoint at <path>``
    (the reason cut to the protocol's 123-byte limit; daphne 4.2 sends the code only, other ASGI
    servers the reason too)."""

    async def connect(self):
        await self.accept()
        reason = f"no WebSocket endpoint at {self.scope.get('path', '?')}".encode()[:123]
        await self.close(code=CLOSE_UNKNOWN_PATH, reason=reason.decode(errors="ignore"))

    async def receive(self, text_data=None, bytes_data=None):
        """Frames that race the close are dropped."""
