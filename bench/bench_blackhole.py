"""The black-hole scene (issue 15 item 2): forward time before, during and after a black hole joins.

Usage:  .venv/bin/python bench/bench_blackhole.py [--forwards 9] [--deadline 10] [--redis URL]

A ``tenzro_cluster`` (qwen3-moe-tiny fixture, 4 agents, replication 2) serves ``--forwards``
no-fault forwards of layer 1 (48 tokens, f32 carrier): the baseline, median wall time of one
``tenzro_moeForward`` over JSON-RPC. Then a fifth agent starts with ``holder_agent --fault
blackhole`` (every expert the site knows declared Warm at committed_tps 1,000,000; never
answers) and, once the shard map lists it on every expert of the layer, ``--forwards`` more
forwards run: the first may cost one batch deadline, the rest must run at normal speed.
Prints one JSON line: ``baseline_ms``, ``first_ms``, ``after_ms`` (median of the rest),
``after_ratio`` (after / baseline, goal ≤ 1.2), failures per phase, and the CPU count —
same machine, same run, same cluster, so the ratio compares like with like.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from holders import wire  # noqa: E402
from tests.cluster_util import env_for, rpc, running_cluster  # noqa: E402

QWEN = ROOT / "tests" / "fixtures" / "qwen3_moe_tiny"
MODEL, LAYER = "qwen3-moe-tiny", 1


def timed_forward(info, x) -> tuple[float, dict]:
    """One f32 ``tenzro_moeForward`` of layer ``LAYER``: (wall ms, result); exits on an error."""
    t = time.perf_counter()
    resp = rpc(info["rpc"], "tenzro_moeForward", {"model_id": MODEL, "layer": LAYER, "d_model": int(x.shape[1]),
                                                  "carrier": "f32", "hidden_states": wire.b64encode(wire.encode_f32(x))},
               timeout=300)
    ms = (time.perf_counter() - t) * 1e3
    if "result" not in resp:
        raise SystemExit(f"forward failed: {resp.get('error')}")
    return ms, resp["result"]


def main() -> None:
    """Run the scene and print its JSON line (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--forwards", type=int, default=9)
    ap.add_argument("--deadline", type=float, default=10.0, help="TENZRO_BATCH_DEADLINE seconds")
    ap.add_argument("--redis", default=None, help="Redis URL: the channels-redis layer (default in-memory)")
    args = ap.parse_args()
    x = load_file(str(QWEN / "reference.safetensors"))[f"layer{LAYER}.hidden_states"].astype(np.float32)
    with tempfile.TemporaryDirectory(prefix="bench-blackhole-") as tmp:
        tmp = Path(tmp)
        env = env_for(tmp, redis_url=args.redis)
        env["TENZRO_BATCH_DEADLINE"] = str(args.deadline)
        with running_cluster(tmp, [QWEN], holders=4, env=env) as (info, _):
            agents = {a["provider"] for a in info["agents"]}
            timed_forward(info, x)  # first forward of the layer: gate load, caches
            before = [timed_forward(info, x) for _ in range(args.forwards)]
            bh = subprocess.Popen([sys.executable, str(ROOT / "manage.py"), "holder_agent", "--site", info["url"],
                                   "--key", str(tmp / "bh.key"), "--blob-dir", str(tmp / "bh"), "--fault", "blackhole"],
                                  cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                t_end = time.time() + 120
                while True:
                    shard = rpc(info["rpc"], "tenzro_moeShardMap", {"model_id": MODEL})["result"]
                    rows = [h for h in shard["holders"] if h["layer"] == LAYER]
                    if all(any(p["provider"] not in agents for p in h["holders"]) for h in rows):
                        break
                    if time.time() > t_end or bh.poll() is not None:
                        raise SystemExit("the black hole never appeared on every expert")
                    time.sleep(0.5)
                during = [timed_forward(info, x) for _ in range(args.forwards)]
            finally:
                bh.send_signal(signal.SIGINT)
                bh.wait(30)
    base = statistics.median(ms for ms, _ in before)
    after = statistics.median(ms for ms, _ in during[1:])
    print(json.dumps({"cpus": os.cpu_count(), "deadline_s": args.deadline, "layer": "redis" if args.redis else "memory",
                      "baseline_ms": round(base, 1), "first_ms": round(during[0][0], 1), "after_ms": round(after, 1),
                      "after_ratio": round(after / base, 3),
                      "failures_before": sum(len(r["failures"]) for _, r in before),
                      "failures_first": len(during[0][1]["failures"]),
                      "failures_after": sum(len(r["failures"]) for _, r in during[1:])}))


if __name__ == "__main__":
    main()
