"""Published, content-addressed blobs of experts and gates."""
from __future__ import annotations

from django.db import models


class ExpertBlob(models.Model):
    """The blob of one expert's FFN weights (``tenzro://blob/<blake3>``) for a model layer."""

    model_id = models.CharField(max_length=200)
    layer = models.PositiveIntegerField()
    expert = models.PositiveIntegerField()
    blob_hash = models.CharField(max_length=64)
    nbytes = models.BigIntegerField()
    quant = models.CharField(max_length=32, default="f32")
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["model_id", "layer", "expert"]
        constraints = [models.UniqueConstraint(fields=["model_id", "layer", "expert"], name="one_blob_per_expert")]

    @property
    def blob_uri(self) -> str:
        """``tenzro://blob/<hash>``."""
        return f"tenzro://blob/{self.blob_hash}"


class GateBlob(models.Model):
    """The self-describing gate (router) blob of one MoE layer."""

    model_id = models.CharField(max_length=200)
    layer = models.PositiveIntegerField()
    blob_hash = models.CharField(max_length=64)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["model_id", "layer"]
        constraints = [models.UniqueConstraint(fields=["model_id", "layer"], name="one_gate_per_layer")]

    @property
    def blob_uri(self) -> str:
        """``tenzro://blob/<hash>``."""
        return f"tenzro://blob/{self.blob_hash}"
