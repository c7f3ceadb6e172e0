"""Admin entries of the receipts economy: kept receipts, disputes, settlements (read-only records)."""
from django.contrib import admin

from settlement.models import Dispute, ReceiptSample, Settlement


class ReadOnly(admin.ModelAdmin):
    """Economy records are written by the services only: the admin browses them."""

    def has_add_permission(self, request):
        """No manual rows."""
        return False

    def has_change_permission(self, request, obj=None):
        """Records are immutable here."""
        return False


@admin.register(ReceiptSample)
class ReceiptSampleAdmin(ReadOnly):
    """Kept receipts."""

    list_display = ("key", "provider", "model_id", "layer", "expert", "carrier_bytes", "audit_state", "stored_at_ms")
    list_filter = ("audit_state", "model_id")
    search_fields = ("key", "provider", "forward_id", "commitment")
    exclude = ("commitment_rows", "carrier_inline")


@admin.register(Dispute)
class DisputeAdmin(ReadOnly):
    """Dispute outcomes and fraud proofs."""

    list_display = ("sample", "provider", "upheld", "executed_by", "automatic", "reputation_after", "created_ms")
    list_filter = ("upheld", "automatic")
    search_fields = ("provider", "sample__key")


@admin.register(Settlement)
class SettlementAdmin(ReadOnly):
    """Per-forward, per-holder settlements."""

    list_display = ("forward_id", "provider", "model_id", "tokens", "batches", "gross", "holder_amount",
                    "network_fee", "state", "settled_at_ms")
    list_filter = ("state", "model_id")
    search_fields = ("forward_id", "provider")
