"""Admin of published blobs and preparation jobs (with a cancel action)."""
from __future__ import annotations

from django.contrib import admin

from prepare import jobs
from prepare.models import PrepareItem, PrepareJob
from registry.models import ExpertBlob, GateBlob


class PrepareItemInline(admin.TabularInline):
    """The per-expert outcomes of a job (read-only)."""

    model = PrepareItem
    extra = 0
    can_delete = False
    fields = ("layer", "expert", "state", "quant", "nbytes", "blob_hash", "fallbacks", "error")
    readonly_fields = fields


@admin.register(PrepareJob)
class PrepareJobAdmin(admin.ModelAdmin):
    """Jobs with progress columns; the cancel action stops them before their next expert."""

    list_display = ("job_id", "model_id", "state", "completed_experts", "total_experts", "failed_experts",
                    "bytes_written", "current_tensor", "updated")
    list_filter = ("state", "model_id")
    readonly_fields = [f.name for f in PrepareJob._meta.fields]
    inlines = [PrepareItemInline]
    actions = ["cancel"]

    @admin.action(description="Cancel the selected jobs")
    def cancel(self, request, queryset):
        """Set the cancel flag of each selected unfinished job."""
        for job in queryset:
            jobs.cancel_job(job.job_id)


@admin.register(ExpertBlob)
class ExpertBlobAdmin(admin.ModelAdmin):
    """Published expert blobs."""

    list_display = ("model_id", "layer", "expert", "quant", "nbytes", "blob_hash", "created")
    list_filter = ("model_id", "quant")


@admin.register(GateBlob)
class GateBlobAdmin(admin.ModelAdmin):
    """Published gate blobs."""

    list_display = ("model_id", "layer", "blob_hash", "created")
