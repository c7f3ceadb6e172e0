"""Reads of the registry: live providers and the (cached) shard view of a model."""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from registry import catalog
from registry.governance import shard_policy
from registry.models import ExpertBlob, Holding, MoeModel, Provider
from moe.shardmap import HoldingInfo, ProviderInfo, ShardView


def live_cutoff():
    """Heartbeats older than this (``MISSED_HEARTBEATS`` intervals) drop a provider from the view."""
    t = settings.TENZRO
    return timezone.now() - timedelta(seconds=t["HEARTBEAT_INTERVAL_S"] * t["MISSED_HEARTBEATS"])


def live_providers():
    """Active providers whose agent socket is open, whose last heartbeat is fresh and that are
    not quarantined (``quarantined_until_ms`` in the past: upheld disputes, docs/DESIGN.md §7)."""
    return Provider.objects.filter(status=Provider.Status.ACTIVE, connected=True,
                                   last_heartbeat__gte=live_cutoff(),
                                   quarantined_until_ms__lte=int(time.time() * 1000))


#: A provider's state as listings and ``/healthz`` show it, best first (the listing order).
PROVIDER_STATES = ("Live", "Failing", "Unproven", "Quarantined", "Offline", "Suspended", "Inactive")


def is_live(p: Provider, cutoff=None, now_ms: int | None = None) -> bool:
    """``live_providers()`` for one row: Active, socket open, heartbeat fresh, not quarantined."""
    cutoff = live_cutoff() if cutoff is None else cutoff
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    return bool(p.status == Provider.Status.ACTIVE and p.connected and p.last_heartbeat
                and p.last_heartbeat >= cutoff and p.quarantined_until_ms <= now_ms)


def is_failing(p: Provider, now=None) -> bool:
    """Whether the router's latest outcome with this holder was a failure, within the last
    ``TENZRO_FAILING_WINDOW`` seconds (``last_failure`` newer than ``last_success``)."""
    if p.last_failure is None or (p.last_success is not None and p.last_success >= p.last_failure):
        return False
    now = timezone.now() if now is None else now
    return p.last_failure >= now - timedelta(seconds=settings.TENZRO["FAILING_WINDOW_S"])


def holder_records(providers: list[str]) -> dict[str, dict]:
    """What every router process recorded of ``providers`` (``record_holder_outcomes``), for
    seeding a new process's scoreboard: ``{provider: {"batches_served", "latency_ms" (EWMA,
    None before the first), "failing" (``is_failing``)}}``; unknown providers are absent."""
    now = timezone.now()
    return {p.provider: {"batches_served": p.batches_served, "latency_ms": p.latency_ms_ewma or None,
                         "failing": is_failing(p, now)}
            for p in Provider.objects.filter(provider__in=list(providers)).only(
                "provider", "batches_served", "latency_ms_ewma", "last_failure", "last_success")}


