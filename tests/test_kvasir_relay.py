"""Issue 27 items 3–5 without processes: the relay socket ``/api/expert-relay`` (contract §1.8), the
worker compute protocol codec (§3), the router's requests over a relay, and the audit of
receiptless batches inside a layer forward."""
from __future__ import annotations

import asyncio
import struct

import numpy as np
import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator

from moe.messages import BatchAnswer, BatchRequest
from moe.shardmap import HoldingInfo, ProviderInfo, ShardView, check_provider_id
from moe.transports import kvasir as codec
from registry import market
from registry.models import MarketCredit, MarketFraud, MarketWorker
from router.ws import AgentLink, AgentUnavailable, agent_group

SERVICE = "svc-" + "k" * 40


# ------------------------------------------------------------------ codec (§3), pure

def test_v2f16_v2_v1_requests_follow_the_contract_layout():
    rows = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = codec.encode_request("v2f16", rows, 5)
    assert struct.unpack_from("<iii", b) == (-3, 2, 2)
    assert np.array_equal(np.frombuffer(b, "<f2", 6, 12), rows.ravel())
    assert np.frombuffer(b, "<i4", 2, 24).tolist() == [0, 1] and np.frombuffer(b, "<i4", 2, 32).tolist() == [5, 5]
    assert np.frombuffer(b, "<f2", 2, 40).tolist() == [1.0, 1.0] and len(b) == 44
    b = codec.encode_request("v2", rows, 0)
    assert struct.unpack_from("<iii", b) == (-2, 2, 2) and len(b) == 12 + 24 + 8 + 8 + 8
    b = codec.encode_request("v1", rows, 3)
    assert struct.unpack_from("<ii", b) == (1, 2) and np.frombuffer(b, "<i4", 2, 32).tolist() == [3, 3]
    assert codec.response_size("v2f16", 2, 3) == 12 and codec.response_size("v1", 2, 3) == 24
    out = codec.decode_response("v2f16", rows.astype("<f2").tobytes(), 2, 3)
    assert out.dtype == np.float32 and np.array_equal(out, rows)
    with pytest.raises(codec.KvasirProtocolError):
        codec.decode_response("v2", b"\0" * 8, 2, 3)
    with pytest.raises(codec.KvasirProtocolError):
        codec.decode_response("v2f16", np.full(6, np.inf, "<f2").tobytes(), 2, 3)
    with pytest.raises(codec.KvasirProtocolError):
        codec.encode_request("v3", rows, 0)
    with pytest.raises(codec.KvasirProtocolError):
        codec.encode_request("v2", rows, -1)


def test_response_stream_reassembles_in_order_and_refuses_unrequested_bytes():
    s = codec.ResponseStream()
    s.expect(3)
    s.expect(2)
    assert s.feed(b"ab") == [] and s.feed(b"cd") == [b"abc"] and s.feed(b"e") == [b"de"] and s.waiting == 0
    with pytest.raises(codec.KvasirProtocolError):
        s.feed(b"x")


def test_compare_rows_passes_fp16_noise_and_fails_a_sign_flip():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((5, 64)).astype(np.float32)
    noisy = ref.astype(np.float16).astype(np.float32)
    assert codec.compare_rows(noisy, ref, 0.75, 0.05, 0.9)["pass"]
    bad = codec.compare_rows(-ref, ref, 0.75, 0.05, 0.9)
    assert not bad["pass"] and bad["rows_passed"] == 0 and bad["failing_rows"][0]["rel_delta"] == pytest.approx(2.0)
    with pytest.raises(ValueError):
        codec.compare_rows(ref[:2], ref, 0.75, 0.05, 0.9)


def test_kvasir_ids_are_holder_ids_with_a_valid_channel_group():
    check_provider_id("kvasir:desktop-7xKp/slot 2")
    check_provider_id("a" * 64)
    for bad in ("kvasir:", "kvasir:\n", "KVASIR:x", "x" * 64):
        with pytest.raises(ValueError, match="kvasir:<worker_id>"):
            check_provider_id(bad)
    import re
    g = agent_group("kvasir:desktop-7xKp/slot 2")
    assert re.fullmatch(r"[A-Za-z0-9_.\-]{1,99}", g) and g != agent_group("kvasir:other")
    assert agent_group("a" * 64) == "agent." + "a" * 64


