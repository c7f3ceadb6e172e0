"""The expert-coverage market, case by case from kvasir_market_contract.md §1.0–1.5, §1.11, §2."""
from __future__ import annotations

import base64
import json
import re
from datetime import timedelta

import pytest
from django.utils import timezone
from nacl.signing import SigningKey

from registry import market
from registry.heartbeat import ingest
from registry.models import MarketChallenge, MarketClaim, MarketModel, MarketWorker, Provider
from registry.operator import operator_token
from tests.conftest import holding, signed_heartbeat

pytestmark = pytest.mark.django_db


def post(client, path, body=None, token=None, raw=None, **headers):
    if token:
        headers["HTTP_AUTHORIZATION"] = f"Bearer {token}"
    data = raw if raw is not None else json.dumps(body if body is not None else {})
    r = client.post(path, data=data, content_type="application/json", **headers)
    return r.status_code, r.json()


def get(client, path, token=None, **headers):
    if token:
        headers["HTTP_AUTHORIZATION"] = f"Bearer {token}"
    r = client.get(path, **headers)
    return r.status_code, r.json()


def wallet_of(key: SigningKey) -> str:
    return market.b58encode(bytes(key.verify_key))


def login(client, key=None) -> tuple[str, str]:
    key = key or SigningKey.generate()
    w = wallet_of(key)
    _, ch = post(client, "/api/auth/challenge", {"wallet": w})
    sig = base64.b64encode(key.sign(ch["message"].encode("utf-8")).signature).decode()
    status, tok = post(client, "/api/auth/node-token", {"wallet": w, "nonce": ch["nonce"], "signature": sig})
    assert status == 200, tok
    return w, tok["node_token"]


@pytest.fixture
def model():
    return market.add_model("org/tiny-moe", n_embd=64, n_layer=4, n_expert=8, expert_layers=[1, 2, 3], name="tiny")


# ------------------------------------------------------------------ auth (§1.1, §1.2, §2)

def test_challenge_cases(client):
    assert post(client, "/api/auth/challenge", {}) == (400, {"error": "wallet is required"})
    assert post(client, "/api/auth/challenge", {"wallet": "   "}) == (400, {"error": "wallet is required"})
    assert post(client, "/api/auth/challenge", {"wallet": "x" * 65}) == (400, {"error": "that is not a wallet address"})
    w = wallet_of(SigningKey.generate())
    for path in ("/api/auth/challenge", "/api/auth/challenge/"):
        status, body = post(client, path, {"wallet": f"  {w} "})
        assert status == 200 and re.fullmatch(r"[0-9a-f]{32}", body["nonce"]) and w in body["message"]
    assert MarketChallenge.objects.filter(wallet=w).count() == 2
    assert client.get("/api/auth/challenge").status_code == 405


def test_challenge_rate_is_per_client(client, settings, monkeypatch):
    """One client asking challenges in a loop is refused (429, a message) while another client
    still logs in; before, only the site-wide bound applied and one client locked out all."""
    from registry import ratelimit

    monkeypatch.setattr(ratelimit, "window_index", lambda window_s: 1)  # one window for the whole burst
    settings.TENZRO = {**settings.TENZRO, "MARKET_CHALLENGE_RATE_PER_MINUTE": 5}
    w = wallet_of(SigningKey.generate())
    attacker = {"REMOTE_ADDR": "10.0.0.66"}
    codes = [post(client, "/api/auth/challenge", {"wallet": w}, **attacker)[0] for _ in range(8)]
    assert codes[:5] == [200] * 5 and set(codes[5:]) == {429}, codes
    status, body = post(client, "/api/auth/challenge", {"wallet": w}, **attacker)
    assert status == 429 and "per minute for this client" in body["error"]
    assert MarketChallenge.objects.count() == 5
    login(client)  # the default test client (127.0.0.1) is a different client: it still logs in


