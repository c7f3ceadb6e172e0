"""Celery tasks of the holders app (thin: call services; idempotent)."""
from __future__ import annotations

import asyncio

from celery import shared_task

from router import repair as repair_site


@shared_task(name="holders.repair_pass")
def repair_pass() -> dict | None:
    """The scheduled repair pass (django-celery-beat row "tenzro repair pass").

    Idempotent per period: a second beat or a retry in the same period returns None.
    """
    return asyncio.run(repair_site.run_pass("beat"))
