"""Reads behind the console pages: plain dicts and lists built from the apps' models and selectors.

Every function here only reads. Shapes are documented per function; counts are ints,
``bytes`` are byte counts, times are aware ``datetime`` (UTC).
"""
from __future__ import annotations

from collections import Counter

from django.db.models import Count, Q, Sum

from prepare.models import PrepareItem, PrepareJob
from registry import governance, selectors
from registry.api import compact_holdings
from registry.models import AuditEntry, Holding, MoeModel, Proposal, Provider
from tenzro_site.console.charts import BarChart, bar_chart


def live_ids() -> set[str]:
    """Ids of the live providers (Active, socket open, heartbeat fresh)."""
    return set(selectors.live_providers().values_list("provider", flat=True))


def model_summaries() -> list[dict]:
    """Per published model: ``{model, slots, covered, under, hot}`` (counts of expert slots) and
    ``histogram``, a ``BarChart`` of its slots by replication in the live view."""
    out = []
    for m in MoeModel.objects.all():
        view = selectors.shard_view(m.model_id)
        keys = m.expert_keys()
        counts = Counter(view.replication(layer, e) for layer, e in keys)
        chart = replication_histogram(counts, view.policy.min_replication, title=f"{m.model_id}: slots by replication")
        out.append({"model": m, "slots": len(keys), "covered": len(view.covered_experts()),
                    "under": len(view.under_replicated()), "hot": len(view.hot_experts()), "histogram": chart})
    return out


def provider_rows(live_only: bool = False, role: str | None = None) -> list[dict]:
    """Providers with their holding counts: ``{p, live, holdings, warm, cold, committed_tps}``.

    ``committed_tps`` sums the tokens/s the provider commits over all its holdings.
    """
    qs = selectors.live_providers() if live_only else Provider.objects.all()
    qs = qs.annotate(n=Count("holdings"), warm=Count("holdings", filter=Q(holdings__residency="Warm")),
                     cold=Count("holdings", filter=Q(holdings__residency="Cold")),
                     tps=Sum("holdings__committed_tps"))
    live = live_ids()
    rows = [{"p": p, "live": p.provider in live, "holdings": p.n, "warm": p.warm, "cold": p.cold,
             "committed_tps": p.tps or 0} for p in qs]
    return [r for r in rows if role in r["p"].roles] if role else rows


def provider_detail(provider: str) -> dict | None:
    """One provider's page data, or None when unknown: ``{p, live, holdings (compact ranges per
    model and layer), holding_count, per_model: {model_id: count}}``."""
    p = Provider.objects.filter(provider=provider).first()
    if p is None:
        return None
    rows = Holding.objects.filter(provider=p).order_by("provider_id", "model_id", "layer", "residency",
                                                        "committed_tps", "expert")
    groups = compact_holdings(rows.values_list("provider_id", "model_id", "layer", "expert", "residency",
                                               "committed_tps"))
    per_model = dict(rows.order_by().values_list("model_id").annotate(n=Count("id")).values_list("model_id", "n"))
    return {"p": p, "live": provider in live_ids(), "holdings": groups, "holding_count": sum(per_model.values()),
            "per_model": per_model}


def recent_failures(limit: int = 10) -> dict:
    """What went wrong lately, from the records that exist:

    ``holders``: providers with batch failures (most first; ``batch_failures``,
    ``batches_served``, reputation); ``offline``: Active providers that are not live (socket
    closed or heartbeat older than the cutoff), latest heartbeat first; ``prepare``: failed
    preparation jobs and failed expert items, newest first (``{job, layer, expert, error}``).
    """
    live = live_ids()
    holders = list(Provider.objects.filter(batch_failures__gt=0).order_by("-batch_failures")[:limit])
    offline = [p for p in Provider.objects.filter(status=Provider.Status.ACTIVE).exclude(provider__in=live)
               .order_by("-last_heartbeat")[:limit]]
    items = [{"job": i.job, "layer": i.layer, "expert": i.expert, "error": i.error}
             for i in PrepareItem.objects.filter(state=PrepareItem.State.FAILED).select_related("job")
             .order_by("-job__updated", "layer", "expert")[:limit]]
    jobs = list(PrepareJob.objects.filter(state=PrepareJob.State.FAILED).exclude(error="")[:limit])
    return {"holders": holders, "offline": offline, "prepare_items": items, "prepare_jobs": jobs}


def _cell_class(n: int, hot: bool, min_rep: int) -> str:
    """Heatmap class of one slot: ``r0`` nobody, ``r1`` below the minimum, ``rok`` at it,
    ``rhi`` above it; `` hot`` appended for hot experts."""
    base = "r0" if n == 0 else "r1" if n < min_rep else "rok" if n == min_rep else "rhi"
    return f"{base} hot" if hot else base


