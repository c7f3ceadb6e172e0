"""Operators' disputes from the console, next to the automatic audits.

Every sampled receipt is audited automatically (``services.audit``), and a receipt keeps one
dispute record. An operator may still dispute a receipt whose audit *passed*: the audit's
record is replaced by the operator's own re-execution (``services.dispute``), so an upheld
outcome penalizes once and the record shows as the operator's. A failed audit already
penalized the provider; disputing it again answers that stored outcome.
"""
from __future__ import annotations

from asgiref.sync import sync_to_async
from django.db import transaction

from settlement import services
from settlement.models import Dispute


def operator_can_dispute(outcome: dict | None) -> bool:
    """Whether the console offers an operator dispute for a receipt with this ``dispute_json``
    outcome (None: not disputed yet): none yet, or an automatic audit that passed."""
    return outcome is None or (outcome["automatic"] and not outcome["disputed"])


def _take_passed_audit(key: str) -> dict | None:
    """Delete the receipt's passed automatic audit, returning its fields to restore; None when
    there is none (no dispute yet, an upheld one, or an operator's)."""
    with transaction.atomic():
        d = Dispute.objects.select_for_update().filter(sample__key=key, automatic=True, upheld=False).first()
        if d is None:
            return None
        fields = {f.attname: getattr(d, f.attname) for f in Dispute._meta.concrete_fields if f.attname != "id"}
        d.delete()
        return fields


def _restore(fields: dict) -> None:
    """Put a taken audit back unless a dispute of that receipt was recorded meanwhile."""
    with transaction.atomic():
        if not Dispute.objects.filter(sample_id=fields["sample_id"]).exists():
            Dispute.objects.create(**fields)


async def operator_dispute(key: str) -> dict:
    """The console's Dispute: ``services.dispute(key)`` run as the operator's (``automatic``
    False), also for a receipt whose automatic audit passed (module docstring). Returns the
    ``dispute_json`` outcome; raises ``services.EconomyError`` like ``dispute``, leaving a
    replaced audit's record as it was."""
    taken = await sync_to_async(_take_passed_audit)(key)
    try:
        return await services.dispute(key)
    except BaseException:
        if taken is not None:
            await sync_to_async(_restore)(taken)
        raise
