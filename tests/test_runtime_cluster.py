"""Tiers through real processes: agents with a small memory budget spill to disk, the shard map
shows Cold/Warm as the live tiers change, forwards promote, and the execution methods are
relayed to an agent over its socket."""
from __future__ import annotations

import base64
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from moe import wire
from moe.ffn import expert_forward
from tenzro_site.verify import max_rel_err
from tests.cluster_util import env_for, rpc, running_cluster
from tests.conftest import QWEN
from tests.test_runtime import expert, rows

pytestmark = pytest.mark.cluster

BUDGET = 8_000_000  # bytes: each qwen tiny expert decodes to 786 432 bytes, each agent holds 32


def residency_of(info: dict, model_id: str, provider: str) -> dict[tuple[int, int], str]:
    resp = rpc(info["rpc"], "tenzro_moeShardMap", {"model_id": model_id})
    if "error" in resp:  # neither published nor held by anyone (e.g. the probe model once unloaded)
        assert resp["error"]["data"]["field"] == "model_id", resp
        return {}
    shard = resp["result"]
    return {(r["layer"], r["expert"]): h["residency"] for r in shard["holders"] for h in r["holders"]
            if h["provider"] == provider}


def tiers_of(info: dict, provider: str, model_id: str) -> dict[tuple[int, int], str]:
    st = rpc(info["rpc"], "tenzro_moeExpertStatus", {"provider": provider})["result"]
    return {(e["layer"], e["expert"]): {"memory": "Warm", "disk": "Cold"}[e["tier"]] for e in st["experts"]
            if e["model_id"] == model_id}


def eventually(fn, timeout: float = 20.0):
    deadline = time.time() + timeout
    while True:
        value = fn()
        if value or time.time() > deadline:
            return value
        time.sleep(0.3)


def test_residency_follows_the_live_tiers_and_methods_relay_to_agents(tmp_path):
    env = env_for(tmp_path)
    env["TENZRO_MEMORY_BUDGET"] = str(BUDGET)
    with running_cluster(tmp_path, [QWEN], holders=2, env=env) as (info, _proc):
        mid, token = info["model_id"], info["operator_token"]
        agent = info["agents"][0]["provider"]

        st = rpc(info["rpc"], "tenzro_moeExpertStatus", {"provider": agent})["result"]
        assert st["memory_budget_bytes"] == BUDGET and st["memory_bytes"] <= BUDGET
        assert st["disk_experts"] > 0 and st["evicted_to_disk"] > 0
        assert st["compute_backend"] == "cpu" and st["gpu"] is False
        # The agent declares more experts than fit in memory; the shard map shows which are Cold.
        assert eventually(lambda: residency_of(info, mid, agent) == tiers_of(info, agent, mid))
        assert "Cold" in residency_of(info, mid, agent).values()

        # A forward over Cold holders promotes on the agents and still matches the reference.
        ref = load_file(str(QWEN / "reference.safetensors"))
        x = ref["layer1.hidden_states"]
        resp = rpc(info["rpc"], "tenzro_moeForward", {"model_id": mid, "layer": 1, "d_model": x.shape[1],
                                                      "hidden_states": wire.b64encode(wire.encode_f32(x)),
                                                      "allow_cold": True, "carrier": "f32"})
        out = wire.decode_f32(wire.b64decode(resp["result"]["outputs"], "outputs"), x.shape[1])
        assert max_rel_err(out, ref["layer1.output"]) <= 1e-5
        assert eventually(lambda: residency_of(info, mid, agent) == tiers_of(info, agent, mid))

        # Executing a Cold expert on the agent promotes it, and the shard map follows.
        cold = sorted(k for k, r in tiers_of(info, agent, mid).items() if r == "Cold")[0]
        before = rpc(info["rpc"], "tenzro_moeExpertStatus", {"provider": agent})["result"]["promotions"]
        res = rpc(info["rpc"], "tenzro_moeExecute", {"model_id": mid, "layer": cold[0], "expert": cold[1],
                                                     "d_model": x.shape[1], "provider": agent, "token_indices": [0, 1],
                                                     "hidden_states": wire.b64encode(wire.encode_f32(x[:2]))})
        assert len(wire.b64decode(res["result"]["outputs"], "o")) == 2 * x.shape[1] * 4
        st = rpc(info["rpc"], "tenzro_moeExpertStatus", {"provider": agent})["result"]
        assert st["promotions"] == before + 1 and st["memory_bytes"] <= BUDGET
        assert eventually(lambda: residency_of(info, mid, agent).get(cold) == "Warm"
                          and residency_of(info, mid, agent) == tiers_of(info, agent, mid))

        # Relayed load (blob_base64 goes through the site's blob store), execute, errors, unload.
        w = expert(7, h=256, f=64)
        load = {"model_id": "probe", "layer": 0, "expert": 3, "provider": agent,
                "blob_base64": base64.b64encode(w.to_blob()).decode()}
        assert rpc(info["rpc"], "tenzro_moeExpertLoad", load)["error"]["code"] == -32001
        row = rpc(info["rpc"], "tenzro_moeExpertLoad", load, token=token)["result"]
        assert row["tier"] == "memory" and row["d_model"] == 256
        assert eventually(lambda: residency_of(info, "probe", agent) == {(0, 3): "Warm"})
        xr = rows(5, h=256)
        res = rpc(info["rpc"], "tenzro_moeExecute", {"model_id": "probe", "layer": 0, "expert": 3, "d_model": 256,
                                                     "provider": agent, "token_indices": [4, 3, 2, 1, 0],
                                                     "hidden_states": wire.b64encode(wire.encode_f32(xr))})["result"]
        np.testing.assert_array_equal(wire.decode_f32(wire.b64decode(res["outputs"], "o"), 256),
                                      expert_forward(w, xr))
        err = rpc(info["rpc"], "tenzro_moeExecute", {"model_id": "probe", "layer": 0, "expert": 4, "d_model": 256,
                                                     "provider": agent, "token_indices": [0],
                                                     "hidden_states": wire.b64encode(wire.encode_f32(xr[:1]))})
        assert err["error"]["code"] == -32004 and err["error"]["data"]["field"] == "expert"
        err = rpc(info["rpc"], "tenzro_moeExpertLoad", {**load, "blob_base64": base64.b64encode(b"junk").decode()},
                  token=token)["error"]
        assert err["code"] == -32004 and "corrupt" in err["message"]
        err = rpc(info["rpc"], "tenzro_moeRoute", {"model_id": "probe", "layer": 0, "d_model": 256, "provider": agent,
                                                   "hidden_states": wire.b64encode(wire.encode_f32(xr))})["error"]
        assert err["code"] == -32004 and err["data"]["field"] == "layer"
        assert rpc(info["rpc"], "tenzro_moeExpertUnload", {"model_id": "probe", "layer": 0, "expert": 3,
                                                           "provider": agent}, token=token)["result"]["unloaded"]
        assert eventually(lambda: residency_of(info, "probe", agent) == {})
        # The holder stayed up through every error.
        assert rpc(info["rpc"], "tenzro_moeExpertStatus", {"provider": agent})["result"]["memory_experts"] > 0
