"""Synthetic HF-style MoE checkpoints with reference outputs from an independent implementation.

The reference here is written per token with plain loops (no code shared with holders/), so
``verify_forward`` on these checkpoints checks our routing and combine against a second
reading of the model math (HF modeling_qwen3_moe.py / modeling_deepseek_v3.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def _silu(x):
    return x / (np.float32(1) + np.exp(-x))


def _ffn(x, g, u, d):
    return d @ (_silu(g @ x) * (u @ x))


def _route_qwen(x, W, k, norm):
    logits = W @ x
    p = np.exp(logits - logits.max())
    p = p / p.sum()
    sel = sorted(sorted(range(len(p)), key=lambda e: (-p[e], e))[:k])
    w = np.array([p[e] for e in sel], dtype=np.float32)
    if norm:
        w = w / w.sum()
    return sel, w


def _route_deepseek(x, W, bias, k, n_group, topk_group, norm, scale):
    s = np.float32(1) / (np.float32(1) + np.exp(-(W @ x)))
    sc = s + bias
    E = len(s)
    per = E // n_group
    group_score = [sum(sorted(sc[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(n_group)]
    keep = sorted(range(n_group), key=lambda g: (-group_score[g], g))[:topk_group]
    masked = [sc[e] if e // per in keep else -np.inf for e in range(E)]
    sel = sorted(sorted(range(E), key=lambda e: (-masked[e], e))[:k])
    w = np.array([s[e] for e in sel], dtype=np.float32)
    if norm:
        w = w / (w.sum() + np.float32(1e-20))
    return sel, (w * np.float32(scale)).astype(np.float32)


def make_checkpoint(root: Path, family: str, *, hidden=64, d_ff=32, experts=8, top_k=2, layers=2, n_group=1,
                    topk_group=1, norm_topk_prob=True, n_shared=0, scale=1.0, dtype="f32", sharded=False,
                    tokens=24, seed=0) -> Path:
    """Write config.json, weights and reference.safetensors/json under ``root``; returns ``root``."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    npdt = {"f32": np.float32, "f16": np.float16}[dtype]
    tensors: dict[str, np.ndarray] = {}
    first_dense = 1 if family == "deepseek_v3" else 0
    moe_layers = list(range(first_dense, layers))

    def mat(r, c, s=0.08):
        return (rng.standard_normal((r, c)) * s).astype(npdt)

    for L in moe_layers:
        p = f"model.layers.{L}.mlp"
        tensors[f"{p}.gate.weight"] = mat(experts, hidden, 0.3)
        if family == "deepseek_v3":
            tensors[f"{p}.gate.e_score_correction_bias"] = (rng.standard_normal(experts) * 0.1).astype(np.float32)
        for e in range(experts):
            tensors[f"{p}.experts.{e}.gate_proj.weight"] = mat(d_ff, hidden)
            tensors[f"{p}.experts.{e}.up_proj.weight"] = mat(d_ff, hidden)
            tensors[f"{p}.experts.{e}.down_proj.weight"] = mat(hidden, d_ff)
        if n_shared:
            tensors[f"{p}.shared_experts.gate_proj.weight"] = mat(d_ff * n_shared, hidden)
            tensors[f"{p}.shared_experts.up_proj.weight"] = mat(d_ff * n_shared, hidden)
            tensors[f"{p}.shared_experts.down_proj.weight"] = mat(hidden, d_ff * n_shared)
    if family == "qwen3_moe":
        config = {"model_type": "qwen3_moe", "hidden_size": hidden, "moe_intermediate_size": d_ff,
                  "num_experts": experts, "num_experts_per_tok": top_k, "norm_topk_prob": norm_topk_prob,
                  "num_hidden_layers": layers, "decoder_sparse_step": 1, "mlp_only_layers": []}
    else:
        config = {"model_type": "deepseek_v3", "hidden_size": hidden, "moe_intermediate_size": d_ff,
                  "n_routed_experts": experts, "num_experts_per_tok": top_k, "norm_topk_prob": norm_topk_prob,
                  "num_hidden_layers": layers, "first_k_dense_replace": first_dense, "n_group": n_group,
                  "topk_group": topk_group, "n_shared_experts": n_shared, "routed_scaling_factor": scale}
    (root / "config.json").write_text(json.dumps(config, indent=1))
    if sharded:
        names = sorted(tensors)
        half = {n: tensors[n] for n in names[: len(names) // 2]}
        rest = {n: tensors[n] for n in names[len(names) // 2:]}
        files = {"model-00001-of-00002.safetensors": half, "model-00002-of-00002.safetensors": rest}
        for fname, part in files.items():
            save_file(part, str(root / fname))
        (root / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {n: f for f, part in files.items() for n in part}}))
    else:
        save_file(tensors, str(root / "model.safetensors"))

    ref = {}
    f32 = {k: v.astype(np.float32) for k, v in tensors.items()}
    for L in moe_layers:
        p = f"model.layers.{L}.mlp"
        X = rng.standard_normal((tokens, hidden)).astype(np.float32)
        out = np.zeros_like(X)
        ids, wts = [], []
        for t in range(tokens):
            x = X[t]
            if family == "qwen3_moe":
                sel, w = _route_qwen(x, f32[f"{p}.gate.weight"], top_k, norm_topk_prob)
            else:
                sel, w = _route_deepseek(x, f32[f"{p}.gate.weight"], f32[f"{p}.gate.e_score_correction_bias"], top_k,
                                         n_group, topk_group, norm_topk_prob, scale)
            acc = np.zeros(hidden, dtype=np.float32)
            for e, we in zip(sel, w):
                acc += we * _ffn(x, f32[f"{p}.experts.{e}.gate_proj.weight"], f32[f"{p}.experts.{e}.up_proj.weight"],
                                 f32[f"{p}.experts.{e}.down_proj.weight"])
            if n_shared:
                acc += _ffn(x, f32[f"{p}.shared_experts.gate_proj.weight"], f32[f"{p}.shared_experts.up_proj.weight"],
                            f32[f"{p}.shared_experts.down_proj.weight"])
            out[t] = acc
            ids.append(sel)
            wts.append(w)
        ref[f"layer{L}.hidden_states"] = X
        ref[f"layer{L}.output"] = out
        ref[f"layer{L}.topk_ids"] = np.array(ids, dtype=np.int64)
        ref[f"layer{L}.topk_weights"] = np.array(wts, dtype=np.float32)
    save_file(ref, str(root / "reference.safetensors"))
    (root / "reference.json").write_text(json.dumps({"family": family, "moe_layers": moe_layers, "config": config,
                                                     "tokens": tokens, "made_with": "tests/synth.py"}))
    return root
