"""Issue 27's done-when with real processes: Kvasir workers written from the contract alone
(``tests/kvasir_worker.py``: wallet auth, volunteer, shard download, a loopback worker speaking
§3, a relay client) serve a ``tenzro_cluster`` of the qwen3-MoE fixture.

Once the agents are stopped, layer 0's forwards run on the honest worker through its relay
(``kvasir:<worker_id>``, transport ``kvasir``) and equal the transformers reference. A second
worker that flips the sign of its outputs joins beside it; the router's audits of receiptless
batches (the site's fallback replica re-executes them) catch it within 32 forwards: it is
quarantined, its coverage leaves ``/api/expert-demand``, and later forwards equal the reference
without naming it.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file

from moe import wire
from tests.cluster_util import (ROOT, env_for, fresh_postgres_db, pid_alive, rpc, rpc_served, running_cluster, stop,
                                wait_for)
from tests.conftest import PG_URL, QWEN, REDIS_URL, needs_services

pytestmark = pytest.mark.cluster

MODEL = "qwen3-moe-tiny"


def start_worker(info, tmp, worker_id, flip=False):
    err = open(tmp / f"{worker_id}.stderr", "wb")
    cmd = [sys.executable, str(ROOT / "tests" / "kvasir_worker.py"), "--site", info["url"], "--model", MODEL,
           "--worker-id", worker_id, "--layer", "0", "--experts", "0:16", "--interval", "5"]
    proc = subprocess.Popen(cmd + (["--flip"] if flip else []), cwd=ROOT, stdout=subprocess.PIPE, stderr=err,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        raise AssertionError(f"worker {worker_id} printed nothing: {(tmp / f'{worker_id}.stderr').read_text()[-3000:]}")
    return proc, json.loads(line)


def forward(rpcs: list[str], x):
    """One layer-0 forward on the next site of ``rpcs`` (rotated: with two sites, every other forward
    lands on the site that does not hold a given relay)."""
    rpcs.append(rpcs.pop(0))
    resp = rpc_served(rpcs[0], "tenzro_moeForward", {"model_id": MODEL, "layer": 0, "d_model": int(x.shape[1]),
                                                         "carrier": "f32",
                                                         "hidden_states": wire.b64encode(wire.encode_f32(x))})
    assert "result" in resp, resp
    return resp["result"]


def rel_err(res, ref, d):
    out = wire.decode_f32(wire.b64decode(res["outputs"], "outputs"), d)
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def test_kvasir_workers_serve_layer_forwards_and_a_liar_is_quarantined(tmp_path):
    scenario(tmp_path, env_for(tmp_path))


@needs_services
@pytest.mark.services
@pytest.mark.timeout(1800)
def test_across_two_site_processes_the_relay_is_reached_through_the_channel_layer(tmp_path):
    """Two sites behind the balancer (PostgreSQL, Redis): a forward that lands on the site not
    holding a worker's relay reaches it through the channel layer, and a quarantine decided there
    closes the relay held by the other site."""
    with fresh_postgres_db(PG_URL) as db_url:
        scenario(tmp_path, env_for(tmp_path, database_url=db_url, redis_url=REDIS_URL), ("--sites", "2"))


def scenario(tmp_path, env: dict, extra: tuple[str, ...] = ()):
    """The done-when (module docstring) on a cluster started with ``env`` and ``extra`` flags."""
    env.update({"TENZRO_VIEW_CACHE": "0", "TENZRO_MARKET_RELAY_CHECK": "2",
                "TENZRO_MARKET_SERVICE_TOKEN": "svc-kvasir-cluster"})
    ref = load_file(str(QWEN / "reference.safetensors"))
    x, want = ref["layer0.hidden_states"].astype(np.float32), ref["layer0.output"]
    d = int(x.shape[1])
    workers = []
    with running_cluster(tmp_path, [QWEN], holders=2, env=env, extra=extra) as (info, _):
        url, tok = info["rpc"], info["operator_token"]
        sites = [u.rstrip("/") + "/rpc" for u in info["sites"]]
        assert len(sites) == (int(extra[1]) if extra else 1)
        listed = rpc(url, "tenzro_moeMarketAddModel", {"model_id": MODEL}, tok)
        assert "result" in listed, listed
        try:
            honest, h = start_worker(info, tmp_path, "honest-1")
            workers.append(honest)
            for a in info["agents"]:  # the agents holding its experts go away
                os.kill(a["pid"], signal.SIGINT)
            wait_for(lambda: not any(pid_alive(a["pid"]) for a in info["agents"]), 60, "agents stopped")

            def served_by_worker():
                try:
                    res = forward(sites, x)
                except AssertionError:
                    return None  # the view still lists a stopped agent, or the relay is not joined yet
                return res if res["holders"] == ["kvasir:honest-1"] else None

            res = wait_for(served_by_worker, 120, "a forward served by the honest worker alone", poll_s=1.0)
            assert res["transports"]["kvasir"] >= 1
            assert rel_err(res, want, d) <= 1e-2

            service = {"Authorization": f"Bearer {node_token(info)}"}

            def layer0_replicas():
                body = httpx.get(info["url"] + "/api/expert-demand", params={"model": MODEL}, headers=service).json()
                layer = next(lay for lay in body["models"][0]["layers"] if lay["layer"] == 0)
                return sorted({s["replicas"] for s in layer["segments"]})

            assert layer0_replicas() == [1]
            cheat, c = start_worker(info, tmp_path, "cheat-1", flip=True)
            workers.append(cheat)
            wait_for(lambda: layer0_replicas() == [2], 30, "the cheat's coverage counted")
            forwards = []
            caught = False
            for _ in range(32):
                r = forward(sites, x)
                forwards.append(r)
                # Every answer is exact: an audited lie is recomputed, and so is every other batch
                # the liar answered in that forward once it is caught.
                assert rel_err(r, want, d) <= 1e-2, r["holders"]
                if layer0_replicas() == [1]:
                    caught = True
                    break
            assert caught, f"the cheat was not quarantined within {len(forwards)} forwards"
            later = [forward(sites, x) for _ in range(3)]
            for r in later:
                assert "kvasir:cheat-1" not in r["holders"] and r["holders"] == ["kvasir:honest-1"]
                assert rel_err(r, want, d) <= 1e-2
            # Its relay was closed and is refused from now on; the honest one stays joined.
            sessions = httpx.get(info["url"] + "/api/expert-relay/sessions",
                                 headers={"X-Kvasir-Service-Token": "svc-kvasir-cluster"}).json()["sessions"]
            state = {s["node_id"]: s["connected"] for s in sessions}
            assert state.get("honest-1") is True and state.get("cheat-1") is not True
        finally:
            for p in workers:
                stop(p, 10)


def node_token(info) -> str:
    """A node token of a fresh wallet (any wallet may read demand)."""
    from nacl.signing import SigningKey

    from tests.kvasir_worker import login

    with httpx.Client(base_url=info["url"], timeout=30) as http:
        return login(http, SigningKey.generate())[1]

