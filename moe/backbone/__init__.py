"""Whole-model forward (embeddings, attention, norms, LM head) in numpy, one module per
family; each decoder layer's MLP (distributed MoE or dense split) is supplied by the caller.

``build_backbone(config, weights)`` picks the family's class by ``model_type``.
"""
from __future__ import annotations

import numpy as np

from moe.backbone.common import Backbone, BackboneError, KVCache
from moe.backbone.deepseek_v3 import DeepseekV3Backbone, KimiK2Backbone
from moe.backbone.mixtral import MixtralBackbone
from moe.backbone.qwen2_moe import Qwen2MoeBackbone
from moe.backbone.qwen3_moe import Qwen3MoeBackbone

FAMILIES: dict[str, type[Backbone]] = {c.family: c for c in (Qwen3MoeBackbone, Qwen2MoeBackbone, MixtralBackbone,
                                                            DeepseekV3Backbone, KimiK2Backbone)}


def build_backbone(config: dict, weights: dict[str, np.ndarray]) -> Backbone:
    """The backbone of ``config['model_type']`` over float32 ``weights`` (checkpoint names).

    Raises ``BackboneError`` for an unsupported family or a missing weight.
    """
    family = config.get("model_type")
    cls = FAMILIES.get(family)
    if cls is None:
        raise BackboneError(f"no backbone for family {family!r}; supported: {sorted(FAMILIES)}", "model_id")
    try:
        return cls(config, weights)
    except KeyError as exc:
        raise BackboneError(f"config lacks {exc.args[0]!r} for a {family} backbone", "config") from None


__all__ = ["FAMILIES", "Backbone", "BackboneError", "KVCache", "build_backbone"]
