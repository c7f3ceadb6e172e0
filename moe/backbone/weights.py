"""Loading a published backbone from its blobs (``prepare.backbone`` writes them).

Pure Python + numpy; the caller supplies ``fetch(hash) -> bytes`` (blob store or network).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from moe.backbone import Backbone, BackboneError, build_backbone
from moe.codec import loads_safetensors

# Key of ``MoeModel.config`` under which ``prepare.backbone.publish_backbone`` records the blobs.
BACKBONE_KEY = "tenzro_backbone"


def load_backbone(config: dict, record: dict, fetch: Callable[[str], bytes]) -> Backbone:
    """The backbone of ``config`` from the group blobs named in ``record['blobs']``.

    Every tensor is decoded to float32. Raises ``BackboneError`` for a missing group or
    weight and ``moe.codec.CheckpointError`` for a malformed blob.
    """
    weights: dict[str, np.ndarray] = {}
    blobs = record.get("blobs") or {}
    if "embed" not in blobs:
        raise BackboneError("the published backbone has no embedding blob")
    for group, h in blobs.items():
        tensors, _ = loads_safetensors(fetch(h), f"backbone blob {group}")
        for name, raw in tensors.items():
            weights[name] = raw.to_f32(name, f"backbone blob {group}")
    return build_backbone(config, weights)
