"""A Kvasir expert worker written from ``kvasir_market_contract.md`` §1–§3 alone (a test client, not
product code): what a phone or desktop does to serve a site's experts.

1. Wallet auth (§2): an ed25519 key (PyNaCl); the wallet is its base58 public key; sign the
   challenge message's UTF-8 bytes, standard base64 → a node token.
2. ``POST /api/expert-volunteer`` (logged; the operator pins what this process serves with
   ``--layer`` / ``--experts``), then the shard download
   ``GET /api/proxy/models/{model}/expert-shard?layer=&expert_begin=&expert_end=`` (Content-Length
   and the metadata's layer and range checked), weights dequantized with gguf-py.
3. A loopback TCP server speaking the worker compute protocol (§3: v1, v2, v2f16; any invalid
   request closes the connection), computing with numpy: out = W_down·(silu(W_gate·h) ⊙ W_up·h).
   ``--flip`` negates every output (a cheat).
4. Heartbeats ``POST /api/expert-coverage`` with ``url: "relay:<session>"`` every ``--interval``
   seconds; once wired, a relay client (``websockets``) dials ``/api/expert-relay?session=&token=``
   and joins the socket to a fresh TCP connection to its own server, bytes both ways, redialing
   after a close.

Prints one JSON line ``{"worker_id", "wallet", "port", "layer", "experts"}`` once serving and
wired; runs until SIGINT / SIGTERM.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import signal
import socket
import struct
import sys
import tempfile

import httpx
import numpy as np
import websockets
from gguf import GGUFReader, GGMLQuantizationType
from gguf.quants import dequantize
from nacl.signing import SigningKey

B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def b58encode(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = ""
    while n:
        n, r = divmod(n, 58)
        out = B58[r] + out
    return "1" * (len(data) - len(data.lstrip(b"\0"))) + out


def login(http: httpx.Client, key: SigningKey) -> tuple[str, str]:
    wallet = b58encode(bytes(key.verify_key))
    ch = http.post("/api/auth/challenge", json={"wallet": wallet}).raise_for_status().json()
    sig = base64.b64encode(key.sign(ch["message"].encode("utf-8")).signature).decode()
    tok = http.post("/api/auth/node-token", json={"wallet": wallet, "nonce": ch["nonce"], "signature": sig})
    return wallet, tok.raise_for_status().json()["node_token"]


def load_shard(data: bytes, layer: int, begin: int, end: int) -> dict[str, np.ndarray]:
    """``{gate, up: f32 [E, I, H], down: f32 [E, H, I]}`` from a mini-GGUF, its metadata checked."""
    with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
        f.write(data)
        f.flush()
        g = GGUFReader(f.name)
        meta = {k: g.fields[f"kvasir.expert_shard.{k}"].contents() for k in ("layer", "expert_begin", "expert_end")}
        if meta != {"layer": layer, "expert_begin": begin, "expert_end": end}:
            raise SystemExit(f"the shard holds {meta}, not layer {layer} experts [{begin}, {end})")
        out = {}
        for t in g.tensors:
            part = t.name.split(".")[2].split("_")[1]  # blk.L.ffn_<part>_exps.weight
            shape = tuple(int(x) for x in reversed(t.shape))
            arr = (np.array(t.data, dtype=np.float32) if t.tensor_type == GGMLQuantizationType.F32
                   else dequantize(np.array(t.data), t.tensor_type).astype(np.float32))
            out[part] = arr.reshape(shape)
    return out


class Experts:
    """The shard's experts; ``run(local_id, rows f32 [n, H]) -> f32 [n, H]``."""

    def __init__(self, w: dict[str, np.ndarray], flip: bool):
        self.w, self.flip = w, flip
        self.n_local, _, self.n_embd = w["gate"].shape

    def run(self, e: int, x: np.ndarray) -> np.ndarray:
        gate = x @ self.w["gate"][e].T
        up = x @ self.w["up"][e].T
        act = gate / (1.0 + np.exp(-gate)) * up
        out = act @ self.w["down"][e].T
        return -out if self.flip else out


class Invalid(Exception):
    """An invalid request: the connection is closed (§3: there is no error frame)."""


