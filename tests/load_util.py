"""Load against a running cluster: many concurrent JSON-RPC clients.

Used by the chaos tests and ``bench/bench_load.py``. ``fire`` runs N clients at once, each
sending its forwards one after another, and returns one ``Outcome`` per request (latency
and error kind). (A black-hole holder is a real agent process: ``holder_agent --fault blackhole``.)
"""
from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass

import httpx
import numpy as np

from moe import wire


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
