"""Receipt signatures and their cost per decode step: one signed receipt per batch vs one message
receipt per coalesced message (``moe.receipts``), in the same run.

Usage:  .venv/bin/python bench/bench_message_receipts.py [--holders 4] [--batches 14] [--rows 8]
        [--rounds 30] [--stream on|off]

``--holders`` holder agents (the real ``Execution`` path: carrier decode, expert FFN of the
shipped Qwen3-MoE fixture, output encode, receipt) serve ``POST /frame`` on loopback in this
process; one step sends ``--batches`` batches (experts dealt round-robin over the holders, each
batch a random subset of ``--rows`` decode rows, q8_0 carrier) through the router's
``HttpHolderClient`` with coalescing on, so each holder gets one message, and checks every
answer with ``LayerForward.verified_receipt`` (the forward's own check). Modes alternate step by
step: ``per-batch`` (``TENZRO_MESSAGE_RECEIPTS=0``) and ``message`` (default). Per step it
counts ed25519 signs and verifies (wrappers on ``moe.receipts.sign``/``verify``) and times
them (CPU µs summed inside the wrappers, ``time.thread_time``: holder sign, router verify), the whole
receipt work of both sides (``make_entry`` + ``make_seal`` on the holders; on the router
``LayerForward.verified_receipt``'s synchronous steps: ``verify_receipt``, ``verify_entry``,
``verify_seal``, ``entry_in_seal``, CPU µs) and the step's wall time; prints medians and the ratios.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
from nacl.signing import SigningKey

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from holders import execution  # noqa: E402
from machine import int_at_least  # noqa: E402  (this directory is sys.path[0] when run as a script)
from holders.agent import AgentConfig, HolderAgent  # noqa: E402
from moe import messages, receipts, wire  # noqa: E402
from moe.messages import BatchRequest  # noqa: E402
from moe.transports.http import HttpHolderClient, serve_http  # noqa: E402
from prepare.checkpoint import Checkpoint  # noqa: E402
from prepare.layouts import load_expert, spec_from_config  # noqa: E402
from router import forward  # noqa: E402
from router.forward import ForwardConfig, LayerForward  # noqa: E402

MODEL, LAYER = "m", 1
FIXTURE = ROOT / "tests" / "fixtures" / "qwen3_moe_tiny"
MODES = {"per-batch": "0", "message": "1"}


class Meter:
    """Counts and CPU seconds (``time.thread_time`` of the calling thread, so a preempted call is
    not charged for the wait) of named calls, wrapped in place (any thread; the GIL orders the adds)."""

    def __init__(self):
        self.n: dict[str, int] = {}
        self.s: dict[str, float] = {}

    def wrap(self, owner, name: str, label: str) -> None:
        real = getattr(owner, name)

        def timed(*a, **k):
            t = time.thread_time()
            try:
                return real(*a, **k)
            finally:
                self.n[label] = self.n.get(label, 0) + 1
                self.s[label] = self.s.get(label, 0.0) + time.thread_time() - t
        setattr(owner, name, timed)

    def take(self) -> tuple[dict, dict]:
        n, s = self.n, self.s
        self.n, self.s = {}, {}
        return n, s


async def step(client, endpoints, experts_of, x, rows, rng, fwd):
    """One decode step's batches, coalesced per holder, each answer checked as the forward does."""
    reqs, where = [], []
    for h, experts in enumerate(experts_of):
        for e in experts:
            toks = sorted(rng.choice(rows, size=int(rng.integers(1, rows + 1)), replace=False).tolist())
            reqs.append(BatchRequest(uuid.uuid4().hex, MODEL, LAYER, e, toks, "q8_0",
                                     wire.encode_rows(x[toks], "q8_0"), "f32", x.shape[1]))
            where.append(h)
    answers = await asyncio.gather(*(client.execute_frame(endpoints[h], r) for h, r in zip(where, reqs)))
    await asyncio.gather(*(fwd.verified_receipt(providers[h], r, a) for h, r, a in zip(where, reqs, answers)))


providers: list[str] = []


