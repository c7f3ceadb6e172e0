"""Qwen2-MoE backbone (HF ``modeling_qwen2_moe.py``): grouped-query attention with biases on
the q/k/v projections (none on ``o_proj``), rotate-half RoPE, no q/k norm. The shared expert
and its sigmoid gate belong to the MoE layer (published with the gate), not here.

Pure numpy; imports nothing from Django.
"""
from __future__ import annotations

from moe.backbone.qwen3_moe import GqaBackbone


class Qwen2MoeBackbone(GqaBackbone):
    """Qwen2-MoE: GQA with q/k/v biases."""

    family = "qwen2_moe"
    qkv_bias = True
