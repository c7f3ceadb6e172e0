"""Numeric core: checkpoint reading, per-family layouts, routing, expert FFN, combine, blobs.

Checked against the real fixtures (HF checkpoints + transformers reference outputs) and
against small independent implementations written here. No Django.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save

from moe.ffn import (ExpertWeights, MissingExpertRows, combine, expert_forward,
                         moe_layer_forward)
from moe.gating import Gate, Routing, route
from prepare.checkpoint import Checkpoint
from moe.codec import CheckpointError, decode_f32, dumps_safetensors, encode_bf16, loads_safetensors
from prepare.layouts import MoeSpec, load_expert, load_gate, spec_from_config

FIXTURES = Path(__file__).parent / "fixtures"
FAMILIES = ("qwen3_moe_tiny", "deepseek_v3_tiny")
ROOT = Path(__file__).resolve().parent.parent


def _cases():
    out = []
    for fx in FAMILIES:
        for layer in json.loads((FIXTURES / fx / "reference.json").read_text())["moe_layers"]:
            out.append((fx, layer))
    return out


CASES = _cases()


class Model:
    """One fixture: checkpoint, spec, reference tensors, and every expert of each MoE layer."""

    def __init__(self, name: str):
        self.dir = FIXTURES / name
        self.ckpt = Checkpoint(self.dir)
        self.spec = spec_from_config(self.ckpt.config)
        self.ref = load_file(str(self.dir / "reference.safetensors"))
        self._gates, self._experts = {}, {}

    def gate(self, layer):
        if layer not in self._gates:
            self._gates[layer] = load_gate(self.ckpt, self.spec, layer)
        return self._gates[layer]

    def experts(self, layer):
        if layer not in self._experts:
            n = self.spec.num_experts + (1 if self.spec.shared_slot is not None else 0)
            self._experts[layer] = {e: load_expert(self.ckpt, self.spec, layer, e) for e in range(n)}
        return self._experts[layer]


@pytest.fixture(scope="module")
def models():
    return {name: Model(name) for name in FAMILIES}


# --------------------------------------------------------------------------- reference fixtures

@pytest.mark.parametrize("fx,layer", CASES)
def test_route_reproduces_reference(models, fx, layer):
    m = models[fx]
    r = route(m.gate(layer), m.ref[f"layer{layer}.hidden_states"])
    k = m.spec.top_k
    assert r.top_k == k
    np.testing.assert_array_equal(r.expert_ids[:, :k], m.ref[f"layer{layer}.topk_ids"])
    np.testing.assert_allclose(r.weights[:, :k], m.ref[f"layer{layer}.topk_weights"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(r.router_logits, m.ref[f"layer{layer}.router_logits"], rtol=0, atol=1e-5)
    assert r.expert_ids.dtype == np.int64 and r.weights.dtype == np.float32
    assert (np.diff(r.expert_ids[:, :k], axis=1) > 0).all()  # ascending expert id
    if m.spec.shared_slot is not None:
        assert r.expert_ids.shape[1] == k + 1
        assert (r.expert_ids[:, -1] == m.spec.num_experts).all() and (r.weights[:, -1] == 1.0).all()
    else:
        assert r.expert_ids.shape[1] == k


@pytest.mark.parametrize("fx,layer", CASES)
def test_moe_layer_forward_reproduces_reference(models, fx, layer):
    m = models[fx]
    out, routing = moe_layer_forward(m.gate(layer), m.experts(layer), m.ref[f"layer{layer}.hidden_states"])
    ref = m.ref[f"layer{layer}.output"]
    assert out.dtype == np.float32 and out.shape == ref.shape
    rel = float(np.abs(out - ref).max() / np.abs(ref).max())
    print(f"{fx} layer {layer}: max relative error {rel:.3g}")
    assert rel <= 1e-5


@pytest.mark.parametrize("fx", ["qwen2_moe_tiny", "mixtral_tiny", "qwen2_moe_trained"])
def test_hf_written_moe_blocks_reproduce_transformers(fx):
    """The fixtures of tests/fixtures/make_hf_fixtures.py ship each MoE block's input and
    output only (no routing tensors): the whole block, shared expert included."""
    m = Model(fx)
    for layer in json.loads((m.dir / "reference.json").read_text())["moe_layers"]:
        out, _ = moe_layer_forward(m.gate(layer), m.experts(layer), m.ref[f"layer{layer}.hidden_states"])
        ref = m.ref[f"layer{layer}.output"]
        rel = float(np.abs(out - ref).max() / np.abs(ref).max())
        assert rel <= 1e-5, (fx, layer, rel)


@pytest.mark.parametrize("fx,layer", CASES)
def test_sharded_combine_is_bit_identical_to_monolithic(models, fx, layer):
    m = models[fx]
    gate, experts, x = m.gate(layer), m.experts(layer), m.ref[f"layer{layer}.hidden_states"]
    mono, routing = moe_layer_forward(gate, experts.__getitem__, x)
    # Each "holder" computes its expert's rows on the same token batch; results arrive in
    # arbitrary order and with token order shuffled after the fact.
    rng = np.random.default_rng(layer)
    outputs = {}
    for e, tok in sorted(routing.tokens_by_expert().items(), reverse=True):
        rows = expert_forward(ExpertWeights.from_blob(experts[e].to_blob()), x[tok])
        p = rng.permutation(len(tok))
        outputs[e] = (tok[p], rows[p])
    sharded = combine(route(gate, x), outputs, gate.d_model)
    assert np.array_equal(sharded.view(np.uint32), mono.view(np.uint32))


def test_qwen3_norm_topk_prob_false_on_fixture(models):
    m = models["qwen3_moe_tiny"]
    for layer in (0, 1):
        gate = dataclasses.replace(m.gate(layer), norm_topk_prob=False)
        r = route(gate, m.ref[f"layer{layer}.hidden_states"])
        ids = m.ref[f"layer{layer}.topk_ids"]
        np.testing.assert_array_equal(r.expert_ids, ids)
        logits = m.ref[f"layer{layer}.router_logits"].astype(np.float64)
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        np.testing.assert_allclose(r.weights, np.take_along_axis(p, ids, 1), rtol=0, atol=1e-6)
        assert (r.weights.sum(1) < 1).all()


# --------------------------------------------------------------------------- independent routers

def _ref_route_softmax(logits, k, norm):
    """Plain per-token Python: softmax over all, sort by (-p, id), optional renormalize."""
    ids_out, w_out = [], []
    for row in logits.astype(np.float64):
        p = np.exp(row - row.max())
        p /= p.sum()
        chosen = sorted(range(len(p)), key=lambda i: (-p[i], i))[:k]
        w = np.array([p[i] for i in chosen])
        if norm:
            w = w / w.sum()
        order = np.argsort(chosen)
        ids_out.append(np.array(chosen)[order])
        w_out.append(w[order])
    return np.array(ids_out), np.array(w_out)


def _ref_route_sigmoid(logits, bias, k, n_group, topk_group, norm, scale):
    """Plain per-token Python version of docs/DESIGN.md §5's DeepSeek rule (−inf group masking)."""
    e = logits.shape[1]
    size = e // n_group
    ids_out, w_out = [], []
    for row in logits:
        s = [float(1.0 / (1.0 + np.exp(-np.float64(v)))) for v in row]
        sb = [s[i] + float(bias[i]) for i in range(e)]
        allowed = set(range(e))
        if n_group > 1:
            gscore = []
            for g in range(n_group):
                top2 = sorted(sb[g * size:(g + 1) * size], reverse=True)[:2]
                gscore.append(top2[0] + top2[1])
            kept = sorted(range(n_group), key=lambda g: (-gscore[g], g))[:topk_group]
            allowed = {i for g in kept for i in range(g * size, (g + 1) * size)}
        chosen = sorted(allowed, key=lambda i: (-sb[i], i))[:k]
        w = np.array([s[i] for i in chosen])
        if norm:
            w = w / (w.sum() + 1e-20)
        w = w * scale
        order = np.argsort(chosen)
        ids_out.append(np.array(chosen)[order])
        w_out.append(w[order])
    return np.array(ids_out), np.array(w_out)