def test_node_token_signature_nonce_and_replay(client):
    key = SigningKey.generate()
    w = wallet_of(key)
    assert post(client, "/api/auth/node-token", {"wallet": w, "nonce": "ab"}) == (
        400, {"error": "wallet, nonce and signature are required"})
    _, ch = post(client, "/api/auth/challenge", {"wallet": w})
    bad = base64.b64encode(SigningKey.generate().sign(ch["message"].encode()).signature).decode()
    assert post(client, "/api/auth/node-token", {"wallet": w, "nonce": ch["nonce"], "signature": bad}) == (
        401, {"error": "the signature does not match that wallet"})
    good = base64.b64encode(key.sign(ch["message"].encode()).signature).decode()
    # The failed attempt burned the nonce: even the right signature is refused now.
    assert post(client, "/api/auth/node-token", {"wallet": w, "nonce": ch["nonce"], "signature": good}) == (
        401, {"error": "that challenge is unknown, expired, or already used"})
    # A nonce issued to another wallet, and an expired one.
    other = wallet_of(SigningKey.generate())
    _, ch2 = post(client, "/api/auth/challenge", {"wallet": other})
    sig2 = base64.b64encode(key.sign(challenge := ch2["message"].encode()).signature).decode()
    assert post(client, "/api/auth/node-token", {"wallet": w, "nonce": ch2["nonce"], "signature": sig2})[0] == 401
    _, ch3 = post(client, "/api/auth/challenge", {"wallet": w})
    MarketChallenge.objects.filter(nonce=ch3["nonce"]).update(created=timezone.now() - timedelta(minutes=6))
    sig3 = base64.b64encode(key.sign(ch3["message"].encode()).signature).decode()
    assert post(client, "/api/auth/node-token", {"wallet": w, "nonce": ch3["nonce"], "signature": sig3})[0] == 401
    assert challenge  # signed bytes were the UTF-8 message (em dash included)
    # Success: a token for the wallet, 30 days, URL-safe.
    w2, tok = login(client, key)
    assert w2 == w and re.fullmatch(r"[A-Za-z0-9_-]+", tok) and market.token_wallet(tok) == w


def test_token_checks(client, model):
    w, tok = login(client)
    assert get(client, "/api/expert-demand") == (401, {"error": "authentication required"})
    assert get(client, "/api/expert-demand", token="garbage")[0] == 401
    expired, _ = market.make_token(w, now=0)
    assert get(client, "/api/expert-demand", token=expired)[0] == 401
    raw = base64.urlsafe_b64decode(tok + "=" * (-len(tok) % 4)).decode().split("|")
    forged = base64.urlsafe_b64encode("|".join(["node", "someone-else", raw[2], raw[3]]).encode()).decode()
    assert get(client, "/api/expert-demand", token=forged)[0] == 401
    assert get(client, "/api/expert-demand", token=tok)[0] == 200
    assert get(client, "/api/expert-demand", HTTP_AUTHORIZATION=f"bearer {tok}")[0] == 200
    assert get(client, "/api/expert-demand", HTTP_X_KVASIR_SERVICE_TOKEN=tok)[0] == 200
    assert get(client, "/api/expert-demand/", HTTP_X_LINKCPP_SERVICE_TOKEN=tok)[0] == 200


def test_bodies_not_json_and_too_large(client, model):
    _, tok = login(client)
    for raw in ("{not json", "[1, 2]", "x" * (2 << 20)):
        assert post(client, "/api/expert-volunteer", raw=raw, token=tok) == (400, {"error": "request body is not JSON"})
    assert MarketClaim.objects.count() == 0  # nothing changed
    assert post(client, "/api/expert-volunteer", raw="", token=tok)[1]["assigned"] is True  # empty body = {}


# ------------------------------------------------------------------ coverage, demand, volunteer (§1.3–1.5, §1.11)

