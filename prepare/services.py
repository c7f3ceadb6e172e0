"""Publishing a checkpoint's experts and gates as content-addressed blobs (one job, inline)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from django.conf import settings
from django.db import transaction

from moe.blobs import BlobStore
from prepare.checkpoint import Checkpoint
from prepare.jobs import JobParamError, create_job, run_job
from prepare.layouts import spec_from_config
from prepare.models import PrepareJob
from registry.models import ExpertBlob
from prepare.remote import is_url, open_checkpoint
from registry.models import MoeModel


class PublishError(ValueError):
    """The checkpoint could not be published completely (the message names what failed)."""


def default_model_id(checkpoint: str | Path) -> str:
    """A model id from a checkpoint directory name or URL: ``qwen3_moe_tiny`` → ``qwen3-moe-tiny``."""
    text = str(checkpoint)
    name = text.rstrip("/").rsplit("/", 1)[-1] if is_url(text) else Path(checkpoint).resolve().name
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-") or "model"


def publish_checkpoint(checkpoint: str | Path, model_id: str | None = None,
                       progress: Callable[[int, int, str], None] | None = None, quant=None,
                       revision: str | None = None) -> MoeModel:
    """Extract every MoE layer's gate and experts (shared slot included) into the blob store,
    quantized per ``quant`` (preset name, per-projection object, or None: dense in the source
    dtype), through one ``PrepareJob`` run inline.

    Idempotent: identical content gives identical blobs and rows. ``progress(done, total,
    what)`` is called after each expert. Raises ``PublishError`` (a ``ValueError``) naming
    the parameter or the first failed expert.
    """
    model_id = model_id or default_model_id(checkpoint)
    source = str(checkpoint) if is_url(str(checkpoint)) else str(Path(checkpoint).resolve())
    try:
        job = create_job(source, model_id, quant=quant, revision=revision)
    except JobParamError as exc:
        raise PublishError(f"{exc.field}: {exc}") from None

    def report(j: PrepareJob) -> None:
        if progress:
            progress(j.completed_experts + j.failed_experts, j.total_experts, j.current_tensor)

    job = run_job(job.job_id, report)
    if job.state != PrepareJob.State.COMPLETED:
        first = job.items.filter(state="failed").first()
        detail = f"; first: layer {first.layer} expert {first.expert}: {first.error}" if first else ""
        raise PublishError(f"publishing {checkpoint}: {job.error}{detail}")
    return MoeModel.objects.get(model_id=model_id)


def dense_layers(checkpoint: Checkpoint) -> list[int]:
    """Layers of ``checkpoint`` with a dense SwiGLU MLP (``model.layers.{L}.mlp.{gate,up,down}_proj``)."""
    spec = spec_from_config(checkpoint.config)
    n = int(checkpoint.config.get("num_hidden_layers", 0) or 0)
    return [layer for layer in range(n) if not spec.is_moe_layer(layer)
            and all(checkpoint.has(f"model.layers.{layer}.mlp.{p}.weight")
                    for p in ("gate_proj", "up_proj", "down_proj"))]


def load_dense(checkpoint: Checkpoint, layer: int):
    """The dense MLP of ``layer`` as float32 ``ExpertWeights``; raises ``CheckpointError``/``ValueError``."""
    from moe.ffn import ExpertWeights

    return ExpertWeights(*(checkpoint.read(f"model.layers.{layer}.mlp.{p}.weight")
                           for p in ("gate_proj", "up_proj", "down_proj")))


def publish_dense(checkpoint: str | Path, model_id: str, parts: int) -> MoeModel | None:
    """Publish every dense MLP layer of ``checkpoint`` split into ``parts`` intermediate slices
    (``prepare.dense``) as the model ``dense_model_id(model_id)``: slice ``s`` of layer ``L``
    is its expert ``(L, s)``, placed and served like any expert. Returns None when the
    checkpoint has no dense MLP layer. Raises ``ValueError`` for a bad ``parts``.
    """
    from prepare.dense import dense_model_id, split_dense

    ckpt = open_checkpoint(checkpoint)
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
            "source": str(checkpoint) if is_url(str(checkpoint)) else str(Path(checkpoint).resolve())})
        ExpertBlob.objects.filter(model_id=mid).exclude(layer__in=layers).delete()
        for layer, s, h, n in rows:
            ExpertBlob.objects.update_or_create(model_id=mid, layer=layer, expert=s,
                                                defaults={"blob_hash": h, "nbytes": n, "quant": "f32"})
        ExpertBlob.objects.filter(model_id=mid, expert__gte=parts).delete()
    return model
