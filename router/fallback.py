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

class FallbackReplica:
    """The site's fallback replica: experts decoded from the blob store on first use, kept in
    an LRU of ``cache_size`` decoded experts. One per router (``router.state.Router.fallback``);
    thread-safe (the forward calls it from worker threads)."""

    def __init__(self, cache_size: int = 256):
        self.cache_size = cache_size
        self._cache: OrderedDict[str, ExpertWeights] = OrderedDict()
        self._lock = threading.Lock()

    def weights(self, blob_hash: str) -> ExpertWeights:
        """The decoded expert of ``blob_hash`` from the site's blob store (hash verified).

        Raises ``BlobError`` when the blob is missing or does not match its hash."""
        with self._lock:
            w = self._cache.get(blob_hash)
            if w is not None:
                self._cache.move_to_end(blob_hash)
                return w
        w = ExpertWeights.from_blob(BlobStore(settings.TENZRO["BLOB_DIR"]).get(blob_hash, verify=True))
        with self._lock:
            self._cache[blob_hash] = w
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return w

    def holds(self, model_id: str, layer: int, expert: int) -> bool:
        """Whether the site's blob store holds the published blob of (model_id, layer, expert)."""
        h = ExpertBlob.objects.filter(model_id=model_id, layer=layer, expert=expert).values_list(
            "blob_hash", flat=True).first()
        return h is not None and BlobStore(settings.TENZRO["BLOB_DIR"]).has(h)

    def for_layer(self, model_id: str, layer: int):
        """``fallback(expert, rows f32 [n, H]) -> f32 [n, H] | None`` for ``LayerForward``: runs
        the expert from the site's blob store, None when the site does not have its blob.
        Called from a worker thread (Django ORM use is synchronous there)."""

        def run(expert: int, rows: np.ndarray) -> np.ndarray | None:
            h = ExpertBlob.objects.filter(model_id=model_id, layer=layer, expert=expert).values_list(
                "blob_hash", flat=True).first()
            if h is None or not BlobStore(settings.TENZRO["BLOB_DIR"]).has(h):
                return None
            return expert_forward(self.weights(h), rows)

        return run
