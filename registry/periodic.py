"""Once per period across processes: the claim beat's sweeps take before they run.

Several beats may run by mistake (one per machine), and a beat restarted mid-period sends
its tasks again; the sweeps are idempotent, but each should still run once per period for
the whole deployment. ``claim_period`` is an atomic add in the shared cache (Redis
``SET NX`` with an expiry in services mode): the first caller of a period wins. The repair
pass has its own claim, a database row per period (``registry.repair_service.begin_pass``).
"""
from __future__ import annotations

import os
import time

from django.conf import settings
from django.core.cache import cache


def claim_period(name: str, period_s: float, now: float | None = None) -> bool:
    """Whether this caller is the first to run ``name`` in the current ``period_s``-second
    period (unix time // period) of this deployment and task queue; raises ``ValueError`` for
    ``period_s`` <= 0. The claim expires after two periods."""
    if not period_s or period_s <= 0:
        raise ValueError(f"period_s must be above 0, got {period_s!r}")
    now = time.time() if now is None else now
    key = (f"tenzro:period:{settings.TENZRO['DEPLOYMENT']}:{settings.CELERY_TASK_DEFAULT_QUEUE}:{name}:"
           f"{int(now // period_s)}")
    return bool(cache.add(key, os.getpid(), timeout=int(2 * period_s) + 1))
