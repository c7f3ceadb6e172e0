"""The site's repair pass over the agent sockets (docs/DESIGN.md §8): claim the period, plan, offer.

``run_pass`` is what both schedulers run — the Celery task ``holders.repair_pass`` (beat,
with Redis) and the in-process timer (``ensure_timer``, without Redis). The period claim in
``registry.repair_service.begin_pass`` makes any number of schedulers run each period once.
Each live agent gets its offer (the plan's rows naming it, its surplus replicas, the
exclusions) as a ``repair`` frame; it recomputes the plan itself, pulls what fits and
answers with its outcome, which is recorded on the pass.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time

from channels.db import database_sync_to_async
from django.conf import settings

from router.apps import current
from router.ws import AgentLink, AgentUnavailable
from registry import repair_service, services as registry_services

log = logging.getLogger("tenzro.repair")


async def run_pass(source: str = "timer") -> dict | None:
    """Run the current period's pass unless another scheduler already claimed it.

    Returns the recorded pass (``tenzro_moeRepairStatus`` shape) or None when the period
    was already claimed. Agent failures (disconnect, timeout, bad answer) are recorded on the
    pass, each offered row as a decline with the reason; they never fail the pass.

    Each agent has ``TENZRO_REPAIR_OFFER_TIMEOUT`` seconds to answer, all at once: a mute agent
    costs the pass those seconds, not the period (it waited 300 s before). An agent still
    pulling when its time is up keeps going; its heartbeats report what it loaded.
    """
    timeout = float(settings.TENZRO["REPAIR_OFFER_TIMEOUT_S"])
    rp = await database_sync_to_async(repair_service.begin_pass)(source)
    if rp is None:
        current().metrics.repair_passes.labels("claimed_elsewhere").inc()
        return None
    started = time.monotonic()
    error = ""
    try:
        offers = await database_sync_to_async(repair_service.plan_offers)(rp)
        link = await AgentLink.get()

        async def offer(provider: str, body: dict) -> None:
            outcome, err = None, ""
            try:
                _answer, payload = await link.request(provider, {"type": "repair"}, json.dumps(body).encode(),
                                                      timeout=timeout)
                outcome = json.loads(payload)
                if not isinstance(outcome, dict):
                    raise ValueError("outcome is not an object")
            except (AgentUnavailable, ValueError, UnicodeDecodeError) as exc:
                err = str(exc)
                outcome = {"declined": [{**r, "reason": f"no answer to the offer: {exc}"} for r in body["rows"]]}
            await database_sync_to_async(repair_service.record_outcome)(rp.pk, provider, outcome, err)

        await asyncio.gather(*(offer(p, body) for p, body in offers.items()))
    except Exception as exc:  # recorded on the pass; the scheduler keeps running
        log.exception("repair pass %s failed", rp.period_key)
        error = f"{type(exc).__name__}: {exc}"
    await database_sync_to_async(repair_service.finish_pass)(rp.pk, started, error)
    current().metrics.repair_passes.labels("error" if error else "ok").inc()
    rp = await database_sync_to_async(type(rp).objects.get)(pk=rp.pk)
    return repair_service.pass_json(rp)


async def _timer_loop() -> None:
    """Run a pass at every period boundary, the first at least one full interval after start (as
    the reference skips its first tick): a pass while the operator is still placing a model would
    pull extra copies of experts whose placement has not been declared yet."""
    first = True
    while True:
        interval = await database_sync_to_async(repair_service.interval_s)()
        now = time.time()
        await asyncio.sleep(((now // interval) + (2 if first else 1)) * interval - now + 0.05)
        first = False
        try:
            await run_pass("timer")
        except Exception:  # the timer outlives a failed pass
            log.exception("repair timer pass failed")


async def _hygiene_loop() -> None:
    """Beat's provider sweeps (``registry.services.provider_hygiene``) every ``TENZRO_HYGIENE_INTERVAL`` s."""
    while True:
        await asyncio.sleep(settings.TENZRO["HYGIENE_INTERVAL_S"])
        try:
            await database_sync_to_async(registry_services.provider_hygiene)()
        except Exception:  # the timer outlives a failed sweep
            log.exception("provider hygiene sweep failed")


def ensure_timer() -> None:
    """Start the in-process stand-ins for beat on the running event loop, once per process (the
    tasks are kept by its ``router.state.Router``), when Celery runs tasks inline (no
    ``REDIS_URL``: no beat): the repair timer and the provider hygiene sweep. Idempotent."""
    if not settings.CELERY_TASK_ALWAYS_EAGER:
        return
    timers = current().timers
    for name, run in (("repair", _timer_loop), ("hygiene", _hygiene_loop)):
        task = timers.get(name)
        if task is None or task.done():
            timers[name] = asyncio.get_running_loop().create_task(run())
