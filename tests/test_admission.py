"""Admission control and loss-free concurrency (issue 15 items 4 and 5).

Forward slots with a bounded queue (busy at once past it), the JSON-RPC batch cap, the
per-client forward rate (-32005, HTTP 429 with Retry-After), deadlines that expire while
the router is saturated are no holder fault, and many concurrent requests to one agent
socket on the in-memory channel layer all answered (none dropped past its capacity).
"""
from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest
from nacl.signing import SigningKey

from moe import wire
from router.admission import Admission, Busy, overloaded
from router.forward import ForwardError
from router.ws import AgentLink, AgentUnavailable
from moe.identity import provider_id
from tests.test_agent_socket import authed
from tests.test_forward import qwen  # noqa: F401  (module fixture: 3 in-process holders)


# -- forward slots ------------------------------------------------------------------------
def test_slots_queue_then_refuse_at_once():
    async def go():
        adm = Admission(limit=2, queue=1, wait_s=5.0)
        release = asyncio.Event()
        order = []

        async def hold(i):
            async with adm.slot():
                order.append(i)
                await release.wait()

        running = [asyncio.create_task(hold(i)) for i in range(3)]  # 2 run, 1 queues
        await asyncio.sleep(0.01)
        assert adm.running == 2 and len(adm.waiters) == 1 and order == [0, 1]
        assert adm.saturated_since(time.monotonic() - 1)
        t = time.perf_counter()
        with pytest.raises(Busy) as err:
            async with adm.slot():
                pass
        assert time.perf_counter() - t < 0.1  # refused at once, not after a deadline
        assert err.value.code == -32005 and err.value.data["reason"] == "capacity"
        release.set()
        await asyncio.gather(*running)
        assert order == [0, 1, 2] and adm.running == 0 and adm.refused == 1

    asyncio.run(go())


def test_a_queued_forward_gives_up_after_the_wait_and_frees_nothing_it_did_not_hold():
    async def go():
        adm = Admission(limit=1, queue=4, wait_s=0.2)
        gate = asyncio.Event()

        async def hold():
            async with adm.slot():
                await gate.wait()

        holder = asyncio.create_task(hold())
        await asyncio.sleep(0.01)
        t = time.perf_counter()
        with pytest.raises(Busy):
            async with adm.slot():
                pass
        assert 0.15 < time.perf_counter() - t < 1.0
        gate.set()
        await holder
        assert adm.running == 0 and not [w for w in adm.waiters if not w.done()]
        async with adm.slot():  # the slot is free again
            assert adm.running == 1

    asyncio.run(go())


# -- saturation is not a holder fault -------------------------------------------------------
def _stalling(fx, bad):
    async def send(provider, info, req):
        if provider == bad:
            await asyncio.sleep(30)
        return await fx.honest(provider, info, req)
    return send


@pytest.mark.parametrize("saturated", [False, True])
def test_deadline_while_the_router_is_saturated_is_not_a_fault(qwen, saturated):  # noqa: F811
    bad = min(qwen.by_id)
    res = qwen.run(send=_stalling(qwen, bad), deadline_s=0.5, saturated=lambda t: saturated)
    assert np.array_equal(res.output, qwen.monolithic())  # the backups still serve the batches
    assert res.failures and all(f["provider"] == bad for f in res.failures)
    assert all(f["fault"] is (not saturated) for f in res.failures)
    if saturated:
        assert all("saturated" in f["error"] for f in res.failures)


def test_a_forward_lost_only_to_saturation_reads_as_overload(qwen):  # noqa: F811
    async def stall(provider, info, req):
        await asyncio.sleep(30)

    with pytest.raises(ForwardError) as err:
        qwen.run(send=stall, deadline_s=0.2, saturated=lambda t: True)
    failures = err.value.data["failures"]
    assert failures and overloaded(failures)  # the site answers -32005 busy, not -32004
    assert not overloaded(failures + [{"provider": "p", "expert": 0, "fault": True, "error": "bad receipt"}])
    with pytest.raises(ForwardError) as err:
        qwen.run(send=stall, deadline_s=0.2, saturated=lambda t: False)
    assert not overloaded(err.value.data["failures"])


# -- JSON-RPC: batch cap, forward rate ----------------------------------------------------
def _call(client, body):
    resp = client.post("/rpc", data=json.dumps(body), content_type="application/json")
    return resp, (resp.json() if resp.content else None)


