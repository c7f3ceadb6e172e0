"""Signed heartbeats: accepted, replaced atomically, and refused without changing anything."""
from __future__ import annotations

import time

import pytest
from nacl.signing import SigningKey

from moe.identity import SignatureError, provider_id
from registry.heartbeat import HeartbeatError, ingest
from registry.models import Holding, MoeModel, Provider
from tests.conftest import holding, signed_heartbeat, with_repeated_key

pytestmark = pytest.mark.django_db


def publish_m(num_experts: int = 8, layers=(0,)) -> None:
    """A published model "m": REST heartbeats may name only models the site knows."""
    MoeModel.objects.create(model_id="m", family="qwen3_moe", num_experts=num_experts, top_k=1, hidden_size=8,
                            expert_d_ff=4, moe_layers=list(layers))


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
    publish_m()
    key = SigningKey.generate()
    ok = client.post("/api/v1/providers/heartbeat", signed_heartbeat(key, [holding()]), content_type="application/json")
    assert ok.status_code == 200 and ok.json()["holdings"] == 1
    bad = signed_heartbeat(key, [holding(expert=3)])
    bad["signature"] = "00" * 64
    resp = client.post("/api/v1/providers/heartbeat", bad, content_type="application/json")
    assert resp.status_code == 400 and resp.json()["field"] == "signature"
    assert Holding.objects.get().expert == 0


# ----------------------------------------------------------------- compact holdings, provider fields, REST


def test_parse_ranges_forms_and_errors():
    from registry.heartbeat import parse_ranges

    assert parse_ranges("0-3,7, 9-10", "x", 100) == [0, 1, 2, 3, 7, 9, 10]
    assert parse_ranges([[0, 2], 5], "x", 100) == [0, 1, 2, 5]
    for bad, msg in (("3-1", "lo <= hi"), ("1-2,2", "twice"), ("a", "not an integer"), ("-1", "not an integer"),
                     ([], "range string"), ([[1, 2, 3]], "pairs"), ([True], "pairs"), ("0-200", "<= 100"),
                     ("٣", "not an integer"), (5, "range string")):
        with pytest.raises(HeartbeatError, match=msg) as err:
            parse_ranges(bad, "holdings[0].experts", 100)
        assert err.value.field == "holdings[0].experts"


def test_compact_holdings_expand_and_fill_blob_uris():
    from registry.models import ExpertBlob

    ExpertBlob.objects.create(model_id="m", layer=1, expert=2, blob_hash="ab" * 32, nbytes=8)
    key = SigningKey.generate()
    ingest(signed_heartbeat(key, [
        {"model_id": "m", "layer": 1, "experts": "0-2,5", "residency": "Cold", "committed_tps": 7},
        {"model_id": "m", "layers": [[2, 3]], "experts": [[0, 1]]},
        holding(model_id="m", layer=9, expert=9, blob_uri="tenzro://blob/" + "cd" * 32),
    ]))
    rows = list(Holding.objects.order_by("layer", "expert").values_list("layer", "expert", "residency",
                                                                         "committed_tps", "blob_uri"))
    assert rows == [(1, 0, "Cold", 7, ""), (1, 1, "Cold", 7, ""), (1, 2, "Cold", 7, "tenzro://blob/" + "ab" * 32),
                    (1, 5, "Cold", 7, ""), (2, 0, "Warm", 0, ""), (2, 1, "Warm", 0, ""), (3, 0, "Warm", 0, ""),
                    (3, 1, "Warm", 0, ""), (9, 9, "Warm", 0, "tenzro://blob/" + "cd" * 32)]


@pytest.mark.parametrize("entry, msg", [
    ({"model_id": "m", "layer": 0, "experts": "0-3", "expert": 1}, "neither expert nor blob_uri"),
    ({"model_id": "m", "layer": 0, "experts": "0-3", "blob_uri": ""}, "neither expert nor blob_uri"),
    ({"model_id": "m", "experts": "0-3"}, "exactly one of layer and layers"),
    ({"model_id": "m", "layer": 0, "layers": "0", "experts": "0-3"}, "exactly one of layer and layers"),
    ({"model_id": "m", "layers": "0-99999", "experts": "0-999999"}, "more than"),
    ({"model_id": "m", "layer": 0, "experts": "0-3", "residency": "Hot"}, "residency"),
    ({"model_id": "m\x00", "layer": 0, "experts": "0"}, "without NUL"),  # PostgreSQL text refuses NUL
])
def test_bad_compact_entries_are_refused_and_change_nothing(entry, msg):
    key = SigningKey.generate()
    ingest(signed_heartbeat(key, [holding(expert=0)]))
    before = state()
    with pytest.raises(HeartbeatError, match=msg):
        ingest(signed_heartbeat(key, [entry], ts_ms=int(time.time() * 1000) + 5))
    assert state() == before