def provider_state(p: Provider, cutoff=None, now_ms: int | None = None) -> str:
    """One of ``PROVIDER_STATES`` for a provider row: the operator's ``status`` when it is not
    Active, ``Quarantined`` (upheld disputes), ``Offline`` (socket closed or heartbeat older than
    the cutoff), ``Failing`` (``is_failing``), ``Unproven`` (live, never served a batch), else ``Live``."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    if p.status != Provider.Status.ACTIVE:
        return str(p.status)
    if p.quarantined_until_ms > now_ms:
        return "Quarantined"
    if not is_live(p, cutoff, now_ms):
        return "Offline"
    if is_failing(p):
        return "Failing"
    return "Live" if p.batches_served > 0 else "Unproven"


def state_order(state: str) -> int:
    """Sort key of a state in listings (``PROVIDER_STATES`` order)."""
    return PROVIDER_STATES.index(state)


_LIVE_FIELDS = ("provider", "roles", "status", "moe_gpu", "iroh_endpoint_id", "http_endpoint", "reputation",
                "holdings_version")


def live_rows() -> tuple[tuple, ...]:
    """Live providers as hashable tuples of ``_LIVE_FIELDS`` (roles as a tuple), sorted by id: one
    query whose result changes whenever a provider's liveness, fields or holdings change
    (``holdings_version``), so views built from it can be reused while it is equal."""
    return tuple((pid, tuple(roles), *rest) for pid, roles, *rest in
                 live_providers().order_by("provider").values_list(*_LIVE_FIELDS))


def provider_infos(model_id: str | None = None, rows: tuple[tuple, ...] | None = None) -> list[ProviderInfo]:
    """Live providers (``rows`` from ``live_rows``, read when None) as planner dataclasses, with
    their holdings (of ``model_id`` when given).

    Rows are read as tuples, not model instances, and become ``HoldingInfo`` without
    re-validation (heartbeat ingest validated them): at Kimi-K2 scale (70k holdings) both
    would cost seconds.
    """
    live = live_rows() if rows is None else rows
    holdings = Holding.objects.filter(provider__in=live_providers())
    if model_id is not None:
        holdings = holdings.filter(model_id=model_id)
    by_provider: dict[str, list[HoldingInfo]] = {p[0]: [] for p in live}
    unchecked = HoldingInfo.unchecked
    for pid, mid, layer, expert, res, tps, blob in holdings.values_list(
            "provider_id", "model_id", "layer", "expert", "residency", "committed_tps", "blob_uri").iterator(
            chunk_size=20_000):
        lst = by_provider.get(pid)
        if lst is not None:  # a provider that turned live between the two reads waits for the next view
            lst.append(unchecked(mid, layer, expert, res, tps, blob or None))
    return [ProviderInfo(provider=pid, roles=roles, status=status, gpu=gpu,
                         iroh_endpoint_id=iroh or None, http_endpoint=http or None, reputation=rep,
                         holdings=tuple(by_provider[pid]))
            for pid, roles, status, gpu, iroh, http, rep, _version in live]


def catalog_shape(model_id: str) -> catalog.ModelShape:
    """The shape ``tenzro_moeCatalogShape`` reports: the seed catalog's entry, else the shape of
    the MoE model published on this site under ``model_id``, built from its stored HF
    ``config.json`` (``ModelShape.from_hf_config``). Raises ``catalog.UnknownModelError`` (close
    matches in its message) when neither knows it."""
    try:
        return catalog.get(model_id)
    except catalog.UnknownModelError as unknown:
        m = MoeModel.objects.filter(model_id=model_id).exclude(family="dense").first()
        if m is None:
            raise
        try:
            return catalog.ModelShape.from_hf_config(m.model_id, m.config,
                                                     source=f"published on this site from {m.source or 'a checkpoint'}")
        except (ValueError, TypeError, KeyError):
            raise unknown from None


def published_shapes() -> list[catalog.ModelShape]:
    """``catalog_shape`` of every MoE model published on this site that the seed catalog lacks."""
    out = []
    for model_id in MoeModel.objects.exclude(family="dense").order_by("model_id").values_list("model_id", flat=True):
        try:
            catalog.get(model_id)
        except catalog.UnknownModelError:
            try:
                out.append(catalog_shape(model_id))
            except catalog.UnknownModelError:
                continue  # a stored config from_hf_config cannot read: not a catalog entry
    return out


def iroh_peers() -> dict[str, tuple[str, list[str]]]:
    """Live providers advertising an iroh endpoint: ``{provider: (endpoint id, ["ip:port", ...])}``
    (from their last signed heartbeat)."""
    return {pid: (eid, list(addrs or [])) for pid, eid, addrs in
            live_providers().exclude(iroh_endpoint_id="").values_list("provider", "iroh_endpoint_id", "iroh_addrs")}


def expected_experts(model_id: str) -> list[tuple[int, int]] | None:
    """Every (layer, expert) slot of ``model_id``: from the published model, else from the seed
    catalog when its layer map is known, else None (the view then knows only covered experts)."""
    m = MoeModel.objects.filter(model_id=model_id).only("num_experts", "n_shared_experts", "moe_layers").first()
    if m:  # not the config column: a published backbone's record is kilobytes of JSON to decode
        return m.expert_keys()
    try:
        shape = catalog.get(model_id)
    except catalog.UnknownModelError:
        return None
    return list(shape.expert_keys()) if shape.is_moe and shape.moe_layers_known else None


# Built views keyed by everything they depend on (model, policy, catalog slots, and each live
# provider's fields and holdings_version), so a hit is exactly what a rebuild would give. Per
# process, a cache rather than state: any process rebuilds from the database on a miss.
_VIEWS: OrderedDict[tuple, list] = OrderedDict()
_VIEWS_LOCK = threading.Lock()
_VIEWS_MAX = 8


def _cached_view(model_id: str) -> list:
    """``[view, to_json() or None]`` for ``model_id`` from the cache, building it on a miss."""
    rows = live_rows()
    policy = shard_policy()
    expected = expected_experts(model_id)
    key = (model_id, policy, None if expected is None else tuple(expected), rows)
    with _VIEWS_LOCK:
        entry = _VIEWS.get(key)
        if entry is not None:
            _VIEWS.move_to_end(key)
            return entry
    view = ShardView.build(model_id, provider_infos(model_id, rows), policy=policy, expected=expected)
    entry = [view, None]
    with _VIEWS_LOCK:
        _VIEWS[key] = entry
        while len(_VIEWS) > _VIEWS_MAX:
            _VIEWS.popitem(last=False)
    return entry


def shard_view(model_id: str, exclude: set[str] | frozenset = frozenset()) -> ShardView:
    """The live shard view of ``model_id`` under the policy in force, catalog-aware when the model
    is published here or in the seed catalog; ``exclude`` drops providers (``ShardView.without``).

    Served from a per-process cache when no provider, holding, policy or catalog input changed
    since it was built (see ``_VIEWS``); the view is immutable, so sharing it is safe.
    """
    view = _cached_view(model_id)[0]
    return view.without(exclude) if exclude else view


def shard_map_json(model_id: str) -> dict:
    """``shard_view(model_id).to_json()``, cached with the view. Callers must not mutate it."""
    entry = _cached_view(model_id)
    if entry[1] is None:
        entry[1] = entry[0].to_json()
    return entry[1]


def _fallback_covers(model_id: str) -> bool:
    """Whether the site's blob store holds every published expert blob of ``model_id``, so its
    fallback replica (``router.fallback``) runs the batches no live holder takes."""
    from moe.blobs import BlobStore

    store = BlobStore(settings.TENZRO["BLOB_DIR"])
    hashes = set(ExpertBlob.objects.filter(model_id=model_id).values_list("blob_hash", flat=True))
    return bool(hashes) and all(store.has(h) for h in hashes)


def health() -> dict:
    """The ``/healthz`` body: ``status`` "ok" or "degraded", ``providers`` and ``live_providers``
    counts, ``failing_holders`` (live provider ids whose latest batch failed, ``is_failing``),
    ``under_replicated`` (``{model_id: slots below the policy's min_replication}`` over published
    models some live provider holds, models at target omitted), ``unserved_models`` (published
    models no live provider holds any expert of: e.g. ones a finished ``make demo`` placed on
    its agents, now offline; still degraded: their generations run on the site's fallback replica
    when its blob store holds their experts, else fail, and ``problems`` says which) and
    ``problems`` (one sentence per finding)."""
    live = list(live_providers())
    failing = sorted(p.provider for p in live if is_failing(p))
    under, unserved = {}, []
    for model_id in MoeModel.objects.order_by("model_id").values_list("model_id", flat=True):
        view = shard_view(model_id)
        if not view.covered_experts():
            unserved.append(model_id)
            continue
        n = len(view.under_replicated())
        if n:
            under[model_id] = n
    problems = [f"{len(failing)} live holder(s) failing their latest batches"] if failing else []
    problems += [f"{m}: {n} expert slot(s) below min_replication" for m, n in under.items()]
    covered = [m for m in unserved if _fallback_covers(m)]
    why = "their holders are offline, e.g. a finished demo's agents, or they were never placed: tenzro_moePlaceModel"
    for models, outcome in ((covered, "the site's fallback replica serves their generations from its blob store "
                                      "(slowly: the site computes every expert); tenzro_moeForward calls fail"),
                            ([m for m in unserved if m not in covered], "requests for them fail")):
        if models:
            problems.append(f"{len(models)} published model(s) with no live holder: {', '.join(models[:5])}"
                            f"{' ...' if len(models) > 5 else ''}: {outcome} ({why})")
    return {"status": "degraded" if problems else "ok", "providers": Provider.objects.count(),
            "live_providers": len(live), "failing_holders": failing, "under_replicated": under,
            "unserved_models": unserved, "problems": problems}
