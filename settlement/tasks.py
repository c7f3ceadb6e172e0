"""Celery tasks of the receipts economy (thin, idempotent): settlement and automatic audits.

Settling claims each pending row exactly once (``services.settle_many``), so a retried task,
two workers or two beats never pay twice. An audit of a key already disputed returns the
stored outcome. Without ``REDIS_URL`` these run inline (eager).
"""
from __future__ import annotations

import asyncio

from celery import shared_task

from registry.periodic import claim_period
from settlement import services


@shared_task(name="settlement.settle_forward")
def settle_forward(forward_id: str) -> int:
    """Settle the pending settlements of one forward; returns how many this run paid."""
    return services.settle_forward(forward_id)


@shared_task(name="settlement.settle_forwards")
def settle_forwards(forward_ids: list[str]) -> int:
    """Settle the pending settlements of several forwards (a generation's layer forwards,
    handed on together) in one task; returns how many this run paid."""
    return services.settle_forwards([str(f) for f in forward_ids])


@shared_task(name="settlement.settle_pending")
def settle_pending(period_s: float | None = None) -> int:
    """Beat sweep: settle any pending settlement (a lost task's); returns how many were paid
    (0 when ``period_s`` is given and another beat's run claimed this period)."""
    if period_s and not claim_period("settlement.settle_pending", period_s):
        return 0
    return services.settle_pending()


@shared_task(name="settlement.audit_receipt")
def audit_receipt(key: str) -> bool:
    """Automatically dispute one kept receipt on an executor other than the accused; returns
    whether it was audited (False: no executor held the blob)."""
    return asyncio.run(services.audit(key)) is not None


@shared_task(name="settlement.audit_pending")
def audit_pending(period_s: float | None = None) -> int:
    """Beat sweep: audit kept receipts that have no dispute yet; returns how many were audited
    (0 when ``period_s`` is given and another beat's run claimed this period)."""
    if period_s and not claim_period("settlement.audit_pending", period_s):
        return 0
    return asyncio.run(services.audit_pending())
