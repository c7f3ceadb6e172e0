"""Receipts economy records (docs/DESIGN.md §7): kept receipt samples, disputes (with fraud proofs), settlements."""
from __future__ import annotations

from django.db import models


class ReceiptSample(models.Model):
    """A remote batch kept in full because ``HMAC(router secret, commitment) mod N == 0``.

    Holds the request header (model, layer, expert, tokens, d_model, carrier kind, output
    encoding, blob hash, quant kind), the exact carrier bytes (inline up to
    ``INLINE_CARRIER_MAX`` bytes, else a file of the receipt store named by its BLAKE3
    ``carrier_hash``), the canonical commitment bytes (their SHA-256 is ``commitment``),
    the signed receipt, the provider and the ``forward_id``. ``audit_state``: "pending" until
    the automatic audit ran (then "done"), or "skipped" when no executor held the blob.
    """

    class Audit(models.TextChoices):
        PENDING = "pending"
        DONE = "done"
        SKIPPED = "skipped"

    key = models.CharField(max_length=300, unique=True)
    forward_id = models.CharField(max_length=64, db_index=True)
    provider = models.CharField(max_length=64, db_index=True)
    model_id = models.CharField(max_length=200, db_index=True)
    layer = models.PositiveIntegerField()
    expert = models.PositiveIntegerField()
    tokens = models.JSONField()
    d_model = models.PositiveIntegerField()
    request_id = models.CharField(max_length=64, unique=True)  # one record per batch, however often replayed
    carrier_kind = models.CharField(max_length=8)
    output_kind = models.CharField(max_length=8)
    blob_hash = models.CharField(max_length=64, blank=True, default="")
    quant = models.CharField(max_length=32, blank=True, default="")
    commitment = models.CharField(max_length=64)
    commitment_rows = models.BinaryField()
    receipt = models.JSONField()
    carrier_inline = models.BinaryField(null=True, blank=True)
    carrier_hash = models.CharField(max_length=64, blank=True, default="")
    carrier_bytes = models.PositiveIntegerField()
    stored_at_ms = models.BigIntegerField()
    audit_state = models.CharField(max_length=8, choices=Audit.choices, default=Audit.PENDING, db_index=True)

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return self.key


class Dispute(models.Model):
    """The outcome of re-executing one kept batch (one per sample: a second dispute returns this).

    ``upheld`` when the re-executed rows fail the committed ones under the governance
    tolerances; ``proof`` is then the site-signed fraud proof. ``executed_by``: "site" or
    the provider id of the honest holder that re-executed.
    """

    sample = models.OneToOneField(ReceiptSample, on_delete=models.CASCADE, related_name="dispute")
    provider = models.CharField(max_length=64, db_index=True)
    upheld = models.BooleanField()
    verification = models.JSONField()
    executed_by = models.CharField(max_length=64)
    proof = models.JSONField(null=True, blank=True)
    automatic = models.BooleanField(default=False)
    reputation_after = models.IntegerField(null=True)
    quarantined_until_ms = models.BigIntegerField(default=0)
    created_ms = models.BigIntegerField()

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"{'upheld' if self.upheld else 'rejected'} {self.sample.key}"


class Settlement(models.Model):
    """What one forward owes one holder for its remote, receipt-verified batches (reference §8).

    Written "pending" right after the forward; one worker claims it exactly once (conditional
    update on ``state``) and credits the holder in the same transaction. ``(forward_id,
    provider)`` is unique. ``commitments_digest``: SHA-256 of the holder's commitment hashes
    (32 bytes each) concatenated in arrival order.
    """

    class State(models.TextChoices):
        PENDING = "pending"
        SETTLED = "settled"

    forward_id = models.CharField(max_length=64)
    provider = models.CharField(max_length=64, db_index=True)
    model_id = models.CharField(max_length=200, db_index=True)
    tokens = models.BigIntegerField()
    batches = models.PositiveIntegerField()
    commitments_digest = models.CharField(max_length=64)
    state = models.CharField(max_length=8, choices=State.choices, default=State.PENDING, db_index=True)
    gross = models.BigIntegerField(default=0)
    holder_amount = models.BigIntegerField(default=0)
    network_fee = models.BigIntegerField(default=0)
    created_ms = models.BigIntegerField()
    settled_at_ms = models.BigIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        constraints = [models.UniqueConstraint(fields=["forward_id", "provider"], name="one_settlement_per_holder")]

    def __str__(self) -> str:
        return f"{self.forward_id[:12]} → {self.provider[:12]} ({self.state})"