# ------------------------------------------------------------------ the relay socket (§1.8)

@pytest.fixture
def relay_settings(settings):
    settings.TENZRO = {**settings.TENZRO, "MARKET_SERVICE_TOKEN": SERVICE, "MARKET_RELAY_CHECK_S": 0.2,
                       "MARKET_RELAY_CREDIT_S": 0.2, "MARKET_RELAY_UNITS_PER_MB": 1.0}


def _cover(wallet, worker_id, segments, url, owner=None):
    market.add_model("org/tiny-moe", n_embd=4, n_layer=2, n_expert=8, expert_layers=[0, 1])
    body = {"worker_id": worker_id, "model": "tiny-moe", "segments": segments, "n_layer": 2, "n_expert": 8,
            "url": url}
    if owner:
        body["owner"] = owner
    return market.post_coverage(wallet, body)


async def _dial(path):
    from tenzro_site.asgi import application

    comm = WebsocketCommunicator(application, path)
    connected, _ = await comm.connect(timeout=10)
    assert connected  # the 101 always completes (Android requires it)
    return comm


async def _closed_with(comm) -> int:
    out = await comm.receive_output(timeout=10)
    assert out["type"] == "websocket.close", out
    await comm.wait()
    return out["code"]


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_refusals_complete_the_101_then_close_4401_4404_4403(relay_settings):
    tok, _ = market.make_token("W" * 40)
    await sync_to_async(_cover)("W" * 40, "w", [[0, 0, 4]], "relay:s-1")
    assert await _closed_with(await _dial("/api/expert-relay?session=s-1&token=nope")) == 4401
    assert await _closed_with(await _dial("/api/expert-relay?session=s-1")) == 4401
    assert await _closed_with(await _dial(f"/api/expert-relay?session=s-2&token={tok}")) == 4404
    assert await _closed_with(await _dial(f"/api/expert-relay/?session=&token={SERVICE}")) == 4404
    await sync_to_async(market.quarantine_worker)("w", "org/tiny-moe", 0, 1, [0], {"pass": False}, "site")
    assert await _closed_with(await _dial(f"/api/expert-relay?session=s-1&token={tok}")) == 4403
    # A quarantined worker's coverage is not counted and its relay is not wired again.
    out = await sync_to_async(_cover)("W" * 40, "w", [[0, 0, 4]], "relay:s-1")
    assert out["wired"] is False
    demand = await sync_to_async(market.demand)(None)
    assert demand["models"][0]["layers"][0]["segments"][0] == {"experts": [0, 8], "replicas": 0, "target": 2,
                                                               "scarcity": 1.0}


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_relay_carries_requests_as_binary_frames_and_credits_the_dialing_wallet(relay_settings):
    phone = "P" * 40
    tok, _ = market.make_token(phone)
    await sync_to_async(_cover)("", "phone-1", [[0, 2, 6]], "relay:")  # a phone posts no owner
    comm = await _dial(f"/api/expert-relay?session=expert-phone-1&token={tok}")
    provider = codec.provider_id("phone-1")
    link = await AgentLink.get()
    for _ in range(100):  # joined once the consumer has run connect()
        if await sync_to_async(lambda: MarketWorker.objects.get(worker_id="phone-1").relay_connected)():
            break
        await asyncio.sleep(0.05)
    task = asyncio.ensure_future(link.request(provider, {"type": "kvasir", "expect": 6}, b"REQUEST", 10))
    frame = await comm.receive_output(timeout=10)
    assert frame == {"type": "websocket.send", "bytes": b"REQUEST"}  # binary, the bytes as given
    await comm.send_to(bytes_data=b"ans")  # the answer arrives in arbitrary chunks
    await comm.send_to(bytes_data=b"wer")
    header, payload = await asyncio.wait_for(task, 10)
    assert header["ok"] and payload == b"answer"
    w = await sync_to_async(MarketWorker.objects.get)(worker_id="phone-1")
    assert w.owner == phone  # the session had no owner: the dialing wallet became it
    sessions = await sync_to_async(market.relay_sessions)("")
    assert sessions["sessions"][0]["connected"] is True
    # A closed socket fails its pending requests at once: a closed socket is a failed worker.
    pending = asyncio.ensure_future(link.request(provider, {"type": "kvasir", "expect": 4}, b"R2", 10))
    assert (await comm.receive_output(timeout=10))["bytes"] == b"R2"
    await comm.disconnect()
    with pytest.raises(AgentUnavailable, match="disconnected"):
        await asyncio.wait_for(pending, 10)
    credit = await sync_to_async(MarketCredit.objects.get)(wallet=phone)
    assert credit.bytes == 9 and credit.units == pytest.approx(9e-6)  # max(7 + 2 out, 6 back)
    w = await sync_to_async(MarketWorker.objects.get)(worker_id="phone-1")
    assert (w.relay_connected, w.relay_ws2tcp, w.relay_tcp2ws) == (False, 9, 6)


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_text_frames_and_unrequested_bytes_close_the_relay(relay_settings):
    tok, _ = market.make_token("W" * 40)
    await sync_to_async(_cover)("W" * 40, "w", [[0, 0, 4]], "relay:s")
    comm = await _dial(f"/api/expert-relay?session=s&token={tok}")
    await comm.send_to(text_data="hello")
    assert await _closed_with(comm) == 1003
    comm = await _dial(f"/api/expert-relay?session=s&token={tok}")
    await comm.send_to(bytes_data=b"unasked")
    assert await _closed_with(comm) == 1002


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_a_session_quiet_for_120_s_is_freed_and_its_socket_closed(relay_settings):
    from datetime import timedelta

    from django.utils import timezone

    tok, _ = market.make_token("W" * 40)
    await sync_to_async(_cover)("W" * 40, "w", [[0, 0, 4]], "relay:s", owner="O" * 40)
    comm = await _dial(f"/api/expert-relay?session=s&token={tok}")
    await sync_to_async(lambda: MarketWorker.objects.filter(worker_id="w").update(
        ts=timezone.now() - timedelta(seconds=121)))()
    assert await _closed_with(comm) == 4404
    assert not await sync_to_async(MarketWorker.objects.filter(worker_id="w").exists)()  # port and session freed


