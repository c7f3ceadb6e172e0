"""Provider hygiene (issue 15 item 9): unproven keys expire, listings show liveness and faults,
``/healthz`` reports a degraded site."""
from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone
from nacl.signing import SigningKey

from registry import services, tasks
from registry.heartbeat import ingest
from moe.identity import provider_id
from registry.models import Holding, MoeModel, Provider
from tests.conftest import holding, needs_services, signed_heartbeat

pytestmark = pytest.mark.django_db


def key(seed: int) -> SigningKey:
    return SigningKey(bytes([seed]) * 32)


def agent(seed: int, holdings=(), connected: bool = True, **fields) -> str:
    """A provider that heartbeated (``holdings``) with its socket open when ``connected``."""
    k = key(seed)
    ingest(signed_heartbeat(k, list(holdings), name=f"p{seed}"))
    pid = provider_id(k)
    Provider.objects.filter(provider=pid).update(connected=connected, **fields)
    return pid


def age(pid: str, seconds: float) -> None:
    """Move a provider's heartbeat and creation ``seconds`` into the past."""
    then = timezone.now() - timedelta(seconds=seconds)
    Provider.objects.filter(provider=pid).update(last_heartbeat=then, created=then)


def test_unproven_providers_expire_and_proven_ones_stay():
    ttl = settings.TENZRO["UNPROVEN_PROVIDER_TTL_S"]
    rest_once = agent(1, [holding("m", 0, 0)], connected=False)  # one REST heartbeat, never a socket
    services.agent_connected(provider_id(key(2)), "chan-2")  # a hello, then gone
    services.agent_disconnected(provider_id(key(2)), "chan-2")
    hello_only = provider_id(key(2))
    proven = agent(3, connected=False, batches_served=4)
    paid = agent(4, connected=False, balance=90)
    suspended = agent(5, connected=False, status=Provider.Status.SUSPENDED)
    fresh = agent(6, connected=False)  # seen a moment ago
    live = agent(7, [holding("m", 0, 1)])  # socket open, heartbeat fresh
    services.agent_connected(provider_id(key(8)), "chan-8")  # hello a moment ago, first heartbeat not yet
    greeting = provider_id(key(8))
    for pid in (rest_once, hello_only, proven, paid, suspended, live, greeting):
        age(pid, ttl + 60)
    Provider.objects.filter(provider=live).update(last_heartbeat=timezone.now())

    assert tasks.expire_unproven_providers.delay().get() == 2  # the beat task, run eagerly here
    left = set(Provider.objects.values_list("provider", flat=True))
    assert left == {proven, paid, suspended, fresh, live, greeting}
    assert not Holding.objects.filter(provider_id=rest_once).exists()
    assert services.expire_unproven_providers() == 0  # idempotent
    schedule = {e["task"] for e in settings.CELERY_BEAT_SCHEDULE.values()}
    assert {"registry.expire_unproven_providers", "registry.sweep_stale_providers"} <= schedule


def test_state_reflects_liveness_and_faults(client):
    live = agent(1, [holding("m", 0, 0)], batches_served=5)
    dead = agent(2, [holding("m", 0, 1)], batches_served=5)  # socket still marked open, heartbeats stopped
    age(dead, 3600)
    newbie = agent(3, [holding("m", 0, 2)])
    black_hole = agent(4, [holding("m", 0, 3)], batches_served=1)
    quarantined = agent(5, quarantined_until_ms=2**62)
    services.record_holder_outcomes({black_hole: 1}, {live: [3.0]})

    def states():
        body = client.post("/rpc", json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tenzro_moeListProviders",
                                                "params": {}}), content_type="application/json").json()
        return {p["provider"]: p["state"] for p in body["result"]["providers"]}

    assert states() == {live: "Live", dead: "Offline", newbie: "Unproven", black_hole: "Failing",
                        quarantined: "Quarantined"}
    services.record_holder_outcomes({}, {black_hole: [4.0]})  # a later success clears it
    assert states()[black_hole] == "Live"
    services.record_holder_outcomes({black_hole: 2}, {})
    Provider.objects.filter(provider=black_hole).update(
        last_failure=timezone.now() - timedelta(seconds=settings.TENZRO["FAILING_WINDOW_S"] + 5))
    assert states()[black_hole] == "Live"  # failures older than the window are history
    assert services.sweep_stale_providers() == 1 and services.sweep_stale_providers() == 0
    assert not Provider.objects.get(provider=dead).connected

    # The console lists live, proven holders first and says what each one is.
    html = client.get("/providers/").content.decode()
    order = [html.index(f"p{seed}</td>") for seed in (1, 4, 3, 5, 2)]
    assert order == sorted(order)
    assert 'data-state="Offline"' in html and 'data-state="Unproven"' in html
    assert 'data-state="Offline"' in client.get(f"/providers/{dead}").content.decode()


