"""The agent WebSocket: nonce authentication (4401), heartbeats, and request relay by id."""
from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.utils import timezone
from nacl.signing import SigningKey

from moe import wire
from moe.identity import DOMAIN_HELLO, provider_id, sign
from registry.models import AgentSession, Holding, Provider
from tenzro_site.asgi import application
from tests.conftest import holding, signed_heartbeat, with_repeated_key

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio]


async def open_socket():
    comm = WebsocketCommunicator(application, "/ws/agent/")
    connected, _ = await comm.connect()
    assert connected
    challenge = await comm.receive_json_from()
    assert challenge["type"] == "challenge" and len(challenge["nonce"]) == 64
    return comm, bytes.fromhex(challenge["nonce"])


async def authed(key, timeout: float = 1):
    comm, nonce = await open_socket()
    await comm.send_json_to({"type": "hello", "provider": provider_id(key), "signature": sign(key, DOMAIN_HELLO, nonce)})
    welcome = await comm.receive_json_from(timeout)
    assert welcome["type"] == "welcome"
    return comm


async def test_bad_nonce_signature_closes_with_4401():
    key, other = SigningKey.generate(), SigningKey.generate()
    comm, nonce = await open_socket()
    await comm.send_json_to({"type": "hello", "provider": provider_id(key),
                             "signature": sign(other, DOMAIN_HELLO, nonce)})
    assert (await comm.receive_json_from())["type"] == "error"
    out = await comm.receive_output()
    assert out == {"type": "websocket.close", "code": 4401}
    assert not await database_sync_to_async(Provider.objects.exists)()


async def test_signature_over_another_nonce_closes_with_4401():
    key = SigningKey.generate()
    comm, nonce = await open_socket()
    await comm.send_json_to({"type": "hello", "provider": provider_id(key),
                             "signature": sign(key, DOMAIN_HELLO, b"\x00" * 32)})
    await comm.receive_json_from()
    assert (await comm.receive_output())["code"] == 4401


async def test_garbage_hello_closes_with_4401():
    comm, _ = await open_socket()
    await comm.send_to(text_data="not json")
    await comm.receive_json_from()
    assert (await comm.receive_output())["code"] == 4401


async def test_heartbeat_over_socket_and_bad_heartbeat_changes_nothing():
    key = SigningKey.generate()
    comm = await authed(key)
    await comm.send_json_to(signed_heartbeat(key, [holding(expert=1)]))
    assert (await comm.receive_json_from())["type"] == "heartbeat_ack"
    p = await database_sync_to_async(Provider.objects.get)(provider=provider_id(key))
    assert p.connected
    bad = signed_heartbeat(key, [holding(expert=2)])
    bad["signature"] = "00" * 64
    await comm.send_json_to(bad)
    err = await comm.receive_json_from()
    assert err["type"] == "error" and err["ref"] == "heartbeat"
    experts = await database_sync_to_async(lambda: list(Holding.objects.values_list("expert", flat=True)))()
    assert experts == [1]
    # The compact form (expert ranges per layer) is accepted on the socket too.
    await comm.send_json_to(signed_heartbeat(key, [{"model_id": "m", "layer": 0, "experts": "0-3,7"}],
                                             ts_ms=int(time.time() * 1000) + 10))
    assert (await comm.receive_json_from())["type"] == "heartbeat_ack"
    experts = await database_sync_to_async(lambda: list(Holding.objects.values_list("expert", flat=True)))()
    assert experts == [0, 1, 2, 3, 7]
    await comm.disconnect()
    p = await database_sync_to_async(Provider.objects.get)(provider=provider_id(key))
    assert not p.connected


async def test_requests_are_relayed_and_answers_matched_by_id():
    key = SigningKey.generate()
    comm = await authed(key)
    layer = get_channel_layer()
    reply = await layer.new_channel("test.")
    await layer.group_send(f"agent.{provider_id(key)}", {
        "type": "agent.request", "id": "r1", "reply_to": reply,
        "header": {"id": "r1", "type": "execute"}, "payload": b"\x01\x02"})
    frame = await comm.receive_from()
    header, payload = wire.unpack_frame(frame)
    assert header["id"] == "r1" and payload == b"\x01\x02"
    # An answer for an id never sent is refused, the real one reaches the reply channel.
    await comm.send_to(bytes_data=wire.pack_frame({"id": "nope", "ok": True}))
    assert "unknown request id" in json.loads(await comm.receive_from())["message"]
    await comm.send_to(bytes_data=wire.pack_frame({"id": "r1", "ok": True}, b"xyz"))
    msg = await layer.receive(reply)
    assert msg["header"]["id"] == "r1" and msg["payload"] == b"xyz"
    await comm.disconnect()


