"""Celery tasks of the registry (thin: look up ids, call services; idempotent)."""
from __future__ import annotations

from celery import shared_task

from registry.selectors import live_cutoff
from registry.models import AgentSession, Provider


@shared_task(name="registry.sweep_stale_providers")
def sweep_stale_providers() -> int:
    """Mark providers whose heartbeats stopped (``MISSED_HEARTBEATS`` intervals) as disconnected.

    Returns how many rows changed; running it twice changes nothing more.
    """
    stale = Provider.objects.filter(connected=True, last_heartbeat__lt=live_cutoff())
    AgentSession.objects.filter(provider__in=stale).delete()
    return stale.update(connected=False, agent_channel="")
