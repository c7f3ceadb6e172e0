"""The scheduled repair pass on the site (docs/DESIGN.md §8): one run per period, plan, record.

The transport half (offering rows to agent sockets) lives in ``router.repair``; this
module owns the database side: the idempotency key per period (``RepairPass.period_key``,
unique), the plan over every model with live holdings, the offers per provider, the
agents' reported outcomes, the ``tenzro_moeRepairStatus`` read, and the django-celery-beat
schedule row that operators edit in the admin.
"""
from __future__ import annotations

import json
import time
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from registry import governance, selectors
from registry.models import ExpertBlob, Holding, RepairPass
from moe.placement import plan_release, plan_repair

#: Name of the django-celery-beat row that runs the pass (and of the Celery task).
BEAT_TASK_NAME = "tenzro repair pass"
TASK = "holders.repair_pass"
#: Declines of this many recent passes steer the next plan to the next HRW candidate.
DECLINE_MEMORY_PASSES = 3


def interval_s() -> int:
    """Seconds between passes: ``TENZRO["REPAIR_INTERVAL_S"]`` when set (> 0), else the policy's."""
    override = settings.TENZRO.get("REPAIR_INTERVAL_S") or 0
    return int(override) if override > 0 else int(governance.current_policy().repair_interval_s)


def period_of(now: float, interval: int) -> int:
    """The period index of unix time ``now`` (seconds): ``floor(now / interval)``."""
    return int(now // interval)


def begin_pass(source: str, now: float | None = None) -> RepairPass | None:
    """Claim the current period: create its ``RepairPass`` row, or return None when another
    process (a second beat, a retried task, the previous slow pass) already claimed it; the
    loser's attempt is counted on the winner's row (``attempts``)."""
    interval = interval_s()
    period = period_of(time.time() if now is None else now, interval)
    key = f"{interval}:{period}"
    try:
        with transaction.atomic():
            return RepairPass.objects.create(period_key=key, period=period, interval_s=interval, source=source)
    except IntegrityError:
        RepairPass.objects.filter(period_key=key).update(attempts=F("attempts") + 1)
        return None


def _recent_declines() -> list[tuple[int, int, str, str]]:
    """(layer, expert, provider, model_id) declined in the last few finished passes."""
    out = []
    for declined in RepairPass.objects.exclude(status=RepairPass.Status.RUNNING).order_by("-period").values_list(
            "declined", flat=True)[:DECLINE_MEMORY_PASSES]:
        for d in declined:
            try:
                out.append((int(d["layer"]), int(d["expert"]), str(d["provider"]), str(d["model_id"])))
            except (KeyError, TypeError, ValueError):
                continue
    return out


def repair_models() -> list[str]:
    """Model ids some live provider holds experts of (the pass never conscripts into others)."""
    return sorted(set(Holding.objects.filter(provider__in=selectors.live_providers())
                      .values_list("model_id", flat=True)))


def plan_offers(rp: RepairPass) -> dict[str, dict]:
    """Plan every model with live holdings and build each live provider's offer.

    An offer is ``{period_key, interval_s, max_repairs, models, excluded, rows, release}``:
    ``rows`` are the plan's rows naming the provider (at most ``max_repairs``), with the
    catalog's ``blob_uri`` filled in where no live holder declares one; ``excluded`` the
    recent declines (``[model_id, layer, expert, provider]``) the plan skipped, so an agent
    recomputing the plan gets the same rows; ``release`` its surplus replicas. The whole plan
    is stored on ``rp``. Returns ``{provider: offer}`` for every live provider holding
    experts of a planned model (an agent with no row still learns the period and interval).
    """
    policy = governance.shard_policy()
    cap = policy.max_repairs_per_pass
    declines = _recent_declines()
    models = repair_models()
    all_rows: list[dict] = []
    offers: dict[str, dict] = {}
    for model_id in models:
        view = selectors.shard_view(model_id)
        excluded = [(layer, expert, p) for layer, expert, p, m in declines if m == model_id]
        rows = plan_repair(view, exclude=excluded)
        catalog = None
        for r in rows:
            row = r.to_json()
            row["kind"] = "repair" if view.replication(r.layer, r.expert) < policy.min_replication else "hot"
            if row["blob_uri"] is None:
                if catalog is None:
                    catalog = {(b.layer, b.expert): b.blob_uri for b in ExpertBlob.objects.filter(model_id=model_id)}
                row["blob_uri"] = catalog.get((r.layer, r.expert))
            all_rows.append(row)
        release = [r.to_json() for r in plan_release(view)]
        for p in view.distinct_providers():
            offer = offers.setdefault(p, {"period_key": rp.period_key, "interval_s": rp.interval_s,
                                          "max_repairs": cap, "models": [], "excluded": [], "rows": [],
                                          "release": []})
            offer["models"].append(model_id)
            offer["excluded"] += [[model_id, layer, expert, q] for layer, expert, q in excluded]
            offer["release"] += [r for r in release if r["provider"] == p]
    for row in all_rows:  # the pass cap is per provider over all models (reference §9)
        offer = offers.get(row["provider"])
        if offer is not None and len(offer["rows"]) < cap:
            offer["rows"].append(row)
    rp.models_planned = models
    rp.rows = all_rows
    rp.offered_to = sum(1 for o in offers.values() if o["rows"] or o["release"])
    rp.save(update_fields=["models_planned", "rows", "offered_to"])
    return offers


def _entries(items, provider: str, with_reason: bool) -> list[dict]:
    out = []
    for it in items if isinstance(items, list) else ():
        if not isinstance(it, dict):
            continue
        try:
            e = {"provider": provider, "model_id": str(it["model_id"]), "layer": int(it["layer"]),
                 "expert": int(it["expert"])}
        except (KeyError, TypeError, ValueError):
            continue
        if with_reason:
            e["reason"] = str(it.get("reason", ""))[:500]
        out.append(e)
    return out


def record_outcome(pass_id: int, provider: str, outcome: dict | None, error: str = "") -> None:
    """Append one agent's answer to the pass: ``outcome`` is ``{accepted, declined, released,
    fetched_bytes}`` as ``holders.repair`` reports it; ``error`` (the offer never got an
    answer) is recorded as a decline of each offered row by the caller. Malformed entries are
    dropped, never trusted."""
    with transaction.atomic():
        rp = RepairPass.objects.select_for_update().get(pk=pass_id)
        if outcome:
            rp.accepted += _entries(outcome.get("accepted"), provider, False)
            rp.declined += _entries(outcome.get("declined"), provider, True)
            rp.released += _entries(outcome.get("released"), provider, False)
            fetched = outcome.get("fetched_bytes")
            if isinstance(fetched, int) and not isinstance(fetched, bool) and 0 <= fetched < 1 << 50:
                rp.fetched_bytes += fetched
        if error:
            rp.error = (rp.error + f"{provider[:12]}…: {error}\n")[:4000]
        rp.save(update_fields=["accepted", "declined", "released", "fetched_bytes", "error"])


def finish_pass(pass_id: int, started: float, error: str = "") -> None:
    """Mark the pass done (or failed with ``error``) and store its duration (ms since ``started``,
    a ``time.monotonic()`` reading)."""
    rp = RepairPass.objects.get(pk=pass_id)
    rp.status = RepairPass.Status.FAILED if error else RepairPass.Status.DONE
    rp.duration_ms = round((time.monotonic() - started) * 1000, 3)
    rp.finished = timezone.now()
    if error:
        rp.error = (rp.error + error)[:4000]
    rp.save(update_fields=["status", "duration_ms", "finished", "error"])


def pass_json(rp: RepairPass, model_id: str | None = None) -> dict:
    """One recorded pass as ``tenzro_moeRepairStatus`` shows it (rows filtered to ``model_id``)."""
    def keep(rows: list) -> list:
        return rows if model_id is None else [r for r in rows if r.get("model_id") == model_id]

    return {"period_key": rp.period_key, "period": rp.period, "interval_s": rp.interval_s, "source": rp.source,
            "status": rp.status, "attempts": rp.attempts, "models": rp.models_planned, "rows": keep(rp.rows),
            "accepted": keep(rp.accepted), "declined": keep(rp.declined), "released": keep(rp.released),
            "offered_to": rp.offered_to, "fetched_bytes": rp.fetched_bytes, "duration_ms": rp.duration_ms,
            "error": rp.error, "started": rp.started.isoformat(),
            "finished": rp.finished.isoformat() if rp.finished else None}


def repair_status(model_id: str | None = None, limit: int = 20) -> dict:
    """``tenzro_moeRepairStatus``: the newest ``limit`` passes (those touching ``model_id`` when
    given), newest first, with the interval in force and the model's current under-replicated
    experts (``tenzro_moeShardMap`` stays the source of truth for replication)."""
    qs = RepairPass.objects.order_by("-period")
    passes = []
    for rp in qs.iterator(chunk_size=100):
        if model_id is not None and model_id not in rp.models_planned:
            continue
        passes.append(pass_json(rp, model_id))
        if len(passes) >= limit:
            break
    out = {"interval_s": interval_s(), "max_repairs_per_pass": governance.current_policy().max_repairs_per_pass,
           "passes": passes}
    if model_id is not None:
        out["model_id"] = model_id
        out["under_replicated_experts"] = [{"layer": layer, "expert": e}
                                           for layer, e in selectors.shard_view(model_id).under_replicated()]
    return out


def ensure_beat_schedule() -> None:
    """Create or update the django-celery-beat row running ``holders.repair_pass`` every
    ``interval_s()`` seconds. Operators see it in the admin (enable/disable, interval); it is
    re-synced after migrations and when a proposal changes ``repair_interval_s``."""
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    every = interval_s()
    schedule, _ = IntervalSchedule.objects.get_or_create(every=every, period=IntervalSchedule.SECONDS)
    task = PeriodicTask.objects.filter(name=BEAT_TASK_NAME).first()
    if task is None:
        PeriodicTask.objects.create(name=BEAT_TASK_NAME, task=TASK, interval=schedule, kwargs=json.dumps({}),
                                    description="Repair pass (docs/DESIGN.md §8): plan from the shard view, offer each "
                                                "agent the rows naming it. One run per period (RepairPass).")
    elif task.interval_id != schedule.id:
        task.interval = schedule
        task.save(update_fields=["interval"])


def prune(keep: timedelta = timedelta(days=7)) -> int:
    """Delete finished passes older than ``keep``; returns how many."""
    return RepairPass.objects.filter(started__lt=timezone.now() - keep).exclude(
        status=RepairPass.Status.RUNNING).delete()[0]