def test_compact_and_expanded_declaring_one_expert_twice():
    key = SigningKey.generate()
    with pytest.raises(HeartbeatError, match="twice"):
        ingest(signed_heartbeat(key, [holding(layer=0, expert=2), {"model_id": "m", "layer": 0, "experts": "0-3"}]))
    assert not Provider.objects.exists()


def test_whole_model_in_compact_form_stays_small():
    """Kimi K2's 60 MoE layers (1-60; layer 0 is dense) × 385 slots: one compact entry instead
    of 23,100 objects."""
    from moe.identity import canonical_json

    key = SigningKey.generate()
    msg = signed_heartbeat(key, [{"model_id": "kimi-k2-instruct", "layers": "1-60", "experts": "0-384"}])
    assert len(canonical_json(msg["body"])) < 600
    ingest(msg)
    assert Holding.objects.count() == 60 * 385


def test_provider_fields_round_trip_and_pure_expert_holders(client):
    key = SigningKey.generate()
    pid = provider_id(key)
    ingest(signed_heartbeat(key, [{"model_id": "m", "layer": 0, "experts": "0-1"}], name="holder-a",
                            roles=["ExpertHolder"], http_endpoint="http://10.0.0.5:8545/rpc",
                            iroh_endpoint_id="a" * 52, iroh_addrs=["10.0.0.5:9001", "[::1]:9001"], moe_gpu=True,
                            price_per_input_token=25, minimum_price=300))
    Provider.objects.filter(provider=pid).update(connected=True)
    got = client.get(f"/api/v1/providers/{pid}").json()
    assert {k: got[k] for k in ("name", "roles", "http_endpoint", "iroh_endpoint_id", "iroh_addrs", "moe_gpu",
                                "price_per_input_token", "minimum_price", "status", "live", "holdings")} == {
        "name": "holder-a", "roles": ["ExpertHolder"], "http_endpoint": "http://10.0.0.5:8545/rpc",
        "iroh_endpoint_id": "a" * 52, "iroh_addrs": ["10.0.0.5:9001", "[::1]:9001"], "moe_gpu": True, "price_per_input_token": 25, "minimum_price": 300,
        "status": "Active", "live": True, "holdings": 2}
    sm = client.get("/api/v1/shard-map", {"model_id": "m"}).json()
    assert sm["expert_holders_role_count"] == 1 and sm["replica_role_count"] == 0  # pure expert holder admitted
    assert sm["holders"][0]["holders"][0] == {"provider": pid, "residency": "Warm", "committed_tps": 0,
                                              "iroh_endpoint_id": "a" * 52, "http_endpoint": "http://10.0.0.5:8545/rpc",
                                              "blob_uri": None, "gpu": True}
    compact = client.get("/api/v1/holdings", {"provider": pid, "compact": "true"}).json()
    assert compact["holdings"] == [{"provider": pid, "model_id": "m", "layer": 0, "experts": "0-1",
                                    "residency": "Warm", "committed_tps": 0}]
    with pytest.raises(HeartbeatError, match="roles"):
        ingest(signed_heartbeat(key, [], ts_ms=int(time.time() * 1000) + 5, roles=["Miner"]))
    with pytest.raises(HeartbeatError, match="moe_gpu"):
        ingest(signed_heartbeat(key, [], ts_ms=int(time.time() * 1000) + 6, moe_gpu="yes"))
    for i, bad in enumerate((["relay.example:443"], ["10.0.0.5"], ["10.0.0.5:0"], "10.0.0.5:9001", [7],
                             ["10.0.0.5:9001"] * 17)):
        with pytest.raises(HeartbeatError, match="iroh_addrs"):
            ingest(signed_heartbeat(key, [], ts_ms=int(time.time() * 1000) + 7 + i, iroh_addrs=bad))
    assert Provider.objects.get(provider=pid).iroh_addrs == ["10.0.0.5:9001", "[::1]:9001"]


