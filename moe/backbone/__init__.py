"""Whole-model forward (embeddings, attention, norms, LM head) in numpy, one module per
family; each decoder layer's MLP (distributed MoE or dense split) is supplied by the caller.

``build_backbone(config, weights)`` picks the family's class by ``model_type`` (config read by
``moe.config.ModelConfig``).
"""
from __future__ import annotations

import numpy as np

from moe.backbone.common import Backbone, BackboneError, KVCache
from moe.backbone.deepseek_v3 import DeepseekV3Backbone, KimiK2Backbone
from moe.backbone.mixtral import MixtralBackbone
from moe.backbone.qwen2_moe import Qwen2MoeBackbone
from moe.backbone.qwen3_moe import Qwen3MoeBackbone
from moe.config import ConfigError, ModelConfig

FAMILIES: dict[str, type[Backbone]] = {c.family: c for c in (Qwen3MoeBackbone, Qwen2MoeBackbone, MixtralBackbone,
                                                            DeepseekV3Backbone, KimiK2Backbone)}


def build_backbone(config: dict | ModelConfig, weights: dict[str, np.ndarray]) -> Backbone:
    """The backbone of ``config`` (a parsed ``config.json`` or its ``ModelConfig``) over float32
    ``weights`` (checkpoint names).

    Raises ``BackboneError`` for an unsupported family, a missing or bad config value or a
    missing weight.
    """
    try:
        cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_hf(config)
    except ConfigError as exc:
        raise BackboneError(str(exc), "config") from None
    cls = FAMILIES.get(cfg.family)
    if cls is None:
        raise BackboneError(f"no backbone for family {cfg.family!r}; supported: {sorted(FAMILIES)}", "model_id")
    try:
        return cls(cfg, weights)
    except ConfigError as exc:
        raise BackboneError(f"config lacks {exc.key!r} for a {cfg.family} backbone", "config") from None


__all__ = ["FAMILIES", "Backbone", "BackboneError", "KVCache", "build_backbone"]