@pytest.mark.parametrize("e,k", [(8, 2), (12, 3), (20, 6), (64, 8)])
@pytest.mark.parametrize("norm", [False, True])
def test_sigmoid_router_matches_independent_reference(e, k, norm):
    rng = np.random.default_rng(e * 100 + k)
    h = 48
    w = rng.standard_normal((e, h)).astype(np.float32) * 0.2
    bias = rng.standard_normal(e).astype(np.float32) * 0.1
    x = rng.standard_normal((40, h)).astype(np.float32)
    gate = Gate("deepseek_v3", w, bias, top_k=k, norm_topk_prob=norm, routed_scaling_factor=2.827)
    r = route(gate, x)
    ids, wts = _ref_route_sigmoid(x @ w.T, bias, k, 1, 1, norm, 2.827)
    np.testing.assert_array_equal(r.expert_ids, ids)
    np.testing.assert_allclose(r.weights, wts, rtol=0, atol=1e-6)


@pytest.mark.parametrize("n_group,topk_group,k", [(4, 2, 4), (8, 3, 6), (4, 1, 4)])
def test_group_limited_router_masks_with_minus_inf(n_group, topk_group, k):
    rng = np.random.default_rng(n_group * 10 + topk_group)
    e, h = 32, 40
    w = rng.standard_normal((e, h)).astype(np.float32) * 0.3
    # Biases below -1 make every biased score negative, so a 0.0 fill (HF) would pick
    # experts from dropped groups; -inf (official DeepSeek) never does.
    bias = (rng.standard_normal(e) * 0.1 - 2.0).astype(np.float32)
    x = rng.standard_normal((64, h)).astype(np.float32)
    gate = Gate("kimi_k2", w, bias, top_k=k, norm_topk_prob=True, routed_scaling_factor=2.5,
                n_group=n_group, topk_group=topk_group, n_shared_experts=1)
    r = route(gate, x)
    ids, wts = _ref_route_sigmoid(x @ w.T, bias, k, n_group, topk_group, True, 2.5)
    np.testing.assert_array_equal(r.expert_ids[:, :k], ids)
    np.testing.assert_allclose(r.weights[:, :k], wts, rtol=0, atol=1e-6)
    groups = r.expert_ids[:, :k] // (e // n_group)
    assert all(len(set(row)) <= topk_group for row in groups.tolist())
    assert (r.expert_ids[:, k] == e).all() and (r.weights[:, k] == 1.0).all()


