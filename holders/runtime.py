"""The expert-host runtime of a holder: loaded experts, execution, and what it declares.

Experts are kept decoded in memory (the Warm tier). Pure Python + numpy; imports nothing
from Django, so the agent runs it on any machine.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from holders.ffn import ExpertWeights, expert_forward


class ExpertNotLoaded(LookupError):
    """The requested (model_id, layer, expert) is not loaded on this holder."""


class DimensionMismatch(ValueError):
    """Input rows do not fit the expert (d_model, row count vs token indices)."""


@dataclass
class LoadedExpert:
    """One expert in memory with the URI of the blob it came from."""

    weights: ExpertWeights
    blob_uri: str
    loaded_at: float


class ExpertRuntime:
    """Thread-safe map of loaded experts keyed by (model_id, layer, expert)."""

    def __init__(self):
        self._experts: dict[tuple[str, int, int], LoadedExpert] = {}
        self._lock = threading.Lock()
        self.tokens_served = 0

    def load(self, model_id: str, layer: int, expert: int, blob: bytes, blob_uri: str = "") -> LoadedExpert:
        """Decode an expert blob (``ExpertWeights.from_blob``) and keep it; raises ``ValueError`` if corrupt."""
        entry = LoadedExpert(ExpertWeights.from_blob(blob), blob_uri, time.time())
        with self._lock:
            self._experts[(model_id, layer, expert)] = entry
        return entry

    def unload(self, model_id: str, layer: int, expert: int) -> bool:
        """Drop an expert; returns whether it was loaded."""
        with self._lock:
            return self._experts.pop((model_id, layer, expert), None) is not None

    def has(self, model_id: str, layer: int, expert: int) -> bool:
        """Whether the expert is loaded."""
        return (model_id, layer, expert) in self._experts

    def execute(self, model_id: str, layer: int, expert: int, rows: np.ndarray, n_tokens: int) -> np.ndarray:
        """Run the expert FFN on ``rows`` f32 [n, H]; returns f32 [n, H].

        Raises ``ExpertNotLoaded`` or ``DimensionMismatch`` (wrong d_model, ``n`` differs
        from ``n_tokens``, no rows).
        """
        entry = self._experts.get((model_id, layer, expert))
        if entry is None:
            raise ExpertNotLoaded(f"expert {model_id} l{layer}/e{expert} is not loaded on this holder")
        w = entry.weights
        if rows.ndim != 2 or rows.shape[1] != w.d_model:
            raise DimensionMismatch(f"rows have d_model {rows.shape[-1]}, expert has {w.d_model}")
        if rows.shape[0] != n_tokens or n_tokens == 0:
            raise DimensionMismatch(f"{rows.shape[0]} rows for {n_tokens} token indices")
        out = expert_forward(w, rows)
        self.tokens_served += n_tokens
        return out

    def holdings(self) -> list[dict]:
        """Heartbeat holdings: every loaded expert as Warm with its blob URI, sorted."""
        with self._lock:
            keys = sorted(self._experts.items())
        return [{"model_id": m, "layer": layer, "expert": e, "residency": "Warm", "committed_tps": 0,
                 "blob_uri": entry.blob_uri} for (m, layer, e), entry in keys]
