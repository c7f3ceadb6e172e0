"""The elementwise activations of the numeric core: ``sigmoid`` (routers, the shared-expert
gate) and ``silu`` (SwiGLU experts, gpt-oss's clamped variant), each defined once.

float32 in, float32 out, computed with separate numpy ufuncs in a fixed order so results are
reproducible bit for bit. Pure numpy; imports nothing from Django.
"""
from __future__ import annotations

import numpy as np


def sigmoid(z: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-z))`` in float32, computed in place in ``z`` (returned).

    ``z``: float32 array of any shape, overwritten. ``exp(-z)`` may overflow to inf for very
    negative z: ``1/(1+inf) = 0``, the right limit, so overflow is not reported.
    """
    with np.errstate(over="ignore"):
        np.negative(z, out=z)
        np.exp(z, out=z)
    z += np.float32(1)
    np.reciprocal(z, out=z)
    return z


def silu(g: np.ndarray, alpha: float | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """``g · σ(alpha · g)`` as ``g / (1 + exp(-alpha · g))`` in float32, the form torch's CPU
    kernel computes (HF ``ACT2FN["silu"]``; with ``alpha`` gpt-oss's ``gate · σ(alpha · gate)``,
    HF ``GptOssExperts``).

    ``g``: float32 array of any shape (left unchanged unless ``out is g``); ``alpha``: None for
    plain SiLU (``alpha = 1`` computed as a negation), else the scale; ``out``: where to write
    (default a new array). Returns float32 of ``g``'s shape. ``exp`` overflow gives ``-0.0``,
    the right limit, not NaN, and is not reported.
    """
    t = np.negative(g) if alpha is None else g * np.float32(-alpha)
    with np.errstate(over="ignore", under="ignore"):
        np.exp(t, out=t)
    t += np.float32(1)
    return np.divide(g, t, out=t if out is None else out)


__all__ = ["sigmoid", "silu"]
