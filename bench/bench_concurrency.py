"""Concurrent clients of ``/v1/completions`` on a real cluster: continuous batching (issue 21).

Usage:  .venv/bin/python bench/bench_concurrency.py [--requests 32] [--clients 16] [--tokens 24]
        [--holders 3] [--checkpoint tests/fixtures/qwen3_moe_tiny] [--rounds 3] [--services]
        [--client aiohttp|httpx] [--json]

Starts ``manage.py tenzro_cluster`` with ``--holders`` agents on the checkpoint, then sends
``--requests`` completions (greedy, ``--tokens`` new tokens, token-id prompts of 4..16 ids)
two ways: one client at a time (the
baseline, each request's solo tokens), then ``--clients`` concurrent clients. Reports output
tokens/s of both, their ratio (issue goal ≥ 6× at 16 clients), p50/p99 latency, errors, and
how many concurrent requests got exactly their solo tokens (goal: all), and the CPU time the
site and the agents spent per generated token in each phase (``/proc``: steadier than tokens/s on
a shared machine, and it shows which process bounds the ratio: the site is one GIL-bound process).
Both phases run ``--rounds`` times, alternating, on the same warm cluster; the ratio is the
median of the rounds' ratios. ``--services`` runs the services deployment (PostgreSQL, Redis,
a Celery worker doing settlement and audits) instead of the embedded one.

The clients share this process and the machine's cores with the cluster, so the client's own
CPU per request is paid between one request's answer and the next one's arrival, and with
16 clients in one process those turnarounds queue behind each other. ``--client`` picks the
HTTP client: ``aiohttp`` (default; one keep-alive connection per client) or ``httpx`` (the
client until 2026-12: ~2 ms of CPU per request here against aiohttp's ~0.5, which cost the
16-client phase about 30 ms each time the 16 requests ended together).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "bench"))

from machine import cpu_seconds  # noqa: E402
from tests.cluster_util import env_for, fresh_postgres_db, running_cluster  # noqa: E402


@contextmanager
def deployment(tmp: Path, services: bool):
    """The cluster's environment: embedded (SQLite, no broker) or, with ``services``, a fresh
    PostgreSQL database and Redis with a Celery worker (as ``tenzro_cluster`` starts one)."""
    if not services:
        yield env_for(tmp)
        return
    pg = os.environ.get("TENZRO_TEST_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    redis = os.environ.get("TENZRO_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
    with fresh_postgres_db(pg) as db:
        yield env_for(tmp, database_url=db, redis_url=redis)


async def one(client, url: str, model: str, prompt: list[int], tokens: int) -> tuple[list, float]:
    """(token ids, seconds) of one greedy completion through ``client`` (an ``aiohttp.ClientSession``
    or an ``httpx.AsyncClient``)."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0}
    t0 = time.perf_counter()
    if isinstance(client, httpx.AsyncClient):
        r = await client.post(f"{url}/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        data = r.json()
    else:
        async with client.post(f"{url}/v1/completions", json=body) as r:
            r.raise_for_status()
            data = await r.json()
    return data["choices"][0]["token_ids"], time.perf_counter() - t0


def session(kind: str, clients: int):
    """The HTTP client of a phase: ``kind`` "aiohttp" or "httpx", ``clients`` connections at most."""
    if kind == "httpx":
        return httpx.AsyncClient(limits=httpx.Limits(max_connections=clients + 4))
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients + 4),
                                 timeout=aiohttp.ClientTimeout(total=600))