# ------------------------------------------------------------------ receiptless holders in a forward

def _view(providers):
    return ShardView.build("m", providers)


@pytest.mark.asyncio
async def test_forward_audits_a_kvasir_worker_quarantines_a_liar_and_recomputes():
    from moe.gating import Routing
    from router.forward import ForwardConfig, LayerForward
    from router.kvasir import KvasirAudit, KvasirHolders

    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    w = rng.standard_normal((3, 8, 8)).astype(np.float32)
    true = lambda e, rows: rows @ w[e]  # noqa: E731
    liar, honest = "kvasir:liar", "kvasir:honest"
    providers = [ProviderInfo(provider=p, holdings=tuple(HoldingInfo("m", 0, e, "Warm") for e in range(3)),
                              reputation=r) for p, r in ((liar, 900), (honest, 100))]
    excluded_by_view: set[str] = set()

    async def get_view(excluded):
        return _view([p for p in providers if p.provider not in excluded | excluded_by_view])

    async def send(provider, info, req: BatchRequest):
        rows = np.frombuffer(req.payload, np.float32).reshape(len(req.tokens), 8)
        out = true(req.expert, rows)
        return BatchAnswer(-out if provider == liar else out, None, "kvasir", 0, 0)

    holders = KvasirHolders()
    caught = []

    async def quarantine(provider, proof):
        caught.append((provider, proof))
        holders.banned[provider] = float("inf")  # as KvasirHolders.quarantine does, without the database
        excluded_by_view.add(provider)
        return proof

    holders.quarantine = quarantine

    async def has_fallback(expert):
        return True

    def fallback(expert, rows):
        return true(expert, rows)

    def audit_with(one_in, has=has_fallback):
        async def make():
            return KvasirAudit(holders, "m", 0, one_in, (0.75, 0.05, 0.9), fallback, has)
        return make

    ids = np.array([[0, 1], [1, 2], [0, 2], [1, 2]], dtype=np.int64)
    routing = Routing(ids, np.full((4, 2), 0.5, np.float32), None, 2, None)
    ref = sum(0.5 * np.stack([true(ids[t, k], x[t:t + 1])[0] for t in range(4)]) for k in range(2))
    cfg = ForwardConfig(deadline_s=5.0, verify=True)
    res = await LayerForward(cfg, gate=None, routing=routing, model_id="m", layer=0, hidden_states=x,
                             get_view=get_view, send=send, carrier="f32", audit=audit_with(8)).run()
    # The liar's first batch is always audited: caught, quarantined, the batch recomputed elsewhere.
    assert caught and caught[0][0] == liar and caught[0][1]["executed_by"] == "site"
    assert not caught[0][1]["verification"]["pass"]
    assert res.holders == [honest] and res.transports["kvasir"] >= 1
    assert np.allclose(res.output, ref, rtol=1e-5, atol=1e-5)
    assert any(f["provider"] == liar and f["fault"] and "audit failed" in f["error"] for f in res.failures)

    async def no_fallback(expert):
        return False

    # Nothing trusted to audit on: receiptless work is refused (and the forward fails, no other holder).
    from router.forward import ForwardError

    with pytest.raises(ForwardError) as info:
        await LayerForward(cfg, gate=None, routing=routing, model_id="m", layer=0, hidden_states=x,
                           get_view=get_view, send=send, carrier="f32", audit=audit_with(8, no_fallback)).run()
    assert any("receiptless work refused" in f["error"] for f in info.value.data["failures"])
    with pytest.raises(ForwardError):
        await LayerForward(cfg, gate=None, routing=routing, model_id="m", layer=0, hidden_states=x,
                           get_view=get_view, send=send, carrier="f32", audit=None).run()


