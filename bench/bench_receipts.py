"""Forward time with receipt persistence at 1 in 1 vs off (and the default 1 in 64).

Usage:  .venv/bin/python bench/bench_receipts.py [--tokens 128] [--rounds 8] [--per-round 5]

Starts ``manage.py tenzro_cluster`` (site + 4 agents, the shipped Qwen3-MoE fixture, its own
SQLite database and var dir), then times ``tenzro_moeForward`` of layer 0 (``--tokens``
random rows, f32 carrier) from the client, alternating the governance field
``receipt_sample_one_in`` between 2^30 ("off": no batch is kept; settlement still runs),
64 (the default) and 1 (every verified batch kept in full: carrier, commitment rows,
receipt) round by round, so the three modes share the machine's noise. Each forward is
followed by a short pause so the background persistence of one forward is charged to the
next only as much as it would be under steady load. Prints the median forward time per
mode and the ratios to "off" (goal: ≤ 1.05 at the default rate).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moe import wire  # noqa: E402
from tests.cluster_util import stop  # noqa: E402

MODES = {"off": 2**30, "1-in-64": 64, "1-in-1": 1}


def rpc(url, method, params, token=None):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    body = httpx.post(url, json={"jsonrpc": "2.0", "id": 1, "method": method, "params": params}, headers=headers,
                      timeout=300).json()
    if "error" in body:
        raise RuntimeError(f"{method}: {body['error']}")
    return body["result"]


def set_rate(url, token, n):
    """Change ``receipt_sample_one_in`` by a proposal the operator alone decides (the cluster runs
    with ``TENZRO_GOVERNANCE_MIN_REPUTATION`` out of reach, so providers never join the electorate)."""
    p = rpc(url, "tenzro_moeCreateProposal", {"title": f"sample 1 in {n}", "changes": {"receipt_sample_one_in": n}},
            token)
    p = rpc(url, "tenzro_moeVoteProposal", {"proposal_id": p["id"], "approve": True}, token)
    if p["status"] != "Applied":
        raise RuntimeError(f"proposal #{p['id']} is {p['status']} after the operator's vote: tally {p['tally']}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--per-round", type=int, default=5)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-receipts-"))
    env = {k: v for k, v in os.environ.items() if k not in {"REDIS_URL", "DATABASE_URL", "TENZRO_OPERATOR_TOKEN"}}
    env.update({"TENZRO_VAR_DIR": str(tmp / "var"), "DATABASE_URL": f"sqlite:///{tmp / 'db.sqlite3'}",
                "PYTHONUNBUFFERED": "1", "TENZRO_AUDIT_INTERVAL": "3600",
                # Each paid settlement adds 1 reputation: after ~100 forwards the 4 agents reached the
                # default 600, joined the electorate and the operator's vote alone no longer passed.
                "TENZRO_GOVERNANCE_MIN_REPUTATION": str(2**62)})
    proc = subprocess.Popen([sys.executable, str(ROOT / "manage.py"), "tenzro_cluster", "--holders", "4",
                             "--checkpoint", str(ROOT / "tests" / "fixtures" / "qwen3_moe_tiny")],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        info = json.loads(proc.stdout.readline())
        url, tok = info["rpc"], info["operator_token"]
        d = 256
        x = np.random.default_rng(0).standard_normal((args.tokens, d)).astype(np.float32)
        params = {"model_id": info["model_id"], "layer": 0, "d_model": d, "carrier": "f32",
                  "hidden_states": wire.b64encode(wire.encode_f32(x))}
        for _ in range(3):
            rpc(url, "tenzro_moeForward", params)  # warm-up
        times: dict[str, list[float]] = {m: [] for m in MODES}
        batches = 0
        for _ in range(args.rounds):
            for mode, n in MODES.items():
                set_rate(url, tok, n)
                for _ in range(args.per_round):
                    t = time.perf_counter()
                    res = rpc(url, "tenzro_moeForward", params)
                    times[mode].append((time.perf_counter() - t) * 1e3)
                    batches += res["receipts"]
                    time.sleep(0.05)
        kept = rpc(url, "tenzro_moeListReceipts", {"limit": 1000})["count"]
        base = statistics.median(times["off"])
        print(f"{args.tokens} tokens, layer 0 of qwen3-moe-tiny over 4 agents, {args.rounds} rounds x "
              f"{args.per_round} forwards per mode, {os.cpu_count()} cores; {batches} verified batches, "
              f"{kept}+ kept")
        for mode in MODES:
            med = statistics.median(times[mode])
            print(f"  {mode:<8} median {med:8.2f} ms   ratio vs off {med / base:6.3f}")
    finally:
        stop(proc, 30)


if __name__ == "__main__":
    main()
