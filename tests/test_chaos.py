"""Chaos with real processes: a ``tenzro_cluster`` (site + 4 agents, replication 2) under faults,
with the router reaching holders over their agent sockets (``ws``) or their iroh endpoints
(``iroh``: ``--agent-iroh``, ``TENZRO_DATA_TRANSPORT=iroh``).

One cluster, scenes in order: 20 concurrent forwards while holders stall and come back
(SIGSTOP/SIGCONT); a stalled holder (its backup answers within the deadline); a holder
SIGKILLed while its batches are in flight (output identical to the no-fault run); every
holder of some experts gone (fail closed naming them; ``allow_partial`` equals the
reference computed without them).

A second cluster, on the Redis channel layer with the default 10 s deadline (issue 15): a black-hole agent joins
(``--fault blackhole``: every expert Warm at committed_tps 1,000,000, never answers) and
costs at most the first forward one deadline; a holder killed right before a forward is
failed over on its socket's close, not on the deadline.
"""
from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from safetensors.numpy import load_file

from moe import wire
from moe.ffn import expert_forward
from moe.gating import route
from router.scoreboard import DEADLINE_FLOOR_S
from prepare.checkpoint import Checkpoint
from prepare.layouts import load_expert, load_gate, spec_from_config
from tests.cluster_util import blackhole_agent, env_for, rpc, rpc_served, running_cluster, wait_for
from tests.conftest import QWEN, REDIS_URL, needs_services

pytestmark = pytest.mark.cluster

MODEL = "qwen3-moe-tiny"
LAYER = 1
# Generous: a stopped holder's batch must still be in flight when the scene kills it, however
# long a loaded machine takes to get the forward to it (see scene 3).
DEADLINE_S = 8.0


def forward(info, x, **extra):
    """One forward; a -32005 Busy (the router saturated by 20 concurrent forwards on a loaded
    machine, no holder at fault) is retried as its ``retry_after_s`` says, as a client would."""
    return rpc_served(info["rpc"], "tenzro_moeForward", {"model_id": MODEL, "layer": LAYER, "d_model": int(x.shape[1]),
                                                         "carrier": "f32",
                                                         "hidden_states": wire.b64encode(wire.encode_f32(x)), **extra})


def outputs(resp, d):
    assert "result" in resp, resp
    return wire.decode_f32(wire.b64decode(resp["result"]["outputs"], "outputs"), d)


def reference_without(x, experts_gone):
    """The layer output with ``experts_gone`` removed: routed weights renormalized over the rest."""
    ck = Checkpoint(QWEN)
    spec = spec_from_config(ck.config)
    gate = load_gate(ck, spec, LAYER)
    r = route(gate, x)
    w = r.weights.astype(np.float64)
    keep = ~np.isin(r.expert_ids, list(experts_gone))
    w = np.where(keep, w * (w.sum(1, keepdims=True) / (w * keep).sum(1, keepdims=True)), 0.0)
    out = np.zeros_like(x)
    for e, tok in r.tokens_by_expert().items():
        if e in experts_gone:
            continue
        rows = expert_forward(load_expert(ck, spec, LAYER, e), x[tok])
        for i, t in enumerate(tok):
            out[t] += np.float32(w[t, list(r.expert_ids[t]).index(e)]) * rows[i]
    return out


def wait_gone(info, provider, timeout=60.0):
    """Wait until the site's shard map no longer lists ``provider`` (its socket closed)."""
    def gone():
        shard = rpc(info["rpc"], "tenzro_moeShardMap", {"model_id": MODEL})["result"]
        return all(h["provider"] != provider for e in shard["holders"] for h in e["holders"])

    wait_for(gone, timeout, f"{provider[:12]}… left the shard map after it was killed", poll_s=0.2)