def test_coverage_validation_and_silent_segment_filter(client, model):
    _, tok = login(client)
    assert post(client, "/api/expert-coverage", {"model": "tiny"}, token=tok) == (
        400, {"error": "worker_id and model are required"})
    segs = [[1, 0, 4], {"layer": 1, "begin": 4, "end": 8}, [2, 0], [2, 0, "x"], [3, 2.0, 6]]
    status, body = post(client, "/api/expert-coverage", {"worker_id": "w", "model": "org/tiny-moe", "segments": segs,
                                                         "n_layer": 4, "n_expert": 8}, token=tok)
    assert status == 200 and body == {"ok": True, "workers": 1, "wired": False, "listen_port": None, "session": None}
    w = MarketWorker.objects.get(worker_id="w")
    assert w.model == "tiny-moe" and w.segments == [[1, 0, 4], [3, 2, 6]]
    post(client, "/api/expert-coverage", {"worker_id": "w", "model": "tiny-moe", "segments": [[1, 0, 9]] * 300},
         token=tok)
    assert len(MarketWorker.objects.get(worker_id="w").segments) == 256


def test_coverage_numeric_string_segments_count_as_numbers(client, model):
    """The Kvasir coordinator converts numeric strings; ``[["1","0","4"]]`` counts as ``[1,0,4]``."""
    _, tok = login(client)
    segs = [["1", "0", "4"], [" 2 ", "0.0", "8"], ["3", "x", "4"], ["nan", "0", "4"], ["1e999", "0", "1"]]
    status, _ = post(client, "/api/expert-coverage", {"worker_id": "s", "model": "tiny-moe", "segments": segs},
                     token=tok)
    assert status == 200
    assert MarketWorker.objects.get(worker_id="s").segments == [[1, 0, 4], [2, 0, 8]]
    segs1 = layer_segments(get(client, "/api/expert-demand?model=tiny", token=tok)[1], 1)
    assert segs1[0] == {"experts": [0, 4], "replicas": 1, "target": 2, "scarcity": 0.5}


def layer_segments(body, layer):
    (m,) = body["models"]
    return next(x["segments"] for x in m["layers"] if x["layer"] == layer)


def test_demand_fold_segments_scarcity_and_eviction(client, model):
    _, tok = login(client)
    status, body = get(client, "/api/expert-demand", token=tok)
    assert status == 200 and body["target_replicas"] == 2 and body["recruiting"] is True
    (m,) = body["models"]
    assert [x["layer"] for x in m["layers"]] == [1, 2, 3] and m["n_layer"] == 4 and m["n_expert"] == 8
    assert layer_segments(body, 1) == [{"experts": [0, 8], "replicas": 0, "target": 2, "scarcity": 1.0}]
    # Two workers overlap on layer 1; the same worker's overlapping segments count twice.
    post(client, "/api/expert-coverage", {"worker_id": "a", "model": "tiny-moe", "segments": [[1, 0, 4]]}, token=tok)
    post(client, "/api/expert-coverage", {"worker_id": "b", "model": "tiny-moe",
                                          "segments": [[1, 2, 6], [1, 5, 6], [0, 0, 8], [1, 7, 7]]}, token=tok)
    # A provider's heartbeat holding counts as one replica too (one scarcity for both kinds of node).
    key = SigningKey.generate()
    ingest(signed_heartbeat(key, [holding("org/tiny-moe", 1, 7)]))
    Provider.objects.update(connected=True)
    segs = layer_segments(get(client, "/api/expert-demand?model=tiny", token=tok)[1], 1)
    assert [(s["experts"], s["replicas"], s["scarcity"]) for s in segs] == [
        ([0, 2], 1, 0.5), ([2, 4], 2, 0.0), ([4, 5], 1, 0.5), ([5, 6], 2, 0.0), ([6, 7], 0, 1.0), ([7, 8], 1, 0.5)]
    assert all(a["experts"][1] == b["experts"][0] for a, b in zip(segs, segs[1:]))  # tiles [0, n) in order
    # 120 s without a post: evicted on read.
    MarketWorker.objects.filter(worker_id="a").update(ts=timezone.now() - timedelta(seconds=121))
    segs = layer_segments(get(client, "/api/expert-demand", token=tok)[1], 1)
    assert segs[0] == {"experts": [0, 2], "replicas": 0, "target": 2, "scarcity": 1.0}
    assert not MarketWorker.objects.filter(worker_id="a").exists()
    assert get(client, "/api/expert-demand?model=nope", token=tok)[1]["models"] == []


