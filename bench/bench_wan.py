"""Holders across the internet (issue 22): decode throughput of a real cluster whose agents dial
the site through a user-space WAN emulator (``tests/wan_proxy.py``).

Usage:  .venv/bin/python bench/bench_wan.py [--rtts 0,10,40,100] [--clients 1,16] [--tokens 24]
        [--jitter-ms 0] [--bandwidth-mbps 0] [--loss 0.01] [--loss-rtt 40] [--holders 3]
        [--checkpoint tests/fixtures/qwen3_moe_tiny] [--microbatches N] [--json]

Starts ``manage.py tenzro_cluster --port P --agent-site http://127.0.0.1:Q`` with a
``WanProxy`` on Q in front of the site's P: every agent socket (heartbeats, expert batches,
blob fetches) crosses the emulated link, so each MoE layer of each decode step pays the RTT.
Client → site HTTP is direct. For each RTT (the proxy's link is changed live, same cluster)
and each client count it sends one greedy ``/v1/completions`` per client (``--tokens`` new
tokens, token-id prompts of 4..16 ids; one client sends ``--solo-requests`` in a row) and
reports output tokens/s, its ratio to the same client count at RTT 0 and to one client at
RTT 0, errors, whether every request's tokens equal RTT 0's, and the mean step timeline
read from the site's ``/metrics`` (``tenzro_step_*``: step wall, router compute, a
micro-batch's wire wait, router idle, micro-batches). Then the same at ``--loss-rtt`` with
``--loss`` per TCP segment (each loss costs a retransmit delay).

KV handoff (``--handoff``, on by default): two more agents join through the site proxy, one
``--role Prefill`` (with iroh) and one ``--role Decode`` whose HTTP and iroh endpoints sit
behind their own proxies (``--advertise-http`` / ``--advertise-iroh``, TCP and UDP) at
``--handoff-rtt``; ``tenzro_moeGenerate`` with ``handoff: true`` on a ``--handoff-prompt``
token prompt then moves the KV cache peer to peer over iroh, over HTTP (the Decode agent
restarted without iroh) and relayed through the site (restarted without endpoints): bytes,
chunks and handoff ms of each, greedy tokens equal across paths.

Goals (issue 22): 16 clients at 40 ms ≥ 0.5× 16 clients at 0 ms and ≥ 4× one client at 0 ms;
one client's step ≤ 1.1 × (layers × RTT) + its compute; identical tokens; 0 errors at 1 % loss.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from machine import cpu_model  # noqa: E402
from tests.cluster_util import env_for, rpc, running_cluster, stop, wait_for  # noqa: E402
from tests.wan_proxy import Link, WanProxy  # noqa: E402

STEP_METRICS = {"wall": "tenzro_step_seconds", "compute": "tenzro_step_compute_seconds",
                "wire": "tenzro_step_wire_seconds", "forward": "tenzro_step_forward_seconds",
                "idle": "tenzro_step_idle_seconds",
                "microbatches": "tenzro_step_microbatches"}


def scrape(url: str) -> dict[str, float]:
    """``{metric_sum / metric_count: value}`` of the step histograms on ``/metrics`` (all models)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        base = name.split("{", 1)[0]
        if base.endswith(("_sum", "_count")) and base.rsplit("_", 1)[0] in STEP_METRICS.values():
            out[base] = out.get(base, 0.0) + float(value)
    return out


def timeline(before: dict, after: dict) -> dict:
    """Mean per step between two scrapes: ms of wall, compute, wire, idle; micro-batches."""
    steps = after.get("tenzro_step_seconds_count", 0) - before.get("tenzro_step_seconds_count", 0)
    out = {"steps": int(steps)}
    for key, name in STEP_METRICS.items():
        d = after.get(f"{name}_sum", 0) - before.get(f"{name}_sum", 0)
        out[key] = round(d / steps * (1 if key == "microbatches" else 1e3), 2) if steps else None
    return out


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], tokens: int) -> list[int]:
    """Token ids of one greedy completion."""
    r = await client.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": tokens,
                                                         "temperature": 0}, timeout=600)
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