TRANSPORTS = {"ws": (), "iroh": ("--agent-iroh",)}


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_chaos_scenes(tmp_path, transport):
    env = env_for(tmp_path)
    env.update({"TENZRO_BATCH_DEADLINE": str(DEADLINE_S), "TENZRO_VIEW_CACHE": "0", "TENZRO_DATA_TRANSPORT": transport})
    x = load_file(str(QWEN / "reference.safetensors"))[f"layer{LAYER}.hidden_states"].astype(np.float32)
    d = x.shape[1]
    inputs = [x * np.float32(1 + i / 16) for i in range(20)]
    with running_cluster(tmp_path, [QWEN], holders=4, env=env, extra=TRANSPORTS[transport]) as (info, _):
        agents = {a["provider"]: a["pid"] for a in info["agents"]}
        first = forward(info, inputs[0])["result"]
        assert first["transports"][transport] == first["batches"] > 0, first["transports"]
        base = [outputs(forward(info, xi), d) for xi in inputs]

        # 1. 20 concurrent forwards while one holder at a time stalls and comes back.
        stop = threading.Event()

        def churn():
            rnd = random.Random(7)
            while not stop.is_set():
                pid = rnd.choice(list(agents.values()))
                os.kill(pid, signal.SIGSTOP)
                time.sleep(rnd.uniform(0.2, 1.0))
                os.kill(pid, signal.SIGCONT)
                time.sleep(rnd.uniform(0.05, 0.3))

        churner = threading.Thread(target=churn)
        churner.start()
        try:
            with ThreadPoolExecutor(20) as pool:
                got = list(pool.map(lambda xi: outputs(forward(info, xi), d), inputs))
        finally:
            stop.set()
            churner.join()
            for pid in agents.values():
                os.kill(pid, signal.SIGCONT)
        for i in range(20):
            assert np.array_equal(got[i], base[i]), f"forward {i} differs from its no-fault result"

        # 2. A stalled holder: its batches go to the backups after one deadline.
        def busiest_primary():
            resp = rpc(info["rpc"], "tenzro_moeShardMap", {"model_id": MODEL})
            assert "result" in resp, resp
            shard = resp["result"]
            primaries = [h["holders"][0]["provider"] for h in shard["holders"] if h["layer"] == LAYER]
            # Among the holders the router used last (its scoreboard may skip one the churn faulted).
            used = forward(info, x)["result"]["holders"]
            return shard, max(sorted(used), key=primaries.count)

        shard, stalled = busiest_primary()
        os.kill(agents[stalled], signal.SIGSTOP)
        try:
            resp = forward(info, x)
        finally:
            os.kill(agents[stalled], signal.SIGCONT)
        assert np.array_equal(outputs(resp, d), base[0])
        fails = resp["result"]["failures"]
        # The backup took over when the holder's deadline passed (at most DEADLINE_S: it follows the
        # holder's observed p99), not when the attempt timed out ("no answer within 30 s"); read
        # from the record, not from a wall clock.
        def within_deadline(error: str) -> bool:
            m = re.search(r"(?:within its|the) ([0-9.]+) s deadline", error)
            return m is not None and float(m.group(1)) <= DEADLINE_S

        assert fails and all(f["provider"] == stalled and within_deadline(f["error"]) for f in fails), fails

        # 3. SIGKILL a holder while its batches are in flight: identical output.
        shard, _ = busiest_primary()
        # The router skips the stalled holder for a while (circuit breaker): the victim is one it uses.
        victim = next(p for p in forward(info, x)["result"]["holders"] if p != stalled)
        os.kill(agents[victim], signal.SIGSTOP)  # hold its batches in flight ...
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(forward, info, x)
            # ... and kill it mid-forward: half the shortest deadline a holder can get (its p99
            # deadline is at least DEADLINE_FLOOR_S) after the request, so the site has dispatched
            # to the stopped victim (killed before that, its closed socket drops it from the plan
            # and nothing is in flight) and the deadline has not yet moved on.
            time.sleep(min(DEADLINE_S, DEADLINE_FLOOR_S) / 2)
            assert not fut.done(), "the forward ended while its holder was stopped"
            os.kill(agents[victim], signal.SIGKILL)
            resp = fut.result()
        assert np.array_equal(outputs(resp, d), base[0])
        assert any(f["provider"] == victim for f in resp["result"]["failures"]), resp["result"]
        wait_gone(info, victim)
        assert np.array_equal(outputs(forward(info, x), d), base[0])

        # 4. Every holder of some experts gone: fail closed; allow_partial = reference without them.
        held = {(h["expert"]): {p["provider"] for p in h["holders"]} for h in shard["holders"] if h["layer"] == LAYER}
        partner = max((p for p in agents if p != victim),
                      key=lambda p: sum(1 for hs in held.values() if hs == {victim, p}))
        gone = sorted(e for e, hs in held.items() if hs <= {victim, partner})
        routing = route(load_gate(Checkpoint(QWEN), spec_from_config(Checkpoint(QWEN).config), LAYER), x)
        routed = set(routing.expert_ids.ravel().tolist())
        assert gone and set(gone) & routed, "the placement left no expert on exactly these two holders"
        os.kill(agents[partner], signal.SIGKILL)
        wait_gone(info, partner)
        err = forward(info, x)["error"]
        assert err["code"] in (-32000, -32004)
        missing = {m["expert"] for m in err["data"]["missing"]}
        assert missing == set(gone) & routed and f"e{min(missing)}" in err["message"]
        # A token whose every routed expert is gone has nothing to renormalize over: the forward
        # refuses it by design, so the partial combine is checked on the tokens that keep one.
        keep = [t for t in range(x.shape[0]) if not set(routing.expert_ids[t].tolist()) <= missing]
        if len(keep) < x.shape[0]:
            err = forward(info, x, allow_partial=True)["error"]
            assert "lost every routed expert" in err["message"]
        xp = x[keep]
        res = forward(info, xp, allow_partial=True)
        out = outputs(res, d)
        routed_p = set(routing.expert_ids[keep].ravel().tolist())
        assert {m["expert"] for m in res["result"]["missing"]} == missing & routed_p
        ref = reference_without(xp, missing)
        assert np.abs(out - ref).max() <= 1e-6 * np.abs(ref).max()


