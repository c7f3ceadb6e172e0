"""Token generation with distributed experts vs the same model in one process.

Usage:  .venv/bin/python bench/bench_generate.py [--batch 8] [--prompt 32] [--steps 8] [--agents 4]
        [--models qwen3,synth] [--carrier f16] [--cpus 0-1] [--repeat 3] [--profile] [--coalesce on|off|both]
        [--site [--site-transport ws|http]]

Two models: the shipped qwen3_moe fixture, and a Qwen3-30B-A3B-shaped synthetic model (2
layers, 128 experts, top-8, H 2048, expert FFN 768, 32 query / 4 KV heads of 128, vocab
``--synth-vocab``) with Q4_K_M experts (gate/up Q4_K, down Q6_K). Quantizing 256 experts
with our numpy quantizer would take minutes on 2 cores, so ``--pool`` distinct Q4_K_M
matrices are quantized once and expert ``e`` takes pool entries chosen by ``e``: every
expert runs the real Q4_K/Q6_K kernels at full size; only their values repeat.

For each model the numpy backbone (``moe.backbone``) runs in this process; the MoE
layer is either ``moe.ffn.moe_layer_forward`` with every expert local (baseline) or
``router.forward.LayerForward`` over ``--agents`` holder processes (the real
``Execution.execute_request`` path behind HTTP ``POST /frame``, signed receipts verified;
experts dealt round-robin). Both run the same prompts in the same run: prefill of
``--batch`` prompts, then ``--steps`` decode steps at batch ``--batch``. Prints decode
tokens/s, the time ratio per decode step (goal ≤ 1.25), prefill tokens/s, greedy-id
agreement, and the KV-handoff bytes per prompt token (``moe.handoff.pack_handoff`` of
the prefilled batch: what a Prefill agent hands a Decode agent).

Equal cores (as ``bench_forward.py``): this process and every agent are pinned to the same
CPU set (``--cpus``, default this process's affinity; ``os.sched_setaffinity``, inherited by
the agents); the in-process baseline gets as many BLAS threads as the set has cores, each
of N agents ``max(1, cores // N)``. In-process and distributed generations alternate
(``--repeat`` of each after one warm-up of each); the decode-step time is the median over
every step of every repeat. ``cpu`` in the report is the CPU model and the SIMD path of the
quantized kernels (``moe.kernels``).

``--site`` (qwen3 only) adds a third path, the product's: a local cluster (``manage.py
tenzro_cluster``: the site process plus ``--agents`` holder agents, replication 2, in a
fresh ``TENZRO_VAR_DIR``; database and channel layer as this environment configures them,
SQLite and in-memory by default) on the same CPU set, and the same prompts through JSON-RPC
``tenzro_moeGenerate`` (backbone on the site, every MoE layer through ``router.state.Router.forward``:
admission, failover, receipts, holder outcomes, settlement). Its decode step is the site's
``timings_ms.decode`` over the decode steps of a generation (median over repeats), alternated
with the other two paths (after each generation the bench waits until the site process is
idle, so its background recording does not land on the other paths); the report adds ``decode_step_ms.site`` and the ratios site/distributed and
site/in-process. ``--site-transport http`` has the site reach the agents over their HTTP
``POST /frame`` (``TENZRO_DATA_TRANSPORT=http``, agents ``--agent-http``), the transport of the
distributed path, so the difference left is the site's own per-forward work.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moe import quant  # noqa: E402
from moe.ffn import ExpertWeights, moe_layer_forward  # noqa: E402
from machine import cpu_model, parse_cpus  # noqa: E402  (this directory is sys.path[0] when run as a script)
from moe.gating import Gate  # noqa: E402

QWEN = ROOT / "tests" / "fixtures" / "qwen3_moe_tiny"
SYNTH = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 2, "num_attention_heads": 32,
         "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
         "moe_intermediate_size": 768, "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
         "max_position_embeddings": 4096, "tie_word_embeddings": False}


def synth_pool(n: int, hidden: int, ffn: int) -> list[ExpertWeights]:
    """``n`` Q4_K_M experts (gate/up ``quant.QuantizedMatrix`` Q4_K, down Q6_K), deterministic."""
    pool = []
    for i in range(n):
        rng = np.random.default_rng(500 + i)
        g, u = (rng.standard_normal((ffn, hidden)).astype(np.float32) * (2 / np.sqrt(hidden)) for _ in range(2))
        d = rng.standard_normal((hidden, ffn)).astype(np.float32) * (2 / np.sqrt(ffn))
        pool.append(ExpertWeights(quant.QuantizedMatrix("q4_k", g.shape, quant.quantize(g, "q4_k")),
                                  quant.QuantizedMatrix("q4_k", u.shape, quant.quantize(u, "q4_k")),
                                  quant.QuantizedMatrix("q6_k", d.shape, quant.quantize(d, "q6_k"))))
    return pool


def synth_expert(pool: list[ExpertWeights], layer: int, e: int) -> ExpertWeights:
    """Expert ``e`` of ``layer``: projections drawn from ``pool`` by index (see module doc)."""
    n = len(pool)
    k = layer * 128 + e
    return ExpertWeights(pool[k % n].gate_proj, pool[(k // n + k) % n].up_proj, pool[(3 * k + 1) % n].down_proj)


class Model:
    """(backbone, gates per MoE layer, ``expert(layer, e)``) of ``name`` (``qwen3`` or ``synth``)."""

    def __init__(self, name: str, pool: int, vocab: int):
        from moe.backbone import build_backbone

        self.name = name
        if name == "qwen3":
            from prepare.backbone import backbone_groups
            from prepare.checkpoint import Checkpoint
            from prepare.layouts import load_expert, load_gate, spec_from_config

            c = Checkpoint(QWEN)
            spec = spec_from_config(c.config)
            self.config = c.config
            w = {n: c.read(n) for names in backbone_groups(c).values() for n in names}
            self.layers = [L for L in range(c.config["num_hidden_layers"]) if spec.is_moe_layer(L)]
            self.gates = {L: load_gate(c, spec, L) for L in self.layers}
            self.experts = {L: {e: load_expert(c, spec, L, e) for e in range(self.gates[L].num_experts)}
                            for L in self.layers}
        else:
            cfg = {**SYNTH, "vocab_size": vocab}
            self.config = cfg
            rng = np.random.default_rng(0)
            H, D, nq, nkv = cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]

            def mat(r, c):
                return (rng.standard_normal((r, c)) / np.sqrt(c)).astype(np.float32)

            w = {"model.embed_tokens.weight": rng.standard_normal((vocab, H)).astype(np.float32),
                 "model.norm.weight": np.ones(H, np.float32), "lm_head.weight": mat(vocab, H)}
            for L in range(cfg["num_hidden_layers"]):
                p = f"model.layers.{L}."
                w.update({p + "input_layernorm.weight": np.ones(H, np.float32),
                          p + "post_attention_layernorm.weight": np.ones(H, np.float32),
                          p + "self_attn.q_proj.weight": mat(nq * D, H), p + "self_attn.k_proj.weight": mat(nkv * D, H),
                          p + "self_attn.v_proj.weight": mat(nkv * D, H), p + "self_attn.o_proj.weight": mat(H, nq * D),
                          p + "self_attn.q_norm.weight": np.ones(D, np.float32),
                          p + "self_attn.k_norm.weight": np.ones(D, np.float32)})
            self.layers = list(range(cfg["num_hidden_layers"]))
            self.gates = {L: Gate("qwen3_moe", mat(cfg["num_experts"], H) * 4, top_k=cfg["num_experts_per_tok"],
                                  norm_topk_prob=True) for L in self.layers}
            experts = synth_pool(pool, H, cfg["moe_intermediate_size"])
            self.experts = {L: {e: synth_expert(experts, L, e) for e in range(cfg["num_experts"])}
                            for L in self.layers}
        self.weights = w  # HF name -> float32 array of the backbone (bench_serving writes it as GGUF)
        self.backbone = build_backbone(self.config, w)


def agent_main(spec: str, port: int, keys: list[tuple[int, int]], pool: int, vocab: int, threads: int = 1) -> None:
    """Holder process: hold ``keys`` (layer, expert) of model ``spec`` with ``threads`` BLAS
    threads, serve HTTP, print ``ready``."""
    from nacl.signing import SigningKey
    from threadpoolctl import threadpool_limits

    from holders.agent import AgentConfig, HolderAgent
    from moe import compute
    from moe.runtime import ExpertRuntime
    from moe.transports.http import serve_http

    threadpool_limits(limits=threads)
    model = Model(spec, pool, vocab)
    config = AgentConfig("http://127.0.0.1:9", SigningKey.generate(), tempfile.mkdtemp(prefix="tenzro-bench-gen-"))
    agent = HolderAgent(config, runtime=ExpertRuntime(backend=compute.backend()))
    for L, e in keys:
        agent.runtime.load_expert(spec, L, e, model.experts[L][e].to_blob("f32"))

    async def main():
        server = await serve_http(agent.execution.http_rpc, "127.0.0.1", port, agent.execution.http_frame)
        print(json.dumps({"ready": agent.provider}), flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SiteCluster:
    """``manage.py tenzro_cluster`` of the qwen3 fixture with ``agents`` agents in a fresh var dir
    (``--site``), the site reaching them over ``transport`` (``ws``: agent sockets, the default;
    ``http``: the agents' ``POST /frame`` as the bench's distributed path);
    ``generate(prompts, steps)`` → (ms per decode step, output ids)."""

    def __init__(self, agents: int, carrier: str, transport: str = "ws"):
        self.var = tempfile.mkdtemp(prefix="tenzro-bench-site-")
        env = {**os.environ, "TENZRO_VAR_DIR": self.var, "TENZRO_DATA_TRANSPORT": transport}
        self.carrier = carrier
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "manage.py"), "tenzro_cluster", "--checkpoint",
                                      str(QWEN), "--holders", str(agents)]
                                     + (["--agent-http"] if transport == "http" else []), stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT)
        for line in self.proc.stdout:
            if line.startswith("{"):
                info = json.loads(line)
                self.rpc, self.model_id, self.site_pid = info["rpc"], info["model_id"], info["site_pid"]
                return
        raise SystemExit(f"tenzro_cluster did not start; logs in {self.var}/logs")

    def generate(self, prompts: list[np.ndarray], steps: int) -> tuple[float, list[list[int]]]:
        import httpx

        body = {"jsonrpc": "2.0", "id": 1, "method": "tenzro_moeGenerate",
                "params": {"model_id": self.model_id, "input_ids": [p.tolist() for p in prompts],
                           "max_new_tokens": steps + 1, "carrier": self.carrier}}
        r = httpx.post(self.rpc, json=body, timeout=600).json()
        if "error" in r:
            raise SystemExit(f"tenzro_moeGenerate failed: {r['error']}")
        out = r["result"]["output_ids"]
        self.quiesce()
        return r["result"]["timings_ms"]["decode"] / (len(out[0]) - 1), out

    def quiesce(self, timeout: float = 30.0) -> None:
        """Wait until the site process is idle (under 10 ms of CPU in 250 ms): its background
        work after an answer (holder outcomes, settlement, audits) must not land on the other
        paths' timings."""
        tick = os.sysconf("SC_CLK_TCK")

        def cpu_s() -> float:
            with open(f"/proc/{self.site_pid}/stat") as fh:
                f = fh.read().rsplit(")", 1)[1].split()
            return (int(f[11]) + int(f[12])) / tick  # utime + stime

        deadline = time.monotonic() + timeout
        last = cpu_s()
        while time.monotonic() < deadline:
            time.sleep(0.25)
            now = cpu_s()
            if now - last < 0.01:
                return
            last = now

    def stop(self) -> None:
        self.proc.terminate()  # the cluster stops its site and agents
        self.proc.wait(30)


