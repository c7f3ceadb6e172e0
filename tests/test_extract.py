"""Expert extraction per family (bf16, FP8 block scales, sharded, fused 3-D), routing of the
added families, quantized expert blobs (gguf-py decodes them bit for bit) and quant plans."""
from __future__ import annotations

import json

import numpy as np
import pytest

from moe import compute
from moe.ffn import ExpertWeights, expert_forward, moe_layer_forward
from moe.gating import Gate, route
from moe.quant import QuantizedMatrix, quantize
from prepare.checkpoint import Checkpoint
from moe.codec import CheckpointError, loads_safetensors
from prepare.layouts import load_expert, load_gate, source_dtype, spec_from_config
from prepare.quantplan import QuantPlanError, parse_quant_plan, quantize_expert
from tests.ckpt_util import make_checkpoint, write_checkpoint

VARIANTS = [
    ("qwen3_moe", {}), ("qwen3_moe", {"fused": True}), ("qwen2_moe", {}), ("qwen2_moe", {"shards": 3}),
    ("mixtral", {}), ("mixtral", {"fused": True, "shards": 2}), ("deepseek_v3", {"fp8": True, "shards": 3}),
    ("kimi_k2", {"fp8": True}), ("glm4_moe", {}), ("glm4_moe", {"fp8": True, "shards": 2}),
]


def _expected(values, spec, layer, e, fused):
    names = spec.expert_tensor_names(layer, e)
    if fused and e != spec.shared_slot:
        f = spec.moe_intermediate_size
        gu = values[f"model.layers.{layer}.mlp.experts.gate_up_proj"][e]
        return gu[:f], gu[f:], values[f"model.layers.{layer}.mlp.experts.down_proj"][e]
    return tuple(values[names[p]] for p in ("gate_proj", "up_proj", "down_proj"))


@pytest.mark.parametrize("family,kw", VARIANTS, ids=[f"{f}-{'-'.join(k) or 'plain'}" for f, k in VARIANTS])
def test_extraction_equals_direct_decode(tmp_path, family, kw):
    cfg, values = make_checkpoint(tmp_path / "ck", family, **kw)
    ckpt = Checkpoint(tmp_path / "ck")
    spec = spec_from_config(ckpt.config)
    assert spec.family == family
    for layer in spec.moe_layers():
        for e in range(spec.slots()):
            w = load_expert(ckpt, spec, layer, e)
            for got, want in zip((w.gate_proj, w.up_proj, w.down_proj),
                                 _expected(values, spec, layer, e, kw.get("fused"))):
                assert got.dtype == np.float32
                np.testing.assert_array_equal(got, want)
        g = load_gate(ckpt, spec, layer)
        assert g.family == family and g.weight.shape == (spec.num_experts, spec.hidden_size)
    assert source_dtype(ckpt, spec, spec.moe_layers()[0], 0) == ("f32" if kw.get("fp8") else "bf16")


def test_fp8_scale_lives_in_another_shard(tmp_path):
    make_checkpoint(tmp_path / "ck", "deepseek_v3", fp8=True, shards=3)
    ckpt = Checkpoint(tmp_path / "ck")
    name = "model.layers.1.mlp.experts.0.down_proj.weight"
    assert ckpt.info(name).dtype == "F8_E4M3"
    assert ckpt.info(name).shard != ckpt.info(name + "_scale_inv").shard


def test_fp8_decode_matches_ml_dtypes_on_all_codes():
    import ml_dtypes

    from moe.codec import FP8_E4M3_TABLE
    ref = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(FP8_E4M3_TABLE, ref)  # NaN positions compare equal too


def test_fp8_nan_codes_and_missing_scale_are_refused(tmp_path):
    cfg = {"model_type": "qwen3_moe"}
    write_checkpoint(tmp_path / "a", cfg, {"w.weight": ("F8_E4M3", (2, 4), bytes([0x7F]) + bytes(7)),
                                           "w.weight_scale_inv": np.ones((1, 1), np.float32),
                                           "v.weight": ("F8_E4M3", (2, 4), bytes(8))})
    ck = Checkpoint(tmp_path / "a")
    with pytest.raises(CheckpointError, match=r"'w\.weight' holds FP8 NaN codes"):
        ck.read("w.weight")
    with pytest.raises(CheckpointError, match=r"'v\.weight' has no 'v\.weight_scale_inv'"):
        ck.read("v.weight")