async def test_a_second_live_session_of_a_key_is_refused_with_4409():
    key = SigningKey.generate()
    first = await authed(key)
    second, nonce = await open_socket()  # the same key started twice by mistake
    await second.send_json_to({"type": "hello", "provider": provider_id(key), "signature": sign(key, DOMAIN_HELLO, nonce)})
    err = await second.receive_json_from(5)  # the first session answers the ping: it is alive
    assert err["type"] == "error" and err["code"] == 4409 and "already connected" in err["message"]
    assert 0 < err["retry_for_s"] <= 46  # until the first session would count as dead (3 x 15 s)
    assert (await second.receive_output())["code"] == 4409
    sessions = await database_sync_to_async(lambda: list(AgentSession.objects.values_list("provider_id", flat=True)))()
    assert sessions == [provider_id(key)]  # the refused socket never got a session
    await first.send_json_to(signed_heartbeat(key))  # the first one still serves
    assert (await first.receive_json_from())["type"] == "heartbeat_ack"
    await first.disconnect()
    p = await database_sync_to_async(Provider.objects.get)(provider=provider_id(key))
    assert not p.connected


async def test_a_stale_session_is_replaced_and_its_socket_closed():
    """A reconnect after a network drop the site has not noticed: the old session stopped
    heartbeating (and opened long ago), so the new hello replaces it."""
    key = SigningKey.generate()
    first = await authed(key)
    long_ago = timezone.now() - timedelta(minutes=5)
    await database_sync_to_async(lambda: (AgentSession.objects.update(opened=long_ago),
                                          Provider.objects.update(last_heartbeat=long_ago)))()
    second = await authed(key)
    assert (await first.receive_output())["code"] == 4410  # superseded
    channels = await database_sync_to_async(lambda: AgentSession.objects.count())()
    assert channels == 1
    await second.send_json_to(signed_heartbeat(key))
    assert (await second.receive_json_from())["type"] == "heartbeat_ack"
    await second.disconnect()


async def test_a_session_whose_site_process_is_gone_is_replaced_at_once():
    """A site killed without closing its sockets leaves sessions that look live (fresh heartbeat)
    but whose consumer no longer answers: the reconnecting agent is not made to wait them out."""
    from registry import services

    key = SigningKey.generate()
    await database_sync_to_async(services.agent_connected)(provider_id(key), "specific.gone!chan")
    await database_sync_to_async(Provider.objects.update)(last_heartbeat=timezone.now())
    t0 = time.monotonic()
    comm = await authed(key, timeout=10)  # after the ping's 2 s, not the heartbeat window
    assert time.monotonic() - t0 < 8  # the heartbeat window is 45 s
    channels = await database_sync_to_async(lambda: list(AgentSession.objects.values_list("channel_name", flat=True)))()
    assert channels != ["specific.gone!chan"] and len(channels) == 1
    await comm.disconnect()


async def test_a_heartbeat_refused_for_its_configuration_closes_with_4422():
    key = SigningKey.generate()
    comm = await authed(key)
    bad = signed_heartbeat(key, name="x" * 5000)
    await comm.send_json_to(bad)
    err = await comm.receive_json_from()
    assert err["type"] == "error" and err["field"] == "name"
    assert (await comm.receive_output())["code"] == 4422


async def test_hostile_json_gets_an_error_not_a_dropped_socket():
    deep = "[" * 50000 + "]" * 50000
    comm, _ = await open_socket()
    await comm.send_to(text_data=deep)  # before the hello: refused with 4401, not a 1011 crash
    assert (await comm.receive_json_from())["type"] == "error"
    assert (await comm.receive_output())["code"] == 4401
    key = SigningKey.generate()
    comm = await authed(key)
    for bad in (deep, '{"x": ' + "9" * 5000 + "}"):
        await comm.send_to(text_data=bad)
        assert (await comm.receive_json_from())["type"] == "error"
    header = b"[" * 30000 + b"]" * 30000
    await comm.send_to(bytes_data=len(header).to_bytes(4, "little") + header)
    assert (await comm.receive_json_from())["type"] == "error"
    await comm.send_json_to(signed_heartbeat(key))  # the socket still serves
    assert (await comm.receive_json_from())["type"] == "heartbeat_ack"
    await comm.disconnect()


