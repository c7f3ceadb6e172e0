"""``verify_forward`` on every family expert preparation adds (real processes), dense and quantized."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tenzro_site.verify import max_rel_err, monolithic, reference_layers
from prepare.checkpoint import Checkpoint
from tests.ckpt_util import make_checkpoint, make_gpt_oss, write_gpt_oss_reference, write_reference
from tests.cluster_util import ROOT, env_for

CASES = {
    "mixtral-fused": ("mixtral", dict(fused=True, experts=6)),
    "qwen2_moe": ("qwen2_moe", dict(shards=2)),
    "glm4_moe-fp8": ("glm4_moe", dict(fp8=True, shards=2, layers=3)),
    "qwen3_moe-fused": ("qwen3_moe", dict(fused=True)),
    "kimi_k2-fp8": ("kimi_k2", dict(fp8=True)),
}


def _make(path, name):
    if name.startswith("gpt_oss"):
        cfg, values = make_gpt_oss(path, mxfp4=name.endswith("mxfp4"))
        return write_gpt_oss_reference(path, cfg, values)
    fam, kw = CASES[name]
    cfg, values = make_checkpoint(path, fam, hidden=64, inter=32, **kw)
    return write_reference(path, cfg, values, fused=kw.get("fused", False))


@pytest.mark.parametrize("name", sorted(CASES) + ["gpt_oss-mxfp4", "gpt_oss-bf16"])
def test_monolithic_matches_independent_reference(tmp_path, name):
    _make(tmp_path / name, name)
    tensors, layers = reference_layers(tmp_path / name / "reference.safetensors")
    ck = Checkpoint(tmp_path / name)
    for layer in layers:
        out = monolithic(ck, layer, tensors[f"layer{layer}.hidden_states"])
        assert max_rel_err(out, tensors[f"layer{layer}.output"]) < 1e-5


@pytest.mark.cluster
@pytest.mark.parametrize("name,quant", [("qwen2_moe", None), ("glm4_moe-fp8", None), ("mixtral-fused", "q8_0"),
                                        ("gpt_oss-mxfp4", None)])
def test_verify_forward_on_added_families(tmp_path, name, quant):
    layers = _make(tmp_path / name, name)
    ckpt = tmp_path / name
    cmd = [sys.executable, str(ROOT / "manage.py"), "verify_forward", "--checkpoint", str(ckpt),
           "--reference", str(ckpt / "reference.safetensors"), "--holders", "2", "--json"]
    res = subprocess.run(cmd + (["--quant", quant] if quant else []), cwd=ROOT, env=env_for(tmp_path),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert [r["layer"] for r in report["layers"]] == layers
    for r in report["layers"]:
        assert r["max_abs_diff_vs_monolithic"] == 0.0
        if quant:
            assert r["quant"] == quant and 0 < r["max_rel_err_vs_dense"] < 0.05
            assert np.isclose(r["max_rel_err_vs_reference"], r["max_rel_err_vs_dense"], rtol=0.2, atol=1e-5)
        else:
            assert r["max_rel_err_vs_reference"] <= 1e-5


@pytest.mark.cluster
def test_verify_forward_is_exact_with_any_blas_thread_count(tmp_path):
    """Issue 24 item 1: a DeepSeek-V3-shaped layer (64 routed experts, 8 groups keeping 3, top-6,
    2 shared experts of d_ff 256 each, H 256) gives sharded == monolithic bit for bit with 1, 2
    and 4 OpenBLAS/OpenMP threads on both sides (site and holder agents inherit the setting)."""
    from tests.synth import make_checkpoint as make_synth

    ckpt = make_synth(tmp_path / "ds", "deepseek_v3", hidden=256, d_ff=256, experts=64, top_k=6, n_group=8,
                      topk_group=3, n_shared=2, scale=2.5, tokens=32)
    for threads in ("1", "2", "4"):
        (tmp_path / threads).mkdir()
        env = env_for(tmp_path / threads)
        env.update(OPENBLAS_NUM_THREADS=threads, OMP_NUM_THREADS=threads)
        cmd = [sys.executable, str(ROOT / "manage.py"), "verify_forward", "--checkpoint", str(ckpt),
               "--reference", str(ckpt / "reference.safetensors"), "--holders", "3", "--json"]
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, f"{threads} threads: {res.stdout}{res.stderr}"
        report = json.loads(res.stdout.strip().splitlines()[-1])
        assert [r["max_abs_diff_vs_monolithic"] for r in report["layers"]] == [0.0], threads
        assert report["layers"][0]["max_rel_err_vs_reference"] <= 1e-5
