"""Requests/s of 1 and N site processes behind HAProxy on the same cores (issue 26).

Usage:  .venv/bin/python bench/bench_sites.py [--sites 1,2] [--requests 48] [--clients 16]
        [--tokens 6] [--holders 3] [--rounds 3] [--json]
Needs PostgreSQL and Redis: ``TENZRO_TEST_DATABASE_URL`` (an admin URL: each run creates and
drops its own database) and ``TENZRO_TEST_REDIS_URL`` (defaults as the tests').

For each entry of ``--sites``: ``tenzro_cluster --sites N --balancer --holders H`` of the qwen3
fixture (HAProxy in front of every count, so both take the same path), a warm-up round (every
distinct prompt once per process: the balancer sends one model's generations to one process, so
warm-up reaches every process only when round robin does), then ``--rounds`` timed rounds of
``--requests`` greedy ``/v1/completions`` from ``--clients`` concurrent clients through the
balancer (a short first round on a just-started cluster ran slower than later ones: the median
round is reported). Reports requests/s, p50/p99 latency, errors, the share of agent requests
relayed through the channel layer (``tenzro_agent_requests_total`` of ``/metrics``), the CPU
time the cluster's processes spent per request in a timed round (sites, agents, balancer,
Celery: less noisy than requests/s on a shared machine, where other work slows a run's wall time
but not its CPU), the 1-minute load average before and after each run, and whether every answer
equals the first run's. The runs share this machine's cores: on a 2-core machine it shows that
nothing slows down or is lost with more processes, not that they scale; on a shared machine
compare the ratios within one invocation (alternate the order).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from machine import cpu_model, cpu_seconds  # noqa: E402

from tests.cluster_util import env_for, fresh_postgres_db, running_cluster  # noqa: E402
from tests.load_util import complete_once_retrying  # noqa: E402

QWEN = ROOT / "tests" / "fixtures" / "qwen3_moe_tiny"
MODEL = "qwen3-moe-tiny"


def agent_paths(client: httpx.Client, url: str) -> dict[str, float]:
    """``tenzro_agent_requests_total`` by path (``local``, ``relay``) summed over the machine's
    site processes (``/metrics`` in multiprocess mode)."""
    out = {"local": 0.0, "relay": 0.0}
    for line in client.get(f"{url}/metrics").text.splitlines():
        if line.startswith("tenzro_agent_requests_total{"):
            path = line.split('path="', 1)[1].split('"', 1)[0]
            out[path] = out.get(path, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def run(sites: int, args) -> dict:
    """One cluster of ``sites`` processes: warm-up, then the timed round; its numbers."""
    pg = os.environ.get("TENZRO_TEST_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    redis = os.environ.get("TENZRO_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
    prompts = [[1 + i % 6, 7, 3 + i % 4, 11] for i in range(args.requests)]
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-sites-") as tmp, fresh_postgres_db(pg) as db:
        env = env_for(Path(tmp), database_url=db, redis_url=redis)
        with running_cluster(Path(tmp), [QWEN], holders=args.holders, env=env,
                             extra=("--sites", str(sites), "--balancer")) as (info, _):
            url = info["url"]
            with httpx.Client(timeout=600) as client:
                for p in sorted({tuple(p) for p in prompts}):
                    for _ in range(sites):
                        complete_once_retrying(client, url, MODEL, list(p), args.tokens)
                paths0 = agent_paths(client, url)
            cpu0 = cpu_seconds(info)
            lat: list[float] = []
            every: list = []  # every round's completions

            def one(client, p):
                t = time.perf_counter()
                c = complete_once_retrying(client, url, MODEL, p, args.tokens)
                lat.append(time.perf_counter() - t)
                return c

            rounds: list[float] = []
            with httpx.Client(timeout=600, limits=httpx.Limits(max_connections=args.clients * 2)) as client, \
                    ThreadPoolExecutor(args.clients) as pool:
                for _ in range(args.rounds):  # the same cluster, warm: the median round is reported
                    t0 = time.perf_counter()
                    outs = list(pool.map(lambda p: one(client, p), prompts))
                    rounds.append(time.perf_counter() - t0)
                    every.extend(outs)
                    if any(None not in (c.token_ids, o.token_ids) and c.token_ids != o.token_ids
                           for c, o in zip(outs, every)):
                        raise SystemExit(f"{sites} site process(es): a round's answers differ from the first round's")
                cpu = {k: (v - cpu0[k]) / args.rounds for k, v in cpu_seconds(info).items()}
                paths = {k: v - paths0.get(k, 0.0) for k, v in agent_paths(client, url).items()}
    wall = statistics.median(rounds)
    lat.sort()
    return {"sites": sites, "requests": len(prompts), "clients": args.clients, "wall_s": round(wall, 2),
            "round_req_per_s": [round(len(prompts) / w, 3) for w in rounds],
            "req_per_s": round(len(prompts) / wall, 3), "p50_s": round(statistics.median(lat), 2),
            "p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 2),
            "errors": sum(c.token_ids is None for c in every), "retried": sum(c.retried for c in every),
            "relay_share": round(paths["relay"] / max(1.0, sum(paths.values())), 3),
            "agent_requests": int(sum(paths.values())),
            "cpu_ms_per_request": {k: round(1e3 * v / len(prompts), 1) for k, v in cpu.items()},
            "load1": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "answers": {tuple(p): c.token_ids for p, c in zip(prompts, outs)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sites", default="1,2")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=6)
    ap.add_argument("--holders", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per cluster (median reported)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.rounds < 1 or args.requests < 1 or args.clients < 1:
        ap.error("--rounds, --requests and --clients must be at least 1")
    results = [run(int(s), args) for s in args.sites.split(",")]
    same = all(r["answers"] == results[0]["answers"] for r in results)
    for r in results:
        r.pop("answers")
    base = results[0]["req_per_s"]
    for r in results:
        r["vs_first"] = round(r["req_per_s"] / base, 3) if base else None
    if args.json:
        print(json.dumps({"cpus": os.cpu_count(), "cpu_model": cpu_model(), "results": results,
                          "answers_equal": same}))
        return
    print(f"{os.cpu_count()} CPUs ({cpu_model()}); {args.requests} greedy completions ({args.tokens} tokens) "
          f"from {args.clients} clients")
    for r in results:
        print(f"  {r['sites']} site process(es): {r['req_per_s']} req/s ({r['vs_first']}x; rounds "
              f"{', '.join(map(str, r['round_req_per_s']))}), p50 {r['p50_s']} s, "
              f"p99 {r['p99_s']} s, errors {r['errors']}, retried {r['retried']}, "
              f"agent requests {r['agent_requests']} ({r['relay_share']:.0%} relayed), "
              f"load {r['load1'][0]}->{r['load1'][1]}")
        cpu = r["cpu_ms_per_request"]
        parts = ", ".join(f"{k} {v:.0f}" for k, v in cpu.items())
        print(f"    CPU ms per request: {sum(cpu.values()):.0f} ({parts})")
    print(f"  every answer equal across runs: {same}")


if __name__ == "__main__":
    main()
