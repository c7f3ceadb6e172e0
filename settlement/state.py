"""The forward listener of the receipts economy (registered by ``SettlementConfig.ready``).

After each forward, in the background of the router's event loop: keep the sampled batches
and write the pending settlements (``services.record_forward``, on a worker thread with its
own connection so the numpy work never queues behind the router's DB reads), then settle
the forward and audit each new sample. With a broker (``REDIS_URL``) these are Celery tasks
(``settlement.tasks``, swept by beat); without one they run here, and an inline timer
(every ``TENZRO_AUDIT_INTERVAL`` seconds, default 30) sweeps what a failed attempt left.
"""
from __future__ import annotations

import asyncio
import logging
import os

from channels.db import database_sync_to_async
from django.conf import settings

from router.hooks import ForwardRecord
from settlement import services, tasks

log = logging.getLogger(__name__)

_audit_slots: dict[int, asyncio.Semaphore] = {}
_timers: dict[int, asyncio.Task] = {}
_background: set[asyncio.Task] = set()


def inline() -> bool:
    """Whether tasks run in this process (no broker: Celery eager mode)."""
    return bool(getattr(settings, "CELERY_TASK_ALWAYS_EAGER", True))


def _spawn(coro) -> None:
    task = asyncio.get_running_loop().create_task(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)


async def _audit_inline(key: str) -> None:
    loop = id(asyncio.get_running_loop())
    slot = _audit_slots.setdefault(loop, asyncio.Semaphore(2))  # audits never crowd out forwards
    async with slot:
        try:
            await services.audit(key)
        except Exception:
            log.exception("audit of %s failed; the sweep retries it", key)


async def _sweep_forever(interval: float) -> None:
    """The inline stand-in for beat: audit and settle what is still pending."""
    while True:
        await asyncio.sleep(interval)
        try:
            await services.audit_pending()
            await database_sync_to_async(services.settle_pending)()
        except Exception:
            log.exception("economy sweep failed; retrying in %s s", interval)


def _ensure_timer() -> None:
    loop = asyncio.get_running_loop()
    t = _timers.get(id(loop))
    if t is None or t.done():
        _timers[id(loop)] = loop.create_task(_sweep_forever(float(os.environ.get("TENZRO_AUDIT_INTERVAL", "30"))))


def _record_and_settle(records: list[ForwardRecord]) -> list[str]:
    """Worker thread: record every forward of ``records``, settle them when tasks run inline
    (else queue one ``settle_forward`` task each); returns the kept sample keys."""
    keys = [k for r in records for k in services.record_forward(r)["samples"]]
    if inline():
        services.settle_forwards([r.forward_id for r in records])
    else:
        for r in records:
            tasks.settle_forward.delay(r.forward_id)
    return keys


async def on_forward(records: list[ForwardRecord]) -> None:
    """Record, settle and audit finished forwards (module docstring), all in one worker-thread
    hop (a generation hands over many layer forwards at once)."""
    records = [r for r in records if r.verified]
    if not records:
        return
    if inline():
        _ensure_timer()
    keys = await database_sync_to_async(_record_and_settle, thread_sensitive=False)(records)
    if inline():
        for key in keys:
            _spawn(_audit_inline(key))
    else:
        await asyncio.to_thread(lambda: [tasks.audit_receipt.delay(k) for k in keys])


async def drain(timeout: float = 120.0) -> None:
    """Wait for the inline audits started so far (tests, the demo)."""
    pending = [t for t in _background if not t.done()]
    if pending:
        await asyncio.wait(pending, timeout=timeout)
