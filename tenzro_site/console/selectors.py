"""Reads behind the console pages: plain dicts and lists built from the apps' models and selectors.

Every function here only reads. Shapes are documented per function; counts are ints,
``bytes`` are byte counts, times are aware ``datetime`` (UTC).
"""
from __future__ import annotations

from collections import Counter

from django.db.models import Count, Q, Sum

from moe.receipts import ReceiptError, verify_stored_receipt
from prepare.models import PrepareItem, PrepareJob
from registry import governance, repair_service, selectors
from registry.api import compact_holdings
from moe.content import BlobError
from registry.models import AuditEntry, Holding, MoeModel, Proposal, Provider
from settlement import selectors as settlement_selectors
from settlement import services as settlement_services
from settlement.disputes import operator_can_dispute
from settlement.models import Dispute, ReceiptSample, Settlement
from settlement.services import EconomyError
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
    """Providers with their holding counts: ``{p, live, state, holdings, warm, cold, committed_tps,
    quarantined}``, in state order (``registry.selectors.PROVIDER_STATES``: live and proven first,
    offline and unproven keys last), then reputation, then id.

    ``state``: ``registry.selectors.provider_state``; ``committed_tps`` sums the tokens/s the
    provider commits over all its holdings; ``quarantined``: an upheld-dispute quarantine is in force now.
    """
    import time

    now = int(time.time() * 1000)
    qs = selectors.live_providers() if live_only else Provider.objects.all()
    qs = qs.annotate(n=Count("holdings"), warm=Count("holdings", filter=Q(holdings__residency="Warm")),
                     cold=Count("holdings", filter=Q(holdings__residency="Cold")),
                     tps=Sum("holdings__committed_tps"))
    live = live_ids()
    cutoff = selectors.live_cutoff()
    rows = [{"p": p, "live": p.provider in live, "state": selectors.provider_state(p, cutoff, now), "holdings": p.n,
             "warm": p.warm, "cold": p.cold, "committed_tps": p.tps or 0, "quarantined": p.quarantined_until_ms > now}
            for p in qs]
    rows.sort(key=lambda r: (selectors.state_order(r["state"]), -r["p"].reputation, r["p"].provider))
    return [r for r in rows if role in r["p"].roles] if role else rows