@pytest.mark.django_db
def test_kvasir_workers_are_listed_only_while_connected_live_and_unquarantined(settings):
    _cover("W" * 40, "a", [[0, 0, 4], [1, 0, 8]], "relay:a")
    _cover("V" * 40, "b", [[1, 4, 8]], "relay:b")
    _cover("U" * 40, "c", [], "relay:c")
    MarketWorker.objects.update(relay_connected=True)
    assert market.kvasir_workers("org/tiny-moe") == [("a", 0, 0, 4), ("b", 1, 4, 8)]
    market.quarantine_worker("b", "org/tiny-moe", 1, 5, [0, 1], {"pass": False}, "site")
    assert market.kvasir_workers("org/tiny-moe") == [("a", 0, 0, 4)]
    assert MarketFraud.objects.get().quarantined_until > MarketFraud.objects.get().created
    from router.kvasir import KvasirHolders

    infos = KvasirHolders().infos("org/tiny-moe")
    assert [i.provider for i in infos] == ["kvasir:a"] and [h.expert for h in infos[0].holdings] == [0, 1, 2, 3]


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_router_speaks_v2f16_then_falls_back_to_v2_and_goes_through_the_channel_layer(relay_settings):
    from router import ws as router_ws
    from router.kvasir import KvasirHolders, Shard

    tok, _ = market.make_token("W" * 40)
    await sync_to_async(_cover)("W" * 40, "w", [[0, 4, 8]], "relay:s")
    holders = KvasirHolders()
    provider = codec.provider_id("w")
    holders.shards[provider] = Shard(0, 4, 8)
    rows = np.arange(8, dtype=np.float32).reshape(2, 4)

    def req():
        return BatchRequest(__import__("uuid").uuid4().hex, "org/tiny-moe", 0, 6, [0, 3], "f32", rows.tobytes(),
                            "f32", 4)

    async def joined():
        comm = await _dial(f"/api/expert-relay?session=s&token={tok}")
        for _ in range(100):
            if router_ws.held_here(provider):
                return comm
            await asyncio.sleep(0.05)
        raise AssertionError("the relay never joined")

    comm = await joined()
    first = asyncio.ensure_future(holders.send(provider, req()))
    sent = (await comm.receive_output(timeout=10))["bytes"]
    assert struct.unpack_from("<iii", sent) == (-3, 2, 2) and np.frombuffer(sent, "<i4", 2, 12 + 16 + 8).tolist() == [2, 2]
    await comm.disconnect()  # a worker without v2f16 closes the connection (§3: no error frame)
    with pytest.raises(AgentUnavailable):
        await asyncio.wait_for(first, 10)
    assert holders.variant[provider] == "v2"
    comm = await joined()
    # Through the channel layer this time (a router in another process or loop).
    local = router_ws._local.pop(provider)
    try:
        second = asyncio.ensure_future(holders.send(provider, req()))
        sent = (await comm.receive_output(timeout=10))["bytes"]
        assert struct.unpack_from("<iii", sent) == (-2, 2, 2)
        out = (rows * 2).astype("<f4").tobytes()
        await comm.send_to(bytes_data=out[:5])
        await comm.send_to(bytes_data=out[5:])
        ans = await asyncio.wait_for(second, 10)
    finally:
        router_ws._local[provider] = local
    assert ans.transport == "kvasir" and ans.receipt is None and np.array_equal(ans.rows, rows * 2)
    assert (provider, "v2") in holders.proven
    with pytest.raises(AgentUnavailable, match="does not serve"):
        await holders.send(provider, BatchRequest("x", "org/tiny-moe", 0, 9, [0], "f32", rows[:1].tobytes(), "f32", 4))
    await comm.disconnect()


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_a_newer_socket_of_a_session_supersedes_the_older_one(relay_settings):
    tok, _ = market.make_token("W" * 40)
    await sync_to_async(_cover)("W" * 40, "w", [[0, 0, 4]], "relay:s")
    old = await _dial(f"/api/expert-relay?session=s&token={tok}")
    new = await _dial(f"/api/expert-relay?session=s&token={tok}")
    assert await _closed_with(old) == 4410
    link = await AgentLink.get()
    task = asyncio.ensure_future(link.request(codec.provider_id("w"), {"type": "kvasir", "expect": 2}, b"Q", 10))
    assert (await new.receive_output(timeout=10))["bytes"] == b"Q"
    await new.send_to(bytes_data=b"ok")
    assert (await asyncio.wait_for(task, 10))[1] == b"ok"
    assert await sync_to_async(lambda: MarketWorker.objects.get(worker_id="w").relay_connected)()
    await new.disconnect()
    assert not await sync_to_async(lambda: MarketWorker.objects.get(worker_id="w").relay_connected)()