async def main(args) -> None:
    ck = Checkpoint(FIXTURE)
    spec = spec_from_config(ck.config)
    agents = [HolderAgent(AgentConfig("http://127.0.0.1:1", SigningKey.generate(),
                                      tempfile.mkdtemp(prefix="tenzro-bench-seal-"))) for _ in range(args.holders)]
    experts_of = [[] for _ in agents]
    for i in range(args.batches):
        e = i
        experts_of[i % args.holders].append(e)
        agents[i % args.holders].runtime.load_expert(MODEL, LAYER, e, load_expert(ck, spec, LAYER, e).to_blob("f32"))
    providers[:] = [a.provider for a in agents]
    servers = [await serve_http(a.execution.http_rpc, "127.0.0.1", 0, a.execution.http_frame, a.execution.http_stream)
               for a in agents]
    endpoints = [f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}/rpc" for s in servers]
    meter = Meter()
    meter.wrap(receipts, "sign", "sign")
    meter.wrap(receipts, "verify", "verify")
    meter.wrap(execution, "make_entry", "holder receipt work")
    meter.wrap(execution, "make_seal", "holder receipt work")
    for name in ("verify_receipt", "verify_entry", "entry_in_seal"):  # LayerForward.verified_receipt's steps
        meter.wrap(forward, name, "router receipt work")
    meter.wrap(messages, "verify_seal", "router receipt work")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.rows, ck.config["hidden_size"])).astype(np.float32)
    fwd = LayerForward(ForwardConfig(), gate=None, model_id=MODEL, layer=LAYER, hidden_states=x, get_view=None,
                       send=None)
    os.environ["TENZRO_COALESCE"] = "1"
    os.environ["TENZRO_STREAM_ANSWERS"] = "1" if args.stream == "on" else "0"
    client = HttpHolderClient(30)
    got: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}
    try:
        for r in range(args.rounds + 2):
            for mode, flag in MODES.items():
                os.environ["TENZRO_MESSAGE_RECEIPTS"] = flag
                meter.take()
                t = time.perf_counter()
                await step(client, endpoints, experts_of, x, args.rows, rng, fwd)
                wall = time.perf_counter() - t
                n, s = meter.take()
                if r < 2:
                    continue  # warm-up: numba, connections
                row = got[mode]
                for k, count in (("sign", "signatures"), ("verify", "verifies")):
                    row.setdefault(f"ed25519 {count}", []).append(n.get(k, 0))
                    row.setdefault(f"ed25519 {k} CPU µs", []).append(s.get(k, 0.0) * 1e6)
                for k in ("holder receipt work", "router receipt work"):
                    row.setdefault(f"{k} CPU µs", []).append(s.get(k, 0.0) * 1e6)
                row.setdefault("step wall µs", []).append(wall * 1e6)
    finally:
        await client.close()
        for s in servers:
            s.close()
        await asyncio.sleep(0.2)  # the servers' connection handlers see the client's EOF and end
    keys = list(got["per-batch"])
    print(f"{args.batches} batches on {args.holders} holders per step, {args.rows} decode rows, stream "
          f"{args.stream}, medians of {args.rounds} steps per mode (alternated)")
    print(f"{'':28s}{'per-batch':>12s}{'message':>12s}{'ratio':>8s}")
    for k in keys:
        a, b = statistics.median(got["per-batch"][k]), statistics.median(got["message"][k])
        print(f"{k:28s}{a:12.1f}{b:12.1f}{(b / a if a else float('nan')):8.2f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--holders", type=int_at_least(1), default=4)
    ap.add_argument("--batches", type=int_at_least(1), default=14, help="at most 16 (the fixture's experts)")
    ap.add_argument("--rows", type=int_at_least(1), default=8)
    ap.add_argument("--rounds", type=int_at_least(1), default=30)
    ap.add_argument("--stream", choices=["on", "off"], default="on")
    a = ap.parse_args()
    if a.batches > 16:
        ap.error(f"--batches: at most 16 (one batch per expert of the fixture's layer), got {a.batches}")
    asyncio.run(main(a))
