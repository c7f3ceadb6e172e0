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


#: HTTP answers that say "retry": the balancer's (a site process died with the request in
#: flight: 502; none available: 503) and the site's (busy: 429; a forward failed: 503).
RETRYABLE = (429, 502, 503, 504)


@dataclass
class Completion:
    """One greedy ``/v1/completions`` request with at most one retry: ``token_ids`` of the
    answer that succeeded (None when none did), ``first`` the first attempt's HTTP status (or
    exception name), ``first_error`` its JSON error body when it failed, ``retried``."""

    token_ids: list[int] | None
    first: int | str
    first_error: dict | None = None
    retried: bool = False


def complete_once_retrying(client: httpx.Client, url: str, model: str, prompt: list[int], max_tokens: int) -> Completion:
    """POST ``url``/v1/completions (greedy, token-id ``prompt``); a retryable failure (a JSON
    ``error`` body with a ``RETRYABLE`` status) is retried once after its ``Retry-After``
    (at most 5 s). A non-JSON or non-retryable failure is returned as is (``token_ids`` None)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}

    def attempt():
        try:
            resp = client.post(f"{url}/v1/completions", json=body)
        except httpx.HTTPError as exc:
            return type(exc).__name__, None, 0.0
        try:
            data = resp.json()
        except ValueError:
            data = None
        wait = min(5.0, float(resp.headers.get("retry-after") or 1))
        return resp.status_code, data, wait

    status, data, wait = attempt()
    if status == 200:
        return Completion(data["choices"][0]["token_ids"], status)
    clean = status in RETRYABLE and isinstance(data, dict) and isinstance(data.get("error"), dict)
    if not clean:
        return Completion(None, status, data)
    time.sleep(wait)
    status2, data2, _ = attempt()
    return Completion(data2["choices"][0]["token_ids"] if status2 == 200 else None, status, data["error"], True)
