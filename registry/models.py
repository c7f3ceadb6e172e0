"""Registry records: providers, the experts they hold, and the models the site knows."""
from __future__ import annotations

from django.db import models

from registry.shardmap import RESIDENCIES


class Provider(models.Model):
    """A node identified by its ed25519 public key (64 lowercase hex), kept current by heartbeats.

    ``connected`` is true while the provider's agent WebSocket is open on some site process;
    ``last_heartbeat_ms`` (unix milliseconds of the last accepted signed heartbeat) is
    strictly increasing, which rejects replays.
    """

    class Status(models.TextChoices):
        ACTIVE = "Active"
        INACTIVE = "Inactive"
        SUSPENDED = "Suspended"

    provider = models.CharField(max_length=64, primary_key=True)
    name = models.CharField(max_length=200, blank=True, default="")
    http_endpoint = models.CharField(max_length=500, blank=True, default="")
    iroh_endpoint_id = models.CharField(max_length=200, blank=True, default="")
    roles = models.JSONField(default=list, blank=True)
    moe_gpu = models.BooleanField(default=False)
    price_per_input_token = models.BigIntegerField(default=10)
    minimum_price = models.BigIntegerField(default=100)
    reputation = models.IntegerField(default=500)
    # Data-plane record of this provider as a holder (written by record_holder_outcomes).
    batches_served = models.BigIntegerField(default=0, db_default=0)
    batch_failures = models.BigIntegerField(default=0, db_default=0)
    latency_ms_ewma = models.FloatField(default=0.0, db_default=0.0)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ACTIVE)
    connected = models.BooleanField(default=False)
    agent_channel = models.CharField(max_length=200, blank=True, default="")
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    last_heartbeat_ms = models.BigIntegerField(default=0)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["provider"]

    def __str__(self) -> str:
        return f"{self.name or 'provider'} {self.provider[:12]}…"


class Holding(models.Model):
    """A provider's declaration that it holds one expert (``expert == num_experts``: shared slot)."""

    provider = models.ForeignKey(Provider, on_delete=models.CASCADE, related_name="holdings")
    model_id = models.CharField(max_length=200)
    layer = models.PositiveIntegerField()
    expert = models.PositiveIntegerField()
    residency = models.CharField(max_length=16, choices=[(r, r) for r in RESIDENCIES], default="Warm")
    committed_tps = models.PositiveIntegerField(default=0)
    blob_uri = models.CharField(max_length=200, blank=True, default="")

    class Meta:
        ordering = ["model_id", "layer", "expert", "provider"]
        constraints = [
            models.UniqueConstraint(fields=["provider", "model_id", "layer", "expert"], name="one_holding_per_expert")
        ]
        indexes = [models.Index(fields=["model_id", "layer", "expert"])]

    def __str__(self) -> str:
        return f"{self.model_id} l{self.layer}/e{self.expert} @ {self.provider_id[:12]}"


class MoeModel(models.Model):
    """A model whose experts are published on this site: its MoE shape, from its HF config.

    ``moe_layers`` lists the MoE layer indices; ``num_experts`` counts routed experts; the
    shared expert (when ``n_shared_experts > 0``) is the extra slot ``num_experts``.
    """

    model_id = models.CharField(max_length=200, primary_key=True)
    family = models.CharField(max_length=50)
    num_experts = models.PositiveIntegerField()
    top_k = models.PositiveIntegerField()
    n_shared_experts = models.PositiveIntegerField(default=0)
    hidden_size = models.PositiveIntegerField()
    expert_d_ff = models.PositiveIntegerField()
    moe_layers = models.JSONField(default=list)
    config = models.JSONField(default=dict)
    source = models.CharField(max_length=1000, blank=True, default="")
    created = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.model_id

    def expert_keys(self) -> list[tuple[int, int]]:
        """Every (layer, expert) slot of the model, shared slot included."""
        slots = self.num_experts + (1 if self.n_shared_experts else 0)
        return [(layer, e) for layer in self.moe_layers for e in range(slots)]
