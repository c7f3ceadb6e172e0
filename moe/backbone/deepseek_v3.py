"""DeepSeek-V3 / Kimi-K2 backbone (HF ``modeling_deepseek_v3.py``): multi-head latent
attention (MLA, DeepSeek-V2 paper §2.1).

Per layer, with ``q_lora_rank`` set: ``q = q_b_proj(RMSNorm(q_a_proj(x)))`` (else ``q_proj``),
split per head into a no-rope part (``qk_nope_head_dim``) and a rope part
(``qk_rope_head_dim``). ``kv_a_proj_with_mqa(x)`` gives the latent (``kv_lora_rank``) and one
rope key shared by all heads; ``kv_b_proj(RMSNorm(latent))`` expands the latent to per-head
no-rope keys and values (``v_head_dim``). Keys are ``cat(k_nope, k_rope)``; RoPE is applied
to the rope parts only, pairs interleaved when ``rope_interleave``. Scaling
``qk_head_dim^-0.5``, times ``mscale²`` under YaRN with ``mscale_all_dim``. Leading layers
(``first_k_dense_replace``) have dense MLPs; both kinds of MLP are the caller's.

The cache keeps the normalized latent and the rotated rope key (``ckv`` ``[T, kv_lora_rank]``,
``k_pe`` ``[T, rope_dim]``), and re-expands per head on each step.

Pure numpy; imports nothing from Django.
"""
from __future__ import annotations

import math

import numpy as np

from moe.backbone.common import Backbone, KVCache, Rotary, apply_rotary, causal_attention, linear, rms_norm
from moe.config import ModelConfig


class DeepseekV3Backbone(Backbone):
    """MLA backbone of ``deepseek_v3`` and ``kimi_k2``."""

    family = "deepseek_v3"

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray]):
        super().__init__(config, weights)
        c = config
        self.n_heads = c.need("num_attention_heads")
        self.q_lora_rank = c.q_lora_rank
        self.kv_lora_rank = c.need("kv_lora_rank")
        self.nope = c.need("qk_nope_head_dim")
        self.rope = c.need("qk_rope_head_dim")
        self.v_dim = c.need("v_head_dim")
        self.qk_dim = self.nope + self.rope
        self.interleave = c.rope_interleave
        params = c.rope
        self.rotary = Rotary(self.rope, params, self.max_position)
        self.scaling = self.qk_dim ** -0.5
        if params["rope_type"] != "default" and params.get("mscale_all_dim"):
            factor = float(params["factor"])
            mscale = 0.1 * float(params["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
            self.scaling *= mscale * mscale

    def kv_bytes_per_token(self) -> int:
        """The latent and the rope key of every layer, float32."""
        return self.num_layers * (self.kv_lora_rank + self.rope) * 4

    def attention(self, layer: int, h: np.ndarray, positions: np.ndarray, cache: KVCache) -> np.ndarray:
        p = f"model.layers.{layer}.self_attn."
        w = self.w
        n = h.shape[0]
        if self.q_lora_rank:
            qa = linear(h, self.weight(p + "q_a_proj.weight"), w.get(p + "q_a_proj.bias"))
            qa = rms_norm(qa, self.weight(p + "q_a_layernorm.weight"), self.eps)
            q = linear(qa, self.weight(p + "q_b_proj.weight"))
        else:
            q = linear(h, self.weight(p + "q_proj.weight"))
        q = q.reshape(n, self.n_heads, self.qk_dim)
        q_nope, q_pe = q[..., :self.nope], q[..., self.nope:]
        ckv = linear(h, self.weight(p + "kv_a_proj_with_mqa.weight"), w.get(p + "kv_a_proj_with_mqa.bias"))
        latent = rms_norm(ckv[:, :self.kv_lora_rank], self.weight(p + "kv_a_layernorm.weight"), self.eps)
        cos, sin = self.rotary.cos_sin(positions)
        q_pe = apply_rotary(np.ascontiguousarray(q_pe), cos, sin, self.interleave)
        k_pe = apply_rotary(np.ascontiguousarray(ckv[:, None, self.kv_lora_rank:]), cos, sin, self.interleave)[:, 0]
        kv = cache.append(layer, ckv=latent, k_pe=k_pe)
        t = kv["ckv"].shape[0]
        expanded = linear(kv["ckv"], self.weight(p + "kv_b_proj.weight"))
        expanded = expanded.reshape(t, self.n_heads, self.nope + self.v_dim)
        k = np.concatenate([expanded[..., :self.nope],
                            np.broadcast_to(kv["k_pe"][:, None, :], (t, self.n_heads, self.rope))], axis=-1)
        v = np.ascontiguousarray(expanded[..., self.nope:])
        query = np.concatenate([q_nope, q_pe], axis=-1)
        out = causal_attention(query, k, v, positions, self.scaling)
        return linear(out.reshape(n, self.n_heads * self.v_dim), self.weight(p + "o_proj.weight"))


class KimiK2Backbone(DeepseekV3Backbone):
    """Kimi K2 (``model_type`` ``kimi_k2``): the DeepSeek-V3 architecture."""

    family = "kimi_k2"