@pytest.mark.parametrize("e,k", [(8, 2), (16, 4), (60, 4), (128, 8)])
@pytest.mark.parametrize("norm", [False, True])
def test_softmax_router_matches_independent_reference(e, k, norm):
    rng = np.random.default_rng(e + k)
    h = 64
    w = rng.standard_normal((e, h)).astype(np.float32) * 0.2
    x = rng.standard_normal((50, h)).astype(np.float32)
    r = route(Gate("qwen3_moe", w, top_k=k, norm_topk_prob=norm), x)
    ids, wts = _ref_route_softmax(x @ w.T, k, norm)
    np.testing.assert_array_equal(r.expert_ids, ids)
    np.testing.assert_allclose(r.weights, wts, rtol=0, atol=1e-6)


def test_qwen3_norm_topk_prob_defaults_to_false():
    gate = Gate("qwen3_moe", np.eye(4, dtype=np.float32), top_k=2)
    assert gate.norm_topk_prob is False
    assert Gate("deepseek_v3", np.eye(4, dtype=np.float32), np.zeros(4), top_k=2).norm_topk_prob is True
    spec = spec_from_config({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                             "hidden_size": 4, "moe_intermediate_size": 8, "num_hidden_layers": 1})
    assert spec.norm_topk_prob is False


def test_ties_go_to_the_lower_expert_id():
    # Small integers: every dot product is exact, so the tied logits are bit-equal.
    w = np.zeros((8, 4), dtype=np.float32)
    w[[2, 5, 6]] = [1, 2, 0, 1]
    w[7] = [1, 1, 0, 0]
    x = np.array([[1, 1, 1, 1], [2, 0, 0, 2]], dtype=np.float32)
    r = route(Gate("qwen3_moe", w, top_k=2, norm_topk_prob=True), x)
    np.testing.assert_array_equal(r.expert_ids, [[2, 5], [2, 5]])
    np.testing.assert_array_equal(r.weights, np.full((2, 2), 0.5, dtype=np.float32))
    r = route(Gate("deepseek_v3", w, np.zeros(8, np.float32), top_k=3), x)
    np.testing.assert_array_equal(r.expert_ids, [[2, 5, 6], [2, 5, 6]])
    # All logits equal: the k lowest ids win.
    r = route(Gate("deepseek_v3", np.zeros((8, 4), np.float32), np.zeros(8, np.float32), top_k=3), x)
    np.testing.assert_array_equal(r.expert_ids, [[0, 1, 2], [0, 1, 2]])
    # Group tie: groups {0,1} and {2,3} score the same, the lower group is kept.
    w2 = np.zeros((8, 4), dtype=np.float32)
    w2[[1, 3]] = [1, 0, 0, 0]
    g = Gate("deepseek_v3", w2, np.zeros(8, np.float32), top_k=2, n_group=4, topk_group=1)
    r = route(g, np.array([[3, 0, 0, 0]], dtype=np.float32))
    np.testing.assert_array_equal(r.expert_ids, [[0, 1]])


def test_route_rejects_bad_input(models):
    gate = models["qwen3_moe_tiny"].gate(0)
    x = np.zeros((3, 256), dtype=np.float32)
    with pytest.raises(ValueError, match=r"d_model=255.*d_model=256"):
        route(gate, np.zeros((3, 255), dtype=np.float32))
    with pytest.raises(ValueError, match="2-D"):
        route(gate, np.zeros(256, dtype=np.float32))
    bad = x.copy()
    bad[1, 7] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        route(gate, bad)
    bad[1, 7] = np.inf
    with pytest.raises(ValueError, match="infinity"):
        route(gate, bad)
    with pytest.raises(ValueError, match="overflow"):
        route(gate, np.full((1, 256), 3e38, dtype=np.float32))
    for k in (0, 17, -1):
        with pytest.raises(ValueError, match="top_k"):
            route(gate, x, top_k=k)
    assert route(gate, x, top_k=16).expert_ids.shape == (3, 16)
    ds = models["deepseek_v3_tiny"].gate(1)  # 4 groups of 4, keep 2 → at most 8 reachable
    with pytest.raises(ValueError, match=r"1\.\.8"):
        route(ds, x, top_k=9)
    legacy = Gate("qwen3_moe", np.eye(4, dtype=np.float32))
    with pytest.raises(ValueError, match="top_k is required"):
        route(legacy, np.eye(4, dtype=np.float32))


def test_gate_validation():
    with pytest.raises(ValueError, match="'llama'.*qwen3_moe"):
        Gate("llama", np.eye(4, dtype=np.float32))
    with pytest.raises(ValueError, match=r"correction bias must have shape \(4,\)"):
        Gate("deepseek_v3", np.eye(4, dtype=np.float32), np.zeros(3))
    with pytest.raises(ValueError, match="no correction bias"):
        Gate("qwen3_moe", np.eye(4, dtype=np.float32), np.zeros(4))
    with pytest.raises(ValueError, match="not divisible by n_group"):
        Gate("deepseek_v3", np.eye(6, dtype=np.float32), np.zeros(6), n_group=4)
    with pytest.raises(ValueError, match="num_experts=5"):
        Gate("qwen3_moe", np.eye(4, dtype=np.float32), num_experts=5)


def test_tokens_by_expert():
    ids = np.array([[0, 3, 5], [1, 3, 5], [0, 1, 5]], dtype=np.int64)
    r = Routing(ids, np.ones((3, 3), np.float32), np.zeros((3, 5), np.float32), 2, 5)
    tb = r.tokens_by_expert()
    assert list(tb) == [0, 1, 3, 5]
    for e, tok in tb.items():
        np.testing.assert_array_equal(tok, [t for t in range(3) if e in ids[t]])
        assert tok.dtype == np.int64


# --------------------------------------------------------------------------- expert FFN