@pytest.mark.asyncio
async def test_without_a_fallback_replica_a_receipt_signing_holder_audits():
    from moe.gating import Routing
    from router.forward import ForwardConfig, LayerForward
    from router.kvasir import KvasirAudit, KvasirHolders

    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    w = rng.standard_normal((2, 8, 8)).astype(np.float32)
    liar, signer = "kvasir:liar", "b" * 64
    providers = [ProviderInfo(provider=p, holdings=tuple(HoldingInfo("m", 0, e, "Warm") for e in range(2)),
                              reputation=r) for p, r in ((liar, 900), (signer, 100))]
    sent = []

    async def get_view(excluded):
        return ShardView.build("m", [p for p in providers if p.provider not in excluded])

    async def send(provider, info, req: BatchRequest):
        sent.append((provider, req.purpose))
        out = np.frombuffer(req.payload, np.float32).reshape(len(req.tokens), 8) @ w[req.expert]
        return BatchAnswer(-out if provider == liar else out, None, "kvasir" if provider == liar else "ws", 0, 0)

    holders = KvasirHolders()
    proofs = []

    async def quarantine(provider, proof):
        holders.banned[provider] = float("inf")
        proofs.append(proof)

    holders.quarantine = quarantine

    async def no_fallback(expert):
        return False

    async def make():
        return KvasirAudit(holders, "m", 0, 8, (0.75, 0.05, 0.9), lambda e, r: None, no_fallback)

    routing = Routing(np.array([[0, 1]] * 3, dtype=np.int64), np.full((3, 2), 0.5, np.float32), None, 2, None)
    res = await LayerForward(ForwardConfig(deadline_s=5.0, verify=False), gate=None, routing=routing, model_id="m",
                             layer=0, hidden_states=x, get_view=get_view, send=send, carrier="f32",
                             audit=make).run()
    assert proofs and proofs[0]["executed_by"] == signer
    assert (signer, "selftest") in sent  # the re-execution is not metered
    assert res.holders == [signer]
    assert np.allclose(res.output, 0.5 * (x @ w[0]) + 0.5 * (x @ w[1]), rtol=1e-5, atol=1e-5)
