"""Distributed MoE layer forward over 4 holder agents on loopback vs the same forward in process.

Usage:  .venv/bin/python bench/bench_forward.py [--experts 128] [--top-k 8] [--hidden 2048]
        [--ffn 768] [--tokens 512] [--agents 4] [--repeat 3] [--carrier auto]
        [--transport http|iroh|ws|all]

One Qwen3-30B-A3B-shaped layer (128 experts, top-8, H 2048, expert FFN 768) with synthetic
Q8_0 weights (random int8 quants and f16 scales, decoded with ``holders.quant``, so every
weight is exactly a Q8_0 value), 512 random tokens. Each agent is a separate process
running the real holder execute path (``HolderAgent.execute_request``: carrier decode →
expert FFN → output encode → signed receipt) behind its HTTP endpoint (binary frames,
``POST /frame``); experts are dealt round-robin (replication 1). The router runs
``holders.forward.distributed_forward`` in this process (receipts verified) and the
baseline ``holders.ffn.moe_layer_forward`` with every expert local, both timed in the same
run (median of ``--repeat``). Prints the time ratio (goal ≤ 1.10) and wire bytes per routed
element out and back (goals ≤ 1.07 and ≤ 2.1), plus the error of the compact wire.

``--transport`` (default ``http``; ``all`` = http, iroh, ws): the router reaches the same
agent processes over each transport named (``bench_transports.py`` says what each one
measures), one distributed forward per transport after each baseline run, and prints one
row per transport.

Agents use one BLAS thread each (as ``holder_agent`` does by default); the baseline uses
``--baseline-threads`` (default 1, the same per-matmul configuration). On a machine with
fewer cores than agents the ratio mostly measures core contention, so the core count is
printed beside it.
"""
from __future__ import annotations

import argparse
import asyncio
import tempfile
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from holders import quant  # noqa: E402
from holders.ffn import ExpertWeights, moe_layer_forward  # noqa: E402
from holders.gating import Gate  # noqa: E402
import bench_transports  # noqa: E402  (this directory is sys.path[0] when run as a script)

MODEL = "bench-qwen3-30b-a3b-layer"
LAYER = 0


def q8_matrix(rng: np.random.Generator, rows: int, cols: int, scale: float) -> np.ndarray:
    """A float32 ``[rows, cols]`` matrix whose values are exactly Q8_0-representable."""
    nb = rows * cols // 32
    blocks = np.empty((nb, 34), dtype=np.uint8)
    blocks[:, :2] = (rng.uniform(0.5, 1.0, nb) * scale / 127).astype(np.float16).view(np.uint8).reshape(nb, 2)
    blocks[:, 2:] = rng.integers(-127, 128, (nb, 32), dtype=np.int8).view(np.uint8)
    return quant.dequantize(blocks.ravel(), "q8_0", (rows, cols))


def expert(e: int, hidden: int, ffn: int) -> ExpertWeights:
    """Synthetic Q8_0 expert ``e`` (deterministic in ``e``)."""
    rng = np.random.default_rng(1000 + e)
    s_in = 2 / np.sqrt(hidden)
    return ExpertWeights(q8_matrix(rng, ffn, hidden, s_in), q8_matrix(rng, ffn, hidden, s_in),
                         q8_matrix(rng, hidden, ffn, 2 / np.sqrt(ffn)))


