"""Celery tasks of the receipts economy (thin, idempotent): settlement and automatic audits.

Settling claims each pending row exactly once (``services.settle_many``), so a retried task,
two workers or two beats never pay twice. An audit of a key already disputed returns the
stored outcome. Without ``REDIS_URL`` these run inline (eager).
"""
from __future__ import annotations

import asyncio

from celery import shared_task

from settlement import services


@shared_task(name="settlement.settle_forward")
def settle_forward(forward_id: str) -> int:
    """Settle the pending settlements of one forward; returns how many this run paid."""
    return services.settle_forward(forward_id)


@shared_task(name="settlement.settle_pending")
def settle_pending() -> int:
    """Beat sweep: settle any pending settlement (a lost task's); returns how many were paid."""
    return services.settle_pending()


@shared_task(name="settlement.audit_receipt")
def audit_receipt(key: str) -> bool:
    """Automatically dispute one kept receipt on an executor other than the accused; returns
    whether it was audited (False: no executor held the blob)."""
    return asyncio.run(services.audit(key)) is not None


@shared_task(name="settlement.audit_pending")
def audit_pending() -> int:
    """Beat sweep: audit kept receipts that have no dispute yet; returns how many were audited."""
    return asyncio.run(services.audit_pending())
