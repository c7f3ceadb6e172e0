"""Reads of the registry: live providers and the shard view of a model."""
from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from registry import catalog
from registry.governance import shard_policy
from registry.models import MoeModel, Provider
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
    """Live providers as planner dataclasses, with their holdings (of ``model_id`` when given)."""
    infos = []
    for p in live_providers().prefetch_related("holdings"):
        holdings = tuple(
            HoldingInfo(h.model_id, h.layer, h.expert, h.residency, h.committed_tps, h.blob_uri or None)
            for h in p.holdings.all() if model_id is None or h.model_id == model_id
        )
        infos.append(ProviderInfo(provider=p.provider, roles=tuple(p.roles), status=p.status, gpu=p.moe_gpu,
                                  iroh_endpoint_id=p.iroh_endpoint_id or None,
                                  http_endpoint=p.http_endpoint or None, reputation=p.reputation,
                                  holdings=holdings))
    return infos


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
