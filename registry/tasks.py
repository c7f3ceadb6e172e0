"""Celery tasks of the registry (thin: call services; idempotent). Scheduled by beat
(``CELERY_BEAT_SCHEDULE``, with ``period_s``: each runs once per period across beats,
``registry.periodic``); without a broker the site's in-process timer runs the same services."""
from __future__ import annotations

from celery import shared_task

from registry import services
from registry.periodic import claim_period


@shared_task(name="registry.sweep_stale_providers")
def sweep_stale_providers(period_s: float | None = None) -> int:
    """``services.sweep_stale_providers``: how many providers were marked disconnected (0 when
    ``period_s`` is given and another beat's run claimed this period)."""
    if period_s and not claim_period("registry.sweep_stale_providers", period_s):
        return 0
    return services.sweep_stale_providers()


@shared_task(name="registry.expire_unproven_providers")
def expire_unproven_providers(period_s: float | None = None) -> int:
    """``services.expire_unproven_providers``: how many unproven providers were deleted (0 when
    ``period_s`` is given and another beat's run claimed this period)."""
    if period_s and not claim_period("registry.expire_unproven_providers", period_s):
        return 0
    return services.expire_unproven_providers()