def _fwd(i):
    return {"jsonrpc": "2.0", "id": i, "method": "tenzro_moeForward",
            "params": {"model_id": "nobody-publishes-this", "layer": 0, "d_model": 4,
                       "hidden_states": wire.b64encode(wire.encode_f32(np.ones((1, 4), np.float32)))}}


@pytest.mark.django_db(transaction=True)
def test_batch_over_the_cap_is_refused_whole(client, settings):
    settings.TENZRO = {**settings.TENZRO, "RPC_MAX_BATCH": 5}
    resp, body = _call(client, [_fwd(i) for i in range(6)])
    assert resp.status_code == 413
    assert body["error"]["code"] == -32600 and body["error"]["data"] == {"field": "batch", "limit": 5}
    resp, body = _call(client, [_fwd(i) for i in range(5)])
    assert resp.status_code == 200 and len(body) == 5


@pytest.mark.django_db(transaction=True)
def test_forward_rate_per_client_is_busy_with_retry_after(client, settings):
    settings.TENZRO = {**settings.TENZRO, "FORWARD_RATE_PER_MINUTE": 3}
    codes = [_call(client, _fwd(i))[1]["error"]["code"] for i in range(3)]
    assert codes == [-32602] * 3  # counted, then refused for the unknown model
    resp, body = _call(client, _fwd(4))
    assert resp.status_code == 429 and int(resp.headers["Retry-After"]) >= 1
    assert body["error"]["code"] == -32005 and body["error"]["data"]["reason"] == "rate"
    # In a batch every forward counts; other methods are not forward-limited.
    resp, body = _call(client, [_fwd(5), {"jsonrpc": "2.0", "id": 6, "method": "tenzro_moeReplicationPolicy"}])
    assert resp.status_code == 200 and body[0]["error"]["code"] == -32005 and "result" in body[1]
    resp = client.post("/v1/completions", data=json.dumps({"model": "m", "prompt": [1]}),
                       content_type="application/json")
    assert resp.status_code == 429 and resp.json()["error"]["type"] == "rate_limit_error"


# -- many concurrent requests to one agent socket (in-memory layer) ---------------------------
@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
async def test_in_memory_layer_loses_no_request_past_its_capacity():
    """1,500 requests in flight to one agent at once (capacity 1,000): every one answered."""
    key = SigningKey.generate()
    comm = await authed(key)

    async def echo():
        while True:
            header, payload = wire.unpack_frame(await comm.receive_from(timeout=30))
            await comm.send_to(bytes_data=wire.pack_frame({"id": header["id"], "ok": True}, payload[::-1]))

    answering = asyncio.create_task(echo())
    link = await AgentLink.get()
    n = 1500

    async def one(i):
        try:
            _, payload = await link.request(provider_id(key), {"type": "execute"}, i.to_bytes(4, "little"), 10.0)
            return int.from_bytes(payload[::-1], "little") == i
        except AgentUnavailable as exc:
            return str(exc)

    try:
        got = await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        answering.cancel()
        await comm.disconnect()
    lost = [g for g in got if g is not True]
    assert not lost, f"{len(lost)} of {n} requests lost, e.g. {lost[0]}"


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
async def test_an_agent_refusing_a_malformed_request_on_its_socket_is_rejected_not_faulted():
    """The agent's socket answers a request it cannot decode with ``ok: false, code: "WireError"``:
    ``send_ws`` raises ``Rejected`` (no reputation cost); any other failure stays an ``AgentUnavailable``."""
    from router import services
    from moe.messages import BatchRequest, Rejected

    key = SigningKey.generate()
    comm = await authed(key)

    async def refuse():
        for code in ("WireError", "ExpertNotLoaded"):
            header, _ = wire.unpack_frame(await comm.receive_from(timeout=30))
            await comm.send_to(bytes_data=wire.pack_frame({"id": header["id"], "ok": False, "code": code,
                                                           "message": "hidden_states: 1 rows but 2 token indices"}))

    answering = asyncio.create_task(refuse())
    req = BatchRequest("r1", "m", 0, 0, [0, 1], "f32", wire.encode_f32(np.ones((2, 4))), "f32", 4)
    try:
        with pytest.raises(Rejected, match="token indices"):
            await services.send_ws(provider_id(key), req)
        with pytest.raises(AgentUnavailable):
            await services.send_ws(provider_id(key), BatchRequest(**{**req.__dict__, "request_id": "r2"}))
        await answering
    finally:
        answering.cancel()
        await comm.disconnect()
