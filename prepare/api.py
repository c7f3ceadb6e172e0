"""JSON-RPC bindings of expert preparation: thin validation around ``prepare.jobs``."""
from __future__ import annotations

from django.db import transaction
from rest_framework import serializers

from prepare import jobs
from prepare.models import PrepareJob
from prepare.tasks import run_prepare_job
from moe.jsonrpc import INVALID_PARAMS, RpcError
from registry.rpc import MethodTable


rpc_methods = MethodTable()


class AnyJson(serializers.Field):
    """A field that passes any JSON value through (the quant preset or object)."""

    def to_internal_value(self, data):
        return data

    def to_representation(self, value):
        return value


class PrepareParams(serializers.Serializer):
    """Params of ``tenzro_moePrepareExperts`` (reference system §5.6, plus the source)."""

    model_id = serializers.CharField(max_length=200)
    checkpoint = serializers.CharField(max_length=1000, help_text=(
        "checkpoint directory or GGUF file on the site, or http(s) URL (a .gguf URL is read by Range requests)"))
    revision = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    layer = serializers.IntegerField(min_value=0, required=False)
    layers = serializers.ListField(child=serializers.IntegerField(min_value=0), required=False, allow_empty=False)
    include_gate = serializers.BooleanField(required=False, default=True)
    experts = serializers.ListField(child=serializers.IntegerField(min_value=0), required=False, allow_empty=False)
    quant = AnyJson(required=False, allow_null=True, default=None)
    replace = serializers.BooleanField(required=False, default=False,
                                       help_text="republish a model id already published with another shape")


def _start(job: PrepareJob) -> None:
    # After commit, so a worker never looks for a job row it cannot see yet.
    transaction.on_commit(lambda: run_prepare_job.delay(str(job.job_id)))


@rpc_methods.method("tenzro_moePrepareExperts", params=PrepareParams, operator=True)
def prepare_experts(p: dict) -> dict:
    """Start a preparation job; returns ``{job_id, model_id, layer, layers, total_experts,
    include_gate, quant, state}`` at once (the work runs in a Celery task)."""
    layers = p.get("layers")
    if "layer" in p:
        layers = sorted(set((layers or []) + [p["layer"]]))
    try:
        job = jobs.create_job(p["checkpoint"], p["model_id"], layers=layers, experts=p.get("experts"),
                              include_gate=p["include_gate"], quant=p["quant"], revision=p["revision"] or None,
                              replace=p["replace"])
    except jobs.JobParamError as exc:
        raise RpcError(INVALID_PARAMS, str(exc), {"field": exc.field}) from exc
    _start(job)
    job.refresh_from_db()
    s = jobs.job_status(job, items=False)
    return {k: s[k] for k in ("job_id", "model_id", "layer", "layers", "total_experts", "include_gate", "quant",
                              "state")}


class JobParams(serializers.Serializer):
    """``{job_id}``."""

    job_id = serializers.UUIDField()


def _job(job_id) -> PrepareJob:
    try:
        return PrepareJob.objects.get(job_id=job_id)
    except PrepareJob.DoesNotExist:
        raise RpcError(INVALID_PARAMS, f"no preparation job {job_id}", {"field": "job_id"}) from None


@rpc_methods.method("tenzro_moePrepareStatus", params=JobParams)
def prepare_status(p: dict) -> dict:
    """Progress and results of a preparation job (experts done/total, bytes, current tensor,
    per-expert URIs, failures and quantization fallbacks)."""
    return jobs.job_status(_job(p["job_id"]))


@rpc_methods.method("tenzro_moePrepareCancel", params=JobParams, operator=True)
def prepare_cancel(p: dict) -> dict:
    """Ask a running job to stop before its next expert; returns its status (no item lists)."""
    return jobs.job_status(jobs.cancel_job(_job(p["job_id"]).job_id), items=False)


@rpc_methods.method("tenzro_moePrepareResume", params=JobParams, operator=True)
def prepare_resume(p: dict) -> dict:
    """Run an unfinished (crashed, failed) job again; finished experts are skipped."""
    job = _job(p["job_id"])
    if job.state == PrepareJob.State.COMPLETED:
        return jobs.job_status(job, items=False)
    if job.state == PrepareJob.State.CANCELLED:
        raise RpcError(INVALID_PARAMS, f"job {job.job_id} was cancelled; start a new one", {"field": "job_id"})
    _start(job)
    job.refresh_from_db()
    return jobs.job_status(job, items=False)
