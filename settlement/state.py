"""The receipts economy's state in one site process (``settlement.apps.current()``): the
forward listener's background work and the dispute runtime.

After each forward, in the background of the router's event loop: keep the sampled batches
and write the pending settlements (``services.record_forwards``, one transaction per group,
on a worker thread with its own connection so the numpy work never queues behind the
router's DB reads), then settle
the forward and audit each new sample. With a broker (``REDIS_URL``) these are Celery tasks
(``settlement.tasks``, swept by beat); without one they run here, and an inline timer
(every ``TENZRO_AUDIT_INTERVAL`` seconds, default 30) sweeps what a failed attempt left.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading

from channels.db import database_sync_to_async
from django.conf import settings

from moe.runtime import ExpertRuntime
from router.apps import current as router_current
from router.hooks import ForwardRecord
from settlement import services, tasks
from settlement.apps import current

log = logging.getLogger(__name__)


def inline() -> bool:
    """Whether tasks run in this process (no broker: Celery eager mode)."""
    return bool(getattr(settings, "CELERY_TASK_ALWAYS_EAGER", True))


def _record_and_settle(records: list[ForwardRecord]) -> list[str]:
    """Worker thread: record every forward of ``records``, settle them when tasks run inline
    (else queue one ``settle_forwards`` task for all of them: a generation's flush is one
    task, not one per layer forward); returns the kept sample keys."""
    keys = [k for out in services.record_forwards(records) for k in out["samples"]]
    if inline():
        services.settle_forwards([r.forward_id for r in records])
    else:
        tasks.settle_forwards.delay([r.forward_id for r in records])
    metrics = router_current().metrics
    metrics.settled_forwards.inc(len(records))
    metrics.settlement_tasks.inc()
    return keys


async def _sweep_forever(interval: float) -> None:
    """The inline stand-in for beat: audit and settle what is still pending."""
    while True:
        await asyncio.sleep(interval)
        try:
            await services.audit_pending()
            await database_sync_to_async(services.settle_pending)()
        except Exception:
            log.exception("economy sweep failed; retrying in %s s", interval)


class Economy:
    """The settlement app's per-process state (module docstring): inline audit slots and sweep
    timers per event loop, the background audits in flight, and the dispute runtime."""

    def __init__(self):
        self._audit_slots: dict[int, asyncio.Semaphore] = {}
        self._timers: dict[int, asyncio.Task] = {}
        self._background: set[asyncio.Task] = set()
        self._dispute_rt: ExpertRuntime | None = None
        self._dispute_lock = threading.Lock()

    @property
    def dispute_runtime(self) -> ExpertRuntime:
        """The site's runtime for dispute re-execution (separate from the serving runtime, so
        holding a disputed blob never makes the router execute that expert locally), created on
        first use with ``TENZRO_DISPUTE_BUDGET`` bytes (default 1 GiB). Experts are keyed by blob
        hash (model id ``blob:<hash>``), so a republished model cannot mix copies."""
        with self._dispute_lock:
            if self._dispute_rt is None:
                self._dispute_rt = ExpertRuntime(memory_budget=int(os.environ.get("TENZRO_DISPUTE_BUDGET", 1 << 30)))
            return self._dispute_rt

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _audit_inline(self, keys: list[str]) -> None:
        slot = self._audit_slots.setdefault(id(asyncio.get_running_loop()),
                                            asyncio.Semaphore(2))  # audits never crowd out forwards
        async with slot:
            try:
                await services.audit_many(keys)
            except Exception:
                log.exception("audits of %s failed; the sweep retries them", ", ".join(keys))

    def _ensure_timer(self) -> None:
        loop = asyncio.get_running_loop()
        t = self._timers.get(id(loop))
        if t is None or t.done():
            self._timers[id(loop)] = loop.create_task(
                _sweep_forever(float(os.environ.get("TENZRO_AUDIT_INTERVAL", "30"))))

    async def on_forward(self, records: list[ForwardRecord]) -> None:
        """Record, settle and audit finished forwards (module docstring), all in one worker-thread
        hop (a generation hands over many layer forwards at once)."""
        records = [r for r in records if r.verified]
        if not records:
            return
        if inline():
            self._ensure_timer()
        keys = await database_sync_to_async(_record_and_settle, thread_sensitive=False)(records)
        if inline():
            if keys:
                self._spawn(self._audit_inline(keys))
        else:
            await asyncio.to_thread(lambda: [tasks.audit_receipt.delay(k) for k in keys])

    async def drain(self, timeout: float = 120.0) -> None:
        """Wait for the inline audits started so far (tests, the demo)."""
        pending = [t for t in self._background if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout)


async def on_forward(records: list[ForwardRecord]) -> None:
    """The forward listener ``SettlementConfig.ready`` registers (``router.hooks``): the
    process's ``Economy`` (``settlement.apps.current()``) handles ``records``."""
    await current().on_forward(records)
