"""End to end with real processes: tenzro_cluster, a forward over its RPC URL, verify_forward."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from holders import wire
from holders.verify import max_rel_err
from tests.cluster_util import ROOT, env_for, pid_alive, rpc, running_cluster
from tests.conftest import DEEPSEEK, QWEN

pytestmark = pytest.mark.cluster


def forward_matches_reference(info: dict, model_id: str, ckpt, layer: int) -> float:
    ref = load_file(str(ckpt / "reference.safetensors"))
    x = ref[f"layer{layer}.hidden_states"]
    resp = rpc(info["rpc"], "tenzro_moeForward", {"model_id": model_id, "layer": layer, "d_model": x.shape[1],
                                                  "carrier": "f32", "hidden_states": wire.b64encode(wire.encode_f32(x))})
    assert "result" in resp, resp
    out = wire.decode_f32(wire.b64decode(resp["result"]["outputs"], "outputs"), x.shape[1])
    assert len(resp["result"]["holders"]) >= 2
    return max_rel_err(out, ref[f"layer{layer}.output"])


def test_cluster_serves_reference_forward_and_stops_everything(tmp_path):
    with running_cluster(tmp_path, [QWEN, DEEPSEEK], holders=3) as (info, proc):
        assert {"url", "rpc", "model_id", "operator_token", "agents"} <= set(info)
        assert len(info["agents"]) == 3
        assert forward_matches_reference(info, "qwen3-moe-tiny", QWEN, 1) <= 1e-5
        assert forward_matches_reference(info, "deepseek-v3-tiny", DEEPSEEK, 2) <= 1e-5
        shard = rpc(info["rpc"], "tenzro_moeShardMap", {"model_id": "deepseek-v3-tiny"})["result"]
        assert shard["under_replicated_experts"] == []
        pids = [a["pid"] for a in info["agents"]] + [info["site_pid"]]
    assert proc.returncode is not None
    deadline = time.time() + 10
    while time.time() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.2)
    assert not any(pid_alive(p) for p in pids)


@pytest.mark.parametrize("ckpt", [QWEN, DEEPSEEK], ids=["qwen3_moe", "deepseek_v3"])
def test_verify_forward_passes_on_fixture(tmp_path, ckpt):
    res = subprocess.run([sys.executable, str(ROOT / "manage.py"), "verify_forward", "--checkpoint", str(ckpt),
                          "--reference", str(ckpt / "reference.safetensors"), "--holders", "3", "--json"],
                         cwd=ROOT, env=env_for(tmp_path), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(res.stdout.strip().splitlines()[-1])
    layers = json.loads((ckpt / "reference.json").read_text())["moe_layers"]
    assert [r["layer"] for r in report["layers"]] == layers
    for r in report["layers"]:
        assert r["max_rel_err_vs_reference"] <= 1e-5
        assert r["max_abs_diff_vs_monolithic"] == 0.0
        assert r["holders"] >= 2 and r["tokens"] == 48
