"""Mixtral backbone (HF ``modeling_mixtral.py``): grouped-query attention without biases or
q/k norm, rotate-half RoPE, optional sliding window (``sliding_window`` in the config).

Pure numpy; imports nothing from Django.
"""
from __future__ import annotations

from moe.backbone.qwen3_moe import GqaBackbone


class MixtralBackbone(GqaBackbone):
    """Mixtral: plain GQA."""

    family = "mixtral"