def test_expert_forward_silu_accuracy_and_extremes():
    h = 64
    x = np.concatenate([np.linspace(-30, 30, 64 * 7, dtype=np.float32).reshape(7, 64),
                        np.array([[-1e4] * 32 + [1e4] * 32], dtype=np.float32)])
    eye = np.eye(h, dtype=np.float32)
    w = ExpertWeights(eye, eye, eye)  # identity matmuls are exact: out = silu(x) * x
    with np.errstate(all="raise"):
        out = expert_forward(w, x)
    x64 = x.astype(np.float64)
    with np.errstate(over="ignore"):
        want = x64 / (1 + np.exp(-x64)) * x64
    assert np.isfinite(out).all()
    rel = np.abs(out - want) / np.maximum(np.abs(want), 1e-30)
    assert rel[np.abs(want) > 1e-30].max() < 4e-7  # a few float32 ulps
    assert (out[7, :32] == 0).all()
    assert out.dtype == np.float32


def test_expert_weights_validation():
    g = np.zeros((8, 4), np.float32)
    with pytest.raises(ValueError, match="up_proj"):
        ExpertWeights(g, np.zeros((8, 5), np.float32), np.zeros((4, 8), np.float32))
    with pytest.raises(ValueError, match="down_proj"):
        ExpertWeights(g, g, np.zeros((8, 4), np.float32))
    with pytest.raises(ValueError, match="gate_proj"):
        ExpertWeights(np.zeros(8, np.float32), g, g)
    bad = g.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="up_proj.weight holds NaN"):
        ExpertWeights(g, bad, np.zeros((4, 8), np.float32))
    w = ExpertWeights(g, g, np.zeros((4, 8), np.float32))
    assert (w.d_model, w.d_ff, w.nbytes) == (4, 8, 3 * 8 * 4 * 4)
    with pytest.raises(ValueError, match=r"\[n, 4\]"):
        expert_forward(w, np.zeros((2, 5), np.float32))


def test_combine_reports_missing_pairs(models):
    m = models["deepseek_v3_tiny"]
    gate, x = m.gate(1), m.ref["layer1.hidden_states"]
    r = route(gate, x)
    tb = r.tokens_by_expert()
    outputs = {e: (tok, expert_forward(m.experts(1)[e], x[tok])) for e, tok in tb.items()}
    dropped = outputs.pop(3)
    with pytest.raises(MissingExpertRows) as exc:
        combine(r, outputs, gate.d_model)
    assert isinstance(exc.value, KeyError)
    np.testing.assert_array_equal(exc.value.missing[3], tb[3])
    assert "expert 3" in str(exc.value) and str(tb[3].tolist()) in str(exc.value)
    outputs[3] = (dropped[0][1:], dropped[1][1:])  # one token short
    with pytest.raises(MissingExpertRows, match=rf"expert 3: tokens \[{tb[3][0]}\]"):
        combine(r, outputs, gate.d_model)
    shared = outputs.pop(16)
    with pytest.raises(MissingExpertRows, match="expert 16"):
        combine(r, outputs, gate.d_model)
    outputs[16] = (shared[0], shared[1][:, :100])
    with pytest.raises(ValueError, match="rows of expert 16"):
        combine(r, outputs, gate.d_model)
    outputs[16] = (shared[0] + 100, shared[1])
    with pytest.raises(ValueError, match="token indices"):
        combine(r, outputs, gate.d_model)


# --------------------------------------------------------------------------- blobs

_HASH_SNIPPET = """
import hashlib, sys
from moe.gating import Gate
from moe.ffn import ExpertWeights
from prepare.checkpoint import Checkpoint
from prepare.layouts import spec_from_config, load_gate, load_expert
ck = Checkpoint(sys.argv[1]); spec = spec_from_config(ck.config)
print(hashlib.sha256(load_gate(ck, spec, 1).to_blob()).hexdigest())
print(hashlib.sha256(load_expert(ck, spec, 1, 16).to_blob("bf16")).hexdigest())
"""


def test_blobs_are_deterministic_across_processes(models):
    m = models["deepseek_v3_tiny"]
    here = [hashlib.sha256(m.gate(1).to_blob()).hexdigest(),
            hashlib.sha256(m.experts(1)[16].to_blob("bf16")).hexdigest()]
    for _ in range(2):  # each process seeds the Rust HashMap differently
        res = subprocess.run([sys.executable, "-c", _HASH_SNIPPET, str(m.dir)], cwd=ROOT,
                             capture_output=True, text=True, check=True)
        assert res.stdout.split() == here


@pytest.mark.parametrize("fx,layer", CASES)
def test_gate_blob_round_trip(models, fx, layer, tmp_path):
    gate = models[fx].gate(layer)
    blob = gate.to_blob()
    assert blob == gate.to_blob()
    back = Gate.from_blob(blob)
    for f in dataclasses.fields(Gate):
        a, b = getattr(gate, f.name), getattr(back, f.name)
        if isinstance(a, np.ndarray):
            assert b.dtype == np.float32 and np.array_equal(a.view(np.uint32), b.view(np.uint32))
        else:
            assert a == b, f.name
    assert back.to_blob() == blob
    path = tmp_path / "gate.safetensors"
    path.write_bytes(blob)
    with safe_open(str(path), framework="np") as f:  # the library reads our bytes
        meta = f.metadata()
        assert meta["family"] == gate.family and meta["top_k"] == str(gate.top_k)
        assert np.array_equal(f.get_tensor("router.weight"), gate.weight)
        assert ("router.bias" in f.keys()) == (gate.correction_bias is not None)


