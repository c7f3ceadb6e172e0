"""Per-client fixed-window counters for the site's synchronous paths (market login, REST
heartbeats): the synchronous twin of ``router.admission.over_rate``, which a registry module
cannot import (``.importlinter``: registry < router).

Windows live in the Django cache (Redis when ``REDIS_URL`` is set), so every site process
shares one count per client.
"""
from __future__ import annotations

import time

from django.core.cache import cache


def window_index(window_s: int) -> int:
    """The current fixed window's number (tests pin it so a window edge cannot split a burst)."""
    return int(time.time() // window_s)


def over_rate(scope: str, client: str, limit: int, window_s: int = 60, n: int = 1) -> bool:
    """Whether ``client`` spent more than ``limit`` units of ``scope`` in the current
    ``window_s``-second window, counting ``n`` more now (``limit`` ≤ 0: unlimited)."""
    if limit <= 0:
        return False
    key = f"rate:{scope}:{client}:{window_index(window_s)}"
    if cache.add(key, n, timeout=window_s + 10):
        return n > limit
    try:
        return cache.incr(key, n) > limit
    except ValueError:  # the key expired between add and incr
        return False


def retry_after_s(window_s: int = 60) -> int:
    """Seconds until the current window of ``over_rate`` ends (at least 1)."""
    return max(1, window_s - int(time.time()) % window_s)
