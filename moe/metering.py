"""Metering of served tokens: per expert and per host, over a rolling minute (reference §10).

Unlike the reference (its gap 16): tokens are kept per expert as well as for the host, the
window is a true rolling 60 s (per-second buckets, so an idle gap never leaves stale
counts), and callers decide what counts: dispute re-execution and self-tests pass
``metered=False`` to the runtime and never reach this meter.

``tps = tokens in the last 60 s / 60`` rounded down, as an integer (tokens per second).
Pure Python; imports nothing from Django.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Hashable

WINDOW_S = 60


class _Window:
    """Per-second token counts over the last ``WINDOW_S`` seconds."""

    __slots__ = ("buckets", "total")

    def __init__(self):
        self.buckets: deque[list[int]] = deque()  # [second, tokens], ascending seconds
        self.total = 0

    def add(self, sec: int, tokens: int) -> None:
        if self.buckets and self.buckets[-1][0] == sec:
            self.buckets[-1][1] += tokens
        else:
            self.buckets.append([sec, tokens])
        self.total += tokens

    def trim(self, sec: int) -> int:
        while self.buckets and self.buckets[0][0] <= sec - WINDOW_S:
            self.total -= self.buckets.popleft()[1]
        return self.total


class Meter:
    """Thread-safe rolling-minute token counts for a host and each of its keys (experts).

    ``clock`` returns seconds (default ``time.monotonic``); injectable for tests.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._host = _Window()
        self._keys: dict[Hashable, _Window] = defaultdict(_Window)
        self._lock = threading.Lock()

    def record(self, key: Hashable, tokens: int) -> None:
        """Count ``tokens`` (≥ 0) served now for ``key`` and for the host."""
        if tokens <= 0:
            return
        sec = int(self.clock())
        with self._lock:
            self._host.add(sec, tokens)
            self._keys[key].add(sec, tokens)

    def tokens(self, key: Hashable | None = None) -> int:
        """Tokens served in the last minute by ``key`` (None: the whole host)."""
        sec = int(self.clock())
        with self._lock:
            if key is None:
                return self._host.trim(sec)
            w = self._keys.get(key)
            if w is None:
                return 0
            n = w.trim(sec)
            if n == 0:
                del self._keys[key]
            return n

    def tps(self, key: Hashable | None = None) -> int:
        """Tokens per second over the last minute (integer, rounded down)."""
        return self.tokens(key) // WINDOW_S

    def forget(self, key: Hashable) -> None:
        """Drop ``key``'s counts (the expert was unloaded); the host total keeps them."""
        with self._lock:
            self._keys.pop(key, None)