async def test_a_request_and_answer_above_the_cap_travel_in_parts_and_arrive_whole(settings):
    settings.TENZRO = {**settings.TENZRO, "WS_MAX_MESSAGE": 64 * 1024}
    key = SigningKey.generate()
    comm = await authed(key)
    layer = get_channel_layer()
    reply = await layer.new_channel("test.")
    tokens = list(range(20_000))  # a header over FRAME_HEADER_MAX too
    big = bytes(range(256)) * 1000  # 256,000 bytes: four frames' worth
    await layer.group_send(f"agent.{provider_id(key)}", {
        "type": "agent.request", "id": "r2", "reply_to": reply,
        "header": {"id": "r2", "type": "execute", "token_indices": tokens}, "payload": big})
    parts, got = wire.Reassembler(), None
    n = 0
    while got is None:
        frame = await comm.receive_from()
        assert len(frame) <= 64 * 1024
        got = parts.feed(*wire.unpack_frame(frame))
        n += 1
    assert n >= 5 and got[0]["token_indices"] == tokens and got[1] == big
    # The agent answers in parts too, out of order: the router receives one whole answer.
    frames = wire.split_frames({"id": "r2", "ok": True, "token_indices": tokens}, big[::-1], 64 * 1024)
    assert len(frames) >= 5
    for frame in reversed(frames):
        await comm.send_to(bytes_data=frame)
    msg = await layer.receive(reply)
    assert msg["header"]["token_indices"] == tokens and msg["payload"] == big[::-1]
    await comm.disconnect()


async def test_socket_heartbeat_with_a_repeated_key_is_refused():
    key = SigningKey.generate()
    comm = await authed(key)
    await comm.send_to(text_data=with_repeated_key(signed_heartbeat(key, [holding(expert=4)]), "holdings", []))
    err = await comm.receive_json_from()
    assert err["type"] == "error" and err["ref"] == "heartbeat" and "repeats the key" in err["message"]
    assert not await database_sync_to_async(Holding.objects.exists)()
    await comm.disconnect()


async def test_a_closed_socket_fails_pending_requests_at_once_and_tells_the_routers():
    import asyncio

    from router.ws import AgentLink, AgentUnavailable

    key = SigningKey.generate()
    pid = provider_id(key)
    heard: list[tuple[str, bool]] = []
    AgentLink.presence_listeners.append(lambda p, up: heard.append((p, up)))
    try:
        stale = await authed(key)
        long_ago = timezone.now() - timedelta(minutes=5)
        await database_sync_to_async(lambda: (AgentSession.objects.update(opened=long_ago),
                                              Provider.objects.update(last_heartbeat=long_ago)))()
        first = await authed(key)  # a reconnect replacing a stale session: closing the old one is not "gone"
        link = await AgentLink.get()
        assert (await stale.receive_output())["code"] == 4410
        await stale.disconnect()
        await asyncio.sleep(0.1)
        assert (pid, False) not in heard
        # A request the agent never answers, pending when its last socket closes: it fails at
        # once (not after its 30 s timeout), and new ones are refused during the grace period.
        pending = asyncio.ensure_future(link.request(pid, {"type": "execute"}, b"", timeout=30.0))
        await first.receive_from()
        t0 = time.perf_counter()
        await first.disconnect()
        with pytest.raises(AgentUnavailable, match="disconnected"):
            await pending
        assert time.perf_counter() - t0 < 5.0
        await asyncio.sleep(0.1)
        assert (pid, False) in heard
        with pytest.raises(AgentUnavailable, match="disconnected"):
            await link.request(pid, {"type": "execute"}, b"", timeout=30.0)
        # The agent comes back: requests reach it again.
        back = await authed(key)
        await asyncio.sleep(0.1)
        assert (pid, True) in heard
        again = asyncio.ensure_future(link.request(pid, {"type": "execute"}, b"", timeout=30.0))
        header, _ = wire.unpack_frame(await back.receive_from())
        await back.send_to(bytes_data=wire.pack_frame({"id": header["id"], "ok": True}, b"ok"))
        assert (await again)[1] == b"ok"
        await back.disconnect()
    finally:
        AgentLink.presence_listeners.pop()