def bench_model(name: str, a) -> dict:
    """Run one model in process and distributed; returns the report dict."""
    from threadpoolctl import threadpool_limits

    from moe.backbone.decode import Generator, Sampling
    from router.forward import ForwardConfig, LayerForward
    from moe.handoff import pack_handoff
    from moe.transports.http import HttpHolderClient
    from moe.shardmap import HoldingInfo, ProviderInfo, ReplicationPolicy, ShardView

    cores = len(a.cpus)
    agent_threads, base_threads = max(1, cores // a.agents), cores
    t_build = time.perf_counter()
    model = Model(name, a.pool, a.synth_vocab)
    keys = [(L, e) for L in model.layers for e in sorted(model.experts[L])]
    procs = []
    site = None
    try:
        if a.site and name == "qwen3":
            site = SiteCluster(a.agents, a.carrier, a.site_transport)
        for i in range(a.agents):
            mine = keys[i::a.agents]
            port = free_port()
            arg = f"{name}:{port}:{';'.join(f'{L},{e}' for L, e in mine)}"
            procs.append((subprocess.Popen([sys.executable, __file__, "--agent", arg, "--pool", str(a.pool),
                                            "--synth-vocab", str(a.synth_vocab), "--agent-threads",
                                            str(agent_threads)], stdout=subprocess.PIPE, text=True),
                          port, mine))
        infos = []
        for p, port, mine in procs:
            line = p.stdout.readline()
            if not line:
                raise SystemExit(f"agent on port {port} did not start")
            infos.append(ProviderInfo(json.loads(line)["ready"], roles=("ExpertHolder",),
                                      http_endpoint=f"http://127.0.0.1:{port}/rpc",
                                      holdings=tuple(HoldingInfo(name, L, e, "Warm", 0, None) for L, e in mine)))
        build_s = time.perf_counter() - t_build
        view = ShardView.build(name, infos, policy=ReplicationPolicy())
        client = HttpHolderClient(300)
        loop = asyncio.new_event_loop()

        async def send(provider, holder, req):
            return await client.execute_frame(holder.http_endpoint, req)

        async def get_view(excluded):
            return view

        def dist_mlp(layer, x):
            res = loop.run_until_complete(LayerForward(
                ForwardConfig(deadline_s=300), gate=model.gates[layer], model_id=name, layer=layer, hidden_states=x,
                get_view=get_view, send=send, carrier=a.carrier).run())
            return res.output

        def local_mlp(layer, x):
            return moe_layer_forward(model.gates[layer], model.experts[layer], x)[0]

        rng = np.random.default_rng(7)
        vocab = model.backbone.vocab_size
        prompts = [rng.integers(0, vocab, a.prompt) for _ in range(a.batch)]
        s = Sampling(max_new_tokens=a.steps + 1)

        def run(mlp):
            g = Generator(model.backbone, mlp, s)
            seqs = g.prefill(prompts)
            handoff = len(pack_handoff(seqs))
            per_step = []
            while True:
                t0 = time.perf_counter()
                if not g.step(seqs):
                    break
                per_step.append(time.perf_counter() - t0)
            return seqs, g.timings["prefill_ms"] / 1e3, per_step, handoff

        # Request coalescing (TENZRO_COALESCE, read at each send): on, off, or both alternated.
        modes = {"on": ("1",), "off": ("0",), "both": ("0", "1")}[a.coalesce]
        locals_, by_mode, sites = [], {m: [] for m in modes}, []
        with threadpool_limits(limits=base_threads):
            run(local_mlp)  # warm up kernels and caches
        with threadpool_limits(limits=1):  # the router's own numpy work: one thread, as the site runs it
            run(dist_mlp)  # warm up connections
        if site is not None:
            site.generate(prompts, a.steps)  # warm up the site's caches and agent sockets
        for _ in range(a.repeat):
            with threadpool_limits(limits=base_threads):
                locals_.append(run(local_mlp))
            for m in modes:
                os.environ["TENZRO_COALESCE"] = m
                with threadpool_limits(limits=1):
                    by_mode[m].append(run(dist_mlp))
            if site is not None:
                sites.append(site.generate(prompts, a.steps))
        dists = by_mode[modes[-1]]
        if a.profile:
            import cProfile
            import io
            import pstats

            prof = cProfile.Profile()
            with threadpool_limits(limits=1):
                prof.runcall(run, dist_mlp)
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
            print(f"router profile of one distributed generation ({name}):\n{out.getvalue()}", flush=True)
        loop.run_until_complete(client.close())
        loop.close()
    finally:
        for p, _, _ in procs:
            p.terminate()
            p.wait(10)
        if site is not None:
            site.stop()
    ls, handoff = locals_[-1][0], locals_[-1][3]
    lstep = float(np.median([t for r in locals_ for t in r[2]]))
    dstep = float(np.median([t for r in dists for t in r[2]]))
    lpre = float(np.median([r[1] for r in locals_]))
    dpre = float(np.median([r[1] for r in dists]))
    solo = {}
    if len(by_mode) == 2:  # --coalesce both: the same distributed generation with every batch sent alone
        sstep = float(np.median([t for r in by_mode["0"] for t in r[2]]))
        ids = [[x.output for x in r[0]] for runs in by_mode.values() for r in runs]
        solo = {"decode_step_ms_solo": round(sstep * 1e3, 2), "decode_step_ratio_solo": round(sstep / lstep, 3),
                "greedy_ids_equal_solo_vs_coalesced": all(i == ids[0] for i in ids)}
    ptoks = a.batch * a.prompt
    r = {"model": name, "agents": a.agents, "batch": a.batch, "prompt_tokens": a.prompt,
            "decode_steps": len(dists[-1][2]), "repeat": a.repeat, "carrier": a.carrier, "cpus": a.cpus,
            "cpu": cpu_description(), "agent_blas_threads": agent_threads, "baseline_blas_threads": base_threads,
            "setup_s": round(build_s, 1),
            "decode_step_ms": {"in_process": round(lstep * 1e3, 2), "distributed": round(dstep * 1e3, 2)},
            "decode_step_ratio": round(dstep / lstep, 3),
            "decode_tokens_per_s": {"in_process": round(a.batch / lstep, 2), "distributed": round(a.batch / dstep, 2)},
            "prefill_tokens_per_s": {"in_process": round(ptoks / lpre, 2), "distributed": round(ptoks / dpre, 2)},
            "greedy_ids_equal": all([x.output for x in r[0]] == [x.output for x in ls]
                                    for r in locals_ + [d for runs in by_mode.values() for d in runs]),
            "kv_handoff_bytes_per_token": round(handoff / ptoks, 1), "coalesce": a.coalesce, **solo}
    if sites:
        sstep = float(np.median([ms for ms, _ in sites])) / 1e3
        r["decode_step_ms"]["site"] = round(sstep * 1e3, 2)
        r["site_vs_distributed_ratio"] = round(sstep / dstep, 3)
        r["site_vs_in_process_ratio"] = round(sstep / lstep, 3)
        r["site_greedy_ids_equal"] = all(out == [x.output for x in ls] for _, out in sites)
        r["site_transport"] = a.site_transport
    return r




def cpu_description() -> str:
    """CPU model (``/proc/cpuinfo``) and the SIMD path of the quantized kernels."""
    from moe import kernels

    return f"{cpu_model()}; quantized kernels: {kernels.isa() or 'numba (no native extension)'}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen3,synth")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--carrier", default="f16", choices=["auto", "f32", "f16", "q8_0"],
                    help="layer-forward carrier (default f16: what a generation's auto means, "
                         "router.generate.GENERATION_AUTO_CARRIER)")
    ap.add_argument("--cpus", default=None, help="CPU set of this process and every agent (default: this "
                                                 "process's affinity), e.g. 0-1")
    ap.add_argument("--repeat", type=int, default=3, help="alternated in-process/distributed generations")
    ap.add_argument("--agent-threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help="also print the router's cProfile top entries")
    ap.add_argument("--site", action="store_true",
                    help="qwen3: also generate through a local cluster's tenzro_moeGenerate (module doc)")
    ap.add_argument("--site-transport", default="ws", choices=["ws", "http"],
                    help="--site: how the site reaches its agents (TENZRO_DATA_TRANSPORT; default ws)")
    ap.add_argument("--coalesce", default="on", choices=["on", "off", "both"],
                    help="request coalescing (TENZRO_COALESCE) of the distributed runs; both = alternate off and on")
    ap.add_argument("--pool", type=int, default=8, help="distinct Q4_K_M matrices of the synthetic model")
    ap.add_argument("--synth-vocab", type=int, default=8192)
    ap.add_argument("--agent", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.agent:
        name, port, keys = a.agent.split(":")
        agent_main(name, int(port), [tuple(map(int, k.split(","))) for k in keys.split(";") if k], a.pool,
                   a.synth_vocab, a.agent_threads)
        return
    try:
        a.cpus = parse_cpus(a.cpus)
    except ValueError as exc:
        ap.error(str(exc))
    os.sched_setaffinity(0, a.cpus)  # inherited by the agents: both sides get the same cores
    for name in a.models.split(","):
        r = bench_model(name, a)
        print(f"{name}: decode step at batch {r['batch']}: in process {r['decode_step_ms']['in_process']} ms, "
              f"distributed {r['decode_step_ms']['distributed']} ms over {r['agents']} agents "
              f"(cpus {r['cpus']}): ratio {r['decode_step_ratio']} (goal <= 1.25); decode tok/s "
              f"{r['decode_tokens_per_s']}; prefill tok/s {r['prefill_tokens_per_s']}; KV handoff "
              f"{r['kv_handoff_bytes_per_token']} B/token; greedy ids equal: {r['greedy_ids_equal']}"
              + (f"; coalescing off: {r['decode_step_ms_solo']} ms, ratio {r['decode_step_ratio_solo']}, "
                 f"greedy ids equal to coalesced: {r['greedy_ids_equal_solo_vs_coalesced']}"
                 if "decode_step_ms_solo" in r else ""), flush=True)
        if "site" in r["decode_step_ms"]:
            print(f"{name}: site tenzro_moeGenerate decode step {r['decode_step_ms']['site']} ms: "
                  f"{r['site_vs_distributed_ratio']}x the distributed path, {r['site_vs_in_process_ratio']}x in "
                  f"process; greedy ids equal: {r['site_greedy_ids_equal']}", flush=True)
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