async def serve_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ex: Experts) -> None:
    """One connection: any number of requests, strictly one request then one response."""
    h = ex.n_embd
    try:
        while True:
            first = struct.unpack("<i", await reader.readexactly(4))[0]
            if first in (-2, -3):
                n_rows, n_pairs = struct.unpack("<ii", await reader.readexactly(8))
                if not (1 <= n_rows <= 8192 and 1 <= n_pairs <= 65536):
                    raise Invalid("counts")
                fdt, fsz = ("<f2", 2) if first == -3 else ("<f4", 4)
                rows = np.frombuffer(await reader.readexactly(n_rows * h * fsz), fdt).astype(np.float32)
                rows = rows.reshape(n_rows, h)
                row_idx = np.frombuffer(await reader.readexactly(4 * n_pairs), "<i4")
                ids = np.frombuffer(await reader.readexactly(4 * n_pairs), "<i4")
                probs = np.frombuffer(await reader.readexactly(n_pairs * fsz), fdt).astype(np.float32)
                if (row_idx < 0).any() or (row_idx >= n_rows).any() or (ids < 0).any() or (ids >= ex.n_local).any():
                    raise Invalid("ids")
                out = np.zeros((n_rows, h), dtype=np.float32)
                for e in np.unique(ids):
                    sel = np.nonzero(ids == e)[0]
                    res = ex.run(int(e), rows[row_idx[sel]])
                    np.add.at(out, row_idx[sel], probs[sel, None] * res)
                writer.write(out.astype(fdt).tobytes())
            elif first >= 1:
                n_used, n_tok = first, struct.unpack("<i", await reader.readexactly(4))[0]
                if not (n_used <= 64 and 1 <= n_tok <= 8192):
                    raise Invalid("counts")
                cur = np.frombuffer(await reader.readexactly(4 * n_tok * h), "<f4").reshape(n_tok, h)
                sel = np.frombuffer(await reader.readexactly(4 * n_tok * n_used), "<i4").reshape(n_tok, n_used)
                if (sel < 0).any() or (sel >= ex.n_local).any() or any(len(set(r)) != n_used for r in sel.tolist()):
                    raise Invalid("ids")
                out = np.zeros((n_tok, n_used, h), dtype=np.float32)
                for u in range(n_used):
                    for e in np.unique(sel[:, u]):
                        t = np.nonzero(sel[:, u] == e)[0]
                        out[t, u] = ex.run(int(e), cur[t])
                writer.write(out.astype("<f4").tobytes())
            else:
                raise Invalid("variant")
            await writer.drain()
    except (asyncio.IncompleteReadError, Invalid, ConnectionError):
        pass
    finally:
        writer.close()


async def join(ws, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy bytes both ways between the relay socket and the loopback connection until either ends."""

    async def up():  # worker → site
        while data := await reader.read(65536):
            await ws.send(data)
        await ws.close()

    async def down():  # site → worker
        async for msg in ws:
            writer.write(msg if isinstance(msg, bytes) else msg.encode())
            await writer.drain()

    tasks = [asyncio.ensure_future(up()), asyncio.ensure_future(down())]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for t in tasks:
        t.cancel()
    writer.close()


async def relay(url: str, port: int, stop: asyncio.Event) -> None:
    """Dial the relay and join it to a fresh loopback connection; redial a second after a close."""
    while not stop.is_set():
        try:
            async with websockets.connect(url, max_size=None, open_timeout=10) as ws:
                await join(ws, *await asyncio.open_connection("127.0.0.1", port))
        except (OSError, websockets.WebSocketException, asyncio.TimeoutError):
            pass
        await asyncio.sleep(1.0)


async def main_async(args) -> None:
    key = SigningKey.generate()
    http = httpx.Client(base_url=args.site, timeout=60)
    wallet, token = login(http, key)
    auth = {"Authorization": f"Bearer {token}"}
    vol = http.post("/api/expert-volunteer", json={"model": args.model, "max_experts": 64}, headers=auth).json()
    print(f"volunteer: {vol}", file=sys.stderr, flush=True)
    begin, end = (int(v) for v in args.experts.split(":"))
    r = http.get(f"/api/proxy/models/{args.model}/expert-shard",
                 params={"layer": args.layer, "expert_begin": begin, "expert_end": end}, headers=auth)
    r.raise_for_status()
    if int(r.headers["content-length"]) != len(r.content):
        raise SystemExit("truncated shard")
    ex = Experts(load_shard(r.content, args.layer, begin, end), args.flip)
    server = await asyncio.start_server(lambda rd, wr: serve_one(rd, wr, ex), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    for s in server.sockets:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    body = {"worker_id": args.worker_id, "model": args.model.rsplit("/", 1)[-1], "segments": [[args.layer, begin, end]],
            "n_layer": vol.get("n_layer", 0), "n_expert": vol.get("n_expert", 0), "url": f"relay:{args.session}",
            "owner": wallet, "os": "linux", "device_kind": "server", "backend": "numpy"}
    cov = await asyncio.to_thread(lambda: http.post("/api/expert-coverage", json=body, headers=auth).json())
    if not cov.get("wired"):
        raise SystemExit(f"coverage not wired: {cov}")
    ws_url = args.site.replace("http", "ws", 1) + f"/api/expert-relay?session={cov['session']}&token={token}"
    relay_task = asyncio.ensure_future(relay(ws_url, port, stop))
    print(json.dumps({"worker_id": args.worker_id, "wallet": wallet, "port": port, "layer": args.layer,
                      "experts": [begin, end]}), flush=True)
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), args.interval)
        except asyncio.TimeoutError:
            await asyncio.to_thread(lambda: http.post("/api/expert-coverage", json=body, headers=auth))
    relay_task.cancel()
    server.close()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--site", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--session", default="")
    p.add_argument("--layer", type=int, required=True)
    p.add_argument("--experts", required=True, help="BEGIN:END (end exclusive)")
    p.add_argument("--interval", type=float, default=15.0)
    p.add_argument("--flip", action="store_true", help="negate every output (a cheating worker)")
    asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    main()