def test_healthz_reports_failing_holders_and_under_replication(client):
    MoeModel.objects.create(model_id="m", family="qwen3_moe", num_experts=2, top_k=1, hidden_size=8,
                            expert_d_ff=4, moe_layers=[0])
    a = agent(1, [holding("m", 0, 0), holding("m", 0, 1)], batches_served=1)
    body = client.get("/healthz").json()
    assert body["ok"] is True and body["status"] == "degraded"
    assert body["under_replicated"] == {"m": 2} and body["failing_holders"] == []
    assert "m: 2 expert slot(s) below min_replication" in body["problems"]

    b = agent(2, [holding("m", 0, 0), holding("m", 0, 1)], batches_served=1)
    body = client.get("/healthz").json()
    assert (body["status"], body["under_replicated"], body["problems"]) == ("ok", {}, [])
    assert (body["providers"], body["live_providers"]) == (2, 2)

    services.record_holder_outcomes({b: 1}, {a: [2.0]})
    body = client.get("/healthz").json()
    assert body["status"] == "degraded" and body["failing_holders"] == [b]


@pytest.mark.cluster
def test_a_running_site_expires_a_throwaway_key_on_its_own(tmp_path):
    """No broker: the site's in-process timer runs the beat task's sweep (interval 1 s, TTL 2 s)."""
    import time

    import httpx

    from tests.cluster_util import env_for, rpc, running_cluster
    from tests.conftest import QWEN

    env = {**env_for(tmp_path), "TENZRO_HYGIENE_INTERVAL": "1", "TENZRO_UNPROVEN_PROVIDER_TTL": "2"}
    with running_cluster(tmp_path, [QWEN], holders=2, env=env) as (info, _proc):
        throwaway = provider_id(key(99))
        r = httpx.post(f"{info['url']}/api/v1/providers/heartbeat", json=signed_heartbeat(key(99)), timeout=30)
        assert r.status_code == 200, r.text

        def listed():
            return {p["provider"]: p["state"]
                    for p in rpc(info["rpc"], "tenzro_moeListProviders", {})["result"]["providers"]}

        assert listed()[throwaway] == "Offline"  # a REST heartbeat opens no socket
        deadline = time.time() + 30
        while time.time() < deadline and throwaway in listed():
            time.sleep(0.5)
        states = listed()
        assert throwaway not in states
        assert set(states) == {a["provider"] for a in info["agents"]}  # the agents, live, are kept


@needs_services
def test_healthz_is_degraded_when_a_broker_has_no_worker_on_the_sites_queue(client, settings):
    """Services mode without a worker (issue: prepare jobs stayed pending while /healthz said ok):
    the real Redis broker is asked, and no worker consumes this site's fresh queue."""
    import uuid

    from django.core.cache import cache

    from tenzro_site.celery import app
    from tests.conftest import REDIS_URL
    queue = f"q{uuid.uuid4().hex[:8]}"
    settings.CELERY_TASK_ALWAYS_EAGER, settings.CELERY_TASK_DEFAULT_QUEUE = False, queue
    old = app.conf.broker_url, app.conf.task_default_queue
    app.conf.broker_url, app.conf.task_default_queue = REDIS_URL, queue
    cache.clear()
    try:
        body = client.get("/healthz").json()
    finally:
        app.conf.broker_url, app.conf.task_default_queue = old
        cache.clear()
    assert body["status"] == "degraded" and body["celery_workers"] == 0
    assert any(f"no Celery worker consumes the task queue {queue!r}" in p for p in body["problems"])
    settings.CELERY_TASK_ALWAYS_EAGER = True
    assert "celery_workers" not in client.get("/healthz").json()  # no broker (tasks run inline): not asked


def test_healthz_names_published_models_no_live_provider_holds():
    """A model placed on agents that are gone (a finished demo's, issue item 24) is listed under
    ``unserved_models`` with a sentence saying why, not as a bare under-replication count."""
    from django.test import Client

    MoeModel.objects.create(model_id="gone-q4-k-m", family="qwen3_moe", num_experts=2, top_k=1, hidden_size=8,
                            expert_d_ff=4, moe_layers=[0])
    MoeModel.objects.create(model_id="m", family="qwen3_moe", num_experts=2, top_k=1, hidden_size=8,
                            expert_d_ff=4, moe_layers=[0])
    agent(1, [holding("m", 0, 0), holding("m", 0, 1)], batches_served=1)
    agent(2, [holding("m", 0, 0), holding("m", 0, 1)], batches_served=1)
    body = Client().get("/healthz").json()
    assert body["status"] == "degraded" and body["under_replicated"] == {}
    assert body["unserved_models"] == ["gone-q4-k-m"]
    assert any("gone-q4-k-m" in p and "no live holder" in p and "requests for them fail" in p
               for p in body["problems"]), body["problems"]


def test_healthz_says_the_fallback_replica_serves_a_model_with_no_live_holder(tmp_path):
    """A published model whose experts are in the site's blob store still generates (the fallback
    replica runs them) with no holder: ``problems`` says so instead of "requests fail"."""
    from django.test import Client

    from prepare.services import publish_checkpoint
    from tests.conftest import QWEN

    publish_checkpoint(QWEN, "fb")
    body = Client().get("/healthz").json()
    assert body["status"] == "degraded" and body["unserved_models"] == ["fb"]
    [p] = [p for p in body["problems"] if "fb" in p]
    assert "fallback replica serves their generations" in p and "requests for them fail" not in p, p
