"""Concurrent clients against a 4-agent cluster, and the black-hole scene (issue 15).

Usage:  .venv/bin/python bench/bench_load.py [--clients 10,100,500] [--layers memory,redis]
        [--rounds 1] [--tokens 64] [--deadline 2] [--no-blackhole] [--json]

For each channel layer (``memory``: in-memory layer, SQLite; ``redis``: channels-redis on
``TENZRO_TEST_REDIS_URL`` and a throwaway PostgreSQL database on ``TENZRO_TEST_DATABASE_URL``)
a ``tenzro_cluster`` of the qwen3-moe-tiny fixture with 4 agents (replication 2) is started;
then, per N in ``--clients``, N clients post at once, each ``--rounds`` forwards of
``--tokens`` tokens one after another (``tenzro_moeForward``, exact f32 carrier, layer 1).
Reported per N: throughput (ok forwards per second of wall time), p50/p99 latency, errors
by kind (``rpc-32005`` busy, ``rpc-32004`` execution, ``ReadTimeout`` …), and the p50 as a
ratio of the single-client p50 measured first in the same run (the baseline, same
machine, same load).

Black-hole scene (first layer only): forward times before a black-hole holder joins (median
of 5), the first forward once the shard map lists it on every expert of the layer (a real
agent process, ``holder_agent --fault blackhole``: it declares every expert on the site Warm
with ``committed_tps`` 1,000,000 and never answers a batch), and the 5 after that, with
``TENZRO_BATCH_DEADLINE=--deadline``. The issue's goals: the first forward costs at most one
deadline more than before, the next ones ≤ 1.2x before (``after_vs_before``).

Prints one line per measurement, and with ``--json`` one JSON object last.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tenzro_site.settings")

from safetensors.numpy import load_file  # noqa: E402

from tests.cluster_util import blackhole_agent, env_for, fresh_postgres_db, running_cluster  # noqa: E402
from tests.conftest import PG_URL, QWEN, REDIS_URL, SERVICES_UP  # noqa: E402
from tests.load_util import fire, forward_body, summary  # noqa: E402

MODEL = "qwen3-moe-tiny"
LAYER = 1


def inputs(n: int, tokens: int) -> list[np.ndarray]:
    """``n`` distinct hidden-state inputs f32 [tokens, H] on the scale of the fixture's reference."""
    ref = load_file(str(QWEN / "reference.safetensors"))[f"layer{LAYER}.hidden_states"].astype(np.float32)
    rng = np.random.default_rng(0)
    scale = float(ref.std())
    return [(rng.standard_normal((tokens, ref.shape[1])) * scale).astype(np.float32) for _ in range(n)]


def load_levels(info: dict, clients: list[int], rounds: int, tokens: int, say) -> dict:
    """The baseline (1 client) then each N: ``summary`` dicts by N."""
    xs = inputs(max(clients) * rounds, tokens)
    url = info["rpc"]
    out = {}
    for n in [1] + clients:
        bodies = [[forward_body(MODEL, LAYER, xs[(c * rounds + r) % len(xs)], req_id=r) for r in range(rounds)]
                  for c in range(n)]
        outcomes, wall = fire(url, bodies, timeout=300)
        s = summary(outcomes, wall)
        if n > 1 and out.get(1, {}).get("p50_ms"):
            s["p50_vs_single"] = round(s["p50_ms"] / out[1]["p50_ms"], 2)
        out[n] = s
        say(f"  {n:4d} clients x {rounds}: {s['ok']}/{s['requests']} ok, {s['throughput_per_s']} fwd/s, "
            f"p50 {s['p50_ms']} ms, p99 {s['p99_ms']} ms, errors {s['errors'] or 'none'}"
            + (f", p50 {s['p50_vs_single']}x single" if "p50_vs_single" in s else ""))
    return out