@pytest.mark.services
@needs_services
def test_chaos_black_hole_and_disconnect(tmp_path):
    # The Redis channel layer: the site's consumers and its router talk through Redis, where a
    # request to a socket that just closed is lost without a word (the in-memory layer hands it
    # to the closing consumer, which fails it).
    env = env_for(tmp_path, redis_url=REDIS_URL)
    env.update({"TENZRO_BATCH_DEADLINE": "10"})  # and the default 1 s view cache
    x = load_file(str(QWEN / "reference.safetensors"))[f"layer{LAYER}.hidden_states"].astype(np.float32)
    d = x.shape[1]
    with running_cluster(tmp_path, [QWEN], holders=4, env=env) as (info, _):
        agents = {a["provider"]: a["pid"] for a in info["agents"]}
        base = outputs(forward(info, x), d)
        for _ in range(4):  # the router observes every primary (probation ends)
            assert np.array_equal(outputs(forward(info, x), d), base)

        # 1. A black hole joins: every expert Warm at committed_tps 1e6, never answers.
        with blackhole_agent(info, tmp_path, env, MODEL, LAYER) as bad:
            first = forward(info, x)
            assert np.array_equal(outputs(first, d), base)
            assert all(f["provider"] == bad and "deadline" in f["error"] for f in first["result"]["failures"])
            for _ in range(5):  # from the next forward on: no deadline waited, the black hole serves nothing
                resp = forward(info, x)
                assert np.array_equal(outputs(resp, d), base)
                assert not resp["result"]["failures"] and bad not in resp["result"]["holders"], resp["result"]
        time.sleep(1.0)

        # 2. A holder killed just before a forward: the router's cached view (1 s) still lists it,
        # and a request to a socket that is gone is dropped by the channel layer without a word.
        victim = forward(info, x)["result"]["holders"][0]
        os.kill(agents[victim], signal.SIGKILL)
        killed = time.perf_counter()
        resp = forward(info, x)
        after_kill = time.perf_counter() - killed
        assert np.array_equal(outputs(resp, d), base)
        fails = [f for f in resp["result"]["failures"] if f["provider"] == victim]
        assert all("disconnected" in f["error"] for f in fails), resp["result"]["failures"]
        assert after_kill < 5.0, f"the backup answered {after_kill:.2f} s after the kill (deadline 10 s)"
