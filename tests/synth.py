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


def make_mla_model(root: Path, *, family: str = "kimi_k2", experts: int = 48, top_k: int = 8, n_group: int = 1,
                   topk_group: int = 1, n_shared: int = 1, scale: float = 2.827, layers: int = 3,
                   seed: int = 0) -> Path:
    """A whole random MLA model (DeepSeek-V3 / Kimi-K2 architecture) under ``root``: bf16 weights
    with the Hub's names and ``tests/fixtures/deepseek_v3_tiny``'s shapes (H 256, q_lora 64,
    kv_lora 32, 4 heads, expert FFN 256, vocab 256, std 0.05 as transformers' init there),
    but ``experts`` routed experts, ``top_k``, groups and ``n_shared`` shared experts; layer 0
    dense. Writes ``reference.safetensors`` (tests/ckpt_util.py's float64 per-token MoE
    reference) and ``generation_reference.safetensors`` (16 prompt ids, their logits and 8
    greedy tokens from the in-process float32 forward: backbone and ``moe_layer_forward``,
    every expert local). Kimi K2 itself: 384 experts, top-8, one group, one shared expert,
    scale 2.827. Returns ``root``."""
    from safetensors.numpy import save_file as _save

    from moe.backbone import build_backbone
    from moe.backbone.decode import Generator, Sampling
    from moe.ffn import ExpertWeights, expert_forward, moe_layer_forward
    from prepare.backbone import backbone_groups
    from prepare.checkpoint import Checkpoint
    from prepare.layouts import load_expert, load_gate, spec_from_config
    from tests.ckpt_util import bf16_tensor, write_checkpoint, write_reference

    tiny = Path(__file__).resolve().parent / "fixtures" / "deepseek_v3_tiny"
    cfg = json.loads((tiny / "config.json").read_text())
    cfg.update(model_type=family, n_routed_experts=experts, num_experts_per_tok=top_k, n_group=n_group,
               topk_group=topk_group, n_shared_experts=n_shared, routed_scaling_factor=scale,
               num_hidden_layers=layers, first_k_dense_replace=1, num_nextn_predict_layers=0)
    H, F, R = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["kv_lora_rank"]
    heads, qk, rope, vd = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"],
                           cfg["qk_rope_head_dim"], cfg["v_head_dim"])
    rng = np.random.default_rng(seed)
    tensors, values = {}, {}

    def put(name, shape, std=0.05, mean=0.0):
        trip, dec = bf16_tensor(mean + rng.standard_normal(shape) * std)
        tensors[name], values[name] = trip, dec

    put("model.embed_tokens.weight", (cfg["vocab_size"], H))
    put("lm_head.weight", (cfg["vocab_size"], H))
    put("model.norm.weight", (H,), 0.1, 1.0)
    for L in range(layers):
        p = f"model.layers.{L}."
        put(p + "input_layernorm.weight", (H,), 0.1, 1.0)
        put(p + "post_attention_layernorm.weight", (H,), 0.1, 1.0)
        a = p + "self_attn."
        put(a + "q_a_proj.weight", (cfg["q_lora_rank"], H))
        put(a + "q_a_layernorm.weight", (cfg["q_lora_rank"],), 0.1, 1.0)
        put(a + "q_b_proj.weight", (heads * qk, cfg["q_lora_rank"]))
        put(a + "kv_a_proj_with_mqa.weight", (R + rope, H))
        put(a + "kv_a_layernorm.weight", (R,), 0.1, 1.0)
        put(a + "kv_b_proj.weight", (heads * (cfg["qk_nope_head_dim"] + vd), R))
        put(a + "o_proj.weight", (H, heads * vd))
        m = p + "mlp."
        if L == 0:
            for proj, shp in (("gate_proj", (cfg["intermediate_size"], H)), ("up_proj", (cfg["intermediate_size"], H)),
                              ("down_proj", (H, cfg["intermediate_size"]))):
                put(f"{m}{proj}.weight", shp)
            continue
        put(m + "gate.weight", (experts, H))
        b = (rng.standard_normal(experts) * 0.05).astype(np.float32)
        tensors[m + "gate.e_score_correction_bias"] = values[m + "gate.e_score_correction_bias"] = b
        for proj, shp in (("gate_proj", (F * n_shared, H)), ("up_proj", (F * n_shared, H)),
                          ("down_proj", (H, F * n_shared))):
            put(f"{m}shared_experts.{proj}.weight", shp)
        for e in range(experts):
            for proj, shp in (("gate_proj", (F, H)), ("up_proj", (F, H)), ("down_proj", (H, F))):
                put(f"{m}experts.{e}.{proj}.weight", shp)
    write_checkpoint(root, cfg, tensors)
    write_reference(root, cfg, values)

    ck = Checkpoint(root)
    spec = spec_from_config(ck.config)
    weights = {n: ck.read(n) for names in backbone_groups(ck).values() for n in names}
    dense = ExpertWeights(*(values[f"model.layers.0.mlp.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj")))
    gates = {L: load_gate(ck, spec, L) for L in range(1, layers)}
    # the shared experts are one more expert, id ``experts`` (prepare/layouts.py)
    experts_w = {(L, e): load_expert(ck, spec, L, e) for L in range(1, layers) for e in range(experts + 1)}

    def mlp(layer, x):
        if layer == 0:
            return expert_forward(dense, x)
        return moe_layer_forward(gates[layer], lambda e: experts_w[(layer, e)], x)[0]

    prompt = np.random.default_rng(seed + 2).integers(0, cfg["vocab_size"], 16)
    seq = Generator(build_backbone(ck.config, weights), mlp, Sampling(max_new_tokens=8)).run(
        [prompt], keep_logits=True)[0]
    _save({"input_ids": prompt[None].astype(np.int64), "logits": seq.prompt_logits.astype(np.float32),
           "greedy_ids": np.array([list(prompt) + seq.output], dtype=np.int64)},
          str(root / "generation_reference.safetensors"))
    return root
