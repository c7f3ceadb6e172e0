"""Registry writes: heartbeats, agent sessions, placement inputs and holder outcomes."""
from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models.functions import Coalesce
from django.utils import timezone

from registry.models import ExpertBlob
from registry import heartbeat
from registry.models import AgentSession, MoeModel, Provider
from registry.selectors import live_cutoff, live_providers

FAILURE_PENALTY = 5
LATENCY_EWMA_ALPHA = 0.2


def ingest_heartbeat(message: dict, expected_provider: str | None = None, client: str | None = None) -> Provider:
    """Verify and apply a signed heartbeat (see ``registry.heartbeat.ingest``; ``client``: the
    REST caller's address, for the stricter storage admission of an anonymous post)."""
    return heartbeat.ingest(message, expected_provider, client=client)


class KeyInUse(Exception):
    """Another live session holds this provider's key: ``channels`` (their channel names);
    ``retry_for_s``: seconds after which they count as dead if their heartbeats stop (a
    reconnect after a network drop)."""

    def __init__(self, message: str, retry_for_s: int, channels: list[str]):
        super().__init__(message)
        self.retry_for_s = retry_for_s
        self.channels = channels


@transaction.atomic
def agent_connected(provider: str, channel_name: str, dead: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """Record that ``provider``'s agent socket is open on ``channel_name``.

    One live session per key: a session is live while the provider's last heartbeat or the
    session's opening is within ``MISSED_HEARTBEATS`` heartbeat intervals (``live_cutoff``),
    unless the caller found it ``dead`` (its consumer did not answer a ping: the site process
    that held it is gone). Raises ``KeyInUse`` when another live session exists (nothing
    written). Sessions that are not live (an agent reconnecting after a network drop the site
    has not noticed yet, a site restarted after a crash) are dropped; returns their channel
    names so the caller can close their sockets.
    """
    provider_row, _ = Provider.objects.select_for_update().get_or_create(provider=provider)
    others = list(AgentSession.objects.filter(provider_id=provider).exclude(channel_name=channel_name))
    cutoff = live_cutoff()
    beat = provider_row.last_heartbeat
    live = [s for s in others if s.channel_name not in dead
            and (s.opened >= cutoff or (beat is not None and beat >= cutoff))]
    if live:
        newest = max([s.opened for s in live] + ([beat] if beat is not None else []))
        window = settings.TENZRO["HEARTBEAT_INTERVAL_S"] * settings.TENZRO["MISSED_HEARTBEATS"]
        retry_for = max(1, int(window - (timezone.now() - newest).total_seconds()) + 1)
        raise KeyInUse(f"key {provider[:16]}... is already connected (session opened "
                       f"{live[0].opened.isoformat(timespec='seconds')}); one live session per key", retry_for,
                       [s.channel_name for s in live])
    dead = [s.channel_name for s in others]
    AgentSession.objects.filter(channel_name__in=dead).delete()
    AgentSession.objects.get_or_create(channel_name=channel_name, defaults={"provider_id": provider})
    Provider.objects.filter(provider=provider).update(connected=True, agent_channel=channel_name)
    return dead


@transaction.atomic
def agent_disconnected(provider: str, channel_name: str) -> bool:
    """Close the session on ``channel_name``; the provider stays connected while another session
    is open. Returns whether it still is."""
    AgentSession.objects.filter(channel_name=channel_name).delete()
    latest = AgentSession.objects.filter(provider_id=provider).order_by("-opened").first()
    Provider.objects.filter(provider=provider).update(connected=latest is not None,
                                                      agent_channel=latest.channel_name if latest else "")
    return latest is not None


@transaction.atomic
def reset_sessions(providers: list[str]) -> int:
    """Forget the agent sessions of ``providers`` only: the caller's own agents, whose processes
    are not running, so no socket of theirs can be open. Sessions of every other provider (agents
    of another site sharing this database) are left alone. Returns how many providers changed."""
    AgentSession.objects.filter(provider_id__in=providers).delete()
    return Provider.objects.filter(provider__in=providers).update(connected=False, agent_channel="")


def sweep_stale_providers() -> int:
    """Mark providers whose heartbeats stopped (``MISSED_HEARTBEATS`` intervals) as disconnected
    and drop their sessions (a site killed without closing its sockets leaves them marked open).
    Returns how many rows changed; running it twice changes nothing more."""
    stale = Provider.objects.filter(connected=True, last_heartbeat__lt=live_cutoff())
    AgentSession.objects.filter(provider__in=stale).delete()
    return stale.update(connected=False, agent_channel="")


def expire_unproven_providers(ttl_s: int | None = None) -> int:
    """Delete providers that never proved anything: no batch served, no balance, status Active
    (a suspension is kept), not live, and not seen for ``ttl_s`` seconds (default
    ``TENZRO_UNPROVEN_PROVIDER_TTL``, 3600) by last heartbeat (else creation) nor by an agent
    socket opened since (an agent between its hello and first heartbeat stays). Throwaway keys
    (a hello, one REST heartbeat) leave no permanent row; a real agent that comes back simply
    starts again at the default reputation. Holdings and sessions go with the row (cascade).
    Returns how many providers were deleted; idempotent."""
    ttl_s = settings.TENZRO["UNPROVEN_PROVIDER_TTL_S"] if ttl_s is None else ttl_s
    seen_before = timezone.now() - timedelta(seconds=ttl_s)
    doomed = (Provider.objects.filter(batches_served=0, balance=0, status=Provider.Status.ACTIVE)
              .exclude(provider__in=live_providers())
              .exclude(sessions__opened__gte=seen_before)
              .annotate(seen=Coalesce("last_heartbeat", "created"))
              .filter(seen__lt=seen_before))
    with transaction.atomic():
        ids = list(doomed.values_list("provider", flat=True))
        Provider.objects.filter(provider__in=ids).delete()
    return len(ids)


def provider_hygiene() -> dict:
    """Both periodic provider sweeps (the beat tasks, or the site's in-process timer without a
    broker): ``{"disconnected": sweep_stale_providers(), "expired": expire_unproven_providers()}``."""
    return {"disconnected": sweep_stale_providers(), "expired": expire_unproven_providers()}


class PlacementError(ValueError):
    """A model cannot be placed: ``field`` "model_id" for a bad parameter (unknown model, no
    published blobs), None for the cluster's state (no live agents)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def placement_inputs(model_id: str) -> tuple[list[tuple[int, int, str]], list[str]]:
    """(published (layer, expert, blob_uri) rows, live connected provider ids) for ``model_id``."""
    if not MoeModel.objects.filter(model_id=model_id).exists():
        raise PlacementError(f"model {model_id!r} is not published on this site", "model_id")
    blobs = [(b.layer, b.expert, b.blob_uri) for b in ExpertBlob.objects.filter(model_id=model_id)]
    if not blobs:
        raise PlacementError(f"model {model_id!r} has no published expert blobs", "model_id")
    providers = list(live_providers().values_list("provider", flat=True))
    if not providers:
        raise PlacementError("no live holder agents are connected")
    return blobs, providers


def record_holder_outcomes(failures: dict[str, int], latencies_ms: dict[str, list[float]]) -> None:
    """Record a forward's holder outcomes: each failure costs ``FAILURE_PENALTY`` reputation
    (reference §7.6, −5 per call failure), counts in ``batch_failures`` and stamps
    ``last_failure``; each success counts in ``batches_served``, moves ``latency_ms_ewma``
    (α = ``LATENCY_EWMA_ALPHA``) and stamps ``last_success`` (together: the "Failing" state).
    Unknown providers are ignored. Reputation only falls here (never below 0, the
    planner's floor); settlement raises it.
    """
    from django.db.models import F, Value
    from django.db.models.functions import Greatest

    now = timezone.now()
    with transaction.atomic():
        # Lock every row first, in provider order: concurrent recorders and settlements (which
        # credit in the same order) then queue instead of deadlocking on PostgreSQL.
        list(Provider.objects.select_for_update().filter(provider__in=sorted({*failures, *latencies_ms}))
             .order_by("provider").values_list("pk", flat=True))
        for provider, n in sorted(failures.items()):
            Provider.objects.filter(provider=provider).update(reputation=Greatest(F("reputation") - FAILURE_PENALTY * n,
                                                                                   Value(0)),
                                                              batch_failures=F("batch_failures") + n,
                                                              last_failure=now)
        for p in Provider.objects.filter(provider__in=list(latencies_ms)).order_by("provider"):
            lat = p.latency_ms_ewma
            for ms in latencies_ms[p.provider]:
                lat = ms if lat == 0 else (1 - LATENCY_EWMA_ALPHA) * lat + LATENCY_EWMA_ALPHA * ms
            p.latency_ms_ewma = lat
            p.batches_served += len(latencies_ms[p.provider])
            p.last_success = now
            p.save(update_fields=["latency_ms_ewma", "batches_served", "last_success"])