async def run(url: str, model: str, prompts: dict[int, list[int]], tokens: int, clients: int) -> dict:
    """``prompts`` ({index: ids}) over ``clients`` concurrent workers: tokens per index, errors."""
    queue = list(prompts.items())
    out: dict[int, list] = {}
    errors: list[str] = []

    async def worker(client):
        while queue:
            i, p = queue.pop(0)
            try:
                out[i] = await one(client, url, model, p, tokens)
            except Exception as exc:  # counted, not fatal: the bench reports errors
                errors.append(f"{type(exc).__name__}: {str(exc)[:160]}")

    t0 = time.perf_counter()
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients + 4)) as client:
        await asyncio.gather(*(worker(client) for _ in range(clients)))
    wall = time.perf_counter() - t0
    new = sum(len(v) for v in out.values())
    return {"wall_s": round(wall, 3), "tokens": new, "tokens_per_s": round(new / wall, 2), "errors": errors,
            "ids": out}


def measure(url: str, model: str, prompts: list[list[int]], tokens: int, clients: int, solo: int) -> dict:
    """One (link, clients) cell: throughput, errors, ids and the step timeline."""
    chosen = dict(enumerate(prompts[:solo if clients == 1 else clients]))
    before = scrape(url)
    res = asyncio.run(run(url, model, chosen, tokens, clients))
    res["timeline"] = timeline(before, scrape(url))
    return res


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    """A free port on 127.0.0.1 (TCP or UDP)."""
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_agent(tmp: Path, env: dict, site: str, name: str, role: str, extra: list[str]) -> subprocess.Popen:
    """A standalone ``python -m holders`` agent (its own key and blob dir under ``tmp``)."""
    home = tmp / name
    home.mkdir(exist_ok=True)
    log = open(home / "agent.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "holders", "--site", site, "--key", str(home / "agent.key"),
                             "--name", name, "--role", role, "--blob-dir", str(home / "blobs"),
                             "--heartbeat-interval", "2", *extra], cwd=ROOT, env=env, stdout=log, stderr=log)