def test_rest_heartbeat_refuses_replayed_foreign_and_stale_compact_heartbeats(client):
    publish_m()
    key, other = SigningKey.generate(), SigningKey.generate()
    post = lambda m: client.post("/api/v1/providers/heartbeat", m, content_type="application/json")  # noqa: E731
    msg = signed_heartbeat(key, [{"model_id": "m", "layer": 0, "experts": "0-7"}])
    assert post(msg).json()["holdings"] == 8
    before = state()
    replay = post(msg)
    assert replay.status_code == 400 and replay.json()["field"] == "body.timestamp_ms"
    foreign = signed_heartbeat(key, [{"model_id": "m", "layer": 0, "experts": "0"}], ts_ms=int(time.time() * 1000) + 9)
    foreign["signature"] = signed_heartbeat(other, [])["signature"]
    assert post(foreign).json()["field"] == "signature"
    stale = signed_heartbeat(key, [{"model_id": "m", "layer": 0, "experts": "0"}],
                             ts_ms=int(time.time() * 1000) - 61_000)
    assert post(stale).json()["field"] == "body.timestamp_ms"
    assert post([1, 2]).json()["field"] == "body"
    assert state() == before


def test_holding_field_errors_name_the_entry():
    key = SigningKey.generate()
    with pytest.raises(HeartbeatError) as err:
        ingest(signed_heartbeat(key, [holding(), {**holding(expert=1), "layer": -1}]))
    assert err.value.field == "holdings[1].layer"


def test_agent_advertises_its_pricing_in_the_signed_heartbeat(tmp_path):
    from holders.agent import AgentConfig, HolderAgent
    from settlement.services import price

    agent = HolderAgent(AgentConfig("http://127.0.0.1:1", SigningKey.generate(), tmp_path, price_per_input_token=3,
                        minimum_price=7))
    msg = agent.session.heartbeat_message()
    ingest(msg)
    p = Provider.objects.get(provider=agent.provider)
    assert (p.price_per_input_token, p.minimum_price) == (3, 7)
    gross, holder_amount, fee = price(2, p.price_per_input_token, p.minimum_price, 9000)
    assert (gross, holder_amount + fee) == (7, 7)  # 2 tokens × 3 < the minimum of 7


def test_rest_heartbeat_with_a_repeated_key_is_refused_before_verifying(client):
    import json

    key = SigningKey.generate()
    text = with_repeated_key(signed_heartbeat(key, [holding()], name="signed"), "name", "unsigned")
    assert json.loads(text)["body"]["name"] == "signed"  # what a last-wins parser verifies: a good signature
    before = state()
    resp = client.post("/api/v1/providers/heartbeat", text, content_type="application/json")
    assert resp.status_code == 400 and resp.json()["field"] == "body" and "repeats the key" in resp.json()["error"]
    assert state() == before



@pytest.mark.parametrize("text,field,words", [
    ('{"body":{},"signature":"x"}', "body.provider", "body.provider must be 64 lowercase hex"),
    ('{"body":{"provider":"ab"},"signature":"x"}', "body.provider", "body.provider must be 64 lowercase hex"),
    ('{"body":NaN}', "body", "JSON parse error - NaN is not JSON"),
    ('{"body":{"x":Infinity},"signature":"x"}', "body", "JSON parse error - Infinity is not JSON"),
])
def test_rest_heartbeat_errors_name_the_right_field(client, text, field, words):
    """A malformed provider id is the body's field (not ``signature``); NaN is the parse error
    every other JSON endpoint gives, not "body must be an object"."""
    before = state()
    resp = client.post("/api/v1/providers/heartbeat", text, content_type="application/json")
    assert resp.status_code == 400 and resp.json()["field"] == field and words in resp.json()["error"], resp.json()
    assert state() == before

