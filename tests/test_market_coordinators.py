"""Issue 27 item 6: what external coordinators read from the market — the dispatch map (§1.6,
with its hand-written parser's constraints), recruitment (§1.7), relay administration (§1.9) —
and the coverage post's relay wiring (§1.5) that the map is built from."""
from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from registry import market
from registry.models import MarketWorker
from tests.test_market import get, login, post

pytestmark = pytest.mark.django_db
SERVICE = "svc-" + "s" * 40
SVC = {"HTTP_X_LINKCPP_SERVICE_TOKEN": SERVICE}


@pytest.fixture
def model(settings):
    settings.TENZRO = {**settings.TENZRO, "MARKET_SERVICE_TOKEN": SERVICE}
    return market.add_model("org/tiny-moe", n_embd=64, n_layer=4, n_expert=8, expert_layers=[1, 2, 3], name="tiny")


def cover(client, tok, worker_id, segments, url="relay:", model="org/tiny-moe", **extra):
    body = {"worker_id": worker_id, "model": model, "segments": segments, "n_layer": 4, "n_expert": 8, **extra}
    if url is not None:
        body["url"] = url
    status, out = post(client, "/api/expert-coverage", body, token=tok)
    assert status == 200, out
    return out


def coordinator_parse(text: str) -> list[tuple[str, int, int, int]]:
    """The backbone's parser (``linkcpp-moe-dispatch.h``) as §1.6 describes it: find each
    ``"worker_id"``, take the next quoted string as the id, then ``experts`` [a,b] and
    ``listen_port`` before the next ``"worker_id"``; keep rows with b > a, port > 0, id non-empty."""
    out = []
    starts = [m.start() for m in re.finditer(re.escape('"worker_id"'), text)]
    for i, s in enumerate(starts):
        chunk = text[s + len('"worker_id"'):starts[i + 1] if i + 1 < len(starts) else len(text)]
        wid = re.search(r'"([^"]*)"', chunk)
        ex = re.search(r'"experts"\s*:\s*\[\s*(-?\d+)\s*,\s*(-?\d+)\s*\]', chunk)
        port = re.search(r'"listen_port"\s*:\s*(-?\d+)', chunk)
        if wid and ex and port and wid.group(1) and int(ex.group(2)) > int(ex.group(1)) and int(port.group(1)) > 0:
            out.append((wid.group(1), int(ex.group(1)), int(ex.group(2)), int(port.group(1))))
    return out


# ------------------------------------------------------------------ relay wiring (§1.5)

def test_relay_coverage_wires_a_sticky_port_and_session(client, model):
    _, tok = login(client)
    a = cover(client, tok, "w", [[1, 0, 4]])
    assert a == {"ok": True, "workers": 1, "wired": True, "listen_port": 52970, "session": "expert-w"}
    b = cover(client, tok, "w2", [[2, 0, 8]], url="relay:phone-7")
    assert (b["wired"], b["listen_port"], b["session"]) == (True, 52971, "phone-7")
    assert cover(client, tok, "w", [[1, 0, 4]])["listen_port"] == 52970  # sticky
    # No relay url: not wired, but the port stays with the worker until it is evicted.
    assert cover(client, tok, "w", [[1, 0, 4]], url=None)["wired"] is False
    assert cover(client, tok, "w", [[1, 0, 4]], url="tcp:9000")["session"] is None
    assert cover(client, tok, "w", [[1, 0, 4]])["listen_port"] == 52970
    assert len(cover(client, tok, "long", [], url="relay:" + "x" * 300)["session"]) == 128
    # Evicted after 120 s quiet: its port goes to the next worker.
    MarketWorker.objects.filter(worker_id="w").update(ts=timezone.now() - timedelta(seconds=121))
    assert cover(client, tok, "w3", [[3, 0, 8]])["listen_port"] == 52970


def test_all_ports_taken_answers_unwired_with_the_session(client, model):
    _, tok = login(client)
    for i in range(market.RELAY_PORTS):
        assert cover(client, tok, f"w{i:02d}", [[1, 0, 8]])["listen_port"] == market.RELAY_PORT_BASE + i
    assert cover(client, tok, "late", [[1, 0, 8]]) == {"ok": True, "workers": 61, "wired": False,
                                                       "listen_port": None, "session": "expert-late"}


# ------------------------------------------------------------------ dispatch map (§1.6)

