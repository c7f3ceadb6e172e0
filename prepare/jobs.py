"""Preparation jobs: extract, quantize and publish experts and gates as content-addressed blobs.

A job (``PrepareJob``) names a checkpoint (directory or http(s) URL), MoE layers, expert ids
and a quant plan. ``run_job`` works through every (layer, expert) in order; each outcome is
an ``PrepareItem`` row written as soon as the expert is published, so:

* a job killed mid-way (even with SIGKILL) resumes by running it again: items already done
  whose blob is in the store are skipped, and since blobs are canonical the resumed job
  ends with exactly the blob URIs an uninterrupted run gives;
* one expert failing (unreadable tensor, non-finite weights, ...) is recorded with its
  error and the others go on; the job ends ``failed`` with the count;
* ``cancel_job`` sets a flag the runner reads before each expert (state ``cancelled``);
* once every expert is done, the checkpoint's backbone (when it ships one) is published too
  (``prepare.backbone.publish_backbone``), so the model can generate and be exported.

Progress (experts done/total, bytes written, the tensor being read) is on the job row, for
``tenzro_moePrepareStatus``, the admin and the web page. Reference behaviour: reference
system §5.6 (with its gaps 29 fixed: persisted, resumable, cancellable, per-expert errors).
"""
from __future__ import annotations

import uuid
from typing import Callable

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from moe.blobs import BlobStore

from moe.content import BlobError
from moe.codec import CheckpointError
from prepare.backbone import has_backbone, publish_backbone
from prepare.chat import ChatTemplateError
from prepare.layouts import MoeSpec, expert_sources, load_expert, load_gate, source_dtype, spec_from_config
from prepare.models import PrepareItem, PrepareJob
from registry.models import ExpertBlob, GateBlob
from prepare.quantplan import QuantPlanError, blob_quant_tag, parse_quant_plan, quantize_expert
from prepare.remote import open_checkpoint
from registry.models import MoeModel
from moe.jsonrpc import ParamError
from registry.model_ids import validate_model_id

_EXPERT_ERRORS = (ValueError, CheckpointError, BlobError, OSError)


class JobParamError(ValueError):
    """Job parameters that cannot work; ``field`` names the parameter."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _open(source: str, revision: str | None):
    try:
        ckpt = open_checkpoint(source, revision or None)
        return ckpt, spec_from_config(ckpt.config)
    except CheckpointError as exc:
        raise JobParamError("checkpoint", str(exc)) from None
    except ValueError as exc:
        raise JobParamError("checkpoint", f"{source}: {exc}") from None


SHAPE_FIELDS = ("family", "num_experts", "top_k", "n_shared_experts", "hidden_size", "expert_d_ff")


def _shape(spec: MoeSpec) -> dict:
    """``spec``'s shape as ``MoeModel`` stores it (``SHAPE_FIELDS``)."""
    return {"family": spec.family, "num_experts": spec.num_experts, "top_k": spec.top_k,
            "n_shared_experts": spec.n_shared_experts, "hidden_size": spec.hidden_size,
            "expert_d_ff": spec.moe_intermediate_size}


def create_job(source: str, model_id: str, layers: list[int] | None = None, experts: list[int] | None = None,
               include_gate: bool = True, quant=None, revision: str | None = None,
               replace: bool = False) -> PrepareJob:
    """Validate the parameters against the checkpoint and save a pending ``PrepareJob``.

    ``layers`` None = every MoE layer; ``experts`` None = every slot (shared included);
    ``quant`` a preset name, a per-projection object (or its JSON text), or None (dense).
    A model id already published with another shape (family, sizes, expert counts) is refused
    unless ``replace``; the same shape from another source (a moved checkout) is accepted.
    Raises ``JobParamError`` naming the field (a model id outside ``registry.model_ids``' rule
    or published with another shape,
    checkpoint unreadable or unsupported, a dense
    or out-of-range layer, an expert out of range, an unknown quant plan) and saves nothing.
    """
    try:
        validate_model_id(model_id)
    except ParamError as exc:
        raise JobParamError("model_id", str(exc)) from None
    try:
        plan = parse_quant_plan(quant)
    except QuantPlanError as exc:
        raise JobParamError("quant", str(exc)) from None
    ckpt, spec = _open(str(source), revision)
    existing = MoeModel.objects.filter(model_id=model_id).first()
    if existing is not None and not replace:
        shape = _shape(spec)
        changed = [f"{k} {getattr(existing, k)} -> {shape[k]}" for k in SHAPE_FIELDS
                   if getattr(existing, k) != shape[k]]
        if changed:  # another model under this id: republishing would mix two checkpoints' experts
            raise JobParamError("model_id", f"model {model_id!r} is already published from {existing.source} "
                                            f"with another shape ({', '.join(changed)}); choose another model id, or "
                                            "replace it (prepare_experts --replace, RPC replace: true)")
    layers = spec.moe_layers() if layers is None else list(layers)
    if not layers:
        raise JobParamError("layers", "no layers given")
    for layer in layers:
        try:
            spec.check_layer(layer)
        except ValueError as exc:
            raise JobParamError("layers", str(exc)) from None
    if experts is not None:
        if not experts:
            raise JobParamError("experts", "the expert list is empty")
        for e in experts:
            try:
                spec.check_expert(layers[0], e)
            except ValueError as exc:
                raise JobParamError("experts", str(exc)) from None
    ids = sorted(set(experts)) if experts is not None else None
    per_layer = len(ids) if ids is not None else spec.slots()
    return PrepareJob.objects.create(
        job_id=uuid.uuid4(), model_id=model_id, source=str(source), revision=revision or "",
        layers=sorted(set(layers)), experts=ids, include_gate=include_gate,
        quant=plan.to_json() if plan else None, total_experts=per_layer * len(set(layers)))


