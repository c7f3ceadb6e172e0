"""Celery tasks of the registry (thin: call services; idempotent). Scheduled by beat
(``CELERY_BEAT_SCHEDULE``); without a broker the site's in-process timer runs the same services."""
from __future__ import annotations

from celery import shared_task

from registry import services


@shared_task(name="registry.sweep_stale_providers")
def sweep_stale_providers() -> int:
    """``services.sweep_stale_providers``: how many providers were marked disconnected."""
    return services.sweep_stale_providers()


@shared_task(name="registry.expire_unproven_providers")
def expire_unproven_providers() -> int:
    """``services.expire_unproven_providers``: how many unproven providers were deleted."""
    return services.expire_unproven_providers()
