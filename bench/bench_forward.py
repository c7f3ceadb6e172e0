"""Distributed MoE layer forward over holder agents on loopback vs the same forward in process, on the same cores.

Usage:  .venv/bin/python bench/bench_forward.py [--agents 2,4] [--cpus 0-1] [--repeat 5] [--transport http]
        [--carrier auto] [--experts 128] [--top-k 8] [--hidden 2048] [--ffn 768] [--tokens 512]
        [--agent-threads N] [--baseline-threads N] [--profile]

One Qwen3-30B-A3B-shaped layer (128 experts, top-8, H 2048, expert FFN 768) with synthetic
Q8_0-valued weights (random int8 quants and f16 scales decoded with ``holders.quant``), 512
random tokens. Each agent is a separate process running the real holder execute path
(``HolderAgent.execute_request``: carrier decode → expert FFN → output encode → signed
receipt) behind the transport chosen by ``--transport`` (``make_send``: ``http`` = binary
frames to ``POST /frame``); experts are dealt round-robin (replication 1). The router runs
``holders.forward.distributed_forward`` in this process (receipts verified); the baseline is
``holders.ffn.moe_layer_forward`` with every expert local.

Equal cores: this process and every agent are pinned to the same CPU set (``--cpus``,
default this process's affinity; ``os.sched_setaffinity``, inherited by the agents), the
baseline gets as many BLAS threads as the set has cores (a second in-process baseline runs
the experts on as many threads, one BLAS thread each: ``moe_expert_parallel``, stronger
when each expert's batch is small), and each of N agents
``max(1, cores // N)`` (``--agent-threads``), so agents do not oversubscribe the cores
they share; the router (this process) runs its distributed forward with one BLAS thread.
Baselines and distributed runs alternate (``--repeat`` of each, after one warm-up
forward) and medians are reported, for every agent count of ``--agents``.
Goal: time ratio ≤ 1.10.

Where the time goes: CPU seconds per forward (``time.thread_time`` inside timed wrappers,
``time.process_time`` for whole processes, so a preempted thread is not charged for the
wait) of the router's phases (gate, carrier encode, frame pack/unpack, output decode,
receipt verify, combine, the rest = event loop, HTTP and scheduling) and the agents'
phases summed over agents (carrier decode, expert compute, output encode, receipt sign,
the rest = HTTP server, frame parsing, event loop), against the baseline's CPU seconds.
The wrappers live in this file (agents report theirs over an extra ``bench/phases`` RPC
method), so the timed code is the production code. ``--profile`` also prints the
router's cProfile top entries (process CPU time) for one distributed forward.

Wire bytes per routed element out and back (goals ≤ 1.07 and ≤ 2.1) and the compact
wire's error against the in-process forward are printed for the last agent count.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from holders import quant  # noqa: E402
from holders.ffn import ExpertWeights, combine, expert_forward, moe_layer_forward  # noqa: E402
from holders.gating import Gate, route  # noqa: E402

MODEL = "bench-qwen3-30b-a3b-layer"
LAYER = 0
TRANSPORTS = ("http",)


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


class Phases:
    """CPU seconds per named phase, accumulated by ``timed`` wrappers (any thread)."""

    def __init__(self):
        self.cpu: dict[str, float] = {}
        self.t0 = time.process_time()

    def reset(self) -> None:
        self.cpu.clear()
        self.t0 = time.process_time()

    def add(self, name: str, seconds: float) -> None:
        self.cpu[name] = self.cpu.get(name, 0.0) + seconds

    def timed(self, name, fn):
        """``fn`` wrapped to charge its thread CPU time to ``name`` (a str, or a callable of
        the call's arguments returning the name)."""
        def wrapper(*args, **kwargs):
            t = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name if isinstance(name, str) else name(*args, **kwargs), time.thread_time() - t)
        return wrapper

    def snapshot(self) -> dict:
        """Phases plus ``process`` (the process's CPU seconds since ``reset``)."""
        return {**self.cpu, "process": time.process_time() - self.t0}