def cancel_job(job_id) -> PrepareJob:
    """Ask a job to stop before its next expert (a pending job is cancelled at once).
    Raises ``PrepareJob.DoesNotExist``."""
    job = PrepareJob.objects.get(job_id=job_id)
    if not job.done:
        PrepareJob.objects.filter(job_id=job.job_id).update(cancel_requested=True)
        if job.state == PrepareJob.State.PENDING:
            PrepareJob.objects.filter(job_id=job.job_id).update(state=PrepareJob.State.CANCELLED,
                                                                finished=timezone.now())
        job.refresh_from_db()
    return job


def _register_model(job: PrepareJob, spec: MoeSpec, config: dict) -> None:
    existing = MoeModel.objects.filter(model_id=job.model_id).first()
    same = existing is not None and all(getattr(existing, k) == v for k, v in _shape(spec).items())
    layers = sorted(set(existing.moe_layers if same else []) | set(job.layers))  # a replaced model starts over
    MoeModel.objects.update_or_create(model_id=job.model_id, defaults={
        **_shape(spec), "moe_layers": layers, "config": config, "source": job.source})


def _refresh_counters(job: PrepareJob, **fields) -> None:
    items = job.items.all()
    job.completed_experts = items.filter(state=PrepareItem.State.DONE, expert__isnull=False).count()
    job.failed_experts = items.filter(state=PrepareItem.State.FAILED).count()
    job.bytes_written = sum(items.filter(state=PrepareItem.State.DONE).values_list("nbytes", flat=True))
    for k, v in fields.items():
        setattr(job, k, v)
    job.save(update_fields=["completed_experts", "failed_experts", "bytes_written", "updated", *fields])


def _finish(job: PrepareJob, state: str, error: str = "") -> PrepareJob:
    job.state, job.error, job.finished, job.current_tensor = state, error, timezone.now(), ""
    job.save(update_fields=["state", "error", "finished", "current_tensor", "updated"])
    return job


def run_job(job_id, progress: Callable[[PrepareJob], None] | None = None) -> PrepareJob:
    """Run (or resume) job ``job_id`` to a final state and return it.

    Items already done whose blob is still in the store are skipped; failed items are
    retried. ``progress(job)`` is called after every expert and gate. Per-expert errors are
    recorded and do not stop the job; an unreadable checkpoint fails it. Idempotent: running
    a completed job again returns it unchanged. Raises ``PrepareJob.DoesNotExist``.
    """
    job = PrepareJob.objects.get(job_id=job_id)
    if job.state in (PrepareJob.State.COMPLETED, PrepareJob.State.CANCELLED):
        return job
    job.state, job.attempts, job.error, job.finished = PrepareJob.State.RUNNING, job.attempts + 1, "", None
    job.save(update_fields=["state", "attempts", "error", "finished", "updated"])
    try:
        plan = parse_quant_plan(job.quant)
        ckpt, spec = _open(job.source, job.revision)
    except (JobParamError, QuantPlanError) as exc:
        return _finish(job, PrepareJob.State.FAILED, str(exc))
    try:
        return _run(job, ckpt, spec, plan, progress)
    finally:
        if hasattr(ckpt, "close"):
            ckpt.close()  # HTTP connection pool of a remote checkpoint