def test_volunteer_choice_clip_claims_and_at_target(client, model):
    w, tok = login(client)
    # Layer 1 experts [0,4) covered once: scarcity 0.5 there, 1.0 elsewhere; widest 1.0 run first.
    post(client, "/api/expert-coverage", {"worker_id": "a", "model": "tiny-moe", "segments": [[1, 0, 4]]}, token=tok)
    status, a = post(client, "/api/expert-volunteer", {"model": "", "max_experts": 32}, token=tok)
    assert status == 200 and list(a) == ["assigned", "model", "layer", "experts", "scarcity", "replicas", "target",
                                         "n_embd", "n_layer", "n_expert"]
    assert a["assigned"] and a["model"] == "org/tiny-moe" and a["layer"] == 2 and a["experts"] == [0, 8]
    assert a["scarcity"] == 1.0 and a["n_embd"] == 64 and a["n_layer"] == 4
    # The claim counts as a replica: the next request (another wallet) goes elsewhere, clipped.
    _, tok2 = login(client)
    _, b = post(client, "/api/expert-volunteer", {"max_experts": 3}, token=tok2)
    assert (b["layer"], b["experts"]) == (3, [0, 3])
    # A repeat by the same wallet refreshes its claim rather than adding a second.
    post(client, "/api/expert-volunteer", {"model": "", "max_experts": 32}, token=tok)
    assert MarketClaim.objects.filter(wallet=w, layer=2).count() == 1
    # Coverage from the claiming wallet naming the range ends the claim (the worker now counts).
    post(client, "/api/expert-coverage", {"worker_id": "mine", "model": "tiny-moe", "segments": [[2, 0, 8]]},
         token=tok)
    assert not MarketClaim.objects.filter(wallet=w, layer=2).exists()
    # max_experts non-numeric or <= 0: no cap. Fill everything to target: nothing to do.
    _, c = post(client, "/api/expert-volunteer", {"max_experts": "lots"}, token=tok2)
    assert c["experts"][1] - c["experts"][0] >= 1
    MarketClaim.objects.all().delete()
    for i in range(2):
        post(client, "/api/expert-coverage", {"worker_id": f"full{i}", "model": "tiny-moe",
                                              "segments": [[1, 0, 8], [2, 0, 8], [3, 0, 8]]}, token=tok)
    assert post(client, "/api/expert-volunteer", {}, token=tok) == (
        200, {"assigned": False, "reason": "expert coverage at target"})


def test_market_add_model_rpc(client):
    req = {"jsonrpc": "2.0", "id": 1, "method": "tenzro_moeMarketAddModel",
           "params": {"model_id": "m2", "n_embd": 32, "n_layer": 2, "n_expert": 4, "expert_layers": [1]}}
    r = client.post("/rpc", data=json.dumps(req), content_type="application/json").json()
    assert r["error"]["code"] == -32001
    auth = {"HTTP_AUTHORIZATION": f"Bearer {operator_token()}"}
    bad = {**req, "params": {**req["params"], "expert_layers": [5]}}
    r = client.post("/rpc", data=json.dumps(bad), content_type="application/json", **auth).json()
    assert r["error"]["data"]["field"] == "expert_layers"
    r = client.post("/rpc", data=json.dumps(req), content_type="application/json", **auth).json()
    assert r["result"]["model_id"] == "m2" and r["result"]["created"] is True
    bad = {**req, "params": {**req["params"], "model_id": "a/b c"}}
    r = client.post("/rpc", data=json.dumps(bad), content_type="application/json", **auth).json()
    assert r["error"]["code"] == -32602 and r["error"]["data"]["field"] == "model_id"


@pytest.mark.parametrize("model_id", ["", "a/b c", "a/b/c", "x" * 201, "-lead"])
def test_market_add_model_command_refuses_a_bad_model_id(model_id):
    from django.core.management import CommandError, call_command

    with pytest.raises(CommandError, match="--model-id"):
        call_command("market_add_model", "--model-id", model_id, "--n-embd", "8", "--n-layer", "2",
                     "--n-expert", "4", "--expert-layers", "1")
    assert not MarketModel.objects.exists()