def test_non_finite_weights_refused_naming_the_tensor(tmp_path):
    cfg, values = make_checkpoint(tmp_path / "ck", "mixtral")
    ckpt = Checkpoint(tmp_path / "ck")
    data = bytearray((tmp_path / "ck" / "model.safetensors").read_bytes())
    name = "model.layers.0.block_sparse_moe.experts.1.w2.weight"
    _, off, _ = ckpt.location(name)
    data[off + 2:off + 4] = np.array([np.inf], ml_bf16()).tobytes()
    (tmp_path / "ck" / "model.safetensors").write_bytes(bytes(data))
    ckpt = Checkpoint(tmp_path / "ck")
    with pytest.raises(ValueError, match=rf"tensor '{name}' holds NaN or infinity \(first at index \(0, 1\)\)"):
        load_expert(ckpt, spec_from_config(cfg), 0, 1)


def ml_bf16():
    import ml_dtypes
    return ml_dtypes.bfloat16


def test_dense_layers_and_other_quant_methods_refused(tmp_path):
    cfg, _ = make_checkpoint(tmp_path / "ck", "glm4_moe")
    spec = spec_from_config(cfg)
    with pytest.raises(ValueError, match=r"layer 0 is a dense layer \(first_k_dense_replace=1\)"):
        load_expert(Checkpoint(tmp_path / "ck"), spec, 0, 0)
    with pytest.raises(ValueError, match="quant_method='compressed-tensors' is not supported"):
        spec_from_config(dict(cfg, quantization_config={"quant_method": "compressed-tensors"}))


