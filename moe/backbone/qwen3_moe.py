"""Qwen3-MoE backbone (HF ``modeling_qwen3_moe.py``): grouped-query attention with RMSNorm
on each query and key head (``q_norm``/``k_norm``, before RoPE), rotate-half RoPE, no
projection biases. The MLP of each layer (MoE or dense) is the caller's.

Pure numpy; imports nothing from Django.
"""
from __future__ import annotations

import numpy as np

from moe.backbone.common import Backbone, KVCache, Rotary, apply_rotary, causal_attention, linear, rms_norm
from moe.config import ModelConfig


class GqaBackbone(Backbone):
    """Grouped-query attention backbone shared by the Qwen and Mixtral families.

    Per layer ``model.layers.{L}.self_attn.{q,k,v,o}_proj.weight`` (``[Hq·D, H]``,
    ``[Hkv·D, H]``, ``[Hkv·D, H]``, ``[H, Hq·D]``), optional ``{q,k,v}_proj.bias``
    (``qkv_bias``) and ``{q,k}_norm.weight`` ``[D]`` (``qk_norm``). Scaling ``D^-0.5``.
    Cache per layer: rotated ``k`` and ``v`` float32 ``[T, Hkv, D]``.
    """

    qk_norm = False
    qkv_bias = False

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray]):
        super().__init__(config, weights)
        self.n_heads = config.need("num_attention_heads")
        self.n_kv = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rotary = Rotary(self.head_dim, config.rope, self.max_position)
        self.scaling = self.head_dim ** -0.5
        self.sliding_window = config.sliding_window

    def kv_bytes_per_token(self) -> int:
        """Rotated ``k`` and ``v`` of every KV head, every layer, float32."""
        return self.num_layers * 2 * self.n_kv * self.head_dim * 4

    def attention(self, layer: int, h: np.ndarray, positions: np.ndarray, cache: KVCache) -> np.ndarray:
        return self.attention_rows(layer, h, np.array([0, h.shape[0]]), [positions], [cache])

    def attention_rows(self, layer: int, h: np.ndarray, bounds: np.ndarray, positions: list[np.ndarray],
                       caches: list[KVCache]) -> np.ndarray:
        """Projections, q/k norms and rotary over every sequence's rows at once (each is
        row-invariant: ``linear``, per-row norms, per-position tables), then each sequence's
        cache append and causal attention, then one ``o_proj``; float32 ``[N, H]``."""
        p = f"model.layers.{layer}.self_attn."
        w = self.w
        n, d = h.shape[0], self.head_dim
        q = linear(h, self.weight(p + "q_proj.weight"), w.get(p + "q_proj.bias")).reshape(n, self.n_heads, d)
        k = linear(h, self.weight(p + "k_proj.weight"), w.get(p + "k_proj.bias")).reshape(n, self.n_kv, d)
        v = linear(h, self.weight(p + "v_proj.weight"), w.get(p + "v_proj.bias")).reshape(n, self.n_kv, d)
        if self.qk_norm:
            q = rms_norm(q, self.weight(p + "q_norm.weight"), self.eps)
            k = rms_norm(k, self.weight(p + "k_norm.weight"), self.eps)
        cos, sin = self.rotary.cos_sin(np.concatenate(positions))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = np.empty((n, self.n_heads, d), dtype=np.float32)
        for i, cache in enumerate(caches):
            lo, hi = int(bounds[i]), int(bounds[i + 1])
            kv = cache.append(layer, k=k[lo:hi], v=v[lo:hi])
            out[lo:hi] = causal_attention(q[lo:hi], kv["k"], kv["v"], positions[i], self.scaling,
                                          self.sliding_window)
        return linear(out.reshape(n, self.n_heads * d), self.weight(p + "o_proj.weight"))


class Qwen3MoeBackbone(GqaBackbone):
    """Qwen3-MoE: GQA with per-head q/k RMSNorm, no biases."""

    family = "qwen3_moe"
    qk_norm = True
