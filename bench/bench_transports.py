"""The data-plane transports for ``bench_forward.py --transport``: what an agent process serves
and how the bench's router reaches it.

- ``http``: binary frames to the agent's ``POST /frame`` (``holders.transports.http``).
- ``iroh``: ``moe/execute`` over QUIC to the agent's iroh endpoint by endpoint id and direct
  address (``holders.transports.iroh``; JSON frames with base64 rows, 4 MiB cap).
- ``ws``: the agent socket's binary frames (``wire.pack_frame``) over a WebSocket the agent
  opens to the bench (``HolderAgent._run_socket``: challenge, signed hello, welcome, then
  frames). The bench writes each request straight onto the socket and matches the answer by
  id: the site's Channels-layer hop (``group_send`` → consumer → socket) is not in this
  number, only framing and the websockets library on both ends.

Each agent serves every transport asked for at once, so one set of agent processes is
measured over each transport in the same run. Imports nothing from Django.

Run alone (``.venv/bin/python bench/bench_transports.py``) it measures the frame codec of
each transport without a network: CPU ms per batch (Q8_0 rows out, bf16 rows back, H 2048,
with a receipt), both ends together (router encode, holder decode/reassemble, holder encode,
router decode), ratio against the binary frames of the socket and HTTP.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from holders import messages, wire
from holders.messages import answer_to_batch
from holders.transports import iroh

TRANSPORTS = ("http", "iroh", "ws")


async def serve_agent(agent, ws_site: str | None, with_iroh: bool) -> dict:
    """Start the agent's extra transports: its socket to ``ws_site`` (a ``SocketHub``) and an
    iroh endpoint on 127.0.0.1. Returns what the router needs: ``iroh_endpoint_id``, ``iroh_addrs``."""
    out = {}
    if with_iroh:
        # Held by the agent: the loop keeps only weak references to the server's tasks.
        agent.iroh = await iroh.IrohServer(iroh.endpoint_secret(agent.key.encode()), "127.0.0.1:0",
                                           agent.execute_rpc, agent.status).start()
        out.update(iroh_endpoint_id=agent.iroh.endpoint_id, iroh_addrs=agent.iroh.addrs)
    if ws_site:
        agent.site, agent.url = ws_site, ws_site.replace("http://", "ws://") + "/ws/agent/"
        agent._loop = asyncio.get_running_loop()
        agent.bench_socket = asyncio.get_running_loop().create_task(agent._run_socket())
    return out


class SocketHub:
    """The bench router's end of the agents' sockets: a WebSocket server on 127.0.0.1 that
    admits an agent after its signed hello and sends it execute frames (answers by id)."""

    def __init__(self):
        self.sockets: dict[str, object] = {}
        self.pending: dict[str, asyncio.Future] = {}
        self.server = None
        self.url = ""
        self.joined = asyncio.Event()

    async def start(self) -> "SocketHub":
        from websockets.asyncio.server import serve
        # No permessage-deflate: daphne (autobahn) does not accept it, so the real socket is uncompressed.
        self.server = await serve(self._agent, "127.0.0.1", 0, max_size=None, ping_interval=None, compression=None)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def _agent(self, ws) -> None:
        from registry.identity import DOMAIN_HELLO, verify
        nonce = os.urandom(32)
        await ws.send(json.dumps(messages.challenge(nonce)))
        hello = json.loads(await ws.recv())
        verify(hello["provider"], DOMAIN_HELLO, nonce, hello["signature"])
        await ws.send(json.dumps(messages.welcome(hello["provider"], 1 << 20, 3600)))
        self.sockets[hello["provider"]] = ws
        self.joined.set()
        from websockets.exceptions import ConnectionClosed
        try:
            async for frame in ws:
                if isinstance(frame, bytes):
                    header, payload = wire.unpack_frame(frame)
                    fut = self.pending.pop(header.get("id"), None)
                    if fut is not None and not fut.done():
                        fut.set_result((header, payload, len(frame)))
        except ConnectionClosed:  # the agent process ended
            pass

    async def send(self, provider: str, _holder, req) -> object:
        """One ``BatchRequest`` over ``provider``'s socket; its ``BatchAnswer``."""
        frame = wire.pack_frame(messages.request_header(req), req.payload)
        fut = asyncio.get_running_loop().create_future()
        self.pending[req.request_id] = fut
        await self.sockets[provider].send(frame)
        answer, payload, back = await fut
        return answer_to_batch(answer, payload, req, "ws", len(frame), back)

    async def close(self) -> None:
        """Close the agents' sockets and stop serving."""
        self.server.close()
        await self.server.wait_closed()


def make_send(transport: str, hub: SocketHub | None = None):
    """(send, close) of the bench router for ``transport``; ``hub`` is required for ``ws``."""
    if transport == "http":
        from holders.transports.http import HttpHolderClient
        client = HttpHolderClient(120)

        async def send(provider, holder, req):
            return await client.execute_frame(holder.http_endpoint, req)

        return send, client.close
    if transport == "iroh":
        client = iroh.IrohHolderClient(120, "127.0.0.1:0")
        peers: dict[str, tuple[str, list[str]]] = {}

        async def send(provider, holder, req):
            return await client.execute(holder.iroh_endpoint_id, peers[provider][1], req)

        send.peers = peers  # filled by the caller from the agents' ready lines
        return send, client.close
    if transport == "ws":
        return hub.send, (lambda: asyncio.sleep(0))
    raise SystemExit(f"--transport must be one of {', '.join(TRANSPORTS)} or all")


def codec_cpu_ms(rows: int, hidden: int = 2048, repeat: int = 30) -> dict:
    """CPU ms per batch of each transport's frame codec, both ends (see the module docstring)."""
    import numpy as np

    from holders.messages import BatchRequest

    x = np.random.default_rng(0).standard_normal((rows, hidden)).astype(np.float32)
    payload, out = wire.encode_rows(x, "q8_0"), wire.encode_rows(x, "bf16")
    req = BatchRequest("r" * 32, "m", 0, 1, list(range(rows)), "q8_0", payload, "bf16", hidden)
    receipt = {"commitment": [[list(range(8)), [0.5] * 8] for _ in range(rows)], "signature": "ab" * 64}
    answer = {"d_model": hidden, "output": "bf16", "token_indices": req.tokens, "receipt": receipt}

    def binary():
        header, data = wire.unpack_frame(wire.pack_frame(messages.request_header(req), req.payload))
        wire.unpack_frame(wire.pack_frame(messages.reply(header["id"], rows=rows, **answer), out))

    def iroh_json():
        params, _, data = iroh.assemble([json.loads(f[4:]) for f in iroh.request_frames(req)])
        for f in iroh.answer_frames(1, params, answer, out):
            wire.b64decode(json.loads(f[4:])["result"]["outputs"], "outputs")

    got = {}
    for name, fn in (("binary (ws, http)", binary), ("iroh JSON", iroh_json)):
        fn()
        t0 = time.process_time()
        for _ in range(repeat):
            fn()
        got[name] = (time.process_time() - t0) / repeat * 1e3
    return got


if __name__ == "__main__":
    for n in (32, 256):
        ms = codec_cpu_ms(n)
        base = ms["binary (ws, http)"]
        print(f"{n:4d} rows: " + ", ".join(f"{k} {v:.2f} ms CPU ({v / base:.1f}x)" for k, v in ms.items()))
