"""The MoE model families this project serves, in one table shared by gating, layouts and catalog.

Each family (an HF ``config.json`` ``model_type``) has a router ``scoring`` rule and the HF
config class's default ``norm_topk_prob``:

- ``"softmax"``: softmax over all experts, top-k of the probabilities (qwen3_moe,
  qwen2_moe, mixtral; HF ``modeling_qwen3_moe.py`` ``Qwen3MoeTopKRouter``);
- ``"sigmoid"``: sigmoid scores, selection on score + correction bias with optional
  group-limited routing (deepseek_v3, kimi_k2, glm4_moe; HF ``modeling_deepseek_v3.py``
  ``DeepseekV3MoE.route_tokens_to_experts``);
- ``"topk_softmax"``: top-k of the (biased) logits, softmax over those k (gpt_oss).

Mixtral always renormalizes (its config has no ``norm_topk_prob``). Pure Python; imports
nothing from Django.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One family: ``name`` (``model_type``), router ``scoring`` and default ``norm_topk_prob``."""

    name: str
    scoring: str
    norm_topk_prob: bool


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("qwen3_moe", "softmax", False),
    Family("deepseek_v3", "sigmoid", True),
    Family("kimi_k2", "sigmoid", True),
    Family("qwen2_moe", "softmax", False),
    Family("mixtral", "softmax", True),
    Family("glm4_moe", "sigmoid", True),
    Family("gpt_oss", "topk_softmax", True),
)}

#: Every served family, in table order.
SUPPORTED_FAMILIES: tuple[str, ...] = tuple(FAMILIES)


def families_scored(scoring: str) -> tuple[str, ...]:
    """The families whose router uses ``scoring`` ("softmax", "sigmoid" or "topk_softmax")."""
    return tuple(name for name, f in FAMILIES.items() if f.scoring == scoring)