async def test_requests_dropped_by_the_layer_fail_when_the_routers_hear_gone():
    import asyncio

    from router.ws import ROUTERS_GROUP, AgentLink, AgentUnavailable, presence_event

    link = await AgentLink.get()
    # Nobody is in this provider's group: the layer drops the request without a word.
    pending = asyncio.ensure_future(link.request("ab" * 32, {"type": "execute"}, b"", timeout=30.0))
    await asyncio.sleep(0.05)
    await get_channel_layer().group_send(ROUTERS_GROUP, presence_event("ab" * 32, False))
    with pytest.raises(AgentUnavailable, match="disconnected"):
        await asyncio.wait_for(pending, 5.0)


async def test_batches_sent_together_reach_the_agent_as_one_frame_and_resolve_each_on_its_own(monkeypatch):
    """``services.send_ws`` from one loop turn: the consumer relays one ``batch`` frame; the
    agent's per-request answers (one a failure) resolve each caller's request alone."""
    import asyncio

    import numpy as np

    from moe import messages

    from router import services
    from moe.messages import BatchRequest, HolderFault

    monkeypatch.setenv("TENZRO_COALESCE", "1")
    key = SigningKey.generate()
    comm = await authed(key)
    rows = np.arange(3 * 32, dtype=np.float32).reshape(3, 32)
    reqs = [BatchRequest(f"req{i}", "m", 0, i, [i], "f32", wire.encode_f32(rows[i:i + 1]), "f32", 32)
            for i in range(3)]
    sent = [asyncio.ensure_future(services.send_ws(provider_id(key), r)) for r in reqs]
    header, payload = wire.unpack_frame(await comm.receive_from(), wire.MESSAGE_HEADER_MAX)
    assert header["type"] == "batch" and [r["id"] for r in header["requests"]] == ["req0", "req1", "req2"]
    answers = [(messages.reply(h["id"], token_indices=h["token_indices"], output="f32", receipt=None), data[::-1])
               if h["id"] != "req1" else (messages.failure(h["id"], -32004, "expert not loaded"), b"")
               for h, data in messages.split_batch(header, payload)]
    await comm.send_to(bytes_data=wire.pack_frame(*messages.batch_reply(header["id"], answers)))
    got = await asyncio.gather(*sent, return_exceptions=True)
    for i in (0, 2):  # each answer decoded from its own bytes
        assert got[i].transport == "ws" and got[i].bytes_out > 0
        assert np.array_equal(got[i].rows, np.frombuffer(wire.encode_f32(rows[i:i + 1])[::-1], "<f4").reshape(1, 32))
    assert isinstance(got[1], HolderFault) and "-32004" in str(got[1])
    await comm.disconnect()


@pytest.mark.parametrize("path", ["local", "layer"])
async def test_a_streamed_batch_resolves_each_request_as_its_answer_arrives(monkeypatch, path):
    """``services.send_ws`` asks for a streamed batch; the agent answers request by request
    (``messages.batch_part``). Each caller resumes when its own answer arrives, before the rest are
    sent, through the consumer's direct relay and through the channel layer; a failure fails only
    its request; an answer the batch never asked for ends the stream (the rest fault)."""
    import asyncio

    import numpy as np

    from moe import messages

    from router import services
    from moe.messages import BatchRequest, HolderFault
    from router import ws

    if path == "layer":  # the router is not the process holding the socket
        monkeypatch.setattr(ws, "_local_socket", lambda provider: None)
    monkeypatch.setenv("TENZRO_COALESCE", "1")
    key = SigningKey.generate()
    comm = await authed(key)
    rows = np.arange(4 * 32, dtype=np.float32).reshape(4, 32)

    def batch(tag):
        return [BatchRequest(f"{tag}{i}", "m", 0, i, [i], "f32", wire.encode_f32(rows[i:i + 1]), "f32", 32)
                for i in range(4)]

    reqs = batch("s")
    sent = [asyncio.ensure_future(services.send_ws(provider_id(key), r)) for r in reqs]
    header, payload = wire.unpack_frame(await comm.receive_from(), wire.MESSAGE_HEADER_MAX)
    assert header["type"] == "batch" and header["stream"] is True
    subs = messages.split_batch(header, payload)
    order = [2, 0, 1, 3]  # answered out of order, as a holder finishes them
    sizes = {}
    for n, i in enumerate(order):
        h, data = subs[i]
        answer = ((messages.failure(h["id"], -32004, "expert not loaded"), b"") if i == 1 else
                  (messages.reply(h["id"], token_indices=h["token_indices"], output="f32", receipt=None), data))
        frame = wire.pack_frame(*messages.batch_part(header["id"], answer, n < 3))
        sizes[i] = len(frame)
        await comm.send_to(bytes_data=frame)
        await asyncio.wait_for(asyncio.shield(sent[i]) if i != 1 else asyncio.wait([sent[i]]), 5.0)
        assert all(not sent[j].done() for j in order[n + 1:])  # the rest still wait
    got = await asyncio.gather(*sent, return_exceptions=True)
    for i in (0, 2, 3):
        assert got[i].transport == "ws" and got[i].bytes_out > 0 and got[i].bytes_back == sizes[i]
        assert np.array_equal(got[i].rows, rows[i:i + 1])
    assert isinstance(got[1], HolderFault) and "-32004" in str(got[1])

    reqs = batch("t")  # a streamed answer to a request the batch never carried
    sent = [asyncio.ensure_future(services.send_ws(provider_id(key), r)) for r in reqs]
    header, payload = wire.unpack_frame(await comm.receive_from(), wire.MESSAGE_HEADER_MAX)
    h, data = messages.split_batch(header, payload)[0]
    good = (messages.reply(h["id"], token_indices=h["token_indices"], output="f32", receipt=None), data)
    await comm.send_to(bytes_data=wire.pack_frame(*messages.batch_part(header["id"], good, True)))
    stray = (messages.reply("nobody", token_indices=[0], output="f32", receipt=None), data)
    await comm.send_to(bytes_data=wire.pack_frame(*messages.batch_part(header["id"], stray, True)))
    got = await asyncio.wait_for(asyncio.gather(*sent, return_exceptions=True), 5.0)
    assert np.array_equal(got[0].rows, rows[0:1])
    assert all(isinstance(g, HolderFault) and "not one answer" in str(g) for g in got[1:])
    await comm.disconnect()