def agent_main(port: int, experts: list[int], hidden: int, ffn: int, ws_site: str = "",
               with_iroh: bool = False) -> None:
    """Holder process: load the given experts, serve HTTP on ``port`` (and the transports of
    ``bench_transports.serve_agent``), print ``ready``."""
    from nacl.signing import SigningKey
    from threadpoolctl import threadpool_limits

    from holders.agent import HolderAgent
    from holders.runtime import ExpertRuntime
    from holders.transports.http import serve_http

    threadpool_limits(limits=1)
    agent = HolderAgent("http://127.0.0.1:9", SigningKey.generate(), tempfile.mkdtemp(prefix="tenzro-bench-holder-"))
    agent.runtime = ExpertRuntime(backend=agent.backend)  # memory tier only: no disk copies of the experts
    for e in experts:
        agent.runtime.load_expert(MODEL, LAYER, e, expert(e, hidden, ffn).to_blob("f32"))

    async def main():
        server = await serve_http(agent._http_rpc, "127.0.0.1", port, agent._http_frame)
        extra = await bench_transports.serve_agent(agent, ws_site, with_iroh)
        print(json.dumps({"ready": agent.provider, **extra}), flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--carrier", default="auto", choices=["auto", "f32", "q8_0"])
    ap.add_argument("--baseline-threads", type=int, default=1, help="BLAS threads of the in-process baseline")
    ap.add_argument("--transport", default="http", choices=[*bench_transports.TRANSPORTS, "all"])
    ap.add_argument("--agent", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--agent-site", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    transports = list(bench_transports.TRANSPORTS) if a.transport == "all" else [a.transport]
    if a.agent:
        port, experts = a.agent.split(":")
        agent_main(int(port), [int(e) for e in experts.split(",") if e], a.hidden, a.ffn, a.agent_site,
                   "iroh" in transports)
        return

    from threadpoolctl import threadpool_limits

    from holders.forward import distributed_forward
    from registry.shardmap import HoldingInfo, ProviderInfo, ReplicationPolicy, ShardView

    rng = np.random.default_rng(0)
    gate = Gate("qwen3_moe", rng.standard_normal((a.experts, a.hidden)).astype(np.float32) * 0.05,
                top_k=a.top_k, norm_topk_prob=True)
    x = rng.standard_normal((a.tokens, a.hidden)).astype(np.float32)
    print(f"building {a.experts} synthetic Q8_0 experts ({a.hidden}x{a.ffn}) and {a.agents} agents ...", flush=True)
    procs, infos, peers = [], [], {}
    loop = asyncio.new_event_loop()
    hub = loop.run_until_complete(bench_transports.SocketHub().start()) if "ws" in transports else None
    try:
        for i in range(a.agents):
            mine = list(range(i, a.experts, a.agents))
            port = free_port()
            p = subprocess.Popen([sys.executable, __file__, "--agent", f"{port}:{','.join(map(str, mine))}",
                                  "--hidden", str(a.hidden), "--ffn", str(a.ffn), "--transport", a.transport,
                                  "--agent-site", hub.url if hub else ""], stdout=subprocess.PIPE, text=True)
            procs.append((p, port, mine))
        experts = {e: expert(e, a.hidden, a.ffn) for e in range(a.experts)}
        for p, port, mine in procs:
            line = p.stdout.readline()
            if not line:
                raise SystemExit(f"agent on port {port} did not start")
            ready = json.loads(line)
            peers[ready["ready"]] = (ready.get("iroh_endpoint_id"), ready.get("iroh_addrs", []))
            infos.append(ProviderInfo(ready["ready"], roles=("ExpertHolder",),
                                      http_endpoint=f"http://127.0.0.1:{port}/rpc",
                                      iroh_endpoint_id=ready.get("iroh_endpoint_id"),
                                      holdings=tuple(HoldingInfo(MODEL, LAYER, e, "Warm", 0, None) for e in mine)))
        view = ShardView.build(MODEL, infos, policy=ReplicationPolicy())
        sends = {t: bench_transports.make_send(t, hub) for t in transports}
        if "iroh" in sends:
            sends["iroh"][0].peers.update(peers)
        while hub is not None and len(hub.sockets) < a.agents:  # every agent's socket admitted
            loop.run_until_complete(asyncio.sleep(0.05))

        async def get_view(excluded):
            return view

        async def dist(carrier, transport):
            return await distributed_forward(gate=gate, model_id=MODEL, layer=LAYER, hidden_states=x,
                                             get_view=get_view, send=sends[transport][0], carrier=carrier,
                                             deadline_s=120, max_message=1 << 20)

        mono_t, dist_ts = [], {t: [] for t in transports}
        exact = None
        results = {t: loop.run_until_complete(dist(a.carrier, t)) for t in transports}  # warm up connections
        for _ in range(a.repeat):
            with threadpool_limits(limits=a.baseline_threads):
                t0 = time.perf_counter()
                exact, _ = moe_layer_forward(gate, experts, x)
                mono_t.append(time.perf_counter() - t0)
            for t in transports:
                t0 = time.perf_counter()
                results[t] = loop.run_until_complete(dist(a.carrier, t))
                dist_ts[t].append(time.perf_counter() - t0)
        routed = a.tokens * a.top_k * a.hidden
        m = statistics.median(mono_t)
        print(f"{'transport':<10}{'distributed ms':>16}{'ratio':>8}{'out B/elem':>12}{'back B/elem':>13}"
              f"{'rel err':>10}  (in process {m * 1e3:.1f} ms, {a.agents} agents, {os.cpu_count()} cores)")
        for t in transports:
            r, d = results[t], statistics.median(dist_ts[t])
            assert r.transports[t] == r.batches, r.transports
            print(f"{t:<10}{d * 1e3:16.1f}{d / m:8.3f}{r.bytes_out / routed:12.4f}{r.bytes_back / routed:13.4f}"
                  f"{float(np.abs(r.output - exact).max() / np.abs(exact).max()):10.2e}")
        res, dd = results[transports[0]], statistics.median(dist_ts[transports[0]])
        err = float(np.abs(res.output - exact).max() / np.abs(exact).max())
        report = {"shape": {"experts": a.experts, "top_k": a.top_k, "hidden": a.hidden, "ffn": a.ffn,
                            "tokens": a.tokens, "agents": a.agents}, "cpu_cores": os.cpu_count(),
                  "carrier": a.carrier, "transport": transports[0],
                  "by_transport": {t: {"distributed_s": round(statistics.median(dist_ts[t]), 4),
                                       "time_ratio": round(statistics.median(dist_ts[t]) / m, 3),
                                       "bytes_out": results[t].bytes_out, "bytes_back": results[t].bytes_back,
                                       "runs_s": [round(v, 4) for v in dist_ts[t]]}
                                   for t in transports}, "baseline_blas_threads": a.baseline_threads,
                  "in_process_s": round(m, 4), "distributed_s": round(dd, 4),
                  "time_ratio": round(dd / m, 3), "bytes_per_element_out": round(res.bytes_out / routed, 4),
                  "bytes_per_element_back": round(res.bytes_back / routed, 4), "batches": res.batches,
                  "receipts_verified": len(res.receipts), "max_rel_err_vs_in_process": err,
                  "router_timings_ms": res.timings_ms}
        print(f"in process {m * 1e3:.1f} ms, distributed {dd * 1e3:.1f} ms over {a.agents} agents "
              f"({os.cpu_count()} cores): ratio {dd / m:.3f} (goal <= 1.10)")
        print(f"wire bytes per routed element: out {report['bytes_per_element_out']:.4f} (goal <= 1.07), "
              f"back {report['bytes_per_element_back']:.4f} (goal <= 2.1); {res.batches} batches, "
              f"{len(res.receipts)} receipts verified; rel err vs in-process {err:.2e}")
        print(json.dumps(report))
        for _, close in sends.values():
            loop.run_until_complete(close())
    finally:
        for p, _, _ in procs:
            p.terminate()
            p.wait(10)
        if hub is not None:
            loop.run_until_complete(hub.close())
        loop.close()


if __name__ == "__main__":
    main()
