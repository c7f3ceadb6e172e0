"""Admission control of the router (issue 15 item 4): a bound on concurrent forwards with a
bounded queue, per-client forward rates, and the router's own saturation signal.

* ``Admission.slot()`` (one ``Admission`` per event loop, kept by ``router.state.Router``): at
  most ``limit`` distributed forwards run at once in one event loop; up to ``queue`` more
  wait (first come, first served) at most ``wait_s`` seconds for a slot; past either bound
  the caller gets ``Busy`` (-32005) at once instead of a deadline later.
* ``Admission.saturated_since(t)``: whether the router itself was saturated since monotonic
  time ``t`` (forwards queued or refused, or the event loop late by more than ``LAG_S``). A
  holder deadline that expires then is the router's fault, not the holder's: the forward
  records it with ``fault: false`` (no reputation loss, no audit fault).
* ``over_rate(scope, client, limit)``: a fixed one-minute window per client address, shared
  across site processes through the Django cache (Redis when ``REDIS_URL`` is set).

Settings (``TENZRO``): ``FORWARD_CONCURRENCY``, ``FORWARD_QUEUE``, ``FORWARD_QUEUE_WAIT_S``,
``FORWARD_RATE_PER_MINUTE`` (README "Configuration").
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import time

from django.conf import settings
from django.core.cache import cache, caches
from django.core.cache.backends.locmem import LocMemCache

from moe.jsonrpc import BUSY, RpcError

LAG_S = 0.25  # event-loop lateness that counts as the router being saturated
_PROBE_S = 0.1


class Busy(RpcError):
    """The router refuses work now (-32005): ``reason`` "capacity" (forward slots and queue
    full, or no slot within the queue wait) or "rate" (the client's forward rate is spent);
    ``data.retry_after_s`` is a hint in seconds."""

    def __init__(self, message: str, reason: str, retry_after_s: float):
        super().__init__(BUSY, message, {"reason": reason, "retry_after_s": retry_after_s},
                         field="rate" if reason == "rate" else "capacity")
        self.reason = reason
        self.retry_after_s = retry_after_s


class Admission:
    """Concurrency bound with a bounded FIFO queue for one event loop (module docstring).

    ``limit`` ≥ 1 forwards run at once; ``queue`` ≥ 0 wait at most ``wait_s`` seconds.
    ``observe(running, queued)``: called when either changes (the router's metrics).
    """

    def __init__(self, limit: int, queue: int, wait_s: float, observe=None):
        self.limit, self.queue, self.wait_s = max(1, limit), max(0, queue), wait_s
        self.observe = observe or (lambda running, queued: None)
        self.running = 0
        self.waiters: collections.deque[asyncio.Future] = collections.deque()
        self.saturated_at = -math.inf
        self.refused = 0
        self._probe: asyncio.Task | None = None

    def watch(self) -> None:
        """Keep the event-loop lag probe of the running loop going (started once, restarted if it ended)."""
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._watch_lag())

    async def _watch_lag(self) -> None:
        """Mark saturation when the loop wakes this probe more than ``LAG_S`` late."""
        while True:
            t = time.monotonic()
            await asyncio.sleep(_PROBE_S)
            if time.monotonic() - t - _PROBE_S > LAG_S:
                self.saturated_at = time.monotonic()

    def saturated_since(self, t: float) -> bool:
        """Whether the router was saturated at any time since monotonic time ``t``."""
        return bool(self.waiters) or self.saturated_at >= t

    def _refuse(self, why: str) -> Busy:
        self.refused += 1
        self.saturated_at = time.monotonic()
        return Busy(f"the router is busy: {why}; retry shortly", "capacity", max(1.0, self.wait_s / 4))

    def _release(self) -> None:
        try:
            while self.waiters:  # hand the slot to the oldest waiter still waiting
                fut = self.waiters.popleft()
                if not fut.done():
                    fut.set_result(None)
                    return
            self.running -= 1
        finally:
            self.observe(self.running, len(self.waiters))

    @contextlib.asynccontextmanager
    async def slot(self):
        """Hold one forward slot for the ``async with`` body. Raises ``Busy`` at once when
        ``limit`` forwards run and ``queue`` wait, or after ``wait_s`` without a slot."""
        if self.running < self.limit and not self.waiters:
            self.running += 1
            self.observe(self.running, len(self.waiters))
        else:
            self.saturated_at = time.monotonic()
            if len(self.waiters) >= self.queue:
                raise self._refuse(f"{self.running} forwards running and {len(self.waiters)} queued")
            fut = asyncio.get_running_loop().create_future()
            self.waiters.append(fut)
            self.observe(self.running, len(self.waiters))
            try:
                await asyncio.wait_for(asyncio.shield(fut), self.wait_s)
            except asyncio.TimeoutError:
                if fut.done() and not fut.cancelled():  # handed over just as the wait ran out
                    self._release()
                else:
                    fut.cancel()
                raise self._refuse(f"no forward slot within {self.wait_s:g} s") from None
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._release()
                else:
                    fut.cancel()
                raise
        try:
            yield
        finally:
            self._release()


def overloaded(failures: list[dict]) -> bool:
    """Whether a failed forward's ``failures`` show the router's own overload and nothing else:
    some deadline expired while it was saturated and no holder was at fault (then the caller
    gets ``Busy``, not an execution error)."""
    return any(f.get("saturated") for f in failures) and not any(f.get("fault") for f in failures)


async def over_rate(scope: str, client: str, limit: int, n: int = 1) -> bool:
    """Whether ``client`` spent more than ``limit`` units of ``scope`` in the current minute,
    counting ``n`` more now (``limit`` ≤ 0: unlimited). Cache-backed fixed window; the
    process's own memory cache (no broker) is counted inline: Django's async cache methods
    would take two thread hand-offs per request for a dictionary update."""
    if limit <= 0:
        return False
    key = f"rate:{scope}:{client}:{int(time.time() // 60)}"
    if isinstance(caches["default"], LocMemCache):
        if cache.add(key, n, timeout=70):
            return n > limit
        try:
            return cache.incr(key, n) > limit
        except ValueError:
            return False
    if await cache.aadd(key, n, timeout=70):
        return n > limit
    try:
        return await cache.aincr(key, n) > limit
    except ValueError:  # the key expired between add and incr
        return False


async def check_forward_rate(client: str | None) -> None:
    """Raise ``Busy("rate")`` when ``client`` is over ``TENZRO["FORWARD_RATE_PER_MINUTE"]``
    forwards in the current minute (each forward method call counts one)."""
    limit = settings.TENZRO["FORWARD_RATE_PER_MINUTE"]
    if await over_rate("forward", client or "?", limit):
        raise Busy(f"forward rate limit of {limit} per minute for this client exceeded; retry in the next minute",
                   "rate", float(60 - int(time.time()) % 60))