def test_legacy_gate_blob_without_family():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((8, 16)).astype(np.float32)
    b = rng.standard_normal(8).astype(np.float32) * 0.1
    x = rng.standard_normal((10, 16)).astype(np.float32)
    g = Gate.from_blob(save({"router.weight": w, "router.bias": b},
                            metadata={"routed_scaling_factor": "2.5", "shared_experts": "1"}))
    assert (g.family, g.norm_topk_prob, g.routed_scaling_factor, g.n_shared_experts, g.top_k) == \
        ("deepseek_v3", True, 2.5, 1, None)
    r = route(g, x, top_k=3)
    ids, wts = _ref_route_sigmoid(x @ w.T, b, 3, 1, 1, True, 2.5)
    np.testing.assert_array_equal(r.expert_ids[:, :3], ids)
    np.testing.assert_allclose(r.weights[:, :3], wts, atol=1e-6)
    assert (r.expert_ids[:, 3] == 8).all()
    # No bias: softmax over the k selected logits; scaling metadata is ignored.
    g = Gate.from_blob(save({"router.weight": w}, metadata={"routed_scaling_factor": "2.5"}))
    assert (g.family, g.norm_topk_prob, g.routed_scaling_factor, g.shared_slot) == ("qwen3_moe", True, 1.0, None)
    r = route(g, x, top_k=2)
    logits = (x @ w.T).astype(np.float64)
    sel = np.take_along_axis(logits, r.expert_ids, 1)
    want = np.exp(sel - sel.max(1, keepdims=True))
    np.testing.assert_allclose(r.weights, want / want.sum(1, keepdims=True), atol=1e-6)


def test_gate_blob_errors():
    w = np.eye(4, dtype=np.float32)
    with pytest.raises(ValueError, match="no 'router.weight'"):
        Gate.from_blob(save({"router.bias": np.zeros(4, np.float32)}))
    with pytest.raises(ValueError, match=r"'router.bias' has shape \(3,\)"):
        Gate.from_blob(save({"router.weight": w, "router.bias": np.zeros(3, np.float32)}))
    with pytest.raises(ValueError, match="top_k='x'"):
        Gate.from_blob(save({"router.weight": w}, metadata={"family": "qwen3_moe", "top_k": "x"}))
    with pytest.raises(ValueError, match="unsupported gate family 'llama'"):
        Gate.from_blob(save({"router.weight": w}, metadata={"family": "llama"}))
    with pytest.raises(ValueError, match="router.logit_bias"):
        Gate.from_blob(save({"router.weight": w, "router.logit_bias": np.zeros(4, np.float32)}))
    with pytest.raises(ValueError, match="num_experts=5"):
        Gate.from_blob(save({"router.weight": w}, metadata={"family": "qwen3_moe", "num_experts": "5"}))
    with pytest.raises(ValueError, match="safetensors"):
        Gate.from_blob(b"\x01\x00")


@pytest.mark.parametrize("fx,layer", CASES)
def test_expert_blob_round_trip(models, fx, layer, tmp_path):
    experts = models[fx].experts(layer)
    for e in (0, max(experts)):
        w = experts[e]
        f32, bf16 = w.to_blob(), w.to_blob("bf16")
        assert f32 == w.to_blob() and bf16 == w.to_blob("bf16")
        assert len(bf16) < len(f32) * 0.51
        for blob in (f32, bf16):  # bf16 is exact: the weights came from a bf16 checkpoint
            back = ExpertWeights.from_blob(blob)
            for p in ("gate_proj", "up_proj", "down_proj"):
                assert np.array_equal(getattr(back, p).view(np.uint32), getattr(w, p).view(np.uint32))
        path = tmp_path / "expert.safetensors"
        path.write_bytes(f32)
        with safe_open(str(path), framework="np") as f:
            assert sorted(f.keys()) == ["down_proj.weight", "gate_proj.weight", "up_proj.weight"]
            assert np.array_equal(f.get_tensor("down_proj.weight"), w.down_proj)


def test_expert_blob_errors():
    g = np.zeros((8, 4), np.float32)
    d = np.zeros((4, 8), np.float32)
    with pytest.raises(ValueError, match="'up_proj.weight'"):
        ExpertWeights.from_blob(save({"gate_proj.weight": g, "down_proj.weight": d}))
    with pytest.raises(ValueError, match="down_proj"):
        ExpertWeights.from_blob(save({"gate_proj.weight": g, "up_proj.weight": g, "down_proj.weight": g}))
    with pytest.raises(ValueError, match="gate_proj.weight.*I64"):
        ExpertWeights.from_blob(save({"gate_proj.weight": g.astype(np.int64), "up_proj.weight": g,
                                      "down_proj.weight": d}))
    with pytest.raises(ValueError, match="extra"):
        ExpertWeights.from_blob(save({"gate_proj.weight": g, "up_proj.weight": g, "down_proj.weight": d,
                                      "extra": d}))
    with pytest.raises(ValueError, match="dtype"):
        ExpertWeights(g, g, d).to_blob("q4")
    # f16 blobs decode too
    back = ExpertWeights.from_blob(save({"gate_proj.weight": g.astype(np.float16) + 1,
                                         "up_proj.weight": g.astype(np.float16), "down_proj.weight": d}))
    assert back.gate_proj.dtype == np.float32 and (back.gate_proj == 1).all()


