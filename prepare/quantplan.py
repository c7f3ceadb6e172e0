"""Quantization plans for expert blobs: presets, the per-projection object, and fallbacks.

A plan names, per projection (``gate_proj``, ``up_proj``, ``down_proj``), a GGUF type or
``None`` (kept dense). Presets (docs/DESIGN.md §5, reference system §5.3): ``q4_k_m`` = gate Q4_K,
up Q4_K, down Q6_K; ``q8_0`` / ``q4_k`` / ``q6_k`` = that type for all three; the
per-projection object ``{"gate": "q4_k", "up": "q4_k", "down": "q6_k"}`` (omitted keys stay
dense). A projection whose row length (``cols``) is not a multiple of the block size falls
back Q4_K/Q6_K → Q8_0 → dense in the source dtype, and every fallback is reported (the
caller writes it into the blob metadata and the job) — never silent.

Pure Python + numpy; imports nothing from Django.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

from moe.ffn import PROJECTIONS, ExpertWeights
from moe.quant import BLOCK_SIZE, QTYPES, QuantizedMatrix, normalize_qtype

PRESETS = {
    "q4_k_m": ("q4_k", "q4_k", "q6_k"),
    "q8_0": ("q8_0",) * 3,
    "q4_k": ("q4_k",) * 3,
    "q6_k": ("q6_k",) * 3,
}
DENSE_NAMES = ("", "none", "dense", "f32", "bf16")
_SHORT = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_FALLBACK = {"q4_k": "q8_0", "q6_k": "q8_0", "q8_0": None}


class QuantPlanError(ValueError):
    """A quant preset or per-projection object cannot be understood."""


@dataclass(frozen=True)
class QuantPlan:
    """Per-projection GGUF types (``None`` = dense) and the label it was given by."""

    gate_proj: str | None
    up_proj: str | None
    down_proj: str | None
    label: str

    def kinds(self) -> dict[str, str | None]:
        """``{projection: qtype or None}``."""
        return {p: getattr(self, p) for p in PROJECTIONS}

    def to_json(self):
        """The preset name, or the per-projection object (short keys), for status output."""
        if self.label in PRESETS:
            return self.label
        return {k: getattr(self, p) for k, p in _SHORT.items() if getattr(self, p)}


def parse_quant_plan(value) -> QuantPlan | None:
    """Read a quant parameter: ``None``/``"none"``/``"dense"``/``"f32"`` → ``None`` (dense);
    a preset name (case-insensitive); a dict, or a JSON string of a dict, with keys among
    ``gate``, ``up``, ``down`` (or the full ``*_proj`` names) and qtype values.

    Raises ``QuantPlanError`` naming the offending key or value.
    """
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise QuantPlanError(f"quant: not valid JSON ({exc})") from None
        else:
            key = text.lower()
            if key in DENSE_NAMES:
                return None
            if key not in PRESETS:
                raise QuantPlanError(f"quant: unknown preset {value!r}; use one of {', '.join(PRESETS)}, "
                                     f"or an object {{\"gate\": ..., \"up\": ..., \"down\": ...}}")
            return QuantPlan(*PRESETS[key], label=key)
    if not isinstance(value, dict):
        raise QuantPlanError("quant: must be a preset name or an object {gate, up, down}")
    kinds: dict[str, str | None] = {p: None for p in PROJECTIONS}
    for k, v in value.items():
        proj = _SHORT.get(k, k if k in PROJECTIONS else None)
        if proj is None:
            raise QuantPlanError(f"quant.{k}: unknown projection; use gate, up, down")
        if v is None or (isinstance(v, str) and v.strip().lower() in DENSE_NAMES):
            continue
        try:
            kinds[proj] = normalize_qtype(v)
        except ValueError:
            raise QuantPlanError(f"quant.{k}: unsupported type {v!r}; supported: {', '.join(QTYPES)}") from None
    if not any(kinds.values()):
        return None
    for name, preset in PRESETS.items():
        if tuple(kinds[p] for p in PROJECTIONS) == preset:
            return QuantPlan(*preset, label=name)
    return QuantPlan(**kinds, label=json.dumps({k: kinds[p] for k, p in _SHORT.items() if kinds[p]},
                                               sort_keys=True))


def choose_qtype(requested: str, cols: int) -> tuple[str | None, str | None]:
    """The type a row of ``cols`` values gets when ``requested`` is asked for, following
    Q4_K/Q6_K → Q8_0 → dense. Returns ``(qtype or None for dense, fallback note or None)``."""
    q: str | None = requested
    while q is not None and cols % BLOCK_SIZE[q]:
        q = _FALLBACK[q]
    if q == requested:
        return q, None
    target = q or "dense (source dtype)"
    return q, (f"{requested} -> {target}: row length {cols} is not a multiple of the "
               f"{requested} block size {BLOCK_SIZE[requested]}")


def quantize_expert(w: ExpertWeights, plan: QuantPlan | None, name: str = "expert"
                    ) -> tuple[ExpertWeights, dict[str, str]]:
    """Quantize ``w``'s dense projections per ``plan`` (llama.cpp reference bytes).

    Returns ``(weights, fallbacks)`` where ``fallbacks`` maps ``"<proj>.weight"`` to a note
    for every projection that could not get its requested type. ``plan`` None returns ``w``
    unchanged. Raises ``ValueError`` naming ``name`` and the projection when quantization
    refuses the values (fp16 scale overflow; non-finite values were refused earlier).
    """
    if plan is None:
        return w, {}
    out, fallbacks = {}, {}
    for proj in PROJECTIONS:
        a = getattr(w, proj)
        requested = getattr(plan, proj)
        if requested is None or isinstance(a, QuantizedMatrix):
            out[proj] = a
            continue
        q, note = choose_qtype(requested, a.shape[1])
        if note:
            fallbacks[f"{proj}.weight"] = note
        if q is None:
            out[proj] = a
            continue
        try:
            out[proj] = QuantizedMatrix.from_dense(a, q)
        except ValueError as exc:
            raise ValueError(f"{name} {proj}.weight: {exc}") from None
    return replace(w, **out), fallbacks


def blob_quant_tag(w: ExpertWeights, dense_dtype: str = "f32") -> str:
    """A short tag of an expert's stored kinds for listings: the common kind, or the
    gate/up/down kinds joined by ``/`` when they differ (dense = ``dense_dtype``)."""
    kinds = [dense_dtype if k == "f32" else k for k in w.quant_kinds().values()]
    return kinds[0] if len(set(kinds)) == 1 else "/".join(kinds)