async def run(url: str, model: str, prompts: list[list[int]], tokens: int, clients: int,
              kind: str = "aiohttp") -> dict:
    """Send ``prompts`` with ``clients`` concurrent workers on a ``kind`` client (``session``);
    per-request tokens, latencies, errors."""
    queue = list(enumerate(prompts))
    out: dict[int, list] = {}
    lat, errors = [], []

    async def worker(client):
        while queue:
            i, p = queue.pop(0)
            try:
                ids, s = await one(client, url, model, p, tokens)
                out[i] = ids
                lat.append(s)
            except Exception as exc:  # counted, not fatal: the bench reports errors
                errors.append(f"{type(exc).__name__}: {str(exc)[:120]}")

    t0 = time.perf_counter()
    async with session(kind, clients) as client:
        await asyncio.gather(*(worker(client) for _ in range(clients)))
    wall = time.perf_counter() - t0
    new = sum(len(v) for v in out.values())
    return {"clients": clients, "wall_s": round(wall, 3), "tokens": new, "tokens_per_s": round(new / wall, 2),
            "p50_s": round(statistics.median(lat), 3) if lat else None,
            "p99_s": round(float(np.percentile(lat, 99)), 3) if lat else None, "errors": errors, "ids": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--holders", type=int, default=3)
    ap.add_argument("--checkpoint", default=str(ROOT / "tests/fixtures/qwen3_moe_tiny"))
    ap.add_argument("--model", default="qwen3-moe-tiny")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rounds", type=int, default=3,
                    help="solo-then-concurrent rounds on one warm cluster; the ratio reported is their median "
                         "(the concurrent phase lasts ~1.5 s: one hiccup of a shared machine moves one round)")
    ap.add_argument("--services", action="store_true",
                    help="the services deployment: PostgreSQL (TENZRO_TEST_DATABASE_URL, an admin URL: a fresh "
                         "database per run), Redis (TENZRO_TEST_REDIS_URL) and a Celery worker for settlement "
                         "and audits; default: the embedded one (SQLite, economy inline in the site)")
    ap.add_argument("--client", choices=("aiohttp", "httpx"), default="aiohttp",
                    help="the HTTP client of both phases (module docstring: its own CPU per request is paid "
                         "on the cluster's cores)")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 256, size=int(rng.integers(4, 17)))] for _ in range(a.requests)]
    with tempfile.TemporaryDirectory() as tmp, deployment(Path(tmp), a.services) as env, \
            running_cluster(Path(tmp), [Path(a.checkpoint)], holders=a.holders, env=env) as (info, _proc):
        url = info["url"]
        asyncio.run(run(url, a.model, prompts[:2], a.tokens, 1, a.client))  # warm: JIT, connections, caches
        rounds = []
        for _ in range(a.rounds):  # one client, then many, on the same warm cluster: a ratio per round
            phases = []
            for clients in (1, a.clients):
                cpu0 = cpu_seconds(info)
                r = asyncio.run(run(url, a.model, prompts, a.tokens, clients, a.client))
                r["cpu_ms_per_token"] = {k: round(1e3 * (v - cpu0[k]) / max(1, r["tokens"]), 2) for k, v in
                                         cpu_seconds(info).items() if k in ("sites", "agents", "celery")}
                phases.append(r)
            solo, many = phases
            rounds.append({"solo": solo, "concurrent": many,
                           "ratio": round(many["tokens_per_s"] / solo["tokens_per_s"], 2) if solo["tokens_per_s"]
                           else None,
                           "equal_to_solo": sum(1 for i, ids in many["ids"].items() if solo["ids"].get(i) == ids)})
    for k, rd in enumerate(rounds, 1):
        for r in (rd["solo"], rd["concurrent"]):
            print(f"round {k} clients {r['clients']:>3}: {r['tokens']} tokens in {r['wall_s']} s = "
                  f"{r['tokens_per_s']} tok/s, p50 {r['p50_s']} s, p99 {r['p99_s']} s, errors {len(r['errors'])}; "
                  f"CPU ms per token: site {r['cpu_ms_per_token']['sites']}, agents {r['cpu_ms_per_token']['agents']}"
                  + (f", celery {r['cpu_ms_per_token']['celery']}" if a.services else ""))
        print(f"round {k} ratio {rd['ratio']}x; {rd['equal_to_solo']}/{len(rd['concurrent']['ids'])} concurrent "
              f"requests equal their solo tokens")
    ratios = [rd["ratio"] for rd in rounds if rd["ratio"] is not None]
    ratio = round(statistics.median(ratios), 2) if ratios else None
    errors = sum(len(r["errors"]) for rd in rounds for r in (rd["solo"], rd["concurrent"]))
    equal = sum(rd["equal_to_solo"] for rd in rounds)
    print(f"median ratio {ratio}x over {len(rounds)} rounds (each {', '.join(f'{x}x' for x in ratios)}); "
          f"errors {errors}; {equal}/{a.requests * len(rounds)} concurrent requests equal their solo tokens")
    if a.json:
        print(json.dumps({"rounds": [{"solo": {k: v for k, v in rd["solo"].items() if k != "ids"},
                                      "concurrent": {k: v for k, v in rd["concurrent"].items() if k != "ids"},
                                      "ratio": rd["ratio"], "equal_to_solo": rd["equal_to_solo"]} for rd in rounds],
                          "ratio": ratio, "errors": errors, "equal_to_solo": equal, "requests": a.requests,
                          "client": a.client}))


if __name__ == "__main__":
    main()