def blackhole_scene(info: dict, tmp: Path, env: dict, tokens: int, deadline_s: float, say) -> dict:
    """Forward seconds before / the first after / the 5 after a ``holder_agent --fault blackhole``
    process joins the cluster ``info`` (``env``: the cluster's; ``tmp``: its key and blob dir)."""
    x = inputs(1, tokens)[0]
    body = forward_body(MODEL, LAYER, x)

    def timed():
        t = time.perf_counter()
        outcomes, _ = fire(info["rpc"], [[body]], timeout=300)
        return round(time.perf_counter() - t, 3), outcomes[0]

    before = [timed()[0] for _ in range(5)]
    with blackhole_agent(info, tmp, env, MODEL, LAYER) as hole:
        time.sleep(1.1)  # past the router's view cache
        outcomes = [timed() for _ in range(6)]
    holes = {hole}
    first, after = outcomes[0][0], [s for s, _ in outcomes[1:]]
    kinds = [o.kind for _, o in outcomes]
    # batches the black hole was sent and let run past the deadline, per forward
    failures = [sum(f.get("provider") in holes for f in (o.result or {}).get("failures", [])) for _, o in outcomes]
    base = statistics.median(before)
    res = {"before_s": before, "first_after_join_s": first, "after_s": after, "outcomes": kinds,
           "blackhole_failures_per_forward": failures,
           "first_extra_vs_deadline": round((first - base) / deadline_s, 2),
           "after_vs_before": round(statistics.median(after) / base, 2)}
    say(f"  black hole (holder_agent --fault blackhole): before {base:.3f} s (median of 5), first after join "
        f"{first:.3f} s ({res['first_extra_vs_deadline']} deadline of {deadline_s:g} s extra; goal <= 1), next 5 "
        f"{after} (median {res['after_vs_before']}x before; goal <= 1.2), outcomes {kinds}, batches lost to "
        f"the black hole per forward {failures}")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="10,100,500", help="comma list of concurrent client counts")
    ap.add_argument("--layers", default="memory,redis", help="comma list: memory, redis")
    ap.add_argument("--rounds", type=int, default=1, help="forwards each client sends one after another")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per forward")
    ap.add_argument("--deadline", type=float, default=2.0, help="TENZRO_BATCH_DEADLINE of the cluster (s)")
    ap.add_argument("--no-blackhole", action="store_true", help="skip the black-hole scene")
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    a = ap.parse_args()
    clients = [int(c) for c in a.clients.split(",") if c]
    layers = [s.strip() for s in a.layers.split(",") if s.strip()]
    bad = [s for s in layers if s not in ("memory", "redis")]
    if bad or not clients or min(clients) < 1 or a.rounds < 1 or a.tokens < 1:
        ap.error("--layers takes memory,redis; --clients, --rounds and --tokens must be positive")
    if "redis" in layers and not SERVICES_UP:
        print(f"redis layer skipped: Redis ({REDIS_URL}) or PostgreSQL ({PG_URL}) not reachable", file=sys.stderr)
        layers.remove("redis")

    def say(s):
        print(s, flush=True)

    say(f"machine: {os.cpu_count()} CPUs, {platform.machine()} {platform.processor() or ''}; cluster: 4 agents, "
        f"replication 2, {MODEL} layer {LAYER}, {a.tokens}-token forwards, f32 carrier, deadline {a.deadline:g} s")
    report = {"cpus": os.cpu_count(), "tokens": a.tokens, "rounds": a.rounds, "deadline_s": a.deadline, "layers": {}}
    import tempfile

    for i, layer in enumerate(layers):
        with ExitStack() as stack:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"bench-load-{layer}-")))
            db = stack.enter_context(fresh_postgres_db(PG_URL)) if layer == "redis" else None
            env = env_for(tmp, database_url=db, redis_url=REDIS_URL if layer == "redis" else None)
            env.update({"TENZRO_BATCH_DEADLINE": str(a.deadline)})
            info, _ = stack.enter_context(running_cluster(tmp, [QWEN], holders=4, env=env))
            say(f"{layer} layer:")
            for _ in range(3):  # warm the agents' first calls (numba, BLAS) before measuring
                fire(info["rpc"], [[forward_body(MODEL, LAYER, inputs(1, a.tokens)[0])]])
            entry = {"levels": load_levels(info, clients, a.rounds, a.tokens, say)}
            if i == 0 and not a.no_blackhole:
                entry["blackhole"] = blackhole_scene(info, tmp, env, a.tokens, a.deadline, say)
            report["layers"][layer] = entry
    if a.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
