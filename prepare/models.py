"""Preparation jobs: long-lived state of extracting and quantizing experts into blobs."""
from __future__ import annotations

from django.db import models

from moe.content import blob_uri


class PrepareJob(models.Model):
    """A preparation job: extract (and quantize) experts of some layers of a checkpoint into
    blobs. Long-lived state lives here (not in Redis): a crashed job resumes from its items.

    ``source`` is a checkpoint directory or an http(s) URL (``revision`` for Hub URLs);
    ``layers`` the MoE layers; ``experts`` the expert ids (None = every slot, shared
    included); ``quant`` the plan as given (preset name, per-projection object, or None for
    dense). Progress: ``completed_experts`` / ``total_experts``, ``failed_experts``,
    ``bytes_written``, ``current_tensor``. ``state`` ends ``completed``, ``failed`` (some
    expert failed, or the job could not run: ``error``) or ``cancelled``.
    """

    class State(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"
        COMPLETED = "completed"
        FAILED = "failed"
        CANCELLED = "cancelled"

    job_id = models.UUIDField(primary_key=True)
    model_id = models.CharField(max_length=200)
    source = models.CharField(max_length=1000)
    revision = models.CharField(max_length=200, blank=True, default="")
    layers = models.JSONField(default=list)
    experts = models.JSONField(null=True, blank=True)
    include_gate = models.BooleanField(default=True)
    quant = models.JSONField(null=True, blank=True)
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING)
    error = models.TextField(blank=True, default="")
    total_experts = models.PositiveIntegerField(default=0)
    completed_experts = models.PositiveIntegerField(default=0)
    failed_experts = models.PositiveIntegerField(default=0)
    bytes_written = models.BigIntegerField(default=0)
    current_tensor = models.CharField(max_length=500, blank=True, default="")
    cancel_requested = models.BooleanField(default=False)
    attempts = models.PositiveIntegerField(default=0)
    created = models.DateTimeField(auto_now_add=True)
    updated = models.DateTimeField(auto_now=True)
    finished = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created"]

    def __str__(self) -> str:
        return f"prepare {self.model_id} {self.job_id} ({self.state})"

    @property
    def done(self) -> bool:
        """Whether the job reached a final state."""
        return self.state in (self.State.COMPLETED, self.State.FAILED, self.State.CANCELLED)


class PrepareItem(models.Model):
    """One expert (or gate: ``expert`` null) of a job: its outcome, blob and fallbacks."""

    class State(models.TextChoices):
        DONE = "done"
        FAILED = "failed"

    job = models.ForeignKey(PrepareJob, on_delete=models.CASCADE, related_name="items")
    layer = models.PositiveIntegerField()
    expert = models.PositiveIntegerField(null=True, blank=True)
    state = models.CharField(max_length=8, choices=State.choices)
    blob_hash = models.CharField(max_length=64, blank=True, default="")
    nbytes = models.BigIntegerField(default=0)
    quant = models.CharField(max_length=64, blank=True, default="")
    fallbacks = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["layer", "expert"]
        constraints = [models.UniqueConstraint(fields=["job", "layer", "expert"], name="one_item_per_job_expert"),
                       models.UniqueConstraint(fields=["job", "layer"], condition=models.Q(expert__isnull=True),
                                               name="one_gate_item_per_job_layer")]

    @property
    def blob_uri(self) -> str:
        """``tenzro://blob/<hash>`` ("" when failed)."""
        return blob_uri(self.blob_hash) if self.blob_hash else ""