def instrument_wire(ph: Phases) -> None:
    """Time the wire codec and frame functions of this process (shared by router and agents)."""
    from holders import wire
    wire.pack_frame = ph.timed("frame pack/unpack", wire.pack_frame)
    wire.unpack_frame = ph.timed("frame pack/unpack", wire.unpack_frame)
    wire.encode_rows = ph.timed(lambda rows, kind: f"encode {kind}", wire.encode_rows)
    wire.decode_rows = ph.timed(lambda data, kind, *a, **k: f"decode {kind}", wire.decode_rows)


def agent_main(port: int, experts: list[int], blob_dir: str, threads: int) -> None:
    """Holder process: load the given experts' blobs, serve HTTP on ``port``, print ``ready``."""
    from nacl.signing import SigningKey
    from threadpoolctl import threadpool_limits

    from holders import agent as agent_mod
    from holders.agent import HolderAgent
    from holders.runtime import ExpertRuntime
    from holders.transports.http import serve_http

    threadpool_limits(limits=threads)
    ph = Phases()
    instrument_wire(ph)
    agent_mod.make_receipt = ph.timed("receipt sign", agent_mod.make_receipt)
    agent = HolderAgent("http://127.0.0.1:9", SigningKey.generate(), tempfile.mkdtemp(prefix="tenzro-bench-holder-"))
    agent.runtime = ExpertRuntime(backend=agent.backend)  # memory tier only: no disk copies of the experts
    for e in experts:
        agent.runtime.load_expert(MODEL, LAYER, e, (Path(blob_dir) / f"{e}.blob").read_bytes())
    agent.runtime.execute = ph.timed("expert compute", agent.runtime.execute)
    for t in threading.enumerate():  # the backend's JIT warm-up (seconds with a cold numba cache) is not the forward's
        if t.name == "compute-warm":
            t.join()

    async def rpc(method, params):
        if method == "bench/phases":  # this bench's own probe: read and restart the phase counters
            snap = ph.snapshot()
            ph.reset()
            return snap
        return await agent._http_rpc(method, params)

    async def main():
        server = await serve_http(rpc, "127.0.0.1", port, agent._http_frame)
        print(json.dumps({"ready": agent.provider}), flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def moe_expert_parallel(gate: Gate, experts: dict, x: np.ndarray, pool: ThreadPoolExecutor) -> np.ndarray:
    """The monolithic layer with its experts spread over ``pool``'s threads (largest batch first;
    the caller limits BLAS to one thread): the stronger in-process use of several cores when
    each expert's batch is too small for a multi-threaded GEMM. Same output as
    ``moe_layer_forward`` with one BLAS thread."""
    routing = route(gate, x)
    by_expert = routing.tokens_by_expert()
    order = sorted(by_expert, key=lambda e: -len(by_expert[e]))
    outs = pool.map(lambda e: (by_expert[e], expert_forward(experts[e], x[by_expert[e]])), order)
    return combine(routing, dict(zip(order, outs)), gate.d_model)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_cpus(text: str | None) -> list[int]:
    """``"0-3,6"`` → [0, 1, 2, 3, 6]; None → this process's affinity."""
    if not text:
        return sorted(os.sched_getaffinity(0))
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return sorted(set(out))


def make_send(transport: str):
    """(send, close, probe) for one transport: ``send(provider, holder, req)`` executes a
    ``BatchRequest`` on a holder, ``close()`` drops connections, ``probe(endpoint, method)``
    calls a JSON-RPC method on an agent (the bench's phase counters)."""
    if transport == "http":
        from holders.transports.http import HttpHolderClient
        client = HttpHolderClient(120)

        async def send(provider, holder, req):
            return await client.execute_frame(holder.http_endpoint, req)

        async def probe(endpoint, method):
            from urllib.parse import urlsplit
            u = urlsplit(endpoint)
            reader, writer = await asyncio.open_connection(u.hostname, u.port)
            body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": {}}).encode()
            writer.write(f"POST /rpc HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                         .encode() + body)
            await writer.drain()
            data = await reader.read()
            writer.close()
            return json.loads(data.split(b"\r\n\r\n", 1)[1])["result"]

        return send, client.close, probe
    raise SystemExit(f"--transport must be one of {', '.join(TRANSPORTS)}")


def start_agents(n: int, a, blob_dir: str, threads: int) -> list[tuple[subprocess.Popen, int, list[int]]]:
    """Spawn ``n`` agent processes (they inherit this process's CPU affinity)."""
    procs = []
    for i in range(n):
        mine = list(range(i, a.experts, n))
        port = free_port()
        p = subprocess.Popen([sys.executable, __file__, "--agent", f"{port}:{','.join(map(str, mine))}",
                              "--blob-dir", blob_dir, "--agent-threads", str(threads)],
                             stdout=subprocess.PIPE, text=True)
        procs.append((p, port, mine))
    return procs


def run_count(n_agents: int, a, cpus: list[int], gate: Gate, experts: dict, x: np.ndarray, blob_dir: str,
              router: Phases) -> dict:
    """Baseline and distributed forwards alternated over ``n_agents`` agents; medians and CPU breakdown."""
    from threadpoolctl import threadpool_limits

    from holders.forward import distributed_forward
    from registry.shardmap import HoldingInfo, ProviderInfo, ReplicationPolicy, ShardView

    cores = len(cpus)
    agent_threads = a.agent_threads or max(1, cores // n_agents)
    base_threads = a.baseline_threads or cores
    procs = start_agents(n_agents, a, blob_dir, agent_threads)
    loop = asyncio.new_event_loop()
    send, close, probe = make_send(a.transport)
    try:
        infos = []
        for p, port, mine in procs:
            line = p.stdout.readline()
            if not line:
                raise SystemExit(f"agent on port {port} did not start")
            infos.append(ProviderInfo(json.loads(line)["ready"], roles=("ExpertHolder",),
                                      http_endpoint=f"http://127.0.0.1:{port}/rpc",
                                      holdings=tuple(HoldingInfo(MODEL, LAYER, e, "Warm", 0, None) for e in mine)))
        view = ShardView.build(MODEL, infos, policy=ReplicationPolicy())

        async def get_view(excluded):
            return view

        async def dist():
            return await distributed_forward(gate=gate, model_id=MODEL, layer=LAYER, hidden_states=x,
                                             get_view=get_view, send=send, carrier=a.carrier, deadline_s=120)

        async def agent_phases():
            return [await probe(i.http_endpoint, "bench/phases") for i in infos]

        with threadpool_limits(limits=1):  # warm-up: connections, caches, first-touch of the weights
            res = loop.run_until_complete(dist())
        loop.run_until_complete(agent_phases())
        mono_t, par_t, dist_t, mono_cpu, par_cpu, router_cpu, agent_cpu = [], [], [], [], [], [], []
        exact = None
        pool = ThreadPoolExecutor(cores)
        for _ in range(a.repeat):
            with threadpool_limits(limits=base_threads):
                c0, t0 = time.process_time(), time.perf_counter()
                exact, _ = moe_layer_forward(gate, experts, x)
                mono_t.append(time.perf_counter() - t0)
                mono_cpu.append(time.process_time() - c0)
            with threadpool_limits(limits=1):
                c0, t0 = time.process_time(), time.perf_counter()
                moe_expert_parallel(gate, experts, x, pool)
                par_t.append(time.perf_counter() - t0)
                par_cpu.append(time.process_time() - c0)
            router.reset()
            with threadpool_limits(limits=1):  # the router's gate is small; a spinning BLAS pool would take agent cores
                t0 = time.perf_counter()
                res = loop.run_until_complete(dist())
                dist_t.append(time.perf_counter() - t0)
            router_cpu.append(router.snapshot())
            agent_cpu.append(loop.run_until_complete(agent_phases()))
        if a.profile:
            prof = cProfile.Profile(time.process_time)  # CPU, not wall: waits on other processes drop out
            with threadpool_limits(limits=1):
                prof.enable()
                loop.run_until_complete(dist())
                prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
            print(f"\nrouter cProfile (process CPU time), one distributed forward over {n_agents} agents:")
            print("\n".join(s.getvalue().splitlines()[4:30]))
        loop.run_until_complete(close())
        pool.shutdown()
    finally:
        loop.close()
        for p, _, _ in procs:
            p.terminate()
            p.wait(10)
    routed = a.tokens * a.top_k * a.hidden
    m, d, par = statistics.median(mono_t), statistics.median(dist_t), statistics.median(par_t)

    def med(snaps, key):
        return statistics.median(s.get(key, 0.0) for s in snaps)

    rkeys = sorted({k for s in router_cpu for k in s})
    router_med = {k: med(router_cpu, k) for k in rkeys}
    summed = [{k: sum(ag.get(k, 0.0) for ag in per) for k in {k for ag in per for k in ag}} for per in agent_cpu]
    akeys = sorted({k for s in summed for k in s})
    agent_med = {k: med(summed, k) for k in akeys}
    return {"agents": n_agents, "cores": cores, "cpus": cpus, "agent_blas_threads": agent_threads,
            "baseline_blas_threads": base_threads, "in_process_s": m, "distributed_s": d, "time_ratio": d / m,
            "expert_parallel_s": par, "time_ratio_vs_expert_parallel": d / par,
            "in_process_runs_s": mono_t, "expert_parallel_runs_s": par_t, "distributed_runs_s": dist_t,
            "baseline_cpu_s": statistics.median(mono_cpu), "expert_parallel_cpu_s": statistics.median(par_cpu),
            "router_cpu_s": router_med, "agents_cpu_s": agent_med,
            "bytes_per_element_out": res.bytes_out / routed, "bytes_per_element_back": res.bytes_back / routed,
            "batches": res.batches, "receipts_verified": len(res.receipts),
            "max_rel_err_vs_in_process": float(np.abs(res.output - exact).max() / np.abs(exact).max()),
            "router_timings_ms": res.timings_ms}


def print_breakdown(r: dict) -> None:
    """CPU ms per forward by phase: router, agents (summed), baseline."""
    rc, ac = dict(r["router_cpu_s"]), dict(r["agents_cpu_s"])
    r_proc, a_proc = rc.pop("process"), ac.pop("process")
    r_rest = r_proc - sum(rc.values())
    a_rest = a_proc - sum(ac.values())
    print(f"  CPU ms per forward (medians): in process {r['baseline_cpu_s'] * 1e3:.1f} (BLAS threads), "
          f"{r['expert_parallel_cpu_s'] * 1e3:.1f} (expert-parallel); "
          f"distributed {(r_proc + a_proc) * 1e3:.1f} = router {r_proc * 1e3:.1f} + agents {a_proc * 1e3:.1f}")
    for k, v in sorted(rc.items(), key=lambda kv: -kv[1]):
        print(f"    router  {k:<24} {v * 1e3:8.1f}")
    print(f"    router  {'event loop, HTTP, rest':<24} {r_rest * 1e3:8.1f}")
    for k, v in sorted(ac.items(), key=lambda kv: -kv[1]):
        print(f"    agents  {k:<24} {v * 1e3:8.1f}")
    print(f"    agents  {'HTTP server, loop, rest':<24} {a_rest * 1e3:8.1f}")


def cpu_model() -> str:
    """CPU model name from /proc/cpuinfo (Linux), else ``platform.processor()``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--agents", default="2,4", help="agent counts to measure, e.g. 2,4")
    ap.add_argument("--cpus", default=None, help="CPU set shared by the baseline and the agents (default: affinity)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--transport", default="http", choices=TRANSPORTS)
    ap.add_argument("--carrier", default="auto", choices=["auto", "f32", "q8_0"])
    ap.add_argument("--baseline-threads", type=int, default=0, help="BLAS threads of the baseline (default: cores)")
    ap.add_argument("--agent-threads", type=int, default=0, help="BLAS threads per agent (default: cores // agents)")
    ap.add_argument("--profile", action="store_true", help="cProfile the router over one more distributed forward")
    ap.add_argument("--blob-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--agent", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.agent:
        port, mine = a.agent.split(":")
        agent_main(int(port), [int(e) for e in mine.split(",") if e], a.blob_dir, max(1, a.agent_threads))
        return

    from holders import kernels
    from holders import forward as forward_mod

    cpus = parse_cpus(a.cpus)
    os.sched_setaffinity(0, cpus)  # the agents inherit it: every process on the same cores
    router = Phases()
    instrument_wire(router)
    forward_mod.verify_receipt = router.timed("receipt verify", forward_mod.verify_receipt)
    forward_mod.route = router.timed("gate", forward_mod.route)
    forward_mod.combine = router.timed("combine", forward_mod.combine)

    rng = np.random.default_rng(0)
    gate = Gate("qwen3_moe", rng.standard_normal((a.experts, a.hidden)).astype(np.float32) * 0.05,
                top_k=a.top_k, norm_topk_prob=True)
    x = rng.standard_normal((a.tokens, a.hidden)).astype(np.float32)
    print(f"CPU {cpu_model()}; pinned to CPUs {cpus} ({len(cpus)} cores; load average "
          f"{os.getloadavg()[0]:.1f}); native kernels {kernels.isa()}; transport {a.transport}; carrier {a.carrier}")
    print(f"building {a.experts} synthetic Q8_0-valued experts ({a.hidden}x{a.ffn}, f32 blobs) ...", flush=True)
    blob_dir = tempfile.mkdtemp(prefix="tenzro-bench-forward-")
    try:
        experts = {}
        for e in range(a.experts):
            experts[e] = expert(e, a.hidden, a.ffn)
            (Path(blob_dir) / f"{e}.blob").write_bytes(experts[e].to_blob("f32"))
        results = []
        for n in [int(v) for v in a.agents.split(",") if v]:
            r = run_count(n, a, cpus, gate, experts, x, blob_dir, router)
            results.append(r)
            print(f"\n{n} agents x {r['agent_blas_threads']} BLAS thread(s) vs in process x "
                  f"{r['baseline_blas_threads']} BLAS thread(s), {r['cores']} cores: in process "
                  f"{r['in_process_s'] * 1e3:.1f} ms, distributed {r['distributed_s'] * 1e3:.1f} ms (medians of "
                  f"{a.repeat}, alternated): ratio {r['time_ratio']:.3f} (goal <= 1.10); in process expert-parallel "
                  f"over {r['cores']} threads {r['expert_parallel_s'] * 1e3:.1f} ms: ratio "
                  f"{r['time_ratio_vs_expert_parallel']:.3f}")
            print_breakdown(r)
        last = results[-1]
        print(f"\nwire bytes per routed element: out {last['bytes_per_element_out']:.4f} (goal <= 1.07), "
              f"back {last['bytes_per_element_back']:.4f} (goal <= 2.1); {last['batches']} batches, "
              f"{last['receipts_verified']} receipts verified; rel err vs in-process "
              f"{last['max_rel_err_vs_in_process']:.2e}")
        print("\n| agents | cores | in process ms (BLAS x cores) | in process ms (expert-parallel) | distributed ms "
              "| ratio | ratio vs expert-parallel | CPU ratio vs expert-parallel |")
        print("|---|---|---|---|---|---|---|---|")
        for r in results:
            cpu = r["router_cpu_s"]["process"] + r["agents_cpu_s"]["process"]
            print(f"| {r['agents']} | {r['cores']} | {r['in_process_s'] * 1e3:.1f} "
                  f"| {r['expert_parallel_s'] * 1e3:.1f} | {r['distributed_s'] * 1e3:.1f} | {r['time_ratio']:.3f} "
                  f"| {r['time_ratio_vs_expert_parallel']:.3f} | {cpu / r['expert_parallel_cpu_s']:.3f} |")
        print(json.dumps({"shape": {"experts": a.experts, "top_k": a.top_k, "hidden": a.hidden, "ffn": a.ffn,
                                    "tokens": a.tokens}, "cpu": cpu_model(), "transport": a.transport,
                          "carrier": a.carrier, "results": results}, default=float))
    finally:
        shutil.rmtree(blob_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