def coverage(model_id: str) -> dict:
    """The coverage page of ``model_id``: ``rows`` ``[(layer, [(expert, replication, class)])]``,
    ``policy``, ``slots``, ``covered``, ``under`` (``[(layer, expert, replication)]``), ``hot``
    count, ``providers`` ``[{p, held}]``, ``big_cells`` (≤ 64 slots a layer: draw larger cells)
    and ``histogram`` (a ``BarChart`` of slots by replication).

    Slots come from the published model, else the seed catalog, else the covered experts.
    """
    view = selectors.shard_view(model_id)
    keys = selectors.expected_experts(model_id) or view.covered_experts()
    policy = view.policy
    layers: dict[int, list] = {}
    counts: Counter[int] = Counter()
    for layer, expert in keys:
        n = view.replication(layer, expert)
        counts[n] += 1
        layers.setdefault(layer, []).append((expert, n, _cell_class(n, view.is_hot(layer, expert),
                                                                     policy.min_replication)))
    held = {p: len(view.held_by(p)) for p in view.distinct_providers()}
    providers = [{"p": p, "held": held[p.provider]} for p in Provider.objects.filter(provider__in=held)]
    under = [(layer, e, view.replication(layer, e)) for layer, e in view.under_replicated()]
    return {"model_id": model_id, "rows": sorted(layers.items()), "policy": policy, "slots": len(keys),
            "covered": sum(1 for k in keys if view.replication(*k) > 0), "under": under,
            "hot": len(view.hot_experts()), "providers": providers,
            "big_cells": max((len(c) for c in layers.values()), default=0) <= 64,
            "histogram": replication_histogram(counts, policy.min_replication)}


def replication_histogram(counts: Counter, min_rep: int, title: str = "Expert slots by replication") -> BarChart | None:
    """A bar chart of expert slots per replication count (``counts``: replication → slots;
    bars for 0 … the largest seen, coloured like the heatmap); None without slots."""
    if not counts:
        return None
    data = [(str(n), counts.get(n, 0), _cell_class(n, False, min_rep)) for n in range(max(counts) + 1)]
    return bar_chart(title, data, x_label="distinct live holders", y_label="slots")


def expert_holders(model_id: str, layer: int, expert: int) -> dict:
    """Holders of one expert in the live view: ``{layer, expert, replication, hot, holders:
    [{h (HolderInfo), name}]}`` ordered as the planner prefers them (Warm first)."""
    view = selectors.shard_view(model_id)
    holders = view.holders(layer, expert, allow_cold=True)
    names = dict(Provider.objects.filter(provider__in=[h.provider for h in holders]).values_list("provider", "name"))
    return {"model_id": model_id, "layer": layer, "expert": expert, "replication": view.replication(layer, expert),
            "hot": view.is_hot(layer, expert), "holders": [{"h": h, "name": names.get(h.provider, "")}
                                                            for h in holders]}


def governance_state(status: str | None = None, audit_limit: int = 50) -> dict:
    """The governance page: ``policy`` (``governance.policy_json``), ``proposals`` as
    ``[{p, tally, percent (of quorum, 0–100), votes}]`` (filtered by ``status`` when given),
    ``electorate`` (voter ids) and ``audit`` (newest ``audit_limit`` entries as ``{entry, summary}``)."""
    qs = Proposal.objects.prefetch_related("votes")
    if status:
        qs = qs.filter(status=status)
    rows = []
    for p in qs[:100]:
        t = governance.tally(p)
        rows.append({"p": p, "tally": t, "percent": min(100, round(100 * t["yes"] / t["quorum"])),
                     "votes": list(p.votes.all())})
    return {"policy": governance.policy_json(), "proposals": rows, "electorate": governance.electorate(),
            "audit": [{"entry": a, "summary": audit_summary(a)} for a in AuditEntry.objects.all()[:audit_limit]]}


def audit_summary(entry: AuditEntry) -> str:
    """One line for an audit entry: the changes proposed, the vote, the fields an applied
    proposal changed (``field before → after``) and the new version, or the rejection reason."""
    d = entry.detail or {}
    if entry.action == AuditEntry.Action.PROPOSED:
        return ", ".join(f"{k} = {v}" for k, v in (d.get("changes") or {}).items())
    if entry.action == AuditEntry.Action.VOTED:
        return "approve" if d.get("approve") else "reject"
    if entry.action == AuditEntry.Action.APPLIED:
        before, after = d.get("before") or {}, d.get("after") or {}
        changed = [f"{k} {before.get(k)} → {v}" for k, v in after.items() if before.get(k) != v]
        return "; ".join(changed) + (f" (policy v{d['version']})" if "version" in d else "")
    if entry.action == AuditEntry.Action.REJECTED:
        return str(d.get("reason", ""))
    return ""


def prepare_summary() -> dict:
    """Counts of preparation jobs per state (``{state: n}``)."""
    return dict(PrepareJob.objects.order_by().values_list("state").annotate(n=Count("job_id")))
