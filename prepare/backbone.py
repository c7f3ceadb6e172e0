"""Publishing a checkpoint's backbone (everything but the MLPs) as content-addressed blobs.

A backbone node needs the embeddings, every layer's attention and norms, the final norm
and the LM head, never a full checkpoint: each group is read by ranged reads
(``Checkpoint.read_bytes``, one tensor at a time) and stored as one canonical safetensors
blob in its source dtype (BF16/F16/F32; FP8 weights are decoded with their block scales to
F32). Groups: ``embed`` (``model.embed_tokens.weight``), ``layer.{L}`` (tensors under
``model.layers.{L}.`` that are not the MLP), ``head`` (``model.norm.weight`` and
``lm_head.weight`` when not tied), and ``tokenizer`` (the raw ``tokenizer.json`` when the
checkpoint ships one; for a GGUF file, built from its ``tokenizer.ggml.*`` metadata by
``prepare.gguf_tokenizer``). The blob hashes are recorded in ``MoeModel.config['tenzro_backbone']``,
with the checkpoint's chat template (text, a few KB) when it ships one (GGUF:
``tokenizer.chat_template``). Any source ``prepare.remote.open_checkpoint`` opens works.
"""
from __future__ import annotations

import json
from pathlib import Path

from moe.backbone.weights import BACKBONE_KEY  # the key the site reads
from prepare.chat import read_chat_template
from moe.codec import dumps_safetensors
from prepare.checkpoint import Checkpoint
from prepare.remote import is_url, open_checkpoint

_NATIVE = ("BF16", "F16", "F32")


def backbone_groups(ckpt: Checkpoint) -> dict[str, list[str]]:
    """Backbone tensor names of ``ckpt`` by blob group (see the module docstring).

    MLP tensors (``.mlp.``, ``.block_sparse_moe.``), FP8 ``*_scale_inv`` companions and
    multi-token-prediction layers past ``num_hidden_layers`` are left out.
    """
    n_layers = int(ckpt.config.get("num_hidden_layers", 0) or 0)
    groups: dict[str, list[str]] = {"embed": [], "head": []}
    for name in ckpt.names():
        if name.endswith("_scale_inv"):
            continue
        if name == "model.embed_tokens.weight":
            groups["embed"].append(name)
        elif name in ("model.norm.weight", "lm_head.weight"):
            groups["head"].append(name)
        elif name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            if layer >= n_layers or ".mlp." in name or ".block_sparse_moe." in name:
                continue
            groups.setdefault(f"layer.{layer}", []).append(name)
    return groups


def group_blob(ckpt: Checkpoint, names: list[str]) -> bytes:
    """One safetensors blob of ``names`` read from ``ckpt`` (source dtype when BF16/F16/F32,
    else decoded to F32). Raises ``CheckpointError`` for a missing or unreadable tensor."""
    tensors = {}
    for name in names:
        info = ckpt.info(name)
        if info.dtype in _NATIVE:
            tensors[name] = (info.dtype, tuple(info.shape), ckpt.read_bytes(name))
        else:
            tensors[name] = ckpt.read(name)
    return dumps_safetensors(tensors, {"format": "tenzro-backbone"})


def has_backbone(ckpt: Checkpoint) -> bool:
    """Whether ``ckpt`` ships a backbone (its token embeddings), so ``publish_backbone`` can
    serve it; an experts-only checkpoint does not."""
    return bool(backbone_groups(ckpt)["embed"])


def how_to_publish(model_id: str) -> str:
    """The operator's way to publish ``model_id``'s backbone, for messages about a model
    that has experts but none (an experts-only checkpoint, or one published before jobs did)."""
    return (f"run `python manage.py prepare_experts --checkpoint CHECKPOINT --model-id {model_id}` with a checkpoint "
            f"that ships its embeddings, attention and head (it publishes the backbone with the experts; "
            f"tenzro_cluster does too)")


def publish_backbone(checkpoint: str | Path, model_id: str, revision: str | None = None,
                     opened: Checkpoint | None = None) -> dict:
    """Store ``checkpoint``'s backbone groups (at ``revision``, for a Hub URL) in the site's
    blob store and record them on the (already published) ``MoeModel`` ``model_id``.
    Idempotent. A completed preparation job calls it (``prepare.jobs.run_job``) with the
    checkpoint it already has open (``opened``: read, not closed, so its header is not read twice).

    Returns the record ``{"blobs": {group: hash}, "nbytes": {group: n}, "tokenizer": hash | None,
    "chat_template": {template, special_tokens} | None}`` (``prepare.chat.read_chat_template``),
    plus ``"gguf_vocab"`` (hash of the JSON of a GGUF file's ``tokenizer.ggml.*`` keys) for a GGUF.
    Raises ``CheckpointError``, ``prepare.chat.ChatTemplateError`` and ``MoeModel.DoesNotExist``.
    """
    from django.conf import settings

    from moe.blobs import BlobStore
    from registry.models import MoeModel

    ckpt = opened if opened is not None else open_checkpoint(checkpoint, revision)
    try:
        store = BlobStore(settings.TENZRO["BLOB_DIR"])
        blobs, sizes = {}, {}
        for group, names in backbone_groups(ckpt).items():
            data = group_blob(ckpt, names)
            blobs[group], sizes[group] = store.put(data), len(data)
        gguf_vocab = None
        if hasattr(ckpt, "tokenizer_json"):  # GGUF: vocabulary and template from the file's metadata
            text = ckpt.tokenizer_json()
            tokenizer = store.put(text.encode()) if text is not None else None
            chat = ckpt.chat_template()
            vocab = ckpt.vocab_metadata()
            gguf_vocab = store.put(json.dumps(vocab, sort_keys=True).encode()) if vocab else None
        else:
            tok = Path(checkpoint) / "tokenizer.json" if not is_url(str(checkpoint)) and Path(checkpoint).is_dir() \
                else None
            tokenizer = store.put(tok.read_bytes()) if tok is not None and tok.is_file() else None
            chat = read_chat_template(checkpoint) if not is_url(str(checkpoint)) else None
    finally:
        if opened is None and hasattr(ckpt, "close"):
            ckpt.close()
    record = {"blobs": blobs, "nbytes": sizes, "tokenizer": tokenizer, "chat_template": chat}
    if gguf_vocab is not None:  # the file's own tokenizer.ggml.* keys, so export_gguf writes them back verbatim
        record["gguf_vocab"] = gguf_vocab
    model = MoeModel.objects.get(model_id=model_id)
    model.config = {**model.config, BACKBONE_KEY: record}
    model.save(update_fields=["config"])
    return record
