"""Reads of the registry: live providers and the shard view of a model."""
from __future__ import annotations

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
    """Active providers whose agent socket is open and whose last heartbeat is fresh."""
    return Provider.objects.filter(status=Provider.Status.ACTIVE, connected=True,
                                   last_heartbeat__gte=live_cutoff())


def provider_infos(model_id: str | None = None) -> list[ProviderInfo]:
    """Live providers as planner dataclasses, with their holdings (of ``model_id`` when given).

    Rows are read as tuples (two queries), not model instances, and become ``HoldingInfo``
    without re-validation (heartbeat ingest validated them): at Kimi-K2 scale (70k holdings)
    both would cost seconds.
    """
    live = list(live_providers().values_list("provider", "roles", "status", "moe_gpu", "iroh_endpoint_id",
                                             "http_endpoint", "reputation"))
    holdings = Holding.objects.filter(provider__in=live_providers())
    if model_id is not None:
        holdings = holdings.filter(model_id=model_id)
    by_provider: dict[str, list[HoldingInfo]] = {p[0]: [] for p in live}
    for pid, mid, layer, expert, res, tps, blob in holdings.values_list(
            "provider_id", "model_id", "layer", "expert", "residency", "committed_tps", "blob_uri").iterator(
            chunk_size=10_000):
        by_provider[pid].append(HoldingInfo.unchecked(mid, layer, expert, res, tps, blob or None))
    return [ProviderInfo(provider=pid, roles=tuple(roles), status=status, gpu=gpu,
                         iroh_endpoint_id=iroh or None, http_endpoint=http or None, reputation=rep,
                         holdings=tuple(by_provider[pid]))
            for pid, roles, status, gpu, iroh, http, rep in live]


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


def shard_view(model_id: str, exclude: set[str] | frozenset = frozenset()) -> ShardView:
    """The live shard view of ``model_id`` under the policy in force (catalog-aware when the model is published here)."""
    infos = [p for p in provider_infos(model_id) if p.provider not in exclude]
    return ShardView.build(model_id, infos, policy=shard_policy(), expected=expected_experts(model_id))