def test_bf16_encode_rounds_to_nearest_even():
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -2.5, 3.0e38, 1e-40], dtype=np.float32)
    raw = encode_bf16(x)
    back = decode_f32(raw.tobytes(), "BF16", x.shape)
    np.testing.assert_array_equal(back[:5], np.array([1.0, 1.0, 1 + 2**-6, 1 + 2**-7, -2.5], np.float32))
    assert np.isfinite(back).all()
    with pytest.raises(ValueError, match="non-finite"):
        encode_bf16(np.array([np.inf], np.float32))


def test_safetensors_codec_is_canonical():
    a = dumps_safetensors({"b": np.ones(3, np.float32), "a": np.zeros((2, 2), np.float16)}, {"z": "1", "a": "2"})
    b = dumps_safetensors({"a": np.zeros((2, 2), np.float16), "b": np.ones(3, np.float32)}, {"a": "2", "z": "1"})
    assert a == b
    (n,) = struct.unpack_from("<Q", a)
    assert n % 8 == 0 and a[8:9] == b"{"
    tensors, meta = loads_safetensors(a)
    assert meta == {"a": "2", "z": "1"} and tensors["b"].to_f32().tolist() == [1, 1, 1]


# --------------------------------------------------------------------------- checkpoint reader

def test_checkpoint_basics(models):
    q = models["qwen3_moe_tiny"].ckpt
    names = q.names()
    assert names == sorted(names) and "model.layers.0.mlp.gate.weight" in names
    assert q.has("model.layers.1.mlp.experts.15.down_proj.weight") and not q.has("nope")
    dtype, shape, shard = q.info("model.layers.0.mlp.gate.weight")
    assert (dtype, shape, shard.name) == ("BF16", (16, 256), "model.safetensors")
    single = Checkpoint(FIXTURES / "qwen3_moe_tiny" / "model.safetensors")
    assert single.config["model_type"] == "qwen3_moe" and single.names() == names
    d = models["deepseek_v3_tiny"].ckpt
    assert len(d.shards) == 9
    bias_name = "model.layers.1.mlp.gate.e_score_correction_bias"
    dtype, shape, shard = d.info(bias_name)
    assert (dtype, shape) == ("F32", (16,))
    with safe_open(str(shard), framework="np") as f:
        assert np.array_equal(d.read(bias_name), f.get_tensor(bias_name))
    # bf16 decode checked against an independent bit-level decode of the same bytes
    name = "model.layers.2.mlp.experts.7.up_proj.weight"
    shard, off, length = d.location(name)
    raw = shard.read_bytes()[off:off + length]
    manual = np.array([struct.unpack("<f", b"\x00\x00" + raw[i:i + 2])[0] for i in range(0, length, 2)],
                      dtype=np.float32).reshape(256, 256)
    assert np.array_equal(d.read(name), manual)


class CountingCheckpoint(Checkpoint):
    """Records every ranged read and every byte the OS file objects hand back."""

    def __init__(self, path):
        self.ranges, self.file_bytes = [], 0
        super().__init__(path)

    def _read_range(self, shard, offset, length):
        self.ranges.append((shard.name, offset, length))
        return super()._read_range(shard, offset, length)

    def _open(self, shard):
        f = super()._open(shard)
        outer = self

        class Wrapped:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                f.close()

            def seek(self, pos):
                return f.seek(pos)

            def read(self, n):
                data = f.read(n)
                outer.file_bytes += len(data)
                return data

        return Wrapped()


def test_reads_only_header_and_tensor_bytes():
    ck = CountingCheckpoint(FIXTURES / "deepseek_v3_tiny")
    assert ck.ranges == []  # construction reads no shard
    name = "model.layers.1.mlp.experts.3.gate_proj.weight"
    arr = ck.read(name)
    shard, off, length = ck.location(name)
    (n,) = struct.unpack("<Q", shard.read_bytes()[:8])
    assert ck.ranges == [(shard.name, 0, 8), (shard.name, 8, n), (shard.name, off, length)]
    assert ck.file_bytes == 8 + n + length == 8 + n + arr.size * 2
    before = ck.file_bytes
    other = "model.layers.1.mlp.experts.4.gate_proj.weight"
    if ck.info(other).shard == shard:  # same shard: header is cached
        ck.read(other)
        assert ck.file_bytes - before == ck.location(other)[2]
    # A whole expert from a fresh reader: per touched shard its header, plus the 3 tensors.
    ck = CountingCheckpoint(FIXTURES / "deepseek_v3_tiny")
    spec = spec_from_config(ck.config)
    load_expert(ck, spec, 2, 16)
    names = spec.expert_tensor_names(2, 16).values()
    shards = {ck.info(nm).shard for nm in names}
    headers = sum(8 + struct.unpack("<Q", s.read_bytes()[:8])[0] for s in shards)
    assert ck.file_bytes == headers + sum(ck.location(nm)[2] for nm in names)
    assert sum(length for *_, length in ck.ranges) == ck.file_bytes


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for p in dst.iterdir():
        p.chmod(0o644)
    return dst


