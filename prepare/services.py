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
