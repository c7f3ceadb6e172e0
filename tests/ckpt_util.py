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

from prepare.checkpoint import dumps_safetensors

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