def test_compact_holdings_round_trip_through_the_parser():
    import random

    from moe.messages import compact_holdings
    from moe.ranges import format_ranges
    from registry.heartbeat import parse_holdings, parse_ranges

    assert format_ranges([5, 0, 1, 2, 9, 10]) == "0-2,5,9-10" and parse_ranges("0-2,5,9-10", "x", 99) == [0, 1, 2, 5, 9, 10]
    rng = random.Random(3)
    held = [{"model_id": m, "layer": layer, "expert": e, "residency": rng.choice(["Warm", "Cold"]),
             "committed_tps": rng.choice([0, 0, 3, 1000, 1500]), "blob_uri": "x"}
            for m in ("a", "b") for layer in range(4) for e in range(40) if rng.random() < 0.7]
    key = lambda h: (h["model_id"], h["layer"], h["expert"])  # noqa: E731
    exact = {key(h): (h["residency"], h["committed_tps"]) for h in parse_holdings(compact_holdings(held))}
    assert exact == {key(h): (h["residency"], h["committed_tps"]) for h in held}
    pow2 = {key(h): h["committed_tps"] for h in parse_holdings(compact_holdings(held, 1))}
    assert pow2 == {key(h): {0: 0, 3: 2, 1000: 512, 1500: 1024}[h["committed_tps"]] for h in held}
    assert all(h["committed_tps"] == 0 for h in parse_holdings(compact_holdings(held, 2)))


# ----------------------------------------------------------------- storage admission (issue 24 item 5)

def _post(client, msg, addr="10.9.9.9"):
    return client.post("/api/v1/providers/heartbeat", msg, content_type="application/json", REMOTE_ADDR=addr)


def test_rest_heartbeat_of_an_unknown_model_or_beyond_the_shape_writes_nothing(client):
    """One 290-byte REST heartbeat from a fresh key declaring layers 0-255 × experts 0-1023 of
    a model nobody published wrote 262,144 holding rows before."""
    publish_m(num_experts=8, layers=(1, 2))
    huge = signed_heartbeat(SigningKey.generate(), [{"model_id": "nobody-publishes-this", "layers": "0-255",
                                                    "experts": "0-1023"}])
    r = _post(client, huge)
    assert r.status_code == 400 and r.json()["field"] == "holdings" and "neither published" in r.json()["error"]
    outside = signed_heartbeat(SigningKey.generate(), [{"model_id": "m", "layers": "0-255", "experts": "0-1023"}])
    r = _post(client, outside)
    assert r.status_code == 400 and "has no expert slot l0/e0" in r.json()["error"]
    with pytest.raises(HeartbeatError, match="has no expert slot l1/e8"):  # the socket path too
        ingest(signed_heartbeat(SigningKey.generate(), [{"model_id": "m", "layer": 1, "experts": "0-8"}]))
    assert not Holding.objects.exists() and not Provider.objects.exists()
    # The whole shape fits (8 routed experts; no shared slot), and the key serves on.
    ok = _post(client, signed_heartbeat(SigningKey.generate(), [{"model_id": "m", "layers": "1-2", "experts": "0-7"}]))
    assert ok.status_code == 200 and ok.json()["holdings"] == 16


def test_rest_heartbeats_from_new_keys_are_rate_limited_per_client_and_capped_on_probation(client, settings,
                                                                                          monkeypatch):
    from registry import ratelimit

    monkeypatch.setattr(ratelimit, "window_index", lambda window_s: 1)  # one window for the whole burst
    settings.TENZRO = {**settings.TENZRO, "NEW_KEY_RATE_PER_MINUTE": 3, "PROBATION_HOLDINGS": 100}
    publish_m(num_experts=200, layers=(0, 1))
    keys = [SigningKey.generate() for _ in range(5)]
    codes = [_post(client, signed_heartbeat(k, [holding(expert=0)])).status_code for k in keys]
    assert codes == [200, 200, 200, 429, 429]
    r = _post(client, signed_heartbeat(keys[4], [holding(expert=0)]))
    assert r.status_code == 429 and r.json()["field"] == "body.provider" and "new provider keys" in r.json()["error"]
    assert _post(client, signed_heartbeat(keys[4], [holding(expert=0)]), addr="10.9.9.10").status_code == 200
    # A key the site has seen keeps heartbeating past the new-key rate.
    assert _post(client, signed_heartbeat(keys[0], [holding(expert=1)], ts_ms=int(time.time() * 1000) + 5)
                 ).status_code == 200
    # Probation: a key that has served no batch declares at most 100 experts; proven keys more.
    over = [{"model_id": "m", "layers": "0-1", "experts": "0-50"}]
    r = _post(client, signed_heartbeat(keys[1], over, ts_ms=int(time.time() * 1000) + 6))
    assert r.status_code == 400 and "at most 100" in r.json()["error"]
    Provider.objects.filter(provider=provider_id(keys[1])).update(batches_served=1)
    r = _post(client, signed_heartbeat(keys[1], over, ts_ms=int(time.time() * 1000) + 7))
    assert r.status_code == 200 and r.json()["holdings"] == 102
