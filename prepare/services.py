"""Publishing a checkpoint's experts and gates as content-addressed blobs."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from django.conf import settings
from django.db import transaction

from prepare.blobs import BlobStore
from prepare.checkpoint import Checkpoint
from prepare.layouts import load_expert, load_gate, spec_from_config
from prepare.models import ExpertBlob, GateBlob
from registry.models import MoeModel


def default_model_id(checkpoint: str | Path) -> str:
    """A model id from a checkpoint directory name: ``qwen3_moe_tiny`` → ``qwen3-moe-tiny``."""
    name = Path(checkpoint).resolve().name
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-") or "model"


def publish_checkpoint(checkpoint: str | Path, model_id: str | None = None,
                       progress: Callable[[int, int, str], None] | None = None) -> MoeModel:
    """Extract every MoE layer's gate and experts (shared slot included) into the blob store.

    Idempotent: identical content gives identical blobs and rows. ``progress(done, total,
    what)`` is called after each blob. Raises ``CheckpointError``/``ValueError`` from the
    reader and layouts (unsupported family, missing tensor, bad dtype).
    """
    ckpt = Checkpoint(checkpoint)
    spec = spec_from_config(ckpt.config)
    model_id = model_id or default_model_id(checkpoint)
    store = BlobStore(settings.TENZRO["BLOB_DIR"])
    slots = spec.num_experts + (1 if spec.n_shared_experts else 0)
    layers = spec.moe_layers()
    total, done = len(layers) * (slots + 1), 0
    gates, experts = [], []
    for layer in layers:
        gates.append((layer, store.put(load_gate(ckpt, spec, layer).to_blob())))
        done += 1
        if progress:
            progress(done, total, f"layer {layer} gate")
        for e in range(slots):
            blob = load_expert(ckpt, spec, layer, e).to_blob()
            experts.append((layer, e, store.put(blob), len(blob)))
            done += 1
            if progress:
                progress(done, total, f"layer {layer} expert {e}")
    with transaction.atomic():
        model, _ = MoeModel.objects.update_or_create(model_id=model_id, defaults={
            "family": spec.family, "num_experts": spec.num_experts, "top_k": spec.top_k,
            "n_shared_experts": spec.n_shared_experts, "hidden_size": spec.hidden_size,
            "expert_d_ff": spec.moe_intermediate_size, "moe_layers": layers, "config": ckpt.config,
            "source": str(Path(checkpoint).resolve())})
        for layer, h in gates:
            GateBlob.objects.update_or_create(model_id=model_id, layer=layer, defaults={"blob_hash": h})
        for layer, e, h, n in experts:
            ExpertBlob.objects.update_or_create(model_id=model_id, layer=layer, expert=e,
                                                defaults={"blob_hash": h, "nbytes": n, "quant": "f32"})
    return model


def dense_layers(checkpoint: Checkpoint) -> list[int]:
    """Layers of ``checkpoint`` with a dense SwiGLU MLP (``model.layers.{L}.mlp.{gate,up,down}_proj``)."""
    spec = spec_from_config(checkpoint.config)
    n = int(checkpoint.config.get("num_hidden_layers", 0) or 0)
    return [layer for layer in range(n) if not spec.is_moe_layer(layer)
            and all(checkpoint.has(f"model.layers.{layer}.mlp.{p}.weight")
                    for p in ("gate_proj", "up_proj", "down_proj"))]


def load_dense(checkpoint: Checkpoint, layer: int):
    """The dense MLP of ``layer`` as float32 ``ExpertWeights``; raises ``CheckpointError``/``ValueError``."""
    from holders.ffn import ExpertWeights

    return ExpertWeights(*(checkpoint.read(f"model.layers.{layer}.mlp.{p}.weight")
                           for p in ("gate_proj", "up_proj", "down_proj")))


def publish_dense(checkpoint: str | Path, model_id: str, parts: int) -> MoeModel | None:
    """Publish every dense MLP layer of ``checkpoint`` split into ``parts`` intermediate slices
    (``holders.dense``) as the model ``dense_model_id(model_id)``: slice ``s`` of layer ``L``
    is its expert ``(L, s)``, placed and served like any expert. Returns None when the
    checkpoint has no dense MLP layer. Raises ``ValueError`` for a bad ``parts``.
    """
    from holders.dense import dense_model_id, split_dense

    ckpt = Checkpoint(checkpoint)
    layers = dense_layers(ckpt)
    if not layers:
        return None
    store = BlobStore(settings.TENZRO["BLOB_DIR"])
    rows, d_ff = [], 0
    for layer in layers:
        w = load_dense(ckpt, layer)
        d_ff = w.d_ff
        for s, part in enumerate(split_dense(w, parts)):
            blob = part.to_blob()
            rows.append((layer, s, store.put(blob), len(blob)))
    mid = dense_model_id(model_id)
    with transaction.atomic():
        model, _ = MoeModel.objects.update_or_create(model_id=mid, defaults={
            "family": "dense", "num_experts": parts, "top_k": parts, "n_shared_experts": 0,
            "hidden_size": int(ckpt.config.get("hidden_size", 0)), "expert_d_ff": d_ff // parts,
            "moe_layers": layers, "config": {"dense_of": model_id, "parts": parts},
            "source": str(Path(checkpoint).resolve())})
        ExpertBlob.objects.filter(model_id=mid).exclude(layer__in=layers).delete()
        for layer, s, h, n in rows:
            ExpertBlob.objects.update_or_create(model_id=mid, layer=layer, expert=s,
                                                defaults={"blob_hash": h, "nbytes": n, "quant": "f32"})
        ExpertBlob.objects.filter(model_id=mid, expert__gte=parts).delete()
    return model
