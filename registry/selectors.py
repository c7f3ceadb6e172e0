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
from registry.models import Holding, MoeModel, Provider
from registry.shardmap import HoldingInfo, ProviderInfo, ShardView


def live_cutoff():
    """Heartbeats older than this (``MISSED_HEARTBEATS`` intervals) drop a provider from the view."""
    t = settings.TENZRO
    return timezone.now() - timedelta(seconds=t["HEARTBEAT_INTERVAL_S"] * t["MISSED_HEARTBEATS"])


def live_providers():
    """Active providers whose agent socket is open, whose last heartbeat is fresh and that are
    not quarantined (``quarantined_until_ms`` in the past: upheld disputes, DESIGN §7)."""
    return Provider.objects.filter(status=Provider.Status.ACTIVE, connected=True,
                                   last_heartbeat__gte=live_cutoff(),
                                   quarantined_until_ms__lte=int(time.time() * 1000))


_LIVE_FIELDS = ("provider", "roles", "status", "moe_gpu", "iroh_endpoint_id", "http_endpoint", "reputation",
                "holdings_version")


def _live_rows() -> tuple[tuple, ...]:
    """Live providers as hashable tuples of ``_LIVE_FIELDS`` (roles as a tuple), sorted by id."""
    return tuple((pid, tuple(roles), *rest) for pid, roles, *rest in
                 live_providers().order_by("provider").values_list(*_LIVE_FIELDS))


def provider_infos(model_id: str | None = None, rows: tuple[tuple, ...] | None = None) -> list[ProviderInfo]:
    """Live providers (``rows`` from ``_live_rows``, read when None) as planner dataclasses, with
    their holdings (of ``model_id`` when given).

    Rows are read as tuples, not model instances, and become ``HoldingInfo`` without
    re-validation (heartbeat ingest validated them): at Kimi-K2 scale (70k holdings) both
    would cost seconds.
    """
    live = _live_rows() if rows is None else rows
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


def iroh_peers() -> dict[str, tuple[str, list[str]]]:
    """Live providers advertising an iroh endpoint: ``{provider: (endpoint id, ["ip:port", ...])}``
    (from their last signed heartbeat)."""
    return {pid: (eid, list(addrs or [])) for pid, eid, addrs in
            live_providers().exclude(iroh_endpoint_id="").values_list("provider", "iroh_endpoint_id", "iroh_addrs")}


def expected_experts(model_id: str) -> list[tuple[int, int]] | None:
    """Every (layer, expert) slot of ``model_id``: from the published model, else from the seed
    catalog when its layer map is known, else None (the view then knows only covered experts)."""
    m = MoeModel.objects.filter(model_id=model_id).first()
    if m:
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
    rows = _live_rows()
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