def handoff_bench(tmp: Path, env: dict, info: dict, site_proxy: WanProxy, model: str, rtt_ms: float,
                  prompt_len: int, prompts: int, tokens: int) -> list[dict]:
    """The KV handoff cells (module docstring): one per path, iroh / http / site."""
    link = Link.rtt(rtt_ms)
    site_proxy.set_link(link)
    http_port, iroh_port = free_port(), free_port(socket.SOCK_DGRAM)
    cells = []
    with WanProxy(http_port, link) as hp, WanProxy(iroh_port, link, udp=True) as up:
        pre = start_agent(tmp, env, site_proxy.url, "prefill", "Prefill", ["--iroh"])
        endpoints = {"iroh": ["--http-port", str(http_port), "--advertise-http", hp.url, "--iroh", "--iroh-bind",
                              f"127.0.0.1:{iroh_port}", "--advertise-iroh", f"127.0.0.1:{up.port}"],
                     "http": ["--http-port", str(http_port), "--advertise-http", hp.url],
                     "site": []}
        dec = None
        rng = np.random.default_rng(1)
        prompt = [[int(t) for t in rng.integers(0, 256, size=prompt_len)] for _ in range(prompts)]
        try:
            for path, flags in endpoints.items():
                if dec is not None:
                    stop(dec)
                dec = start_agent(tmp, env, site_proxy.url, "decode", "Decode", flags)

                def ready(path=path):
                    rows = rpc(info["rpc"], "tenzro_moeListProviders", {"live": True})["result"]["providers"]
                    by = {r["name"]: r for r in rows}
                    d = by.get("decode")
                    return ("prefill" in by and d is not None and bool(d["http_endpoint"]) == (path != "site")
                            and bool(d["iroh_addrs"]) == (path == "iroh"))

                wait_for(ready, 180, f"the Prefill and Decode agents ({path}) to join")
                runs = []
                for _ in range(2):  # the first pays connection set-up (QUIC / TCP handshakes)
                    r = rpc(info["rpc"], "tenzro_moeGenerate", {"model_id": model, "input_ids": prompt,
                                                                "max_new_tokens": tokens, "handoff": True},
                            timeout=600)
                    if "error" in r:
                        raise RuntimeError(f"handoff over {path}: {r['error']}")
                    runs.append(r["result"])
                kv, last = runs[-1]["kv_handoff"], runs[-1]
                cells.append({"path": kv["path"], "want": path, "rtt_ms": rtt_ms,
                              "prompt_tokens": prompt_len * prompts, "bytes": kv["bytes"], "kv_bytes": kv["kv_bytes"],
                              "chunks": kv["frames"], "handoff_ms": [x["timings_ms"]["handoff"] for x in runs],
                              "send_ms": [x["kv_handoff"].get("send_ms") for x in runs],
                              "output_ids": last["output_ids"]})
                c = cells[-1]
                print(f"handoff at {rtt_ms:g} ms RTT over {kv['path']:>4}: {kv['bytes']} bytes ({kv['kv_bytes']} KV, "
                      f"{c['prompt_tokens']} prompt tokens) in {kv['frames']} chunk(s): site saw {c['handoff_ms'][0]} "
                      f"ms first, {c['handoff_ms'][1]} ms warm; Prefill agent's send {c['send_ms']} ms", flush=True)
        finally:
            for proc in (pre, dec):
                if proc is not None:
                    stop(proc)
    same = all(c["output_ids"] == cells[0]["output_ids"] for c in cells)
    print(f"handoff: greedy tokens identical across paths: {'yes' if same else 'NO'}")
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rtts", default="0,10,40,100", help="round trips in ms, comma-separated (0 first)")
    ap.add_argument("--clients", default="1,16", help="client counts, comma-separated")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--solo-requests", type=int, default=3, help="requests one client sends in a row")
    ap.add_argument("--jitter-ms", type=float, default=0.0, help="RTT jitter (± half per direction)")
    ap.add_argument("--bandwidth-mbps", type=float, default=0.0, help="link cap per direction (0: none)")
    ap.add_argument("--loss", type=float, default=0.01, help="loss probability of the loss run (0: skip it)")
    ap.add_argument("--loss-rtt", type=float, default=40.0)
    ap.add_argument("--holders", type=int, default=3)
    ap.add_argument("--microbatches", type=int, default=None,
                    help="TENZRO_GEN_MICROBATCHES of the site (default the site's, 4; 1 = no overlap)")
    ap.add_argument("--checkpoint", default=str(ROOT / "tests/fixtures/qwen3_moe_tiny"))
    ap.add_argument("--model", default="qwen3-moe-tiny")
    ap.add_argument("--handoff", action=argparse.BooleanOptionalAction, default=True,
                    help="also measure the KV handoff paths (default on)")
    ap.add_argument("--handoff-rtt", type=float, default=40.0)
    ap.add_argument("--handoff-prompt", type=int, default=120, help="tokens per prompt of the handoff runs")
    ap.add_argument("--handoff-prompts", type=int, default=8, help="prompts of one handoff run (its KV caches move "
                                                                     "together)")
    ap.add_argument("--skip-decode", action="store_true", help="only the handoff part")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rtts = [float(x) for x in a.rtts.split(",")]
    counts = [int(x) for x in a.clients.split(",")]
    if rtts[0] != 0 or 1 not in counts:
        ap.error("--rtts must start with 0 and --clients include 1 (the baselines)")
    layers = json.loads((Path(a.checkpoint) / "config.json").read_text())["num_hidden_layers"]
    bw = a.bandwidth_mbps * 1e6 / 8 if a.bandwidth_mbps else None
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 256, size=int(rng.integers(4, 17)))] for _ in range(max(counts))]
    cells: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        env = env_for(Path(tmp))
        if a.microbatches:
            env["TENZRO_GEN_MICROBATCHES"] = str(a.microbatches)
        with socket.socket() as s:  # the site's port, known before it starts: the proxy forwards there
            s.bind(("127.0.0.1", 0))
            site_port = s.getsockname()[1]
        with WanProxy(site_port, Link()) as proxy, running_cluster(
                Path(tmp), [Path(a.checkpoint)], holders=a.holders, env=env,
                extra=("--port", str(site_port), "--agent-site", proxy.url)) as (info, _proc):
            url = info["url"]
            asyncio.run(run(url, a.model, dict(enumerate(prompts[:2])), a.tokens, 2))  # warm: JIT, connections
            base: dict[int, dict] = {}
            runs = [(r, 0.0) for r in rtts] + ([(a.loss_rtt, a.loss)] if a.loss else [])
            runs = [] if a.skip_decode else runs
            for rtt, loss in runs:
                proxy.set_link(Link.rtt(rtt, a.jitter_ms, bw, loss))
                for c in counts:
                    res = measure(url, a.model, prompts, a.tokens, c, a.solo_requests)
                    if rtt == 0 and not loss:
                        base[c] = res
                    ref = base[c]["ids"]
                    same = all(ref.get(i) == ids for i, ids in res["ids"].items()) and len(res["ids"]) == len(ref)
                    cell = {"rtt_ms": rtt, "loss": loss, "clients": c, **{k: v for k, v in res.items() if k != "ids"},
                            "ratio_to_rtt0": round(res["tokens_per_s"] / base[c]["tokens_per_s"], 3),
                            "ratio_to_1_client_rtt0": round(res["tokens_per_s"] / base[1]["tokens_per_s"], 3),
                            "tokens_identical": same, "layers": layers}
                    tl = res["timeline"]
                    if c == 1 and tl["wall"] is not None:  # the no-extra-round-trip goal: the step's
                        # compute is everything but the network: the same step at RTT 0 (router and holders)
                        cell["step_bound_ms"] = round(1.1 * layers * rtt + base[1]["timeline"]["wall"], 2)
                    cells.append(cell)
                    print(f"rtt {rtt:>5g} ms loss {loss:<4g} clients {c:>2}: {res['tokens_per_s']:>7} tok/s "
                          f"(x{cell['ratio_to_rtt0']} of rtt 0, x{cell['ratio_to_1_client_rtt0']} of 1 client rtt 0) "
                          f"step {tl['wall']} ms = compute {tl['compute']} + idle {tl['idle']} "
                          f"(wire/micro-batch {tl['wire']} of which forwards {tl['forward']}, "
                          f"{tl['microbatches']} micro-batches)"
                          + (f", bound {cell['step_bound_ms']} ms" if "step_bound_ms" in cell else "")
                          + f"; errors {len(res['errors'])}; tokens identical {'yes' if same else 'NO'}",
                          flush=True)
            print(f"proxy: {proxy.stats}")
            handoff = (handoff_bench(Path(tmp), env, info, proxy, a.model, a.handoff_rtt, a.handoff_prompt,
                                     a.handoff_prompts, 4)
                       if a.handoff else [])
    print(f"cpu: {cpu_model()}; holders {a.holders}; layers {layers}; tokens {a.tokens}")
    if a.json:
        print(json.dumps({"cells": cells, "handoff": [{k: v for k, v in c.items() if k != "output_ids"}
                                                       for c in handoff],
                          "cpu": cpu_model(), "holders": a.holders, "tokens": a.tokens}))


if __name__ == "__main__":
    main()