def test_missing_tensor_and_paths(tmp_path, models):
    for ck in (models["qwen3_moe_tiny"].ckpt, models["deepseek_v3_tiny"].ckpt):
        with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.experts\.99\.up_proj\.weight'"):
            ck.read("model.layers.1.mlp.experts.99.up_proj.weight")
        with pytest.raises(CheckpointError, match="not in the checkpoint"):
            ck.info("nope")
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        Checkpoint(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        Checkpoint(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        Checkpoint(tmp_path / "empty")
    d = _copy(FIXTURES / "deepseek_v3_tiny", tmp_path / "ds")
    (d / "model-00004-of-00009.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00004-of-00009.safetensors.*missing"):
        Checkpoint(d)
    assert isinstance(CheckpointError("x"), ValueError)


def test_truncated_shard(tmp_path):
    d = _copy(FIXTURES / "deepseek_v3_tiny", tmp_path / "ds")
    ck = Checkpoint(d)
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    shard = ck.info(name).shard
    full = ck.read(name)
    data = shard.read_bytes()
    # The file shrinks after its header was validated: the ranged read notices.
    shard.write_bytes(data[:-100])
    last = max(ck.header(shard).tensors, key=lambda t: ck.header(shard).tensors[t].end)
    with pytest.raises(CheckpointError, match="truncated"):
        ck.read(last)
    # A fresh reader refuses the shard from its header, naming the tensor that does not fit.
    ck2 = Checkpoint(d)
    with pytest.raises(CheckpointError, match=rf"{shard.name}.*{last}.*truncated"):
        ck2.read(name)
    # Other shards still read fine.
    other = next(n for n in ck2.names() if ck2.info(n).shard != shard and n.endswith("proj.weight"))
    assert ck2.read(other).dtype == np.float32
    shard.write_bytes(data)
    assert np.array_equal(Checkpoint(d).read(name), full)


def _write_raw(path: Path, header: bytes, data: bytes = b"", n: int | None = None) -> Path:
    path.write_bytes(struct.pack("<Q", len(header) if n is None else n) + header + data)
    return path


@pytest.mark.parametrize("case,pattern", [
    ("short", "shorter than 8"),
    ("huge_n", "exceeds"),
    ("n_past_end", "runs past the end"),
    ("not_object", "starting with '{'"),
    ("bad_json", "not UTF-8 JSON"),
    ("duplicate", "duplicate key 'w'"),
    ("bad_dtype", "unknown dtype 'F17'"),
    ("size_mismatch", "needs 24"),
    ("overlap", "overlaps"),
    ("hole", "hole"),
    ("trailing", "after the last tensor"),
    ("bad_offsets", "bad data_offsets"),
])
def test_bad_headers(tmp_path, case, pattern):
    p = tmp_path / "model.safetensors"
    w = {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
    body = bytes(24)
    if case == "short":
        p.write_bytes(b"\x01\x02\x03")
    elif case == "huge_n":
        _write_raw(p, b"{}", n=200_000_000)
    elif case == "n_past_end":
        _write_raw(p, b"{}", n=4096)
    elif case == "not_object":
        _write_raw(p, b'["w"]   ')
    elif case == "bad_json":
        _write_raw(p, b'{"w": ')
    elif case == "duplicate":
        _write_raw(p, b'{"w":' + json.dumps(w).encode() + b',"w":' + json.dumps(w).encode() + b"}", body)
    elif case == "bad_dtype":
        _write_raw(p, json.dumps({"w": dict(w, dtype="F17")}).encode(), body)
    elif case == "size_mismatch":
        _write_raw(p, json.dumps({"w": dict(w, data_offsets=[0, 20])}).encode(), bytes(20))
    elif case == "overlap":
        _write_raw(p, json.dumps({"w": w, "v": dict(w, data_offsets=[12, 36])}).encode(), bytes(36))
    elif case == "hole":
        _write_raw(p, json.dumps({"w": dict(w, data_offsets=[8, 32])}).encode(), bytes(32))
    elif case == "trailing":
        _write_raw(p, json.dumps({"w": w}).encode(), bytes(30))
    elif case == "bad_offsets":
        _write_raw(p, json.dumps({"w": dict(w, data_offsets=[24, 0])}).encode(), body)
    with pytest.raises(CheckpointError, match=pattern) as exc:
        Checkpoint(p).read("w")
    assert "model.safetensors" in str(exc.value)
    with pytest.raises(CheckpointError):
        loads_safetensors(p.read_bytes())


def test_unsupported_dtypes_fail_before_reading(tmp_path):
    p = tmp_path / "model.safetensors"
    p.write_bytes(dumps_safetensors({
        "experts.0.w": ("F8_E5M2", (4, 8), bytes(32)),
        "experts.0.w_scale_inv": np.ones((1, 1), np.float32),
        "ids": np.arange(3, dtype=np.int64),
    }))
    ck = CountingCheckpoint(p)
    with pytest.raises(CheckpointError, match=r"'experts\.0\.w'.*F8_E5M2.*only F8_E4M3") as exc:
        ck.read("experts.0.w")
    assert "BF16, F16, F32" in str(exc.value)
    assert all(off < 8 + 512 for _, off, _ in ck.ranges)  # only header reads happened
    with pytest.raises(CheckpointError, match="'ids'.*I64"):
        ck.read("ids")
    assert ck.read_bytes("experts.0.w") == bytes(32)
    assert ck.read("experts.0.w_scale_inv").tolist() == [[1.0]]


def test_index_inconsistent_with_shard(tmp_path):
    d = _copy(FIXTURES / "deepseek_v3_tiny", tmp_path / "ds")
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    idx["weight_map"]["model.layers.1.mlp.experts.0.up_proj.weight"] = "model-00009-of-00009.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="index maps tensor 'model.layers.1.mlp.experts.0.up_proj.weight'"):
        Checkpoint(d).read("model.layers.1.mlp.experts.0.up_proj.weight")


# --------------------------------------------------------------------------- layouts

def test_specs_from_fixture_configs(models):
    q = models["qwen3_moe_tiny"].spec
    assert (q.family, q.num_experts, q.top_k, q.hidden_size, q.moe_intermediate_size) == ("qwen3_moe", 16, 4, 256, 256)
    assert q.norm_topk_prob is True and q.n_shared_experts == 0 and q.shared_slot is None
    assert q.moe_layers() == [0, 1]
    d = models["deepseek_v3_tiny"].spec
    assert (d.family, d.num_experts, d.n_shared_experts, d.n_group, d.topk_group) == ("deepseek_v3", 16, 1, 4, 2)
    assert d.routed_scaling_factor == 2.5 and d.shared_slot == 16 and d.first_k_dense_replace == 1
    assert d.moe_layers() == [1, 2]  # layer 3 (num_nextn_predict_layers) is never listed
    for fx in FAMILIES:
        ref = json.loads((FIXTURES / fx / "reference.json").read_text())
        assert models[fx].spec.moe_layers() == ref["moe_layers"]
        assert spec_from_config(ref["config"]) == models[fx].spec  # num_local_experts spelling


def test_layer_rules_and_family_variants():
    base = {"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "hidden_size": 16,
            "moe_intermediate_size": 8, "num_hidden_layers": 6}
    spec = spec_from_config(dict(base, decoder_sparse_step=2, mlp_only_layers=[1]))
    assert spec.moe_layers() == [3, 5]
    with pytest.raises(ValueError, match=r"layer 1 is a dense layer \(mlp_only_layers=\[1\], decoder_sparse_step=2\)"):
        spec.check_layer(1)
    with pytest.raises(ValueError, match="conflicting expert counts"):
        spec_from_config(dict(base, num_local_experts=16))
    with pytest.raises(ValueError, match="'num_experts_per_tok'"):
        spec_from_config({k: v for k, v in base.items() if k != "num_experts_per_tok"})
    with pytest.raises(ValueError, match=r"unsupported model_type 'llama'.*qwen3_moe, deepseek_v3, kimi_k2"):
        spec_from_config(dict(base, model_type="llama"))
    kimi = {"model_type": "kimi_k2", "n_routed_experts": 384, "num_experts_per_tok": 8, "hidden_size": 7168,
            "moe_intermediate_size": 2048, "num_hidden_layers": 61, "n_shared_experts": 1, "n_group": 1,
            "topk_group": 1, "routed_scaling_factor": 2.827, "first_k_dense_replace": 1, "norm_topk_prob": True}
    k = spec_from_config(kimi)
    assert k.moe_layers() == list(range(1, 61)) and k.shared_slot == 384 and k.shared_intermediate_size == 2048
    assert k.expert_tensor_names(5, 384)["down_proj"] == "model.layers.5.mlp.shared_experts.down_proj.weight"
    assert k.gate_tensor_names(5)["bias"] == "model.layers.5.mlp.gate.e_score_correction_bias"
    ds = spec_from_config(dict(kimi, model_type="deepseek_v3", n_routed_experts=256, n_group=8, topk_group=4,
                               first_k_dense_replace=3, moe_layer_freq=2))
    assert ds.moe_layers() == list(range(4, 61, 2))
    bare = spec_from_config({k2: v for k2, v in kimi.items()
                             if k2 not in ("norm_topk_prob", "routed_scaling_factor", "n_group", "topk_group",
                                           "first_k_dense_replace")})
    assert (bare.norm_topk_prob, bare.routed_scaling_factor) == (True, 1.0)
    assert (bare.n_group, bare.first_k_dense_replace) == (1, 0)
    with pytest.raises(ValueError, match="not divisible by n_group"):
        spec_from_config(dict(kimi, n_group=7))
    assert isinstance(spec, MoeSpec)


def test_load_gate_and_expert_errors(models):
    d = models["deepseek_v3_tiny"]
    with pytest.raises(ValueError, match=r"layer 0 is a dense layer \(first_k_dense_replace=1\)"):
        load_gate(d.ckpt, d.spec, 0)
    with pytest.raises(ValueError, match="layer 0 is a dense layer"):
        load_expert(d.ckpt, d.spec, 0, 0)
    with pytest.raises(ValueError, match="layer 3 is out of range"):
        load_gate(d.ckpt, d.spec, 3)
    with pytest.raises(ValueError, match=r"expert 17 is out of range: layer 1 has 16 routed experts \(0..15\)"):
        load_expert(d.ckpt, d.spec, 1, 17)
    q = models["qwen3_moe_tiny"]
    with pytest.raises(ValueError, match="expert 16 is out of range.*no shared expert"):
        load_expert(q.ckpt, q.spec, 0, 16)
    with pytest.raises(ValueError, match="expert -1"):
        load_expert(q.ckpt, q.spec, 0, -1)
    shared = d.experts(1)[16]
    assert (shared.d_model, shared.d_ff) == (256, 256)
    g = d.gate(1)
    assert g.correction_bias is not None and g.correction_bias.dtype == np.float32
    assert (g.top_k, g.n_group, g.topk_group, g.routed_scaling_factor, g.shared_slot) == (4, 4, 2, 2.5, 16)
    wrong = dataclasses.replace(d.spec, moe_intermediate_size=128)
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.experts.2.gate_proj.weight' has shape \(256, 256\)"):
        load_expert(d.ckpt, wrong, 1, 2)
