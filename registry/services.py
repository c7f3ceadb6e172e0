"""Registry writes: heartbeats, agent sessions, placement inputs and holder outcomes."""
from __future__ import annotations

from django.db import transaction

from registry.models import ExpertBlob
from registry import heartbeat
from registry.models import AgentSession, MoeModel, Provider
from registry.selectors import live_providers

FAILURE_PENALTY = 5
LATENCY_EWMA_ALPHA = 0.2


def ingest_heartbeat(message: dict, expected_provider: str | None = None) -> Provider:
    """Verify and apply a signed heartbeat (see ``registry.heartbeat.ingest``)."""
    return heartbeat.ingest(message, expected_provider)


@transaction.atomic
def agent_connected(provider: str, channel_name: str) -> None:
    """Record that ``provider``'s agent socket is open on ``channel_name``."""
    Provider.objects.get_or_create(provider=provider)
    AgentSession.objects.get_or_create(channel_name=channel_name, defaults={"provider_id": provider})
    Provider.objects.filter(provider=provider).update(connected=True, agent_channel=channel_name)


@transaction.atomic
def agent_disconnected(provider: str, channel_name: str) -> bool:
    """Close the session on ``channel_name``; the provider stays connected while another session
    is open. Returns whether it still is."""
    AgentSession.objects.filter(channel_name=channel_name).delete()
    latest = AgentSession.objects.filter(provider_id=provider).order_by("-opened").first()
    Provider.objects.filter(provider=provider).update(connected=latest is not None,
                                                      agent_channel=latest.channel_name if latest else "")
    return latest is not None


def reset_sessions() -> None:
    """Forget every agent session (a site that starts fresh has no open sockets)."""
    AgentSession.objects.all().delete()
    Provider.objects.update(connected=False, agent_channel="")


class PlacementError(ValueError):
    """A model cannot be placed (unknown model, no published blobs, no live agents)."""


def placement_inputs(model_id: str) -> tuple[list[tuple[int, int, str]], list[str]]:
    """(published (layer, expert, blob_uri) rows, live connected provider ids) for ``model_id``."""
    if not MoeModel.objects.filter(model_id=model_id).exists():
        raise PlacementError(f"model {model_id!r} is not published on this site")
    blobs = [(b.layer, b.expert, b.blob_uri) for b in ExpertBlob.objects.filter(model_id=model_id)]
    if not blobs:
        raise PlacementError(f"model {model_id!r} has no published expert blobs")
    providers = list(live_providers().values_list("provider", flat=True))
    if not providers:
        raise PlacementError("no live holder agents are connected")
    return blobs, providers


def record_holder_outcomes(failures: dict[str, int], latencies_ms: dict[str, list[float]]) -> None:
    """Record a forward's holder outcomes: each failure costs ``FAILURE_PENALTY`` reputation
    (reference §7.6, −5 per call failure) and counts in ``batch_failures``; each success
    counts in ``batches_served`` and moves ``latency_ms_ewma`` (α = ``LATENCY_EWMA_ALPHA``).
    Unknown providers are ignored. Reputation only falls here (never below 0, the
    planner's floor); settlement raises it.
    """
    from django.db import transaction
    from django.db.models import F, Value
    from django.db.models.functions import Greatest

    with transaction.atomic():
        for provider, n in failures.items():
            Provider.objects.filter(provider=provider).update(reputation=Greatest(F("reputation") - FAILURE_PENALTY * n,
                                                                                   Value(0)),
                                                              batch_failures=F("batch_failures") + n)
        for p in Provider.objects.select_for_update().filter(provider__in=list(latencies_ms)):
            lat = p.latency_ms_ewma
            for ms in latencies_ms[p.provider]:
                lat = ms if lat == 0 else (1 - LATENCY_EWMA_ALPHA) * lat + LATENCY_EWMA_ALPHA * ms
            p.latency_ms_ewma = lat
            p.batches_served += len(latencies_ms[p.provider])
            p.save(update_fields=["latency_ms_ewma", "batches_served"])