async def test_side_sockets_serve_their_process_without_a_session_and_a_misdirected_one_is_refused(settings):
    """Behind a balancer (site ids set) the welcome names this process and every one; a side
    socket (``?site=<this process>``) proves the key like the main one, holds no session, joins
    no group, refuses heartbeats, and carries this process's requests to the agent, even after
    another process says the agent's main socket is gone. One naming another process (down,
    so the balancer sent it here) is closed with 4421."""
    import asyncio

    from router.ws import ROUTERS_GROUP, AgentLink, held_here, presence_event

    settings.TENZRO = {**settings.TENZRO, "SITE_ID": "s1", "SITE_IDS": ("s0", "s1")}
    key = SigningKey.generate()
    pid = provider_id(key)

    async def hello(path):
        comm = WebsocketCommunicator(application, path)
        assert (await comm.connect())[0]
        nonce = bytes.fromhex((await comm.receive_json_from())["nonce"])
        await comm.send_json_to({"type": "hello", "provider": pid, "signature": sign(key, DOMAIN_HELLO, nonce)})
        return comm, await comm.receive_json_from(5)

    wrong, err = await hello("/ws/agent/?site=s0")
    assert err["type"] == "error" and err["code"] == 4421 and "'s1', not 's0'" in err["message"]
    assert (await wrong.receive_output())["code"] == 4421
    side, welcome = await hello("/ws/agent/?site=s1")
    assert welcome["type"] == "welcome" and welcome["site"] == "s1" and welcome["sites"] == ["s0", "s1"]
    assert not await database_sync_to_async(AgentSession.objects.exists)()
    assert held_here(pid)
    await side.send_json_to(signed_heartbeat(key))
    assert "main socket" in (await side.receive_json_from())["message"]

    link = await AgentLink.get()
    for _ in range(2):
        answer = asyncio.ensure_future(link.request(pid, {"type": "execute"}, b"x", timeout=30.0))
        header, payload = wire.unpack_frame(await side.receive_from())
        assert payload == b"x"
        await side.send_to(bytes_data=wire.pack_frame({"id": header["id"], "ok": True}, b"ok"))
        assert (await answer)[1] == b"ok"
        # The main socket's process (another one) says it closed: this process still reaches the agent.
        await get_channel_layer().group_send(ROUTERS_GROUP, presence_event(pid, False))
        await asyncio.sleep(0.1)
    await side.disconnect()
    assert not held_here(pid)
    # The main socket's welcome names the processes too.
    main, welcome = await hello("/ws/agent/")
    assert welcome["type"] == "welcome" and welcome["site"] == "s1" and welcome["sites"] == ["s0", "s1"]
    await main.disconnect()