def _softmax(z):
    z = z.astype(np.float64) - z.max(axis=1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(axis=1, keepdims=True)


def _ffn(w: ExpertWeights, x):
    x = x.astype(np.float64)
    g = x @ w.gate_proj.T.astype(np.float64)
    u = x @ w.up_proj.T.astype(np.float64)
    return (g / (1 + np.exp(-g)) * u) @ w.down_proj.T.astype(np.float64)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_softmax_families_forward_matches_independent_reference(tmp_path, family):
    cfg, _ = make_checkpoint(tmp_path / "ck", family, experts=8, top_k=2)
    ckpt = Checkpoint(tmp_path / "ck")
    spec = spec_from_config(cfg)
    gate = load_gate(ckpt, spec, 1)
    gate2 = Gate.from_blob(gate.to_blob())
    experts = {e: load_expert(ckpt, spec, 1, e) for e in range(spec.slots())}
    x = np.random.default_rng(3).standard_normal((20, spec.hidden_size)).astype(np.float32)
    out, routing = moe_layer_forward(gate2, experts, x)
    p = _softmax(x.astype(np.float64) @ gate.weight.T.astype(np.float64))
    ref = np.zeros((20, spec.hidden_size))
    for t in range(20):
        sel = np.argsort(-p[t], kind="stable")[:2]
        w = p[t, sel] / (p[t, sel].sum() if spec.norm_topk_prob else 1.0)
        for e, wt in zip(sel, w):
            ref[t] += wt * _ffn(experts[int(e)], x[t:t + 1])[0]
        if family == "qwen2_moe":
            s = 1 / (1 + np.exp(-(x[t].astype(np.float64) @ gate.shared_gate[0].astype(np.float64))))
            ref[t] += s * _ffn(experts[spec.num_experts], x[t:t + 1])[0]
    assert np.abs(out - ref).max() / np.abs(ref).max() < 1e-5
    assert (routing.shared_slot is not None) == (family == "qwen2_moe")
    if family == "qwen2_moe":
        assert not np.all(routing.weights[:, -1] == 1.0)  # the sigmoid gate, not a fixed 1.0
    assert spec.norm_topk_prob is (family == "mixtral")


def test_glm4_moe_routes_like_deepseek(tmp_path):
    cfg, _ = make_checkpoint(tmp_path / "ck", "glm4_moe", experts=8)
    ckpt = Checkpoint(tmp_path / "ck")
    spec = spec_from_config(cfg)
    g = load_gate(ckpt, spec, 1)
    ds = Gate.from_blob(g.to_blob())
    ds.family = "deepseek_v3"
    x = np.random.default_rng(1).standard_normal((10, spec.hidden_size)).astype(np.float32)
    a, b = route(g, x), route(ds, x)
    np.testing.assert_array_equal(a.expert_ids, b.expert_ids)
    np.testing.assert_array_equal(a.weights, b.weights)


# -- quantized blobs ----------------------------------------------------------------------

def _gguf():
    gguf = pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as G
    return gguf.quants, {"q8_0": G.Q8_0, "q4_k": G.Q4_K, "q6_k": G.Q6_K}


@pytest.mark.parametrize("preset", ["q4_k_m", "q8_0", "q6_k"])
def test_gguf_py_decodes_our_blobs_bit_identically(preset):
    gq, types = _gguf()
    rng = np.random.default_rng(7)
    w = ExpertWeights(rng.standard_normal((256, 512)).astype(np.float32) * 0.05,
                      rng.standard_normal((256, 512)).astype(np.float32) * 0.05,
                      rng.standard_normal((512, 256)).astype(np.float32) * 0.05)
    q, fallbacks = quantize_expert(w, parse_quant_plan(preset))
    assert fallbacks == {}
    blob = q.to_blob("bf16")
    tensors, meta = loads_safetensors(blob)
    back = ExpertWeights.from_blob(blob)
    for p in ("gate_proj", "up_proj", "down_proj"):
        qt = meta[f"{p}.weight.quant"]
        rows, cols = map(int, meta[f"{p}.weight.shape"].split(","))
        raw = np.frombuffer(tensors[f"{p}.weight"].data, np.uint8).reshape(rows, -1)
        assert tensors[f"{p}.weight"].dtype == "U8" and len(tensors[f"{p}.weight"].shape) == 1
        np.testing.assert_array_equal(raw, quantize(getattr(w, p), qt))  # the reference bytes
        ours = getattr(back, p).dequantize()
        theirs = gq.dequantize(raw, types[qt])
        assert theirs.shape == (rows, cols)
        np.testing.assert_array_equal(ours.view(np.uint32), theirs.astype(np.float32).view(np.uint32))
    x = rng.standard_normal((5, 512)).astype(np.float32)
    # Through the compute seam: the native kernels quantize activations to 8 bits as ggml does (~2% of
    # the output's scale over three products; on x86 for every batch), the numba kernel reads the blocks
    # (same values, f32 sums in another order); above their batches a bit-identical decode and the dense product.
    ref = expert_forward(back.dense(), x)
    tol = 5e-2 if compute.backend().describe().get("native_kernels") else 1e-5
    np.testing.assert_allclose(expert_forward(back, x), ref, rtol=0, atol=tol * np.abs(ref).max())
    limit = compute.backend().describe().get("native_batch", 0)
    if limit is None:  # the x86 native kernels run every batch: a row is the same in any batch
        xb = rng.standard_normal((67, 512)).astype(np.float32)
        np.testing.assert_array_equal(expert_forward(back, xb)[60:], expert_forward(back, xb[60:]))
    else:  # above the native kernel's batches: decoded, the dense product's bits
        xb = rng.standard_normal((max(64, limit + 1), 512)).astype(np.float32)
        np.testing.assert_array_equal(expert_forward(back, xb), expert_forward(back.dense(), xb))
    assert ExpertWeights.from_blob(blob).to_blob("bf16") == blob  # canonical


def test_fallback_is_recorded_and_keeps_the_source_dtype():
    rng = np.random.default_rng(2)
    w = ExpertWeights(*(rng.standard_normal(s).astype(np.float32) for s in ((80, 256), (80, 256), (256, 80))))
    q, fb = quantize_expert(w, parse_quant_plan("q4_k_m"))
    assert set(fb) == {"down_proj.weight"}
    assert "q6_k -> dense (source dtype): row length 80" in fb["down_proj.weight"]
    blob = q.to_blob("bf16", {f"{k}.fallback": v for k, v in fb.items()})
    tensors, meta = loads_safetensors(blob)
    assert tensors["down_proj.weight"].dtype == "BF16"  # not an F32 blow-up
    assert meta["down_proj.weight.fallback"] == fb["down_proj.weight"]
    assert ExpertWeights.from_blob(blob).quant_kinds() == {"gate_proj": "q4_k", "up_proj": "q4_k", "down_proj": "f32"}
    q2, fb2 = quantize_expert(ExpertWeights(*(rng.standard_normal(s).astype(np.float32)
                                              for s in ((64, 1408), (64, 1408), (1408, 64)))),
                              parse_quant_plan({"gate": "q4_k", "down": "q8_0"}))
    assert fb2 == {"gate_proj.weight": "q4_k -> q8_0: row length 1408 is not a multiple of the q4_k block size 256"}
    assert q2.quant_kinds()["gate_proj"] == "q8_0" and q2.quant_kinds()["up_proj"] == "f32"


def test_quant_plan_parsing():
    assert parse_quant_plan("Q4_K_M").kinds() == {"gate_proj": "q4_k", "up_proj": "q4_k", "down_proj": "q6_k"}
    assert parse_quant_plan(None) is None and parse_quant_plan("none") is None
    assert parse_quant_plan('{"gate":"q8_0","up":"q8_0","down":"q8_0"}').label == "q8_0"
    assert parse_quant_plan({"down": "q6_k"}).to_json() == {"down": "q6_k"}
    with pytest.raises(QuantPlanError, match="unknown preset 'q3_k'"):
        parse_quant_plan("q3_k")
    with pytest.raises(QuantPlanError, match=r"quant\.middle: unknown projection"):
        parse_quant_plan({"middle": "q8_0"})
    with pytest.raises(QuantPlanError, match=r"quant\.up: unsupported type 'q5_k'"):
        parse_quant_plan({"up": "q5_k"})
    with pytest.raises(QuantPlanError, match="not valid JSON"):
        parse_quant_plan("{gate")


def test_bad_quantized_blobs_are_refused():
    w = ExpertWeights(*(np.ones(s, np.float32) for s in ((32, 256), (32, 256), (256, 32))))
    q, _ = quantize_expert(w, parse_quant_plan({"gate": "q8_0"}))
    blob = q.to_blob()
    tensors, meta = loads_safetensors(blob)
    from moe.codec import dumps_safetensors
    raw = {k: (t.dtype, t.shape, bytes(t.data)) for k, t in tensors.items()}
    with pytest.raises(ValueError, match="unsupported quant 'q2_k'"):
        ExpertWeights.from_blob(dumps_safetensors(raw, dict(meta, **{"gate_proj.weight.quant": "q2_k"})))
    with pytest.raises(ValueError, match=r"'gate_proj.weight.shape' must be \"rows,cols\""):
        ExpertWeights.from_blob(dumps_safetensors(raw, dict(meta, **{"gate_proj.weight.shape": "32"})))
    with pytest.raises(ValueError, match="needs .* bytes"):
        ExpertWeights.from_blob(dumps_safetensors(raw, dict(meta, **{"gate_proj.weight.shape": "16,256"})))
    inf_blocks = bytearray(raw["gate_proj.weight"][2])
    inf_blocks[0:2] = np.array([np.inf], "<f2").tobytes()
    bad = dict(raw, **{"gate_proj.weight": ("U8", raw["gate_proj.weight"][1], bytes(inf_blocks))})
    with pytest.raises(ValueError, match="NaN or infinite fp16 block scale"):
        ExpertWeights.from_blob(dumps_safetensors(bad, meta))
    no_meta = {k: v for k, v in meta.items() if not k.startswith("gate_proj")}
    with pytest.raises(ValueError, match="is U8 but has no 'gate_proj.weight.quant'"):
        ExpertWeights.from_blob(dumps_safetensors(raw, no_meta))
    assert isinstance(ExpertWeights.from_blob(blob).gate_proj, QuantizedMatrix)
    assert json.loads(json.dumps(meta))  # metadata is plain strings


def test_gpt_oss_mxfp4_extraction_biases_blob_and_fallbacks(tmp_path):
    from moe.codec import decode_mxfp4
    from tests.ckpt_util import make_gpt_oss

    cfg, values = make_gpt_oss(tmp_path / "oss", experts=3, hidden=96, inter=64)
    ckpt = Checkpoint(tmp_path / "oss")
    spec = spec_from_config(ckpt.config)
    assert spec.moe_layers() == [0, 1] and spec.num_experts == 3 and source_dtype(ckpt, spec, 1, 2) == "f32"
    w = load_expert(ckpt, spec, 1, 2)
    gu = values["model.layers.1.mlp.experts.gate_up_proj"][2].T  # [2F, H]
    np.testing.assert_array_equal(w.gate_proj, gu[0::2])
    np.testing.assert_array_equal(w.up_proj, gu[1::2])
    np.testing.assert_array_equal(w.down_proj, values["model.layers.1.mlp.experts.down_proj"][2].T)
    np.testing.assert_array_equal(w.up_bias, values["model.layers.1.mlp.experts.gate_up_proj_bias"][2][1::2])
    assert w.activation == "swiglu_oss"
    g = load_gate(ckpt, spec, 1)
    assert g.family == "gpt_oss" and g.logit_bias.shape == (3,)
    assert Gate.from_blob(g.to_blob()).logit_bias.tolist() == g.logit_bias.tolist()
    q, fb = quantize_expert(w, parse_quant_plan("q4_k_m"))
    assert set(fb) == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}  # 96 and 64 columns: all Q8_0
    assert q.quant_kinds() == {"gate_proj": "q8_0", "up_proj": "q8_0", "down_proj": "q8_0"}
    back = ExpertWeights.from_blob(q.to_blob("f32", {f"{k}.fallback": v for k, v in fb.items()}))
    assert back.activation == "swiglu_oss" and back.swiglu_limit == 7.0
    np.testing.assert_array_equal(back.down_bias, w.down_bias)
    x = np.random.default_rng(0).standard_normal((4, 96)).astype(np.float32)
    np.testing.assert_array_equal(expert_forward(back, x), expert_forward(q, x))
    with pytest.raises(CheckpointError, match="MXFP4 scale 255 is NaN"):
        decode_mxfp4(np.zeros((1, 1, 16), np.uint8), np.full((1, 1), 255, np.uint8), "t")
