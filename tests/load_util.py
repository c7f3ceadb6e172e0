"""Load against a running cluster: many concurrent JSON-RPC clients, and a black-hole holder.

Used by the chaos tests and ``bench/bench_load.py``. ``fire`` runs N clients at once, each
sending its forwards one after another, and returns one ``Outcome`` per request (latency
and error kind). ``BlackHole`` is a raw agent socket: hello, signed heartbeats declaring
every given expert ``Warm`` with a huge ``committed_tps``, and it never answers a request.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import statistics
import threading
import time
from dataclasses import dataclass

import httpx
import numpy as np
from nacl.signing import SigningKey
from websockets.asyncio.client import connect

from holders import wire
from registry.identity import DOMAIN_HEARTBEAT, DOMAIN_HELLO, provider_id, sign, sign_body


@dataclass
class Outcome:
    """One request: ``ms`` wall time, ``kind`` "ok" or the error kind (JSON-RPC code, HTTP
    status, or exception name), ``result`` the JSON-RPC result when ok."""

    ms: float
    kind: str
    result: dict | None = None


def forward_body(model_id: str, layer: int, x: np.ndarray, req_id: int = 1, **extra) -> dict:
    """A ``tenzro_moeForward`` request for hidden states ``x`` f32 [T, H] (exact f32 carrier)."""
    return {"jsonrpc": "2.0", "id": req_id, "method": "tenzro_moeForward",
            "params": {"model_id": model_id, "layer": layer, "d_model": int(x.shape[1]), "carrier": "f32",
                       "hidden_states": wire.b64encode(wire.encode_f32(np.ascontiguousarray(x, np.float32))),
                       **extra}}


def _kind(resp: httpx.Response) -> tuple[str, dict | None]:
    try:
        body = resp.json()
    except ValueError:
        return f"http{resp.status_code}", None
    if isinstance(body, dict) and "result" in body:
        return "ok", body["result"]
    if isinstance(body, dict) and "error" in body:
        return f"rpc{body['error'].get('code')}", None
    return f"http{resp.status_code}", None


async def _fire(url: str, bodies: list[list[dict]], timeout: float) -> list[Outcome]:
    limits = httpx.Limits(max_connections=len(bodies) + 1, max_keepalive_connections=len(bodies) + 1)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        async def one_client(mine: list[dict]) -> list[Outcome]:
            out = []
            for body in mine:
                t = time.perf_counter()
                try:
                    kind, result = _kind(await client.post(url, json=body))
                except httpx.HTTPError as exc:
                    kind, result = type(exc).__name__, None
                out.append(Outcome((time.perf_counter() - t) * 1e3, kind, result))
            return out

        per = await asyncio.gather(*(one_client(b) for b in bodies))
    return [o for client_outcomes in per for o in client_outcomes]


def fire(url: str, bodies: list[list[dict]], timeout: float = 120.0) -> tuple[list[Outcome], float]:
    """Run ``len(bodies)`` clients at once, client ``i`` posting ``bodies[i]`` in order.
    Returns (outcomes of every request, wall seconds of the whole run)."""
    t = time.perf_counter()
    out = asyncio.run(_fire(url, bodies, timeout))
    return out, time.perf_counter() - t


def summary(outcomes: list[Outcome], wall_s: float) -> dict:
    """Throughput (ok forwards/s over the wall time), p50/p99 latency (ms, every request) and
    errors by kind."""
    ms = sorted(o.ms for o in outcomes)
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.kind != "ok":
            errors[o.kind] = errors.get(o.kind, 0) + 1
    ok = sum(1 for o in outcomes if o.kind == "ok")

    def pct(p):
        return round(ms[min(len(ms) - 1, int(p * len(ms)))], 1) if ms else None

    return {"requests": len(outcomes), "ok": ok, "errors": errors, "wall_s": round(wall_s, 2),
            "throughput_per_s": round(ok / wall_s, 2) if wall_s else None, "p50_ms": pct(0.50), "p99_ms": pct(0.99),
            "mean_ms": round(statistics.fmean(ms), 1) if ms else None}


class BlackHole:
    """A raw agent that claims ``holdings`` (``(model_id, layer, expert)``) Warm with
    ``committed_tps`` 1,000,000 on signed heartbeats and never answers a request.

    ``start()`` returns once the site acknowledged the first heartbeat; ``stop()`` closes the
    socket. ``requests`` counts the request frames it swallowed.
    """

    def __init__(self, site_url: str, holdings: list[tuple[str, int, int]], interval: float = 2.0):
        self.ws_url = site_url.replace("http://", "ws://").rstrip("/") + "/ws/agent/"
        self.holdings, self.interval = holdings, interval
        self.key = SigningKey.generate()
        self.provider = provider_id(self.key)
        self.requests = 0
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._error: BaseException | None = None

    def heartbeat(self) -> dict:
        """A signed heartbeat declaring every holding Warm at a huge committed rate."""
        body = {"provider": self.provider, "timestamp_ms": int(time.time() * 1000), "nonce": secrets.token_hex(16),
                "name": "black-hole", "roles": ["ExpertHolder"], "http_endpoint": "", "iroh_endpoint_id": "",
                "moe_gpu": False, "holdings": [{"model_id": m, "layer": layer, "expert": e, "residency": "Warm",
                                                "committed_tps": 1_000_000, "blob_uri": ""}
                                               for m, layer, e in self.holdings]}
        return {"type": "heartbeat", "body": body, "signature": sign_body(self.key, DOMAIN_HEARTBEAT, body)}

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            async with connect(self.ws_url, max_size=None) as ws:
                nonce = bytes.fromhex(json.loads(await ws.recv())["nonce"])
                await ws.send(json.dumps({"type": "hello", "provider": self.provider,
                                          "signature": sign(self.key, DOMAIN_HELLO, nonce)}))
                assert json.loads(await ws.recv())["type"] == "welcome"

                async def beat():
                    while True:
                        await ws.send(json.dumps(self.heartbeat()))
                        await asyncio.sleep(self.interval)

                async def swallow():
                    async for frame in ws:
                        if isinstance(frame, bytes):
                            self.requests += 1
                        elif json.loads(frame).get("type") == "heartbeat_ack":
                            self._ready.set()
                        else:
                            raise AssertionError(f"site refused the black hole: {frame}")

                tasks = [asyncio.create_task(beat()), asyncio.create_task(swallow())]
                await self._stop.wait()
                for t in tasks:
                    t.cancel()
        except BaseException as exc:  # surfaced by start()
            self._error = exc
            self._ready.set()

    def start(self, timeout: float = 20.0) -> "BlackHole":
        """Connect, say hello, heartbeat; raises ``RuntimeError`` when the site did not ack."""
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            raise RuntimeError(f"black-hole holder did not join: {self._error!r}")
        return self

    def stop(self) -> None:
        """Close the socket and end the thread."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