def test_dispatch_map_rows_filters_and_fragile_parser(client, model):
    _, tok = login(client)
    cover(client, tok, "b", [[1, 4, 8], [2, 0, 8]], url="relay:s-b", owner="OwnerB")
    cover(client, tok, "a", [[1, 0, 4]])
    cover(client, tok, "c", [[2, 0, 8]])
    cover(client, tok, "plain", [[1, 0, 8]], url=None)  # not relay-wired: no row
    cover(client, tok, "other", [[1, 0, 8]], model="other-moe")  # another model
    cover(client, tok, "empty", [])  # wired, no segments: layer 0, [0, 0], which the parser drops
    r = client.get("/api/expert-dispatch-map?model=org/tiny-moe", **SVC)
    assert r.status_code == 200 and r["Content-Type"] == "application/json"
    body = r.json()
    assert body == {"model": "tiny-moe", "rows": [
        {"worker_id": "a", "layer": 1, "experts": [0, 4], "listen_port": 52971, "session": "expert-a", "node_id": "a"},
        {"worker_id": "b", "layer": 1, "experts": [4, 8], "listen_port": 52970, "session": "s-b", "node_id": "b"},
        {"worker_id": "c", "layer": 2, "experts": [0, 8], "listen_port": 52972, "session": "expert-c", "node_id": "c"},
        {"worker_id": "empty", "layer": 0, "experts": [0, 0], "listen_port": 52974, "session": "expert-empty",
         "node_id": "empty"}]}
    text = r.content.decode()
    assert all(list(row)[0] == "worker_id" for row in body["rows"])  # key order on the wire
    assert text.count('"worker_id"') == 4
    assert coordinator_parse(text) == [("a", 0, 4, 52971), ("b", 4, 8, 52970), ("c", 0, 8, 52972)]
    # layer filter (the row's layer is its first segment's), the X-Kvasir header, a trailing slash
    status, body = get(client, "/api/expert-dispatch-map/?model=tiny-moe&layer=2", HTTP_X_KVASIR_SERVICE_TOKEN=SERVICE)
    assert status == 200 and [x["worker_id"] for x in body["rows"]] == ["c"]
    assert get(client, "/api/expert-dispatch-map?model=tiny-moe&layer=3", **SVC)[1]["rows"] == []
    assert get(client, "/api/expert-dispatch-map?model=nope", **SVC)[1] == {"model": "nope", "rows": []}
    # stale: only rows whose last relay-wired post is that recent; a later plain post does not refresh
    MarketWorker.objects.filter(worker_id="a").update(relay_ts=timezone.now() - timedelta(seconds=30))
    cover(client, tok, "a", [[1, 0, 4]], url=None)

    def ids(q):
        return [x["worker_id"] for x in get(client, "/api/expert-dispatch-map?model=tiny-moe" + q, **SVC)[1]["rows"]]
    assert ids("&stale=10") == ["b", "c", "empty"] and ids("&stale=45.5") == ["a", "b", "c", "empty"]
    # A dead worker (120 s quiet) has no row whatever stale says.
    MarketWorker.objects.filter(worker_id="c").update(ts=timezone.now() - timedelta(seconds=121))
    assert ids("&stale=1000") == ["a", "b", "empty"]


def test_dispatch_map_never_repeats_the_worker_id_key(client, model):
    """The parser keys rows on the text ``"worker_id"``; a worker or session carrying that text
    would forge a row, so such rows are left out and such a model is refused."""
    _, tok = login(client)
    cover(client, tok, "worker_id", [[1, 0, 4]])
    cover(client, tok, "ok", [[1, 4, 8]], url='relay:x"worker_id"y')  # escaped: \"worker_id\" is harmless
    cover(client, tok, "z", [[2, 0, 8]], url="relay:worker_id")
    r = client.get("/api/expert-dispatch-map?model=tiny-moe", **SVC)
    text = r.content.decode()
    assert [x["worker_id"] for x in r.json()["rows"]] == ["ok"]
    assert text.count('"worker_id"') == 1 and coordinator_parse(text) == [("ok", 4, 8, 52971)]
    assert get(client, "/api/expert-dispatch-map?model=worker_id", **SVC)[0] == 400


def test_dispatch_map_auth_and_bad_queries(client, model):
    _, tok = login(client)
    assert get(client, "/api/expert-dispatch-map?model=tiny-moe") == (401, {"error": "authentication required"})
    assert get(client, "/api/expert-dispatch-map?model=tiny-moe", token=tok) == (
        403, {"error": "a service token is required to read the dispatch map"})
    assert get(client, "/api/expert-dispatch-map", **SVC) == (400, {"error": "model is required"})
    for q, field in [("layer=x", "layer"), ("layer=-2", "layer"), ("layer=1.5", "layer"), ("stale=-1", "stale"),
                     ("stale=nan", "stale"), ("stale=inf", "stale")]:
        status, body = get(client, f"/api/expert-dispatch-map?model=tiny-moe&{q}", **SVC)
        assert status == 400 and body["error"].startswith(field), (q, body)
    r = client.post("/api/expert-dispatch-map?model=tiny-moe", **SVC)
    assert r.status_code == 405 and r.json()["error"]