def provider_detail(provider: str) -> dict | None:
    """One provider's page data, or None when unknown: ``{p, live, state, holdings (compact ranges
    per model and layer), holding_count, per_model: {model_id: count}}``."""
    p = Provider.objects.filter(provider=provider).first()
    if p is None:
        return None
    rows = Holding.objects.filter(provider=p).order_by("provider_id", "model_id", "layer", "residency",
                                                        "committed_tps", "expert")
    groups = compact_holdings(rows.values_list("provider_id", "model_id", "layer", "expert", "residency",
                                               "committed_tps"))
    per_model = dict(rows.order_by().values_list("model_id").annotate(n=Count("id")).values_list("model_id", "n"))
    return {"p": p, "live": provider in live_ids(), "state": selectors.provider_state(p), "holdings": groups, "holding_count": sum(per_model.values()),
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


# ---- receipts economy (settlement app) -------------------------------------------------------

RECEIPT_PAGE = 200


def receipts(model_id: str | None = None, provider: str | None = None, layer: int | None = None,
             expert: int | None = None, limit: int = RECEIPT_PAGE) -> dict:
    """Kept receipt samples, newest first, filtered like ``tenzro_moeListReceipts``:
    ``{rows: [sample_json + {name}], models: [model ids kept], limit}`` (``name``: the
    provider's display name, "" when unknown)."""
    rows = settlement_selectors.list_receipts(model_id=model_id or None, provider=provider or None, layer=layer,
                                              expert=expert, limit=limit)["receipts"]
    _named(rows)
    audited = set(Dispute.objects.filter(sample__key__in=[r["key"] for r in rows], automatic=True)
                  .values_list("sample__key", flat=True))
    for r in rows:  # the list's badge: "audit passed" / "audit failed" apart from operators' disputes
        r["outcome"] = None if r["dispute"] is None else \
            {"automatic": r["key"] in audited, "disputed": r["dispute"] == "upheld"}
    models = list(ReceiptSample.objects.order_by("model_id").values_list("model_id", flat=True).distinct())
    return {"rows": rows, "models": models, "limit": limit}


def _names(providers) -> dict[str, str]:
    return dict(Provider.objects.filter(provider__in=list(providers)).values_list("provider", "name"))


def signature_status(s: ReceiptSample) -> dict:
    """Re-verify a kept receipt with the dispute's own check (``moe.receipts.
    verify_stored_receipt``: signer, carrier hash, commitment hash, tokens, Ed25519 signature over
    the request identity): ``{ok: bool, detail: str}``; a missing carrier file is reported, not raised."""
    try:
        carrier = settlement_services.sample_carrier(s)
        verify_stored_receipt(s.receipt, provider=s.provider, request_id=s.request_id, model_id=s.model_id,
                              layer=s.layer, expert=s.expert, tokens=list(s.tokens), d_model=s.d_model,
                              carrier_kind=s.carrier_kind, carrier=carrier, commitment=bytes(s.commitment_rows))
    except EconomyError as exc:
        return {"ok": False, "detail": exc.message}
    except (ReceiptError, BlobError, OSError, ValueError) as exc:
        return {"ok": False, "detail": str(exc)}
    return {"ok": True, "detail": "signature, carrier hash and commitment rows verify"}


def receipt_detail(key: str) -> dict | None:
    """One kept receipt, or None when unknown: ``settlement.selectors.get_receipt`` (header,
    signed receipt, commitment rows, dispute outcome) plus ``signature`` (``signature_status``),
    ``name`` of the provider, ``settlement`` (its forward's settlement with this provider, or None)
    and ``can_dispute`` (an operator may dispute it: ``settlement.disputes.operator_can_dispute``)."""
    try:
        r = settlement_selectors.get_receipt(key)
    except EconomyError:
        return None
    s = ReceiptSample.objects.get(key=key)
    r["signature"] = signature_status(s)
    r["name"] = _names([s.provider]).get(s.provider, "")
    r["settlement"] = Settlement.objects.filter(forward_id=s.forward_id, provider=s.provider).first()
    r["can_dispute"] = operator_can_dispute(r["dispute_outcome"])
    return r


def _named(rows: list[dict]) -> list[dict]:
    """``rows`` with each provider's ``name`` added (in place)."""
    names = _names({r["provider"] for r in rows})
    for r in rows:
        r["name"] = names.get(r["provider"], "")
    return rows


def disputes(provider: str | None = None, upheld: bool | None = None, limit: int = 200) -> dict:
    """Operators' disputes and automatic audits apart, newest first (``tenzro_moeListDisputes``
    rows with their fraud proofs and the provider's ``name``): ``{rows, audits, upheld, rejected,
    audits_failed, audits_passed}``; the counts are over all records, unfiltered."""
    rows = settlement_selectors.list_disputes(provider=provider or None, upheld=upheld, limit=limit,
                                              automatic=False)["disputes"]
    audits = settlement_selectors.list_disputes(provider=provider or None, upheld=upheld, limit=limit,
                                                automatic=True)["disputes"]
    _named(rows + audits)
    counts = dict(((auto, up), n) for auto, up, n in Dispute.objects.order_by().values_list("automatic", "upheld")
                  .annotate(n=Count("id")))
    return {"rows": rows, "audits": audits, "upheld": counts.get((False, True), 0),
            "rejected": counts.get((False, False), 0), "audits_failed": counts.get((True, True), 0),
            "audits_passed": counts.get((True, False), 0)}


def _settlement_qs(model_id: str | None = None, provider: str | None = None, forward_id: str | None = None):
    qs = Settlement.objects.all()
    for name, value in (("model_id", model_id), ("provider", provider), ("forward_id", forward_id)):
        if value:
            qs = qs.filter(**{name: value})
    return qs


def settlement_ledger(model_id: str | None = None, provider: str | None = None, forward_id: str | None = None,
                      limit: int = 200, now_ms: int | None = None) -> dict:
    """The settlement ledger under the filters: ``rows`` (per forward and holder, newest first,
    pending ones included), ``totals`` (settled only: ``tokens, batches, gross, holder_amount,
    network_fee, settlements``; amounts in the network's integer price unit), ``pending`` (count),
    ``per_provider`` (``[{provider, name, balance, settlements, tokens, gross, holder_amount,
    network_fee}]``, most paid first) and ``chart`` (settled tokens per minute)."""
    qs = _settlement_qs(model_id, provider, forward_id)
    settled = qs.filter(state=Settlement.State.SETTLED)
    sums = ("tokens", "batches", "gross", "holder_amount", "network_fee")
    totals = {k: v or 0 for k, v in settled.aggregate(**{k: Sum(k) for k in sums}).items()}
    totals["settlements"] = settled.count()
    per = list(settled.order_by().values("provider").annotate(settlements=Count("id"), **{k: Sum(k) for k in sums})
               .order_by("-holder_amount", "provider"))
    info = {p.provider: p for p in Provider.objects.filter(provider__in=[r["provider"] for r in per])}
    for r in per:
        p = info.get(r["provider"])
        r["name"], r["balance"] = (p.name, p.balance) if p else ("", None)
    rows = list(qs.order_by("-id")[:limit])
    names = _names({s.provider for s in rows})
    return {"rows": [{"s": s, "name": names.get(s.provider, "")} for s in rows], "totals": totals,
            "pending": qs.filter(state=Settlement.State.PENDING).count(), "per_provider": per,
            "chart": settled_tokens_chart(settled, now_ms=now_ms), "limit": limit}


def settlement_csv_rows(model_id: str | None = None, provider: str | None = None, forward_id: str | None = None):
    """The ledger as CSV rows (header first): every settlement under the filters, oldest first,
    columns of ``settlement.selectors.settlement_json`` plus ``created_ms``. A generator (streamed)."""
    cols = ["forward_id", "model_id", "provider", "state", "tokens", "batches", "gross", "holder_amount",
            "network_fee", "commitments_digest", "created_ms", "settled_at_ms"]
    yield cols
    for s in _settlement_qs(model_id, provider, forward_id).order_by("id").iterator(chunk_size=500):
        yield [getattr(s, c) if getattr(s, c) is not None else "" for c in cols]


def settled_tokens_chart(settled_qs, minutes: int = 30, now_ms: int | None = None) -> BarChart:
    """Bar chart of tokens settled per minute over the last ``minutes`` minutes (by
    ``Settlement.settled_at_ms``, UTC minute buckets; labels ``HH:MM`` every 5th bar, newest right)."""
    import time
    from datetime import datetime, timezone

    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    end = now_ms // 60_000  # current minute (inclusive)
    start = end - minutes + 1
    buckets = Counter()
    for at, tokens in settled_qs.filter(settled_at_ms__gte=start * 60_000).values_list("settled_at_ms", "tokens"):
        buckets[at // 60_000] += tokens
    data = [(datetime.fromtimestamp(m * 60, tz=timezone.utc).strftime("%H:%M"), buckets.get(m, 0), "bar-tokens")
            for m in range(start, end + 1)]
    return bar_chart(f"Tokens settled per minute (last {minutes} min, UTC)", data, x_label="minute",
                     y_label="tokens", width=520, tick_every=5)


def provider_economy(provider: str, limit: int = 20) -> dict:
    """A provider's economy: ``quarantined`` (bool, now), ``quarantined_until`` (ms), ``receipts``,
    ``disputes`` (newest ``limit`` rows of each), ``settlements`` (newest ``limit``), ``paid``
    (settled totals: ``settlements, tokens, holder_amount``) and ``reputation_chart`` (reputation
    after each of its disputes, oldest first; None without disputes)."""
    import time

    p = Provider.objects.get(provider=provider)
    settled = Settlement.objects.filter(provider=provider, state=Settlement.State.SETTLED)
    paid = settled.aggregate(tokens=Sum("tokens"), holder_amount=Sum("holder_amount"))
    paid = {"settlements": settled.count(), "tokens": paid["tokens"] or 0, "holder_amount": paid["holder_amount"] or 0}
    hist = list(Dispute.objects.filter(provider=provider, reputation_after__isnull=False).order_by("-id")
                .values_list("id", "reputation_after", "upheld")[:30])[::-1]
    chart = bar_chart("Reputation after each dispute", [(f"#{i}", rep, "bar-bad" if up else "bar-ok")
                                                       for i, rep, up in hist],
                      x_label="dispute", y_label="reputation", width=420) if hist else None
    return {"quarantined": p.quarantined_until_ms > int(time.time() * 1000),
            "quarantined_until": p.quarantined_until_ms,
            "receipts": receipts(provider=provider, limit=limit)["rows"],
            "disputes": _named(settlement_selectors.list_disputes(provider=provider, limit=limit)["disputes"]),
            "settlements": list(Settlement.objects.filter(provider=provider).order_by("-id")[:limit]),
            "paid": paid, "reputation_chart": chart}


def repair_passes(model_id: str, limit: int = 10) -> list[dict]:
    """The newest ``limit`` repair passes that planned ``model_id`` (``registry.repair_service.
    pass_json`` rows filtered to it: ``rows`` plan, ``accepted``, ``declined`` with ``reason``)."""
    return repair_service.repair_status(model_id, limit=limit)["passes"]
