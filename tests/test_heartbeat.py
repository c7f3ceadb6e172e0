"""Signed heartbeats: accepted, replaced atomically, and refused without changing anything."""
from __future__ import annotations

import time

import pytest
from nacl.signing import SigningKey

from holders.identity import SignatureError, provider_id
from registry.heartbeat import HeartbeatError, ingest
from registry.models import Holding, Provider
from tests.conftest import holding, signed_heartbeat

pytestmark = pytest.mark.django_db


def state():
    return (sorted(Provider.objects.values_list("provider", "last_heartbeat_ms", "name")),
            sorted(Holding.objects.values_list("provider_id", "model_id", "layer", "expert", "residency")))


def test_heartbeat_creates_provider_and_replaces_holdings():
    key = SigningKey.generate()
    ingest(signed_heartbeat(key, [holding(expert=0), holding(expert=1)]))
    assert Holding.objects.filter(provider_id=provider_id(key)).count() == 2
    ingest(signed_heartbeat(key, [holding(expert=5, residency="Cold")], ts_ms=int(time.time() * 1000) + 5))
    assert list(Holding.objects.values_list("expert", "residency")) == [(5, "Cold")]


def test_bad_signature_is_rejected_and_changes_nothing():
    key, other = SigningKey.generate(), SigningKey.generate()
    ingest(signed_heartbeat(key, [holding(expert=0)]))
    before = state()
    msg = signed_heartbeat(key, [holding(expert=9)], ts_ms=int(time.time() * 1000) + 10)
    msg["signature"] = signed_heartbeat(other, [holding(expert=9)])["signature"]  # signed by another key
    with pytest.raises(SignatureError):
        ingest(msg)
    tampered = signed_heartbeat(key, [holding(expert=1)], ts_ms=int(time.time() * 1000) + 20)
    tampered["body"]["holdings"][0]["expert"] = 2  # body altered after signing
    with pytest.raises(SignatureError):
        ingest(tampered)
    assert state() == before


def test_replay_and_stale_timestamps_are_rejected():
    key = SigningKey.generate()
    msg = signed_heartbeat(key, [holding(expert=0)])
    ingest(msg)
    before = state()
    with pytest.raises(HeartbeatError, match="replayed"):
        ingest(msg)
    with pytest.raises(HeartbeatError, match="from the site clock"):
        ingest(signed_heartbeat(key, [], ts_ms=int(time.time() * 1000) - 120_000))
    assert state() == before


def test_wrong_provider_on_socket_and_malformed_holdings():
    key = SigningKey.generate()
    with pytest.raises(HeartbeatError, match="differs from the key"):
        ingest(signed_heartbeat(key), expected_provider="0" * 64)
    with pytest.raises(HeartbeatError, match="residency"):
        ingest(signed_heartbeat(key, [holding(residency="Hot")]))
    with pytest.raises(HeartbeatError, match="twice"):
        ingest(signed_heartbeat(key, [holding(), holding()]))
    with pytest.raises(HeartbeatError, match="blob_uri"):
        ingest(signed_heartbeat(key, [holding(blob_uri="http://x")]))
    assert not Provider.objects.exists()


def test_http_heartbeat_endpoint(client):
    key = SigningKey.generate()
    ok = client.post("/api/v1/providers/heartbeat", signed_heartbeat(key, [holding()]), content_type="application/json")
    assert ok.status_code == 200 and ok.json()["holdings"] == 1
    bad = signed_heartbeat(key, [holding(expert=3)])
    bad["signature"] = "00" * 64
    resp = client.post("/api/v1/providers/heartbeat", bad, content_type="application/json")
    assert resp.status_code == 400 and resp.json()["field"] == "signature"
    assert Holding.objects.get().expert == 0
