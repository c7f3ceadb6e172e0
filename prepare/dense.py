"""Dense MLP layers split across holders by slices of the intermediate dimension (docs/DESIGN.md §7).

A SwiGLU MLP ``Y = (silu(X·Wgᵀ) ⊙ (X·Wuᵀ))·Wdᵀ`` is a sum over its intermediate units, so
with the intermediate range cut into contiguous slices ``s`` (rows of ``Wg``/``Wu``,
columns of ``Wd``), ``Y = Σ_s (silu(X·Wg_sᵀ) ⊙ (X·Wu_sᵀ))·Wd_sᵀ``: each slice is an ordinary
expert FFN of width ``F_s`` that a holder can execute unchanged. The router recombines the
slice outputs by the MoE combine with every token routed to every slice at weight 1.0,
adding slices in ascending order; ``split_forward`` computes the same sum in process, so
distributed and in-process agree bit for bit. Against the unsplit MLP the sums differ only
by f32 rounding of the regrouped additions.

Dense layers of a checkpoint are published as a model of their own,
``dense_model_id(model_id)``, whose "experts" are the slices (expert id = slice index).

Pure Python + numpy; imports nothing from Django.
"""
from __future__ import annotations

import numpy as np

from moe.ffn import ExpertWeights, combine, expert_forward
from moe.gating import Routing

DENSE_SUFFIX = ".dense"


def dense_model_id(model_id: str) -> str:
    """The model id under which ``model_id``'s dense-layer slices are published."""
    return model_id + DENSE_SUFFIX


def slice_bounds(d_ff: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous ``[lo, hi)`` ranges cutting ``d_ff`` into ``parts`` (sizes differ by at most 1).

    Raises ``ValueError`` unless ``1 <= parts <= d_ff``.
    """
    if not isinstance(parts, int) or not 1 <= parts <= d_ff:
        raise ValueError(f"parts must be an integer in 1..{d_ff} (the intermediate size), got {parts!r}")
    edges = [d_ff * i // parts for i in range(parts + 1)]
    return [(edges[i], edges[i + 1]) for i in range(parts)]


def split_dense(w: ExpertWeights, parts: int) -> list[ExpertWeights]:
    """Cut a dense SwiGLU MLP into ``parts`` slice FFNs (``gate_proj``/``up_proj`` rows,
    ``down_proj`` columns of each range of ``slice_bounds``). Raises ``ValueError`` as
    ``slice_bounds``."""
    return [ExpertWeights(w.gate_proj[lo:hi], w.up_proj[lo:hi], w.down_proj[:, lo:hi])
            for lo, hi in slice_bounds(w.d_ff, parts)]


def dense_routing(n_tokens: int, parts: int) -> Routing:
    """Every token routed to every slice at weight 1.0 (``expert_ids`` int64 ``[T, parts]``)."""
    ids = np.tile(np.arange(parts, dtype=np.int64), (n_tokens, 1))
    return Routing(ids, np.ones((n_tokens, parts), dtype=np.float32),
                   np.zeros((n_tokens, parts), dtype=np.float32), parts, None)


def split_forward(slices: list[ExpertWeights], x: np.ndarray) -> np.ndarray:
    """In-process forward of a split dense MLP: slice outputs summed in ascending slice order.

    ``x`` float32 ``[T, H]`` → float32 ``[T, H]``; the same sum the distributed forward makes.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    tokens = np.arange(x.shape[0])
    outs = {s: (tokens, expert_forward(w, x)) for s, w in enumerate(slices)}
    return combine(dense_routing(x.shape[0], len(slices)), outs, x.shape[1])
