"""Distributed MoE layer forward over holder agents on loopback vs the same forward in process, on the same cores.

Usage:  .venv/bin/python bench/bench_forward.py [--agents 2,4] [--cpus 0-1] [--repeat 5]
        [--transport http|iroh|ws|all] [--carrier auto] [--experts 128] [--top-k 8] [--hidden 2048]
        [--ffn 768] [--tokens 512] [--agent-threads N] [--baseline-threads N] [--profile]
        [--coalesce on|off|both]

One Qwen3-30B-A3B-shaped layer (128 experts, top-8, H 2048, expert FFN 768) with synthetic
Q8_0-valued weights (random int8 quants and f16 scales decoded with ``moe.quant``), 512
random tokens. Each agent is a separate process running the real holder execute path
(``Execution.execute_request``: carrier decode → expert FFN → output encode → signed
receipt); experts are dealt round-robin (replication 1). The router runs
``router.forward.LayerForward`` in this process (receipts verified); the baseline is
``moe.ffn.moe_layer_forward`` with every expert local.

Transports (``--transport``, default ``http``; ``all`` = http, iroh, ws): every agent serves
HTTP and, when measured, iroh and its socket to a ``bench_transports.SocketHub`` of this
process (``bench_transports.serve_agent``), so the same agent processes are reached over
each transport named, one row per transport (``bench_transports.py`` says what each one
measures: ``http`` = binary frames to ``POST /frame``, ``iroh`` = ``moe/execute`` JSON
frames over QUIC, ``ws`` = the agent socket's binary frames without the Channels hop).

Equal cores: this process and every agent are pinned to the same CPU set (``--cpus``,
default this process's affinity; ``os.sched_setaffinity``, inherited by the agents), the
baseline gets as many BLAS threads as the set has cores (a second in-process baseline runs
the experts on as many threads, one BLAS thread each: ``moe_expert_parallel``, stronger
when each expert's batch is small), and each of N agents
``max(1, cores // N)`` (``--agent-threads``), so agents do not oversubscribe the cores
they share; the router (this process) runs its distributed forward with one BLAS thread.
Baselines and distributed runs alternate (per repeat: baseline, expert-parallel, then one
distributed forward per transport; ``--repeat`` of each, after one warm-up forward per
transport) and medians are reported, for every agent count of ``--agents``.
Goal: time ratio ≤ 1.10.

Where the time goes: CPU seconds per forward (``time.thread_time`` inside timed wrappers,
``time.process_time`` for whole processes, so a preempted thread is not charged for the
wait) of the router's phases (gate, carrier encode, frame pack/unpack, output decode,
receipt verify, combine, the rest = event loop, transport client and scheduling) and the
agents' phases summed over agents (carrier decode, expert compute, output encode, receipt
sign, the rest = transport server, event loop), against the baseline's CPU seconds.
"frame pack/unpack" is the transport's framing: binary frames (``wire``) for http and ws,
the JSON-RPC frames with base64 rows for iroh (``iroh.request_frames``/``assemble``/
``answer_frames``, ``wire.b64decode``; the JSON parse of a received frame stays in the
rest). The wrappers live in this file (agents report theirs over an extra ``bench/phases``
RPC method on HTTP), so the timed code is the production code. ``--profile`` also prints
the router's cProfile top entries (process CPU time) for one distributed forward per transport.

Request coalescing (``--coalesce``, default ``on``; ``moe.transports.coalesce``): the
batches a forward sends to one agent in the same loop turn go as one message (one ``batch``
frame, one iroh stream); ``both`` also measures each transport with it off, alternated in the
same run, as row ``<transport>/solo``.

Wire bytes per routed element out and back (goals ≤ 1.07 and ≤ 2.1) and the compact
wire's error against the in-process forward are printed per transport for the last agent count.
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

from moe import quant  # noqa: E402
from moe.ffn import ExpertWeights, combine, expert_forward, moe_layer_forward  # noqa: E402
from moe.gating import Gate, route  # noqa: E402

import bench_transports  # noqa: E402  (this directory is sys.path[0] when run as a script)
from machine import cpu_model, int_at_least, int_list, parse_cpus  # noqa: E402

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


class Phases:
    """CPU seconds per named phase, accumulated by ``timed`` wrappers (any thread). A timed
    call inside another is charged to the outer one only (no second count)."""

    def __init__(self):
        self.cpu: dict[str, float] = {}
        self.t0 = time.process_time()
        self.depth = threading.local()

    def reset(self) -> None:
        self.cpu.clear()
        self.t0 = time.process_time()

    def add(self, name: str, seconds: float) -> None:
        self.cpu[name] = self.cpu.get(name, 0.0) + seconds

    def timed(self, name, fn):
        """``fn`` wrapped to charge its thread CPU time to ``name`` (a str, or a callable of
        the call's arguments returning the name)."""
        def wrapper(*args, **kwargs):
            depth = getattr(self.depth, "n", 0)
            self.depth.n = depth + 1
            t = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth.n = depth
                if depth == 0:
                    self.add(name if isinstance(name, str) else name(*args, **kwargs), time.thread_time() - t)
        return wrapper

    def snapshot(self) -> dict:
        """Phases plus ``process`` (the process's CPU seconds since ``reset``)."""
        return {**self.cpu, "process": time.process_time() - self.t0}


def instrument_wire(ph: Phases) -> None:
    """Time the carrier codec and every transport's framing in this process (router and agents)."""
    from moe import wire
    from moe.transports import iroh
    for fn in ("pack_frame", "unpack_frame", "split_frames", "b64decode"):
        setattr(wire, fn, ph.timed("frame pack/unpack", getattr(wire, fn)))
    for fn in ("request_frames", "assemble", "answer_frames"):  # iroh's JSON frames, base64 rows
        setattr(iroh, fn, ph.timed("frame pack/unpack", getattr(iroh, fn)))
    wire.encode_rows = ph.timed(lambda rows, kind: f"encode {kind}", wire.encode_rows)
    wire.decode_rows = ph.timed(lambda data, kind, *a, **k: f"decode {kind}", wire.decode_rows)


def agent_main(port: int, experts: list[int], blob_dir: str, threads: int, ws_site: str, with_iroh: bool) -> None:
    """Holder process: load the given experts' blobs, serve HTTP on ``port`` and the transports of
    ``bench_transports.serve_agent`` (a socket to ``ws_site`` when given, iroh when ``with_iroh``),
    print the ready line (provider id, iroh endpoint id and addresses)."""
    from nacl.signing import SigningKey
    from threadpoolctl import threadpool_limits

    from holders import execution
    from holders.agent import AgentConfig, HolderAgent
    from moe import compute
    from moe.runtime import ExpertRuntime
    from moe.transports.http import serve_http

    threadpool_limits(limits=threads)
    ph = Phases()
    instrument_wire(ph)
    execution.make_entry = ph.timed("receipt sign", execution.make_entry)
    execution.make_seal = ph.timed("receipt sign", execution.make_seal)  # a coalesced message's one signature
    # The site is the bench's SocketHub when the ws transport is measured (its socket starts in
    # bench_transports.serve_agent); memory tier only: no disk copies of the experts.
    config = AgentConfig(ws_site or "http://127.0.0.1:9", SigningKey.generate(),
                         tempfile.mkdtemp(prefix="tenzro-bench-holder-"))
    agent = HolderAgent(config, runtime=ExpertRuntime(backend=compute.backend()))
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
        return await agent.execution.http_rpc(method, params)

    async def main():
        server = await serve_http(rpc, "127.0.0.1", port, agent.execution.http_frame)
        extra = await bench_transports.serve_agent(agent, ws_site, with_iroh)
        print(json.dumps({"ready": agent.provider, **extra}), flush=True)
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




async def probe(endpoint: str, method: str) -> dict:
    """Call JSON-RPC ``method`` (no params) on an agent's HTTP ``endpoint``; its result."""
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


def make_send(transport: str, hub: bench_transports.SocketHub | None = None):
    """(send, close, probe) for one transport: ``send(provider, holder, req)`` executes a
    ``BatchRequest`` on a holder (``bench_transports.make_send``; ``hub`` required for ``ws``;
    the ``iroh`` sender's ``.peers`` must be filled from the agents' ready lines), ``close()``
    drops connections, ``probe(endpoint, method)`` calls a JSON-RPC method on an agent over
    HTTP, which every agent serves (the bench's phase counters)."""
    return (*bench_transports.make_send(transport, hub), probe)


def start_agents(n: int, a, blob_dir: str, threads: int, ws_site: str) -> list[tuple[subprocess.Popen, int, list[int]]]:
    """Spawn ``n`` agent processes (they inherit this process's CPU affinity); ``ws_site``: the
    ``SocketHub`` URL their sockets connect to, or "" without ``ws``."""
    procs = []
    for i in range(n):
        mine = list(range(i, a.experts, n))
        port = free_port()
        p = subprocess.Popen([sys.executable, __file__, "--agent", f"{port}:{','.join(map(str, mine))}",
                              "--blob-dir", blob_dir, "--agent-threads", str(threads), "--transport", a.transport,
                              "--agent-site", ws_site],
                             stdout=subprocess.PIPE, text=True)
        procs.append((p, port, mine))
    return procs


def variants(transports: list[str], coalesce: str) -> list[tuple[str, str, bool]]:
    """(row name, transport, coalescing on) measured per transport for ``--coalesce`` on, off or
    both: the row is named after the transport with coalescing on, ``<transport>/solo`` off."""
    modes = {"on": (True,), "off": (False,), "both": (False, True)}[coalesce]
    return [(t if on else f"{t}/solo", t, on) for t in transports for on in modes]


def transports_of(choice: str) -> list[str]:
    """``--transport`` → the transports measured (``all`` = every one of ``bench_transports``)."""
    return list(bench_transports.TRANSPORTS) if choice == "all" else [choice]


def run_count(n_agents: int, a, cpus: list[int], gate: Gate, experts: dict, x: np.ndarray, blob_dir: str,
              router: Phases) -> dict:
    """Baselines and one distributed forward per transport alternated over the same ``n_agents``
    agents; medians and CPU breakdown, the distributed figures under ``by_transport``."""
    from threadpoolctl import threadpool_limits

    from router.forward import ForwardConfig, LayerForward
    from moe.shardmap import HoldingInfo, ProviderInfo, ReplicationPolicy, ShardView

    transports = transports_of(a.transport)
    rows = variants(transports, a.coalesce)  # (row name, transport, coalescing on)
    cores = len(cpus)
    agent_threads = a.agent_threads or max(1, cores // n_agents)
    base_threads = a.baseline_threads or cores
    loop = asyncio.new_event_loop()
    hub = loop.run_until_complete(bench_transports.SocketHub().start()) if "ws" in transports else None
    procs = start_agents(n_agents, a, blob_dir, agent_threads, hub.url if hub else "")
    try:
        infos, peers = [], {}
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
        sends = {t: make_send(t, hub) for t in transports}
        if "iroh" in sends:
            sends["iroh"][0].peers.update(peers)
        if hub is not None:
            loop.run_until_complete(hub.wait_for_agents(n_agents))
        agent_probe = sends[transports[0]][2]  # over HTTP whatever the transport

        async def get_view(excluded):
            return view

        async def dist(name):
            _, t, on = next(v for v in rows if v[0] == name)
            os.environ["TENZRO_COALESCE"] = "1" if on else "0"  # read by the transports at each send
            return await LayerForward(ForwardConfig(deadline_s=120), gate=gate, model_id=MODEL, layer=LAYER,
                                      hidden_states=x, get_view=get_view, send=sends[t][0], carrier=a.carrier).run()

        async def agent_phases():
            return [await agent_probe(i.http_endpoint, "bench/phases") for i in infos]

        res = {}
        with threadpool_limits(limits=1):  # warm-up: connections, caches, first-touch of the weights
            for name, _, _ in rows:
                res[name] = loop.run_until_complete(dist(name))
        loop.run_until_complete(agent_phases())
        mono_t, par_t, mono_cpu, par_cpu = [], [], [], []
        dist_t = {name: [] for name, _, _ in rows}
        router_cpu = {name: [] for name, _, _ in rows}
        agent_cpu = {name: [] for name, _, _ in rows}
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
            for name, t, _ in rows:
                router.reset()
                with threadpool_limits(limits=1):  # the router's gate is small; a spinning BLAS pool takes agent cores
                    t0 = time.perf_counter()
                    res[name] = loop.run_until_complete(dist(name))
                    dist_t[name].append(time.perf_counter() - t0)
                router_cpu[name].append(router.snapshot())
                agent_cpu[name].append(loop.run_until_complete(agent_phases()))
                if res[name].transports.get(t) != res[name].batches:
                    raise SystemExit(f"{name}: not every batch went over {t}: {res[name].transports}")
        if a.profile:
            for t, _, _ in rows:
                prof = cProfile.Profile(time.process_time)  # CPU, not wall: waits on other processes drop out
                with threadpool_limits(limits=1):
                    prof.enable()
                    loop.run_until_complete(dist(t))
                    prof.disable()
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
                print(f"\nrouter cProfile (process CPU time), one distributed forward over {n_agents} agents, {t}:")
                print("\n".join(s.getvalue().splitlines()[4:30]))
        for _, close, _ in sends.values():
            loop.run_until_complete(close())
        pool.shutdown()
    finally:
        for p, _, _ in procs:
            p.terminate()
            p.wait(10)
        if hub is not None:
            loop.run_until_complete(hub.close())
        loop.close()
    routed = a.tokens * a.top_k * a.hidden
    m, par = statistics.median(mono_t), statistics.median(par_t)

    def med(snaps, key):
        return statistics.median(s.get(key, 0.0) for s in snaps)

    def cpu_medians(snaps: list[dict]) -> dict:
        return {k: med(snaps, k) for k in sorted({k for s in snaps for k in s})}

    def summed(per_run: list[list[dict]]) -> list[dict]:  # over agents, per run
        return [{k: sum(ag.get(k, 0.0) for ag in per) for k in {k for ag in per for k in ag}} for per in per_run]

    by_transport = {}
    for t, _, _ in rows:
        d, r = statistics.median(dist_t[t]), res[t]
        by_transport[t] = {
            "distributed_s": d, "time_ratio": d / m, "time_ratio_vs_expert_parallel": d / par,
            "distributed_runs_s": dist_t[t], "router_cpu_s": cpu_medians(router_cpu[t]),
            "agents_cpu_s": cpu_medians(summed(agent_cpu[t])),
            "bytes_per_element_out": r.bytes_out / routed, "bytes_per_element_back": r.bytes_back / routed,
            "batches": r.batches, "receipts_verified": len(r.receipts),
            "max_rel_err_vs_in_process": float(np.abs(r.output - exact).max() / np.abs(exact).max()),
            "router_timings_ms": r.timings_ms}
    return {"agents": n_agents, "cores": cores, "cpus": cpus, "agent_blas_threads": agent_threads,
            "baseline_blas_threads": base_threads, "in_process_s": m, "expert_parallel_s": par,
            "in_process_runs_s": mono_t, "expert_parallel_runs_s": par_t,
            "baseline_cpu_s": statistics.median(mono_cpu), "expert_parallel_cpu_s": statistics.median(par_cpu),
            "by_transport": by_transport}


def print_breakdown(r: dict, t: str) -> None:
    """CPU ms per forward by phase over transport ``t``: router, agents (summed), baseline."""
    bt = r["by_transport"][t]
    rc, ac = dict(bt["router_cpu_s"]), dict(bt["agents_cpu_s"])
    r_proc, a_proc = rc.pop("process"), ac.pop("process")
    r_rest = r_proc - sum(rc.values())
    a_rest = a_proc - sum(ac.values())
    print(f"  {t}: CPU ms per forward (medians): in process {r['baseline_cpu_s'] * 1e3:.1f} (BLAS threads), "
          f"{r['expert_parallel_cpu_s'] * 1e3:.1f} (expert-parallel); "
          f"distributed {(r_proc + a_proc) * 1e3:.1f} = router {r_proc * 1e3:.1f} + agents {a_proc * 1e3:.1f}")
    for k, v in sorted(rc.items(), key=lambda kv: -kv[1]):
        print(f"    router  {k:<28} {v * 1e3:8.1f}")
    print(f"    router  {'event loop, ' + t + ' client, rest':<28} {r_rest * 1e3:8.1f}")
    for k, v in sorted(ac.items(), key=lambda kv: -kv[1]):
        print(f"    agents  {k:<28} {v * 1e3:8.1f}")
    print(f"    agents  {t + ' server, loop, rest':<28} {a_rest * 1e3:8.1f}")




def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int_at_least(1), default=128)
    ap.add_argument("--top-k", type=int_at_least(1), default=8, help="at most --experts (default 8)")
    ap.add_argument("--hidden", type=int_at_least(32), default=2048, help="a multiple of 32 (default 2048)")
    ap.add_argument("--ffn", type=int_at_least(32), default=768, help="a multiple of 32 (default 768)")
    ap.add_argument("--tokens", type=int_at_least(1), default=512)
    ap.add_argument("--agents", type=int_list(1), default="2,4", help="agent counts to measure, e.g. 2,4 (each "
                    "at most --experts)")
    ap.add_argument("--cpus", default=None, help="CPU set shared by the baseline and the agents (default: affinity)")
    ap.add_argument("--repeat", type=int_at_least(1), default=5)
    ap.add_argument("--transport", default="http", choices=[*bench_transports.TRANSPORTS, "all"],
                    help="transport(s) from the router to the same agents; all = one row each")
    ap.add_argument("--carrier", default="auto", choices=["auto", "f32", "q8_0"])
    ap.add_argument("--coalesce", default="on", choices=["on", "off", "both"],
                    help="request coalescing (TENZRO_COALESCE) per transport; both = a <transport>/solo row too")
    ap.add_argument("--baseline-threads", type=int_at_least(0), default=0,
                    help="BLAS threads of the baseline (default 0: cores)")
    ap.add_argument("--agent-threads", type=int_at_least(0), default=0,
                    help="BLAS threads per agent (default 0: cores // agents)")
    ap.add_argument("--profile", action="store_true", help="cProfile the router over one more distributed forward")
    ap.add_argument("--blob-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--agent", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--agent-site", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.agent:
        pass
    elif a.top_k > a.experts:
        ap.error(f"--top-k {a.top_k} is more than --experts {a.experts}")
    elif a.hidden % 32 or a.ffn % 32:
        ap.error("--hidden and --ffn must be multiples of 32 (the Q8_0 block)")
    elif max(a.agents) > a.experts:
        ap.error(f"--agents {max(a.agents)} is more than --experts {a.experts}: an agent would hold nothing")
    if a.agent:
        port, mine = a.agent.split(":")
        agent_main(int(port), [int(e) for e in mine.split(",") if e], a.blob_dir, max(1, a.agent_threads),
                   a.agent_site, "iroh" in transports_of(a.transport))
        return
    if "iroh" in transports_of(a.transport):
        from moe.transports import iroh
        if not iroh.available():
            raise SystemExit("--transport iroh: the iroh package cannot be imported; install iroh==1.2.0")

    from moe import kernels
    from router import forward as forward_mod
    from moe import messages

    try:
        cpus = parse_cpus(a.cpus)
    except ValueError as exc:
        ap.error(str(exc))
    os.sched_setaffinity(0, cpus)  # the agents inherit it: every process on the same cores
    router = Phases()
    instrument_wire(router)
    for name in ("verify_receipt", "verify_entry", "entry_in_seal"):  # single receipts, message entries
        setattr(forward_mod, name, router.timed("receipt verify", getattr(forward_mod, name)))
    messages.verify_seal = router.timed("receipt verify", messages.verify_seal)  # once per coalesced message
    forward_mod.route = router.timed("gate", forward_mod.route)
    forward_mod.combine = router.timed("combine", forward_mod.combine)

    rng = np.random.default_rng(0)
    gate = Gate("qwen3_moe", rng.standard_normal((a.experts, a.hidden)).astype(np.float32) * 0.05,
                top_k=a.top_k, norm_topk_prob=True)
    x = rng.standard_normal((a.tokens, a.hidden)).astype(np.float32)
    transports = transports_of(a.transport)
    print(f"CPU {cpu_model()}; pinned to CPUs {cpus} ({len(cpus)} cores; load average "
          f"{os.getloadavg()[0]:.1f}); native kernels {kernels.isa()}; transports {', '.join(transports)}; "
          f"carrier {a.carrier}")
    print(f"building {a.experts} synthetic Q8_0-valued experts ({a.hidden}x{a.ffn}, f32 blobs) ...", flush=True)
    blob_dir = tempfile.mkdtemp(prefix="tenzro-bench-forward-")
    try:
        experts = {}
        for e in range(a.experts):
            experts[e] = expert(e, a.hidden, a.ffn)
            (Path(blob_dir) / f"{e}.blob").write_bytes(experts[e].to_blob("f32"))
        results = []
        for n in a.agents:
            r = run_count(n, a, cpus, gate, experts, x, blob_dir, router)
            results.append(r)
            print(f"\n{n} agents x {r['agent_blas_threads']} BLAS thread(s) vs in process x "
                  f"{r['baseline_blas_threads']} BLAS thread(s), {r['cores']} cores: in process "
                  f"{r['in_process_s'] * 1e3:.1f} ms, expert-parallel over {r['cores']} threads "
                  f"{r['expert_parallel_s'] * 1e3:.1f} ms (medians of {a.repeat}, alternated with each transport)")
            for t, bt in r["by_transport"].items():
                print(f"  {t:<10} distributed {bt['distributed_s'] * 1e3:.1f} ms: ratio {bt['time_ratio']:.3f} "
                      f"(goal <= 1.10), vs expert-parallel {bt['time_ratio_vs_expert_parallel']:.3f}; runs "
                      + " ".join(f"{v * 1e3:.0f}" for v in bt["distributed_runs_s"]))
            for t in r["by_transport"]:
                print_breakdown(r, t)
        print(f"\nwire per transport, {results[-1]['agents']} agents:")
        for t, bt in results[-1]["by_transport"].items():
            print(f"  {t:<10} bytes per routed element out {bt['bytes_per_element_out']:.4f} (goal <= 1.07), back "
                  f"{bt['bytes_per_element_back']:.4f} (goal <= 2.1); {bt['batches']} batches, "
                  f"{bt['receipts_verified']} receipts verified; rel err vs in-process "
                  f"{bt['max_rel_err_vs_in_process']:.2e}")
        print("\n| agents | transport | cores | in process ms (BLAS x cores) | in process ms (expert-parallel) "
              "| distributed ms | ratio | ratio vs expert-parallel | CPU ratio vs expert-parallel |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in results:
            for t, bt in r["by_transport"].items():
                cpu = bt["router_cpu_s"]["process"] + bt["agents_cpu_s"]["process"]
                print(f"| {r['agents']} | {t} | {r['cores']} | {r['in_process_s'] * 1e3:.1f} "
                      f"| {r['expert_parallel_s'] * 1e3:.1f} | {bt['distributed_s'] * 1e3:.1f} "
                      f"| {bt['time_ratio']:.3f} | {bt['time_ratio_vs_expert_parallel']:.3f} "
                      f"| {cpu / r['expert_parallel_cpu_s']:.3f} |")
        print(json.dumps({"shape": {"experts": a.experts, "top_k": a.top_k, "hidden": a.hidden, "ffn": a.ffn,
                                    "tokens": a.tokens}, "cpu": cpu_model(), "transports": transports,
                          "carrier": a.carrier, "results": results}, default=float))
    finally:
        shutil.rmtree(blob_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
