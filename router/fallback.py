"""The backbone node's fallback replica (Kvasir's churn tolerance): every expert of a served
model stays in the site's disk tier — the content-addressed blob store the model was
published into — and the site executes a batch itself only when every remote holder of
that expert failed (``LayerForward.run_fallback``; reported as transport ``fallback``).

Experts are decoded from their blobs on first fallback use and kept in a small LRU of
decoded weights, so a churn burst does not re-read the disk for every token.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
from django.conf import settings

from moe.blobs import BlobStore
from moe.ffn import ExpertWeights, expert_forward
from registry.models import ExpertBlob

_CACHE_SIZE = 256
_cache: OrderedDict[str, ExpertWeights] = OrderedDict()
_lock = threading.Lock()


def _weights(blob_hash: str) -> ExpertWeights:
    with _lock:
        w = _cache.get(blob_hash)
        if w is not None:
            _cache.move_to_end(blob_hash)
            return w
    w = ExpertWeights.from_blob(BlobStore(settings.TENZRO["BLOB_DIR"]).get(blob_hash, verify=True))
    with _lock:
        _cache[blob_hash] = w
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return w


def fallback_for(model_id: str, layer: int):
    """``fallback(expert, rows f32 [n, H]) -> f32 [n, H] | None`` for ``LayerForward``: runs
    the expert from the site's blob store, None when the site does not have its blob.
    Called from a worker thread (Django ORM use is synchronous there)."""

    def run(expert: int, rows: np.ndarray) -> np.ndarray | None:
        h = ExpertBlob.objects.filter(model_id=model_id, layer=layer, expert=expert).values_list(
            "blob_hash", flat=True).first()
        if h is None or not BlobStore(settings.TENZRO["BLOB_DIR"]).has(h):
            return None
        return expert_forward(_weights(h), rows)

    return run
