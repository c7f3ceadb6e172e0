"""``python manage.py export_gguf --model-id ID --out FILE``: write a published model as a GGUF
file llama.cpp loads (``prepare.gguf_export``)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from moe.backbone.weights import BACKBONE_KEY
from moe.blobs import BlobStore
from moe.codec import loads_safetensors
from moe.ffn import ExpertWeights
from moe.gating import Gate
from prepare.backbone import how_to_publish
from prepare.dense import dense_model_id
from prepare.gguf_export import ExportError, ExportModel, expert_from_blob, write_gguf
from registry.models import ExpertBlob, GateBlob, MoeModel


def gather(model_id: str, store: BlobStore) -> ExportModel:
    """The ``ExportModel`` of published model ``model_id`` from the site's rows and blob store.
    Raises ``ExportError`` naming what was never published."""
    model = MoeModel.objects.filter(model_id=model_id).first()
    if model is None:
        raise ExportError(f"--model-id: no published model {model_id!r}")
    record = (model.config or {}).get(BACKBONE_KEY)
    if not record or not record.get("blobs"):
        raise ExportError(f"model {model_id!r} has no published backbone: {how_to_publish(model_id)}")
    backbone = {}
    for group, h in record["blobs"].items():
        tensors, _ = loads_safetensors(store.get(h), f"backbone blob {group}")
        for name, raw in tensors.items():
            backbone[name] = (raw.dtype if raw.dtype in ("BF16", "F16") else "F32", raw.to_f32(name, group))
    gates = {g.layer: Gate.from_blob(store.get(g.blob_hash)) for g in GateBlob.objects.filter(model_id=model_id)}
    rows = {(r.layer, r.expert): r for r in ExpertBlob.objects.filter(model_id=model_id)}

    def expert(layer: int, e: int):
        r = rows.get((layer, e))
        if r is None:
            raise ExportError(f"model {model_id!r}: layer {layer} expert {e} was never published")
        return expert_from_blob(store.get(r.blob_hash), f"expert blob {layer}/{e}")

    dense = {}
    slices: dict[int, list] = {}
    for r in ExpertBlob.objects.filter(model_id=dense_model_id(model_id)).order_by("layer", "expert"):
        slices.setdefault(r.layer, []).append(ExpertWeights.from_blob(store.get(r.blob_hash)))
    for layer, parts in slices.items():  # prepare.dense slices rejoined: rows of gate/up, columns of down
        dense[layer] = ExpertWeights(np.concatenate([p.gate_proj for p in parts]),
                                     np.concatenate([p.up_proj for p in parts]),
                                     np.concatenate([p.down_proj for p in parts], axis=1))
    tok = record.get("tokenizer")
    chat = record.get("chat_template") or {}
    return ExportModel(config=model.config, backbone=backbone, gates=gates, expert=expert, dense=dense,
                       tokenizer_json=store.get(tok).decode() if tok else None,
                       chat_template=chat.get("template"),
                       gguf_vocab=json.loads(store.get(record["gguf_vocab"])) if record.get("gguf_vocab") else None)


class Command(BaseCommand):
    help = ("Write a published model (experts, gates, backbone, dense layers, tokenizer, chat template) as one "
            "GGUF file that llama.cpp loads; experts keep their block types (ffn_{gate,up,down}_exps stacks).")

    def add_arguments(self, parser):
        parser.add_argument("--model-id", required=True)
        parser.add_argument("--out", required=True, help="the .gguf file to write")
        parser.add_argument("--json", action="store_true", help="print the report as one JSON line")

    def handle(self, *args, **opts):
        store = BlobStore(settings.TENZRO["BLOB_DIR"])
        if not opts["out"].strip():
            raise CommandError("--out is empty; give the .gguf file to write")
        out = Path(opts["out"])
        if out.is_dir():
            raise CommandError(f"--out: {out} is a directory; give the .gguf file to write")
        if not out.parent.is_dir():
            raise CommandError(f"--out: directory {out.parent} does not exist")
        # Written under a temporary name and renamed when whole: a failed export leaves no
        # truncated GGUF (which llama.cpp would refuse) at --out, nor clobbers an older one.
        part = out.with_name(out.name + ".part")
        try:
            report = write_gguf(gather(opts["model_id"], store), part, progress=not opts["json"])
            os.replace(part, out)
        except (ExportError, ValueError, OSError) as exc:
            part.unlink(missing_ok=True)
            if isinstance(exc, OSError) and exc.filename in (str(part), str(out)):  # e.g. disk full, no permission
                raise CommandError(f"--out: cannot write {out}: {exc.strerror}") from exc
            raise CommandError(str(exc)) from exc
        report = {"model_id": opts["model_id"], "out": opts["out"], **report}
        if opts["json"]:
            self.stdout.write(json.dumps(report))
        else:
            self.stdout.write(f"wrote {opts['out']}: {report['tensors']} tensors")
            for what, note in report["notes"].items():
                self.stdout.write(f"  {what}: {note}")