# ------------------------------------------------------------------ recruitment (§1.7)

def test_recruitment_is_read_only_and_counts_live_workers(client, model):
    _, tok = login(client)
    cover(client, tok, "a", [[1, 0, 4]])
    cover(client, tok, "b", [[2, 0, 8]], url=None, model="tiny")
    cover(client, tok, "c", [[2, 0, 8]], model="other-moe")
    before = list(MarketWorker.objects.order_by("worker_id").values())
    for kw in ({"token": tok}, SVC):
        status, body = get(client, "/api/moe/recruitment", **kw)
        assert status == 200
        assert body == {"saturate_at": 2, "boost": 0, "target_base": 2, "models": [
            {"model": "org/tiny-moe", "busy": None, "slots": None, "saturated": False, "recruiting": True,
             "base_target": 2, "effective_target": 2, "expert_workers": 2, "age_s": None}]}
    assert list(MarketWorker.objects.order_by("worker_id").values()) == before
    assert get(client, "/api/moe/recruitment")[0] == 401
    assert client.post("/api/moe/recruitment", token=tok).status_code == 405


# ------------------------------------------------------------------ relay administration (§1.9)

def test_relay_sessions_service_only(client, model):
    _, tok = login(client)
    assert get(client, "/api/expert-relay/sessions", **SVC) == (200, {"sessions": []})
    t0 = timezone.now()
    cover(client, tok, "a", [[1, 0, 4]], owner="OwnerA")
    cover(client, tok, "b", [], url="relay:s-b")
    cover(client, tok, "plain", [[1, 0, 8]], url=None)
    assert get(client, "/api/expert-relay/sessions", token=tok) == (
        403, {"error": "a service token is required to list relay sessions"})
    assert get(client, "/api/expert-relay/sessions")[0] == 401
    status, body = get(client, "/api/expert-relay/sessions/", **SVC)
    assert status == 200
    a, b = body["sessions"]
    assert a == {"session": "expert-a", "node_id": "a", "owner": "OwnerA", "model": "tiny-moe", "layer": 1,
                 "experts": [0, 4], "listen_host": "127.0.0.1", "listen_port": 52970, "claimed_at": a["claimed_at"],
                 "connected": False, "bytes": None}
    assert abs(a["claimed_at"] / 1000 - t0.timestamp()) < 3600 and isinstance(a["claimed_at"], int)
    assert (b["session"], b["owner"], b["layer"], b["experts"], b["listen_port"]) == ("s-b", None, 0, [0, 0], 52971)
    # claimed_at is kept across heartbeats of the same session, renewed for a new session name
    cover(client, tok, "a", [[1, 0, 4]])
    assert get(client, "/api/expert-relay/sessions", **SVC)[1]["sessions"][0]["claimed_at"] == a["claimed_at"]
    MarketWorker.objects.filter(worker_id="a").update(ts=timezone.now() - timedelta(seconds=121))
    assert [s["session"] for s in get(client, "/api/expert-relay/sessions", **SVC)[1]["sessions"]] == ["s-b"]


def test_relay_register_is_refused_clearly(client, model):
    _, tok = login(client)
    body = {"session": "s", "host": "10.0.0.5", "port": 9000}
    assert post(client, "/api/expert-relay/register", body, token=tok) == (
        403, {"error": "a service token is required to register a relay listener"})
    status, out = post(client, "/api/expert-relay/register", body, **SVC)
    assert status == 501 and "does not register relay listeners" in out["error"]
    assert not MarketWorker.objects.exists()


def test_a_lost_port_race_retries_with_the_next_free_port(client, model, monkeypatch):
    """Two first posts racing for one port: the unique column refuses the loser, whose post is
    retried (not a 500) and gets the next free port."""
    _, tok = login(client)
    assert cover(client, tok, "a", [[1, 0, 4]])["listen_port"] == 52970
    real, calls = market._wire, []

    def racing(w, worker_id, now):  # the first attempt saw a stale free-port set
        calls.append(worker_id)
        session = real(w, worker_id, now)
        if len(calls) == 1:
            w.listen_port = 52970
        return session

    monkeypatch.setattr(market, "_wire", racing)
    out = cover(client, tok, "b", [[1, 4, 8]])
    assert out["listen_port"] == 52971 and calls == ["b", "b"]
    assert MarketWorker.objects.get(worker_id="b").listen_port == 52971
