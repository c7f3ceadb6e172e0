"""Self-healing with real processes: a ``tenzro_cluster`` (site + 4 agents, replication 2,
``--repair-interval 3``); one agent is SIGKILLed; within a few passes every expert is back at
``min_replication`` on distinct live holders, the passes are recorded, and a forward equals
the transformers reference and the pre-fault output."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from moe import wire
from tests.cluster_util import env_for, pid_alive, rpc, running_cluster
from tests.conftest import QWEN

pytestmark = pytest.mark.cluster

MODEL = "qwen3-moe-tiny"
INTERVAL_S = 3


def forward(info, x, layer):
    resp = rpc(info["rpc"], "tenzro_moeForward", {"model_id": MODEL, "layer": layer, "d_model": int(x.shape[1]),
                                                  "carrier": "f32",
                                                  "hidden_states": wire.b64encode(wire.encode_f32(x))}, timeout=120)
    assert "result" in resp, resp
    return wire.decode_f32(wire.b64decode(resp["result"]["outputs"], "outputs"), x.shape[1])


def test_sigkilled_holder_is_repaired(tmp_path):
    env = env_for(tmp_path)
    env["TENZRO_VIEW_CACHE"] = "0"
    ref = load_file(str(QWEN / "reference.safetensors"))
    layers = sorted({int(k.split(".")[0][5:]) for k in ref if k.endswith(".hidden_states")})
    with running_cluster(tmp_path, [QWEN], holders=4, env=env,
                         extra=("--repair-interval", str(INTERVAL_S))) as (info, _):
        before = {layer: forward(info, ref[f"layer{layer}.hidden_states"].astype(np.float32), layer)
                  for layer in layers}
        victim = info["agents"][0]
        held = rpc(info["rpc"], "tenzro_moeShardMap", {"model_id": MODEL})["result"]
        # Experts the kill leaves under min_replication (a repair racing placement may have left a third copy).
        lost = sum(1 for row in held["holders"]
                   if victim["provider"] in {h["provider"] for h in row["holders"]} and row["replication"] <= 2)
        assert lost > 2, "the victim should hold more experts than one pass repairs"
        killed_at = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        deadline = time.time() + 40 * INTERVAL_S
        while pid_alive(victim["pid"]) and time.time() < deadline:
            time.sleep(0.1)

        live = {a["provider"] for a in info["agents"][1:]}
        smap = None
        while time.time() < deadline:
            smap = rpc(info["rpc"], "tenzro_moeShardMap", {"model_id": MODEL})["result"]
            holders = [[h["provider"] for h in row["holders"]] for row in smap["holders"]]
            if (not smap["under_replicated_experts"] and victim["provider"] not in smap["providers"]
                    and all(len(set(hs)) == len(hs) >= 2 and set(hs) <= live for hs in holders)):
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"not repaired in time: under-replicated {smap and smap['under_replicated_experts']}")

        status = rpc(info["rpc"], "tenzro_moeRepairStatus", {"model_id": MODEL, "limit": 50})["result"]
        assert status["interval_s"] == INTERVAL_S
        # Passes of periods ending after the kill (earlier ones may have pulled during placement).
        passes = [p for p in status["passes"] if (p["period"] + 1) * p["interval_s"] > killed_at]
        accepted = [a for p in passes for a in p["accepted"] if a["provider"] in live]
        assert len(accepted) >= lost, status
        # The pass of the kill's own period may have run (and had the victim accept) just before the kill;
        # every pass that started after it offered rows to live agents only.
        assert all(a["provider"] in live for p in passes if p["period"] * p["interval_s"] >= killed_at
                   for a in p["accepted"])
        assert sum(p["fetched_bytes"] for p in passes) > 0
        assert len({p["period_key"] for p in passes}) == len(passes)  # one record per period
        assert all(len([a for a in p["accepted"] if a["provider"] == q]) <= status["max_repairs_per_pass"]
                   for p in passes for q in live)  # the per-pass cap held on every agent

        for layer in layers:
            x = ref[f"layer{layer}.hidden_states"].astype(np.float32)
            out = forward(info, x, layer)
            assert np.array_equal(out, before[layer]), f"layer {layer}: repaired cluster differs from before"
            want = ref[f"layer{layer}.output"].astype(np.float32)
            assert np.linalg.norm(out - want) / np.linalg.norm(want) <= 1e-5


def test_repair_interval_flag_is_checked(tmp_path):
    import subprocess
    import sys

    from tests.cluster_util import ROOT

    proc = subprocess.run([sys.executable, str(ROOT / "manage.py"), "tenzro_cluster", "--checkpoint", str(QWEN),
                           "--repair-interval", "0"], cwd=ROOT, env=env_for(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "--repair-interval" in proc.stderr
