"""Synthetic Hugging Face checkpoints for extraction tests (bf16 / FP8 / sharded / fused).

``make_checkpoint`` writes ``config.json`` and safetensors shards with the Hub's tensor names
for a family and returns the float32 values each tensor decodes to (what a direct decode
gives), so tests compare extraction against them.
"""
from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np

from moe.codec import dumps_safetensors

BF16 = ml_dtypes.bfloat16
FP8 = ml_dtypes.float8_e4m3fn


def bf16_tensor(x: np.ndarray):
    """(triple for dumps_safetensors, float32 decode) of ``x`` rounded to bf16."""
    b = np.asarray(x, np.float32).astype(BF16)
    return ("BF16", b.shape, b.tobytes()), b.astype(np.float32)


def fp8_tensor(x: np.ndarray, block=(128, 128)):
    """(weight triple, scale array f32, float32 decode) of ``x`` as FP8 e4m3 with block scales."""
    r, c = x.shape
    bi, bj = block
    nb = (-(-r // bi), -(-c // bj))
    scale = np.empty(nb, np.float32)
    for i in range(nb[0]):
        for j in range(nb[1]):
            blk = x[i * bi:(i + 1) * bi, j * bj:(j + 1) * bj]
            scale[i, j] = max(float(np.abs(blk).max()), 1e-12) / 448.0
    full = np.repeat(np.repeat(scale, bi, 0), bj, 1)[:r, :c]
    q = (x / full).astype(FP8)
    decoded = q.astype(np.float32) * full
    return ("F8_E4M3", q.shape, q.view(np.uint8).tobytes()), scale, decoded.astype(np.float32)


def write_checkpoint(path: Path, config: dict, tensors: dict, shards: int = 1) -> None:
    """Write ``tensors`` (name → array or triple) as ``shards`` files plus an index when > 1."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    if shards == 1:
        (path / "model.safetensors").write_bytes(dumps_safetensors(tensors))
        return
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        (path / fname).write_bytes(dumps_safetensors({n: tensors[n] for n in part}))
        weight_map.update({n: fname for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def make_checkpoint(path: Path, family: str, *, experts=4, hidden=64, inter=32, layers=2, top_k=2,
                    fp8=False, fused=False, shards=1, shared_inter=48, seed=0, fp8_block=(32, 32)):
    """A random checkpoint of ``family``; returns ``(config, values)`` where ``values`` maps
    every tensor name to the float32 a direct decode gives."""
    rng = np.random.default_rng(seed)
    cfg = {"model_type": family, "hidden_size": hidden, "num_hidden_layers": layers,
           "num_experts_per_tok": top_k}
    if family == "mixtral":
        cfg.update(num_local_experts=experts, intermediate_size=inter)
    elif family in ("qwen3_moe", "qwen2_moe"):
        cfg.update(num_experts=experts, moe_intermediate_size=inter, norm_topk_prob=family == "qwen3_moe")
        if family == "qwen2_moe":
            cfg["shared_expert_intermediate_size"] = shared_inter
    else:
        cfg.update(n_routed_experts=experts, moe_intermediate_size=inter, n_shared_experts=1,
                   first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=1.5,
                   norm_topk_prob=True)
    if fp8:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": list(fp8_block)}
    tensors, values = {}, {}

    def put(name, arr, allow_fp8=True):
        arr = np.asarray(arr, np.float32)
        if fp8 and allow_fp8 and arr.ndim == 2 and arr.shape[0] > 1:
            trip, scale, dec = fp8_tensor(arr, fp8_block)
            tensors[name], tensors[name + "_scale_inv"] = trip, scale
            values[name], values[name + "_scale_inv"] = dec, scale
        else:
            trip, dec = bf16_tensor(arr)
            tensors[name], values[name] = trip, dec

    def mat(r, c):
        return rng.standard_normal((r, c)).astype(np.float32) * 0.1

    moe_layers = range(1, layers) if family in ("deepseek_v3", "kimi_k2", "glm4_moe") else range(layers)
    for layer in moe_layers:
        pre = f"model.layers.{layer}." + ("block_sparse_moe" if family == "mixtral" and not fused else "mlp")
        put(f"{pre}.gate.weight", mat(experts, hidden), allow_fp8=False)
        if family in ("deepseek_v3", "kimi_k2", "glm4_moe"):
            b = rng.standard_normal(experts).astype(np.float32) * 0.01
            tensors[f"{pre}.gate.e_score_correction_bias"] = b
            values[f"{pre}.gate.e_score_correction_bias"] = b
            for p, shp in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
                put(f"{pre}.shared_experts.{p}.weight", mat(*shp))
        if family == "qwen2_moe":
            put(f"{pre}.shared_expert_gate.weight", mat(1, hidden), allow_fp8=False)
            for p, shp in (("gate_proj", (shared_inter, hidden)), ("up_proj", (shared_inter, hidden)),
                           ("down_proj", (hidden, shared_inter))):
                put(f"{pre}.shared_expert.{p}.weight", mat(*shp))
        if fused:
            gu = rng.standard_normal((experts, 2 * inter, hidden)).astype(np.float32) * 0.1
            dn = rng.standard_normal((experts, hidden, inter)).astype(np.float32) * 0.1
            for name, arr in ((f"{pre}.experts.gate_up_proj", gu), (f"{pre}.experts.down_proj", dn)):
                trip, dec = bf16_tensor(arr)
                tensors[name], values[name] = trip, dec
            continue
        names = ({"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"} if family == "mixtral"
                 else {p: p for p in ("gate_proj", "up_proj", "down_proj")})
        for e in range(experts):
            for p, shp in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
                put(f"{pre}.experts.{e}.{names[p]}.weight", mat(*shp))
    write_checkpoint(path, cfg, tensors, shards)
    return cfg, values


def expert_values(cfg: dict, values: dict, layer: int, e: int, fused: bool = False):
    """(gate, up, down) float32 of expert ``e`` (``E`` = the shared expert) from ``values``."""
    fam = cfg["model_type"]
    n = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    if e == n:
        sh = "shared_expert" if fam == "qwen2_moe" else "shared_experts"
        return tuple(values[f"model.layers.{layer}.mlp.{sh}.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj"))
    if fused:
        f = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        gu = values[f"model.layers.{layer}.mlp.experts.gate_up_proj"][e]
        return gu[:f], gu[f:], values[f"model.layers.{layer}.mlp.experts.down_proj"][e]
    if fam == "mixtral":
        pre = f"model.layers.{layer}.block_sparse_moe.experts.{e}"
        return tuple(values[f"{pre}.{w}.weight"] for w in ("w1", "w3", "w2"))
    pre = f"model.layers.{layer}.mlp.experts.{e}"
    return tuple(values[f"{pre}.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj"))


def write_reference(path: Path, cfg: dict, values: dict, fused: bool = False, tokens: int = 16, seed: int = 5):
    """Write ``reference.safetensors`` / ``reference.json`` (docs/DESIGN.md §4 bundle format) beside a
    checkpoint made by ``make_checkpoint``, computed per token in float64 from the decoded
    values with a second, loop-based reading of each family's MoE block (HF modeling code for
    qwen2_moe / mixtral / glm4_moe; −inf group masking). Returns the MoE layers."""
    from safetensors.numpy import save_file

    fam = cfg["model_type"]
    rng = np.random.default_rng(seed)
    n = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    k = cfg["num_experts_per_tok"]
    sigmoid_family = fam in ("deepseek_v3", "kimi_k2", "glm4_moe")
    layers = list(range(1 if sigmoid_family else 0, cfg["num_hidden_layers"]))

    def ffn(w, x):
        g, u, d = (a.astype(np.float64) for a in w)
        h = g @ x
        return d @ (h / (1 + np.exp(-h)) * (u @ x))

    ref = {}
    for layer in layers:
        pre = f"model.layers.{layer}." + ("block_sparse_moe" if fam == "mixtral" and not fused else "mlp")
        W = values[f"{pre}.gate.weight"].astype(np.float64)
        X = rng.standard_normal((tokens, cfg["hidden_size"])).astype(np.float32)
        out = np.zeros((tokens, cfg["hidden_size"]))
        ids, wts = [], []
        for t in range(tokens):
            x = X[t].astype(np.float64)
            logits = W @ x
            if sigmoid_family:
                s = 1 / (1 + np.exp(-logits))
                b = s + values[f"{pre}.gate.e_score_correction_bias"]
                per = n // cfg["n_group"]
                gs = [sum(sorted(b[g * per:(g + 1) * per])[-2:]) for g in range(cfg["n_group"])]
                keep = sorted(range(cfg["n_group"]), key=lambda g: (-gs[g], g))[:cfg["topk_group"]]
                masked = [b[e] if e // per in keep else -np.inf for e in range(n)]
                sel = sorted(sorted(range(n), key=lambda e: (-masked[e], e))[:k])
                w = np.array([s[e] for e in sel])
                w = w / (w.sum() + 1e-20) * cfg["routed_scaling_factor"]
            else:
                p = np.exp(logits - logits.max())
                p /= p.sum()
                sel = sorted(sorted(range(n), key=lambda e: (-p[e], e))[:k])
                w = np.array([p[e] for e in sel])
                if fam == "mixtral" or cfg.get("norm_topk_prob"):
                    w = w / w.sum()
            for e, we in zip(sel, w):
                out[t] += we * ffn(expert_values(cfg, values, layer, e, fused), x)
            if sigmoid_family:
                out[t] += ffn(expert_values(cfg, values, layer, n), x)
            elif fam == "qwen2_moe":
                sg = 1 / (1 + np.exp(-(values[f"{pre}.shared_expert_gate.weight"][0].astype(np.float64) @ x)))
                out[t] += sg * ffn(expert_values(cfg, values, layer, n), x)
            ids.append(sel)
            wts.append(w)
        ref[f"layer{layer}.hidden_states"] = X
        ref[f"layer{layer}.output"] = out.astype(np.float32)
        ref[f"layer{layer}.topk_ids"] = np.array(ids, dtype=np.int64)
        ref[f"layer{layer}.topk_weights"] = np.array(wts, dtype=np.float32)
    save_file(ref, str(path / "reference.safetensors"))
    (path / "reference.json").write_text(json.dumps({"family": fam, "moe_layers": layers, "config": cfg,
                                                     "made_with": "tests/ckpt_util.py"}))
    return layers


def _e2m1(code: np.ndarray) -> np.ndarray:
    """E2M1 value of 4-bit codes from the format itself (sign bit 3, exponent bits 2..1 with
    bias 1, mantissa bit 0; exponent 0 is subnormal m·0.5) — independent of FP4_VALUES."""
    sign = np.where(code & 8, -1.0, 1.0)
    e, m = (code >> 1) & 3, code & 1
    return sign * np.where(e == 0, m * 0.5, (1 + m / 2) * 2.0 ** (e - 1.0))


def make_gpt_oss(path: Path, *, experts=4, hidden=64, inter=64, layers=2, top_k=2, mxfp4=True, seed=0):
    """A random gpt-oss checkpoint (MXFP4 expert blocks, or the dequantized bf16 HF layout);
    returns ``(config, values)`` with the experts in HF orientation: ``...gate_up_proj``
    ``[E, H, 2F]`` and ``...down_proj`` ``[E, F, H]`` (float32), biases, router."""
    rng = np.random.default_rng(seed)
    cfg = {"model_type": "gpt_oss", "hidden_size": hidden, "intermediate_size": inter, "num_local_experts": experts,
           "num_experts_per_tok": top_k, "num_hidden_layers": layers, "swiglu_limit": 7.0}
    if mxfp4:
        cfg["quantization_config"] = {"quant_method": "mxfp4"}
    tensors, values = {}, {}

    def bf(name, arr):
        trip, dec = bf16_tensor(arr)
        tensors[name], values[name] = trip, dec

    for layer in range(layers):
        pre = f"model.layers.{layer}.mlp"
        bf(f"{pre}.router.weight", rng.standard_normal((experts, hidden)).astype(np.float32) * 0.2)
        bf(f"{pre}.router.bias", rng.standard_normal(experts).astype(np.float32) * 0.1)
        bf(f"{pre}.experts.gate_up_proj_bias", rng.standard_normal((experts, 2 * inter)).astype(np.float32) * 0.1)
        bf(f"{pre}.experts.down_proj_bias", rng.standard_normal((experts, hidden)).astype(np.float32) * 0.1)
        for kind, (rows, cols) in (("gate_up_proj", (2 * inter, hidden)), ("down_proj", (hidden, inter))):
            if mxfp4:
                blocks = rng.integers(0, 256, (experts, rows, cols // 32, 16), dtype=np.uint8)
                scales = rng.integers(120, 126, (experts, rows, cols // 32), dtype=np.uint8)
                tensors[f"{pre}.experts.{kind}_blocks"] = blocks
                tensors[f"{pre}.experts.{kind}_scales"] = scales
                codes = np.stack((blocks & 15, blocks >> 4), axis=-1).reshape(experts, rows, cols)
                dense = _e2m1(codes) * 2.0 ** (np.repeat(scales, 32, axis=2).astype(np.float64) - 127)
                values[f"{pre}.experts.{kind}"] = dense.astype(np.float32).transpose(0, 2, 1)  # HF [E, in, out]
            else:
                bf(f"{pre}.experts.{kind}",
                   rng.standard_normal((experts, cols, rows)).astype(np.float32) * 0.1)
    write_checkpoint(path, cfg, tensors)
    return cfg, values


def write_gpt_oss_reference(path: Path, cfg: dict, values: dict, tokens: int = 16, seed: int = 5):
    """Reference bundle for ``make_gpt_oss`` computed per token in float64 from HF's
    ``GptOssTopKRouter`` / ``GptOssExperts`` (top-k of biased logits, softmax over k;
    interleaved gate/up columns, clamped SwiGLU with alpha 1.702, biases). Returns the layers."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    k, lim = cfg["num_experts_per_tok"], cfg["swiglu_limit"]
    layers = list(range(cfg["num_hidden_layers"]))
    ref = {}
    for layer in layers:
        pre = f"model.layers.{layer}.mlp"
        W, b = values[f"{pre}.router.weight"].astype(np.float64), values[f"{pre}.router.bias"]
        X = rng.standard_normal((tokens, cfg["hidden_size"])).astype(np.float32)
        out = np.zeros(X.shape)
        ids, wts = [], []
        for t in range(tokens):
            x = X[t].astype(np.float64)
            logits = W @ x + b
            top = sorted(range(len(logits)), key=lambda e: (-logits[e], e))[:k]
            p = np.exp(logits[top] - logits[top].max())
            p /= p.sum()
            for e, we in zip(top, p):
                gu = x @ values[f"{pre}.experts.gate_up_proj"][e].astype(np.float64) + \
                    values[f"{pre}.experts.gate_up_proj_bias"][e]
                gate, up = np.minimum(gu[0::2], lim), np.clip(gu[1::2], -lim, lim)
                h = (up + 1) * gate / (1 + np.exp(-1.702 * gate))
                out[t] += we * (h @ values[f"{pre}.experts.down_proj"][e].astype(np.float64) +
                                values[f"{pre}.experts.down_proj_bias"][e])
            order = np.argsort(top)
            ids.append([top[i] for i in order])
            wts.append(p[order])
        ref[f"layer{layer}.hidden_states"] = X
        ref[f"layer{layer}.output"] = out.astype(np.float32)
        ref[f"layer{layer}.topk_ids"] = np.array(ids, dtype=np.int64)
        ref[f"layer{layer}.topk_weights"] = np.array(wts, dtype=np.float32)
    save_file(ref, str(path / "reference.safetensors"))
    (path / "reference.json").write_text(json.dumps({"family": "gpt_oss", "moe_layers": layers, "config": cfg,
                                                     "made_with": "tests/ckpt_util.py"}))
    return layers