def _run(job: PrepareJob, ckpt, spec: MoeSpec, plan, progress) -> PrepareJob:
    store = BlobStore(settings.TENZRO["BLOB_DIR"])
    _register_model(job, spec, ckpt.config)
    done = {(i.layer, i.expert) for i in job.items.filter(state=PrepareItem.State.DONE) if store.has(i.blob_hash)}
    ids = job.experts if job.experts is not None else list(range(spec.slots()))

    def record(layer: int, expert: int | None, **fields) -> None:
        PrepareItem.objects.update_or_create(job=job, layer=layer, expert=expert, defaults=fields)

    for layer in job.layers:
        if job.include_gate and (layer, None) not in done:
            try:
                blob = load_gate(ckpt, spec, layer).to_blob()
                h = store.put(blob)
                with transaction.atomic():
                    GateBlob.objects.update_or_create(model_id=job.model_id, layer=layer, defaults={"blob_hash": h})
                    record(layer, None, state=PrepareItem.State.DONE, blob_hash=h, nbytes=len(blob), error="")
            except _EXPERT_ERRORS as exc:
                record(layer, None, state=PrepareItem.State.FAILED, blob_hash="", nbytes=0, error=str(exc))
            _refresh_counters(job)
            if progress:
                progress(job)
        for e in ids:
            if (layer, e) in done:
                continue
            if PrepareJob.objects.filter(job_id=job.job_id, cancel_requested=True).exists():
                return _finish(job, PrepareJob.State.CANCELLED, "cancelled by the operator")
            try:
                job.current_tensor = ", ".join(expert_sources(ckpt, spec, layer, e))[:500]
                job.save(update_fields=["current_tensor", "updated"])
                if hasattr(ckpt, "load_expert_blocks"):  # GGUF: the file's blocks, kept as they are
                    names = spec.expert_tensor_names(layer, e)
                    w, decoded = ckpt.load_expert_blocks(names, f"layer {layer} expert {e}")
                    dtype = ckpt.blob_dtype(names)
                else:
                    w, decoded = load_expert(ckpt, spec, layer, e), {}
                    dtype = source_dtype(ckpt, spec, layer, e)
                wq, fallbacks = quantize_expert(w, plan, f"layer {layer} expert {e}")
                fallbacks = {**decoded, **fallbacks}
                blob = wq.to_blob(dtype, {f"{k}.fallback": v for k, v in fallbacks.items()})
                h = store.put(blob)
                tag = blob_quant_tag(wq, dtype)
                with transaction.atomic():
                    ExpertBlob.objects.update_or_create(model_id=job.model_id, layer=layer, expert=e,
                                                        defaults={"blob_hash": h, "nbytes": len(blob), "quant": tag})
                    record(layer, e, state=PrepareItem.State.DONE, blob_hash=h, nbytes=len(blob), quant=tag,
                           fallbacks=fallbacks, error="")
            except _EXPERT_ERRORS as exc:
                record(layer, e, state=PrepareItem.State.FAILED, blob_hash="", nbytes=0, quant="", fallbacks={},
                       error=str(exc))
            _refresh_counters(job)
            if progress:
                progress(job)
    _refresh_counters(job)
    if job.failed_experts:
        return _finish(job, PrepareJob.State.FAILED, f"{job.failed_experts} of {job.total_experts} experts "
                                                     f"(or gates) failed; see the failures list")
    if has_backbone(ckpt):  # embeddings, attention, norms, head: the site can generate and export the model
        _refresh_counters(job, current_tensor="backbone")
        try:
            publish_backbone(job.source, job.model_id, job.revision or None, opened=ckpt)
        except (*_EXPERT_ERRORS, ChatTemplateError) as exc:
            return _finish(job, PrepareJob.State.FAILED, f"backbone: {exc}")
    return _finish(job, PrepareJob.State.COMPLETED)


def job_status(job: PrepareJob, items: bool = True) -> dict:
    """The ``tenzro_moePrepareStatus`` result: the reference's fields (``model_id``,
    ``layer`` (first), ``state``, ``error``, ``total_experts``, ``completed_experts``,
    ``experts[]``, ``gate``) plus ``job_id``, ``layers``, ``quant``, ``failed_experts``,
    ``bytes_written``, ``current_tensor``, ``failures[]``, ``gates[]`` and ``fallbacks[]``."""
    out = {"job_id": str(job.job_id), "model_id": job.model_id, "source": job.source, "revision": job.revision,
           "layer": job.layers[0] if job.layers else None, "layers": job.layers, "include_gate": job.include_gate,
           "quant": job.quant, "state": job.state, "error": job.error or None, "total_experts": job.total_experts,
           "completed_experts": job.completed_experts, "failed_experts": job.failed_experts,
           "bytes_written": job.bytes_written, "current_tensor": job.current_tensor, "attempts": job.attempts,
           "cancel_requested": job.cancel_requested}
    if not items:
        return out
    rows = list(job.items.all())
    out["experts"] = [{"layer": i.layer, "expert": i.expert, "uri": i.blob_uri, "bytes": i.nbytes, "quant": i.quant}
                      for i in rows if i.expert is not None and i.state == PrepareItem.State.DONE]
    out["gates"] = [{"layer": i.layer, "uri": i.blob_uri, "bytes": i.nbytes}
                    for i in rows if i.expert is None and i.state == PrepareItem.State.DONE]
    out["gate"] = out["gates"][0] if out["gates"] else None
    out["failures"] = [{"layer": i.layer, "expert": i.expert, "error": i.error}
                       for i in rows if i.state == PrepareItem.State.FAILED]
    out["fallbacks"] = [{"layer": i.layer, "expert": i.expert, "tensor": t, "note": note}
                        for i in rows for t, note in sorted(i.fallbacks.items())]
    return out
