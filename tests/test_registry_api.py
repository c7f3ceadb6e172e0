"""Golden JSON shapes of every registry JSON-RPC method, the REST mirror, limits, docs and the coverage page.

The golden file ``tests/fixtures/golden/registry_api.json`` holds the exact results of each
method over a fixed registry (fixed keys, fixed holdings); times are normalized to
``"<time>"``. Regenerate it deliberately with ``TENZRO_UPDATE_GOLDEN=1`` after a reviewed
change of a result shape.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from nacl.signing import SigningKey

from moe.identity import provider_id
from registry import governance
from registry.heartbeat import ingest
from registry.models import Provider
from registry.operator import operator_token
from tests.conftest import signed_heartbeat

pytestmark = pytest.mark.django_db
GOLDEN = Path(__file__).parent / "fixtures" / "golden" / "registry_api.json"
TIME_KEYS = {"created", "decided", "updated", "at", "last_heartbeat", "last_heartbeat_ms"}
KEYS = [SigningKey(bytes([i + 1]) * 32) for i in range(3)]


def normalize(obj):
    """Replace wall-clock values by ``"<time>"`` so results compare across runs."""
    if isinstance(obj, dict):
        return {k: ("<time>" if k in TIME_KEYS and v is not None else normalize(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [normalize(v) for v in obj]
    return obj


def registry():
    """Three live providers over model ``m`` (2 layers × 4 experts + shared slot 4, unevenly held)."""
    now = int(time.time() * 1000)
    ingest(signed_heartbeat(KEYS[0], [{"model_id": "m", "layers": "0-1", "experts": "0-4", "committed_tps": 1500}],
                            ts_ms=now, name="gpu-a", roles=["ExpertHolder", "Router"], moe_gpu=True,
                            http_endpoint="http://a:1/rpc", iroh_endpoint_id="a" * 52))
    ingest(signed_heartbeat(KEYS[1], [{"model_id": "m", "layer": 0, "experts": "0-2", "residency": "Cold"},
                                      {"model_id": "m", "layer": 1, "experts": "0-1", "committed_tps": 10}],
                            ts_ms=now, name="cpu-b", roles=["ExpertHolder"], http_endpoint="http://b:1/rpc"))
    ingest(signed_heartbeat(KEYS[2], [{"model_id": "m", "layer": 1, "experts": "0,3", "committed_tps": 10}],
                            ts_ms=now, name="replica-c", roles=["Replica", "ExpertHolder", "PrefillDecode"]))
    Provider.objects.update(connected=True)
    Provider.objects.filter(provider=provider_id(KEYS[1])).update(reputation=900)


def rpc(client, method, params, token=None):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
    return client.post("/rpc", body, content_type="application/json", **headers).json()


PLAN = {"model_id": "m", "allow_cold": False, "split_threshold": 2,
        "routings": [{"token_index": t, "experts": [{"layer": 1, "expert": 0}, {"layer": 1, "expert": 2},
                                                     {"layer": 1, "expert": 4}]} for t in range(3)]
        + [{"token_index": 3, "experts": [{"layer": 0, "expert": 3}, {"layer": 0, "expert": 9}]}]}


@pytest.mark.django_db(transaction=True, reset_sequences=True)  # proposal ids start at 1 on every backend
def test_every_method_matches_the_golden_results(client):
    registry()
    tok = operator_token()
    results = {
        "tenzro_moeShardMap": rpc(client, "tenzro_moeShardMap", {"model_id": "m"}),
        "tenzro_moePlanDispatch": rpc(client, "tenzro_moePlanDispatch", PLAN),
        "tenzro_moePlanDispatch_cold_nosplit": rpc(client, "tenzro_moePlanDispatch",
                                                   {**PLAN, "allow_cold": True, "split_threshold": 0}),
        "tenzro_moeReplicationPolicy": rpc(client, "tenzro_moeReplicationPolicy", []),
        "tenzro_moeCatalogShape": rpc(client, "tenzro_moeCatalogShape", {"model_id": "kimi-k2-instruct"}),
        "tenzro_moeCatalogShape_unknown": rpc(client, "tenzro_moeCatalogShape", {"model_id": "kimi-k9"}),
        "tenzro_moeListProviders": rpc(client, "tenzro_moeListProviders", {"live": True}),
        "tenzro_moeCreateProposal": rpc(client, "tenzro_moeCreateProposal",
                                        {"title": "min 3", "description": "more copies",
                                         "changes": {"min_replication": 3}}, tok),
        "tenzro_moeCreateProposal_unauthorized": rpc(client, "tenzro_moeCreateProposal",
                                                     {"title": "x", "changes": {"min_replication": 3}}),
    }
    results["tenzro_moeVoteProposal"] = rpc(client, "tenzro_moeVoteProposal", {"proposal_id": 1, "approve": True}, tok)
    results["tenzro_moeGetProposal"] = rpc(client, "tenzro_moeGetProposal", {"proposal_id": 1})
    governance.vote(1, f"provider:{provider_id(KEYS[1])}", True)  # 2 of 2 electors: applied
    results["tenzro_moeListProposals"] = rpc(client, "tenzro_moeListProposals", {"status": "Applied"})
    results["tenzro_moeShardMap_after_policy"] = rpc(client, "tenzro_moeShardMap", {"model_id": "m"})
    results["tenzro_moeWithdrawProposal"] = rpc(client, "tenzro_moeWithdrawProposal", {"proposal_id": 1}, tok)
    results["tenzro_moeGovernanceAudit"] = rpc(client, "tenzro_moeGovernanceAudit", {})
    results = normalize(results)
    if os.environ.get("TENZRO_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert sorted(results) == sorted(golden)
    for name in golden:
        assert results[name] == golden[name], name


def test_rest_mirror_answers_what_rpc_answers(client):
    registry()
    pairs = [
        ("tenzro_moeShardMap", {"model_id": "m"}, client.get("/api/v1/shard-map", {"model_id": "m"})),
        ("tenzro_moePlanDispatch", PLAN, client.post("/api/v1/plan", PLAN, content_type="application/json")),
        ("tenzro_moeReplicationPolicy", {}, client.get("/api/v1/policy")),
        ("tenzro_moeCatalogShape", {"model_id": "deepseek-v3-0324"}, client.get("/api/v1/catalog/deepseek-v3-0324")),
        ("tenzro_moeListProviders", {}, client.get("/api/v1/providers")),
        ("tenzro_moeGovernanceAudit", {}, client.get("/api/v1/governance/audit")),
    ]
    for method, params, resp in pairs:
        assert resp.status_code == 200, method
        assert normalize(resp.json()) == normalize(rpc(client, method, params)["result"]), method
    catalog = client.get("/api/v1/catalog").json()
    assert catalog["count"] >= 29 and {m["model_id"] for m in catalog["models"]} >= {"kimi-k3", "gpt-oss-120b"}
    assert client.get("/api/v1/catalog/nope-model").status_code == 404
    # A model no one publishes or holds is an error naming the field, not an empty shard map.
    gone = client.get("/api/v1/shard-map", {"model_id": "nope-model"})
    assert gone.status_code == 404 and "nope-model" in gone.json()["error"], gone.content
    err = rpc(client, "tenzro_moeShardMap", {"model_id": "nope-model"})["error"]
    assert err["code"] == -32602 and err["data"]["field"] == "model_id"
    holdings = client.get("/api/v1/holdings", {"model_id": "m", "limit": 3}).json()
    assert holdings["count"] == 10 + 5 + 2 and len(holdings["holdings"]) == 3
    assert client.get("/api/v1/providers", {"role": "Router"}).json()["count"] == 1
    assert client.get("/api/v1/providers/xyz").status_code == 400
    assert client.get("/api/v1/providers/" + "0" * 64).status_code == 404
    bad = client.post("/api/v1/plan", {"model_id": "m", "routings": []}, content_type="application/json")
    assert bad.status_code == 400 and bad.json()["field"] == "routings"
    dup = {"model_id": "m", "routings": [{"token_index": 0, "experts": [{"layer": 0, "expert": 0}] * 2}]}
    r = client.post("/api/v1/plan", dup, content_type="application/json")
    assert r.status_code == 422 and "twice" in r.json()["error"]


def test_plan_default_split_threshold_comes_from_settings(client, settings):
    registry()
    settings.TENZRO = {**settings.TENZRO, "PLAN_SPLIT_THRESHOLD": 1}
    routings = [{"token_index": t, "experts": [{"layer": 1, "expert": 0}]} for t in range(4)]
    plan = rpc(client, "tenzro_moePlanDispatch", {"model_id": "m", "routings": routings})["result"]
    assert plan["batch_count"] == 4  # one token per batch, dealt over the warm holders
    assert len({b["provider"] for b in plan["batches"]}) == 3


def test_body_limits_answer_413_and_change_nothing(client):
    big = json.dumps({"title": "x" * 2_000_000, "changes": {"min_replication": 3}})
    r = client.post("/api/v1/proposals", big, content_type="application/json",
                    HTTP_AUTHORIZATION=f"Bearer {operator_token()}")
    assert r.status_code == 413 and "limit" in r.json()["error"]
    hb = signed_heartbeat(SigningKey.generate(), [], name="n" * (9 * 1024 * 1024))
    r = client.post("/api/v1/providers/heartbeat", hb, content_type="application/json")
    assert r.status_code == 413
    assert not Provider.objects.exists() and governance.audit_json() == []


def test_rest_reads_and_writes_are_rate_limited(client, settings):
    from django.core.cache import cache

    cache.clear()
    settings.TENZRO = {**settings.TENZRO, "API_READ_RATE": "3/min", "API_WRITE_RATE": "1/min"}
    codes = [client.get("/api/v1/policy").status_code for _ in range(4)]
    assert codes == [200, 200, 200, 429]
    hb = lambda: client.post("/api/v1/providers/heartbeat", [], content_type="application/json").status_code  # noqa
    assert (hb(), hb()) == (400, 429)
    cache.clear()


def test_schema_docs_and_static_bundle_are_served_offline(client):
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert schema.status_code == 200
    paths = json.loads(schema.content)["paths"]
    assert {"/api/v1/plan", "/api/v1/shard-map", "/api/v1/proposals", "/api/v1/providers/heartbeat"} <= set(paths)
    docs = client.get("/api/docs/")
    html = docs.content.decode()
    assert docs.status_code == 200 and "swagger-ui" in html and "cdn" not in html.lower()
    bundle = [s for s in html.split('"') if s.startswith("/static/") and s.endswith(".js")]
    assert bundle and all(client.get(s).status_code == 200 for s in bundle)


def test_coverage_page_colours_every_slot(client):
    registry()
    page = client.get("/coverage/m")
    html = page.content.decode()
    assert page.status_code == 200
    # 10 covered slots (2 layers × 5), no catalog: green where ≥ 2 providers, hot where tps ≥ 1000.
    assert html.count(' hot" title=') == 10  # provider a commits 1500 tps on every slot: marked hot
    assert "gpu-a" in html and "cpu-b" in html and "replica-c" in html
    kimi = client.get("/coverage/kimi-k2-instruct").content.decode()
    assert kimi.count('<td class="r0"') == 60 * 385  # catalog-aware: every slot shown, none held


def test_deeply_nested_json_is_a_client_error(client):
    deep = "[" * 50_000 + "]" * 50_000
    for url in ("/api/v1/plan", "/api/v1/providers/heartbeat"):
        r = client.post(url, deep, content_type="application/json")
        assert r.status_code == 400 and "nested too deeply" in r.json()["error"]
    assert client.post("/rpc", deep, content_type="application/json").json()["error"]["code"] == -32700
    nested = {"a": None}
    for _ in range(900):
        nested = {"a": nested}
    hb = signed_heartbeat(SigningKey.generate(), [])
    hb["body"]["extra"] = nested
    r = client.post("/api/v1/providers/heartbeat", json.dumps(hb), content_type="application/json")
    assert r.status_code == 400 and not Provider.objects.exists()


def test_cached_shard_view_follows_every_input():
    from registry import selectors

    registry()
    first = selectors.shard_view("m")
    assert selectors.shard_view("m") is first  # nothing changed: served from the cache
    ingest(signed_heartbeat(KEYS[2], [{"model_id": "m", "layer": 1, "experts": "0,3", "committed_tps": 10}],
                            name="replica-c", roles=["Replica", "ExpertHolder", "PrefillDecode"]))
    assert selectors.shard_view("m") is first  # a heartbeat repeating its holdings changes nothing
    ingest(signed_heartbeat(KEYS[2], [{"model_id": "m", "layer": 1, "experts": "0-3"}],
                            ts_ms=int(time.time() * 1000) + 50, roles=["ExpertHolder"]))
    second = selectors.shard_view("m")
    assert second is not first and second.replication(1, 2) == 2 and second.role_count["Replica"] == 0
    Provider.objects.filter(provider=provider_id(KEYS[0])).update(reputation=1)
    third = selectors.shard_view("m")
    assert third is not second and third.provider(provider_id(KEYS[0])).reputation == 1
    p = governance.create_proposal("min 1", {"min_replication": 1}, "operator")
    governance.vote(p.pk, "operator", True)
    governance.vote(p.pk, f"provider:{provider_id(KEYS[1])}", True)  # reputation 900: an elector
    assert selectors.shard_view("m").policy.min_replication == 1
    Provider.objects.filter(provider=provider_id(KEYS[1])).update(connected=False)
    assert provider_id(KEYS[1]) not in selectors.shard_view("m").distinct_providers()
    assert selectors.shard_map_json("m") == selectors.shard_view("m").to_json()
    assert provider_id(KEYS[0]) not in selectors.shard_view("m", exclude={provider_id(KEYS[0])}).distinct_providers()


def test_router_live_view_rereads_holdings_only_when_a_provider_changed():
    from router.forward import ForwardConfig
    from router.state import Router

    registry()
    router = Router(ForwardConfig(view_cache_s=0))  # every forward asks the database
    first = router.live_view("m")
    assert router.live_view("m") is first  # same live rows: the same infos, so the same built view
    ingest(signed_heartbeat(KEYS[2], [{"model_id": "m", "layer": 1, "experts": "0,3", "committed_tps": 10}],
                            name="replica-c", roles=["Replica", "ExpertHolder", "PrefillDecode"]))
    assert router.live_view("m") is first  # a heartbeat repeating its holdings changes nothing
    ingest(signed_heartbeat(KEYS[2], [{"model_id": "m", "layer": 1, "experts": "0-3"}],
                            ts_ms=int(time.time() * 1000) + 50, roles=["ExpertHolder"]))
    second = router.live_view("m")
    assert second is not first and second.replication(1, 2) == 2
    Provider.objects.filter(provider=provider_id(KEYS[1])).update(connected=False)
    third = router.live_view("m")
    assert provider_id(KEYS[1]) not in third.distinct_providers()
    assert provider_id(KEYS[0]) not in router.live_view("m", frozenset({provider_id(KEYS[0])})).distinct_providers()
