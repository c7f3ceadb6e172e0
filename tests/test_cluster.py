"""End to end with real processes: tenzro_cluster, a forward over its RPC URL, verify_forward."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from moe import wire
from tenzro_site.verify import max_rel_err
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
    dense = report["dense_layers"]
    assert [r["layer"] for r in dense] == ([0] if ckpt == DEEPSEEK else [])
    for r in dense:  # DeepSeek's leading dense MLP, split by intermediate slices over holders
        assert r["ok"] and r["parts"] == 2 and r["holders"] >= 1
        assert r["max_abs_diff_vs_split"] == 0.0 and r["max_rel_err_vs_unsplit"] <= 1e-5


SYNTHETIC = {
    # qwen3_moe, raw softmax probabilities (norm_topk_prob false), f16 weights, 12 experts top-3
    "qwen_raw_f16": dict(family="qwen3_moe", hidden=96, d_ff=48, experts=12, top_k=3, layers=2,
                         norm_topk_prob=False, dtype="f16"),
    # deepseek_v3, 4 groups keep 1, 2 fused shared experts, no renormalisation, scaling 1.5, sharded
    "deepseek_groups_sharded": dict(family="deepseek_v3", hidden=64, d_ff=32, experts=16, top_k=3, layers=3,
                                    n_group=4, topk_group=1, n_shared=2, norm_topk_prob=False, scale=1.5,
                                    sharded=True),
}


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_verify_forward_on_other_checkpoints(tmp_path, name):
    from tests.synth import make_checkpoint

    ckpt = make_checkpoint(tmp_path / name, **SYNTHETIC[name])
    res = subprocess.run([sys.executable, str(ROOT / "manage.py"), "verify_forward", "--checkpoint", str(ckpt),
                          "--reference", str(ckpt / "reference.safetensors"), "--holders", "2", "--json"],
                         cwd=ROOT, env=env_for(tmp_path), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(report["layers"]) == 2
    assert all(r["max_abs_diff_vs_monolithic"] == 0.0 for r in report["layers"])


def test_verify_forward_exits_1_when_the_reference_disagrees(tmp_path):
    from safetensors.numpy import load_file, save_file

    from tests.synth import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "bad", family="qwen3_moe", layers=1)
    ref = load_file(str(ckpt / "reference.safetensors"))
    ref["layer0.output"] = ref["layer0.output"] * np.float32(1.001)  # 1e-3 relative: far above 1e-5
    save_file(ref, str(ckpt / "reference.safetensors"))
    res = subprocess.run([sys.executable, str(ROOT / "manage.py"), "verify_forward", "--checkpoint", str(ckpt),
                          "--reference", str(ckpt / "reference.safetensors"), "--holders", "1", "--json"],
                         cwd=ROOT, env=env_for(tmp_path), capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stdout + res.stderr
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["layers"][0]["max_rel_err_vs_reference"] > 1e-4
    assert report["layers"][0]["max_abs_diff_vs_monolithic"] == 0.0


def test_verify_forward_batches_above_one_frame_equal_monolithic(tmp_path):
    from tests.synth import make_checkpoint

    # H 4096 and 62 tokens on each of 2 experts: each batch (~1 MiB of f32 rows each way) crosses the
    # agent socket in part frames, and the agent executes it whole (it once ran 59 + 3 rows apart).
    ckpt = make_checkpoint(tmp_path / "h4096", family="qwen3_moe", hidden=4096, d_ff=32, experts=2, top_k=2,
                           layers=1, tokens=62)
    res = subprocess.run([sys.executable, str(ROOT / "manage.py"), "verify_forward", "--checkpoint", str(ckpt),
                          "--reference", str(ckpt / "reference.safetensors"), "--holders", "2", "--json"],
                         cwd=ROOT, env=env_for(tmp_path), capture_output=True, text=True, timeout=300)
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert [r["max_abs_diff_vs_monolithic"] for r in report["layers"]] == [0.0], res.stdout + res.stderr
    assert res.returncode == 0, res.stdout + res.stderr
