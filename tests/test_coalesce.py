"""Request coalescing: batches for one holder sent in the same loop turn travel in one message
(socket/HTTP ``batch`` frame, one iroh stream), each answered on its own.

The queue itself is tested on plain coroutines; the transports against a real ``HolderAgent``
execute path (expert FFN, signed receipts) behind its HTTP ``/frame`` endpoint, its iroh
endpoint and its socket handler, with answers compared bit for bit to the same requests sent
one by one (``TENZRO_COALESCE=0``).
"""
from __future__ import annotations

import asyncio
import tempfile
import uuid

import numpy as np
import pytest
from nacl.signing import SigningKey
from safetensors.numpy import load_file

from moe import messages, wire
from holders.agent import AgentConfig, HolderAgent
from moe.messages import BatchRequest, HolderFault
from moe.receipts import verify_receipt
from moe.transports import iroh
from moe.transports.coalesce import Coalescer
from moe.transports.http import HttpHolderClient, serve_http
from prepare.checkpoint import Checkpoint
from prepare.layouts import load_expert, spec_from_config
from tests.conftest import QWEN

MODEL, LAYER, EXPERTS = "m", 1, (3, 4, 5)


# ---- the queue ----

def test_requests_of_one_turn_go_together_and_each_gets_its_own_outcome(monkeypatch):
    monkeypatch.setenv("TENZRO_COALESCE", "1")
    calls = []

    async def one(r):
        calls.append([r])
        return r * 10

    async def many(rs):
        calls.append(list(rs))
        return [ValueError(f"bad {r}") if r == 2 else r * 10 for r in rs]

    async def go():
        c = Coalescer()
        got = await asyncio.gather(*(c.submit("a", r, one, many) for r in (1, 2, 3)),
                                   c.submit("b", 7, one, many), return_exceptions=True)
        later = await c.submit("a", 4, one, many)  # a later turn: alone
        return got, later

    got, later = asyncio.run(go())
    assert got[0] == 10 and isinstance(got[1], ValueError) and str(got[1]) == "bad 2" and got[2] == 30
    assert got[3] == 70 and later == 40
    assert sorted(calls) == [[1, 2, 3], [4], [7]]


def test_coalescing_off_sends_each_alone_and_a_whole_failure_reaches_every_caller(monkeypatch):
    async def one(r):
        return r

    async def many(rs):
        raise ConnectionError("holder gone")

    async def go():
        c = Coalescer()
        return await asyncio.gather(*(c.submit("a", r, one, many) for r in (1, 2)), return_exceptions=True)

    for off in ("0", "OFF", " false "):
        monkeypatch.setenv("TENZRO_COALESCE", off)
        assert asyncio.run(go()) == [1, 2]
    monkeypatch.setenv("TENZRO_COALESCE", "1")
    assert [type(e) for e in asyncio.run(go())] == [ConnectionError, ConnectionError]


def test_a_caller_that_stops_waiting_leaves_the_others_and_the_last_one_cancels_the_exchange(monkeypatch):
    monkeypatch.setenv("TENZRO_COALESCE", "1")
    state = {}

    async def one(r):
        return r

    async def many(rs):
        try:
            await asyncio.sleep(0.2 if len(rs) == 2 else 30)
        except asyncio.CancelledError:
            state["cancelled"] = True
            raise
        return list(rs)

    async def go():
        c = Coalescer()
        short = asyncio.wait_for(c.submit("a", 1, one, many), 0.01)
        res = await asyncio.gather(short, c.submit("a", 2, one, many), return_exceptions=True)
        both = [asyncio.ensure_future(c.submit("b", r, one, many)) for r in (1, 2, 3)]
        await asyncio.sleep(0.01)
        for f in both:
            f.cancel()
        await asyncio.sleep(0.01)
        return res

    res = asyncio.run(go())
    assert isinstance(res[0], asyncio.TimeoutError) and res[1] == 2
    assert state.get("cancelled")


# ---- a real holder's execute path ----

def make_holder(inline_work: int):
    """(agent holding ``EXPERTS`` of the fixture's ``LAYER``, its hidden states, the sizes of the
    messages its ``execute_stream`` ran) with ``AgentConfig.inline_work``."""
    ck = Checkpoint(QWEN)
    spec = spec_from_config(ck.config)
    agent = HolderAgent(AgentConfig("http://127.0.0.1:1", SigningKey.generate(), tempfile.mkdtemp(prefix="tenzro-test-coal-"),
                                    inline_work=inline_work))
    for e in EXPERTS:
        agent.runtime.load_expert(MODEL, LAYER, e, load_expert(ck, spec, LAYER, e).to_blob("f32"))
    x = load_file(str(QWEN / "reference.safetensors"))[f"layer{LAYER}.hidden_states"].astype(np.float32)
    calls = []
    real = agent.execution.execute_stream

    def counted(items, *rest):  # every path (whole, streamed, iroh) runs one execute_stream per message
        calls.append(len(items))
        return real(items, *rest)

    agent.execution.execute_stream = counted
    return agent, x, calls


@pytest.fixture(scope="module")
def holder():
    """A holder whose every message runs on its compute threads (the streaming paths under test)."""
    return make_holder(0)


def requests(x, carrier="q8_0", output="bf16", bad_expert=None):
    """One request per held expert over different tokens (and one for ``bad_expert``)."""
    out = []
    for i, e in enumerate(EXPERTS + ((bad_expert,) if bad_expert is not None else ())):
        tokens = list(range(i, x.shape[0], 2))
        out.append(BatchRequest(uuid.uuid4().hex, MODEL, LAYER, e, tokens, carrier,
                                wire.encode_rows(x[tokens], carrier), output, x.shape[1]))
    return out


def check(agent, reqs, answers, singles):
    """Each answer: verified receipt, rows bit-identical to the same request sent alone."""
    for req, ans, alone in zip(reqs, answers, singles):
        assert np.array_equal(ans.rows, alone.rows)
        verify_receipt(ans.receipt, provider=agent.provider, request_id=req.request_id, model_id=MODEL, layer=LAYER,
                       expert=req.expert, tokens=req.tokens, carrier_kind=req.carrier, carrier=req.payload,
                       rows=ans.rows, seal=ans.seal.body if ans.seal else None)


def fresh(reqs):
    """The same requests under new ids (a receipt signs its request id)."""
    return [BatchRequest(uuid.uuid4().hex, *[getattr(r, f) for f in ("model_id", "layer", "expert", "tokens",
                                                                      "carrier", "payload", "output", "d_model")])
            for r in reqs]


def test_http_sends_one_frame_per_holder_and_one_bad_request_fails_alone(holder, monkeypatch):
    agent, x, calls = holder
    reqs = requests(x, bad_expert=9)

    async def go():
        server = await serve_http(agent.execution.http_rpc, "127.0.0.1", 0, agent.execution.http_frame)
        endpoint = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/rpc"
        client = HttpHolderClient(30)
        try:
            monkeypatch.setenv("TENZRO_COALESCE", "0")
            singles = await asyncio.gather(*(client.execute_frame(endpoint, r) for r in fresh(reqs[:-1])))
            calls.clear()
            monkeypatch.setenv("TENZRO_COALESCE", "1")
            got = await asyncio.gather(*(client.execute_frame(endpoint, r) for r in reqs), return_exceptions=True)
            return singles, got
        finally:
            await client.close()
            server.close()

    singles, got = asyncio.run(go())
    assert calls == [len(reqs)]  # one message, one execute_stream
    assert isinstance(got[-1], HolderFault) and "-32004" in str(got[-1])
    assert all(a.transport == "http" and a.bytes_out > 0 and a.bytes_back > 0 for a in got[:-1])
    check(agent, reqs, got[:-1], singles)


def holding_back(agent, expert):
    """(gate, a stand-in for ``agent.execution._execute`` that holds requests for ``expert`` until the gate opens)."""
    import threading
    gate = threading.Event()
    real = agent.execution._execute

    def held_back(req, carrier, payload, index=None):
        if req["expert"] == expert:
            assert gate.wait(30)
        return real(req, carrier, payload, index)
    return gate, held_back


async def first_while_held(send, reqs, gate):
    """Send ``reqs`` together; (the first request's answer, which requests were done when it
    came, every outcome once ``gate`` opens)."""
    tasks = [asyncio.ensure_future(send(r)) for r in reqs]
    first = await asyncio.wait_for(asyncio.shield(tasks[0]), 20)
    early = [t.done() for t in tasks]
    gate.set()
    return first, early, await asyncio.gather(*tasks, return_exceptions=True)


def test_http_streamed_batch_answers_each_request_as_it_finishes(holder, monkeypatch):
    """A streamed ``batch`` (chunked reply): the first request's caller has its verified answer
    while the holder is still inside the second; bits equal the requests sent alone, a bad request
    fails alone, and the keep-alive connection is reused afterwards."""
    agent, x, _ = holder
    reqs = requests(x, bad_expert=9)
    gate, held_back = holding_back(agent, EXPERTS[1])

    async def go():
        server = await serve_http(agent.execution.http_rpc, "127.0.0.1", 0, agent.execution.http_frame, agent.execution.http_stream)
        endpoint = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/rpc"
        client = HttpHolderClient(30)
        try:
            monkeypatch.setenv("TENZRO_COALESCE", "0")
            singles = await asyncio.gather(*(client.execute_frame(endpoint, r) for r in fresh(reqs[:-1])))
            monkeypatch.setenv("TENZRO_COALESCE", "1")
            monkeypatch.setattr(agent.execution, "_execute", held_back)
            first, early, got = await first_while_held(lambda r: client.execute_frame(endpoint, r), reqs, gate)
            await asyncio.sleep(0.05)  # the stream's last chunk is read after the last answer
            pooled = sum(len(v) for v in client._idle.values())
            again = await asyncio.gather(*(client.execute_frame(endpoint, r) for r in fresh(reqs[:-1])))
            return singles, first, early, got, pooled, again
        finally:
            await client.close()
            server.close()

    singles, first, early, got, pooled, again = asyncio.run(go())
    assert first is got[0] and early[0] and not early[1]
    assert isinstance(got[-1], HolderFault) and "-32004" in str(got[-1])
    check(agent, reqs, got[:-1], singles)
    assert pooled >= 1  # the connection went back to the pool, not closed
    assert all(np.array_equal(a.rows, b.rows) for a, b in zip(again, singles))


def test_http_streamed_batch_refused_whole_and_a_holder_without_streaming(holder, monkeypatch):
    """A malformed streamed batch gets one failure frame (every request rejected, no holder
    fault); a holder without a stream handler answers the same batch whole and the client
    reads that too, as it does when the router asks for a whole answer (TENZRO_STREAM_ANSWERS=0)."""
    agent, x, calls = holder
    reqs = requests(x)
    again = fresh(reqs)

    async def go():
        server = await serve_http(agent.execution.http_rpc, "127.0.0.1", 0, agent.execution.http_frame, agent.execution.http_stream)
        plain = await serve_http(agent.execution.http_rpc, "127.0.0.1", 0, agent.execution.http_frame)
        ep = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/rpc"
        ep_plain = f"http://127.0.0.1:{plain.sockets[0].getsockname()[1]}/rpc"
        client = HttpHolderClient(30)
        try:
            bad = wire.pack_frame({"type": "batch", "id": "b", "stream": True, "requests": [{"nbytes": 5}]}, b"xy")
            answer, _ = wire.unpack_frame(await client._exchange(ep, bad, lambda f: None), wire.MESSAGE_HEADER_MAX)
            monkeypatch.setenv("TENZRO_COALESCE", "1")
            got = await asyncio.gather(*(client.execute_frame(ep_plain, r) for r in reqs))
            monkeypatch.setenv("TENZRO_STREAM_ANSWERS", "0")  # the router asks for a whole answer
            calls_before = len(calls)
            got += await asyncio.gather(*(client.execute_frame(ep, r) for r in again))
            assert len(calls) == calls_before + 1
            return answer, got
        finally:
            await client.close()
            server.close()
            plain.close()

    answer, got = asyncio.run(go())
    assert answer["ok"] is False and answer["code"] == -32602 and "nbytes" in answer["message"]
    for req, ans in zip(reqs + again, got):
        verify_receipt(ans.receipt, provider=agent.provider, request_id=req.request_id, model_id=MODEL, layer=LAYER,
                       expert=req.expert, tokens=req.tokens, carrier_kind=req.carrier, carrier=req.payload,
                       rows=ans.rows, seal=ans.seal.body if ans.seal else None)


async def iroh_pair(agent):
    """The agent's iroh endpoint on loopback (as ``holder_agent --iroh`` serves it) and a router client."""
    server = await iroh.IrohServer(iroh.endpoint_secret(agent.key.encode()), "127.0.0.1:0", agent.execution.execute_rpc,
                                   agent.execution.status, agent.execution.execute_stream_rpc).start()
    return server, iroh.IrohHolderClient(timeout=60, bind="127.0.0.1:0")


def test_iroh_sends_one_stream_per_holder_and_one_bad_request_fails_alone(holder, monkeypatch):
    agent, x, calls = holder
    reqs = requests(x, carrier="f32", output="f32", bad_expert=9)
    big = requests(np.concatenate([x] * 300), carrier="f32", output="f32")  # several frames each

    async def go():
        server, client = await iroh_pair(agent)
        try:
            monkeypatch.setenv("TENZRO_COALESCE", "0")
            singles = await asyncio.gather(*(client.execute(server.endpoint_id, server.addrs, r)
                                             for r in fresh(reqs[:-1]) + fresh(big)))
            calls.clear()
            monkeypatch.setenv("TENZRO_COALESCE", "1")
            got = await asyncio.gather(*(client.execute(server.endpoint_id, server.addrs, r) for r in reqs),
                                       return_exceptions=True)
            got_big = await asyncio.gather(*(client.execute(server.endpoint_id, server.addrs, r) for r in big))
            return singles, got, got_big
        finally:
            await client.close()
            await server.close()

    singles, got, got_big = asyncio.run(go())
    assert calls == [len(reqs), len(big)]
    assert isinstance(got[-1], HolderFault) and "-32004" in str(got[-1])
    assert all(len(iroh.request_frames(r)) >= 2 for r in big)
    check(agent, reqs[:-1], got[:-1], singles[:len(reqs) - 1])
    check(agent, big, got_big, singles[len(reqs) - 1:])


def test_iroh_coalesced_stream_answers_each_request_as_it_finishes(holder, monkeypatch):
    """The holder writes each request's frames as soon as it finishes: the first caller has its
    verified answer while the holder is still inside the second request."""
    agent, x, _ = holder
    reqs = requests(x, carrier="f32", output="f32")
    gate, held_back = holding_back(agent, EXPERTS[1])

    async def go():
        server, client = await iroh_pair(agent)
        try:
            monkeypatch.setenv("TENZRO_COALESCE", "1")
            monkeypatch.setattr(agent.execution, "_execute", held_back)
            return await first_while_held(lambda r: client.execute(server.endpoint_id, server.addrs, r), reqs, gate)
        finally:
            await client.close()
            await server.close()

    first, early, got = asyncio.run(go())
    assert first is got[0] and early[0] and not early[1]
    for req, ans in zip(reqs, got):
        assert ans.transport == "iroh" and ans.bytes_back > 0
        verify_receipt(ans.receipt, provider=agent.provider, request_id=req.request_id, model_id=MODEL, layer=LAYER,
                       expert=req.expert, tokens=req.tokens, carrier_kind=req.carrier, carrier=req.payload,
                       rows=ans.rows, seal=ans.seal.body if ans.seal else None)


def test_a_stream_announcing_more_requests_than_it_carries_is_refused(holder):
    agent, x, _ = holder
    req = requests(x, carrier="f32", output="f32")[0]

    async def go():
        from tests.test_iroh import raw_call
        server = await iroh.IrohServer(iroh.endpoint_secret(agent.key.encode()), "127.0.0.1:0", agent.execution.execute_rpc,
                                       agent.execution.status, agent.execution.execute_stream_rpc).start()
        try:
            short = await raw_call(server, b"".join(iroh.request_frames(req, 1, 3)))
            bad = await raw_call(server, b"".join(iroh.request_frames(req, 1, 10_000)))
            twice = await raw_call(server, b"".join(iroh.request_frames(req, 1, 2) * 2))
            return short, bad, twice
        finally:
            await server.close()

    short, bad, twice = asyncio.run(go())
    assert short[0]["error"]["code"] == -32600 and "3 requests" in short[0]["error"]["message"]
    assert bad[0]["error"]["code"] == -32600 and "stream_requests" in bad[0]["error"]["message"]
    assert twice[0]["error"]["code"] == -32600 and "distinct ids" in twice[0]["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_socket_batch_frame_is_answered_per_request_and_a_malformed_batch_gets_an_error(holder, stream):
    """The agent's socket answers a ``batch`` with one reply carrying every answer, or, asked to
    ``stream``, with one ``batch_part`` per request (``more`` on all but the last, read back with
    ``StreamedBatch``); either way each answer equals the request sent alone and its receipt
    verifies, a request for an expert not held fails alone, and a malformed batch gets one error."""
    agent, x, calls = holder
    reqs = requests(x, bad_expert=9)
    sent = []

    class Socket:  # the agent's end of its socket: what it writes back
        async def send(self, frame):
            sent.append(frame)

    async def go():
        agent.session.ws, agent.session.max_message = Socket(), 1 << 20
        singles = [await agent.execution.execute_request({**messages.request_header(r), "request_id": r.request_id},
                                               r.carrier, r.payload) for r in reqs[:-1]]
        calls.clear()
        header, payload = messages.batch_frame(reqs, "b1")
        await agent.handle({**header, "stream": stream}, payload)
        await agent.handle({"type": "batch", "id": "b2", "stream": stream, "requests": [{"nbytes": 5}]}, b"xy")
        return singles

    singles = asyncio.run(go())
    if stream:
        parts = [wire.unpack_frame(f, wire.MESSAGE_HEADER_MAX) for f in sent[:len(reqs)]]
        assert [h["id"] for h, _ in parts] == ["b1"] * len(reqs)
        assert [h["more"] for h, _ in parts] == [True] * (len(reqs) - 1) + [False]
        streamed = messages.StreamedBatch(reqs, "ws", 1)
        for h, data in parts:
            streamed.part(h, data, 1)
        outcomes = streamed.finish()
    else:
        assert calls == [len(reqs)]
        answer, data = wire.unpack_frame(sent[0], wire.MESSAGE_HEADER_MAX)
        outcomes = messages.batch_answers(answer, data, reqs, "ws", 1, 1)
    assert isinstance(outcomes[-1], HolderFault) and "-32004" in str(outcomes[-1])
    for req, ans, (_, out) in zip(reqs, outcomes, singles):
        assert np.array_equal(ans.rows, wire.decode_rows(out, req.output, req.d_model, len(req.tokens)))
        verify_receipt(ans.receipt, provider=agent.provider, request_id=req.request_id, model_id=MODEL, layer=LAYER,
                       expert=req.expert, tokens=req.tokens, carrier_kind=req.carrier, carrier=req.payload,
                       rows=ans.rows, seal=ans.seal.body if ans.seal else None)
    bad, _ = wire.unpack_frame(sent[-1])
    assert bad["id"] == "b2" and bad["ok"] is False and "more" not in bad and "nbytes" in bad["message"]


def test_batch_reply_that_does_not_match_its_requests_faults_only_what_it_cannot_answer(holder):
    _, x, _ = holder
    reqs = requests(x)
    good = (messages.reply(reqs[0].request_id, token_indices=reqs[0].tokens, output="f32"),
            wire.encode_f32(x[reqs[0].tokens]))
    header, payload = messages.batch_reply("b", [good, (messages.reply("other"), b""),
                                                 (messages.failure(reqs[2].request_id, -32001, "no"), b"")])
    out = messages.batch_answers(header, payload, reqs, "ws", 10, 10)
    assert np.array_equal(out[0].rows, x[reqs[0].tokens])
    assert isinstance(out[1], HolderFault) and "not its request" in str(out[1])
    assert type(out[2]).__name__ == "AuthRefusal"
    short = messages.batch_answers(header, payload, reqs[:2], "ws", 10, 10)
    assert all(isinstance(o, HolderFault) and "3 answers for 2" in str(o) for o in short)
    with pytest.raises(wire.WireError):
        messages.split_batch({"requests": [{"nbytes": 1}]}, b"ab")


def test_a_holder_refusing_one_request_or_the_whole_batch_as_malformed_is_not_blamed(holder):
    """-32602/-32600 from the holder means our request was malformed: ``Rejected`` for that
    request alone (or for every request when the whole batch was refused), never a fault."""
    _, x, _ = holder
    reqs = requests(x)
    good = (messages.reply(reqs[0].request_id, token_indices=reqs[0].tokens, output="f32"),
            wire.encode_f32(x[reqs[0].tokens]))
    header, payload = messages.batch_reply("b", [good, (messages.failure(reqs[1].request_id, -32602, "bad"), b""),
                                                 (messages.failure(reqs[2].request_id, -32004, "gone"), b"")])
    out = messages.batch_answers(header, payload, reqs, "ws", 10, 10)
    assert np.array_equal(out[0].rows, x[reqs[0].tokens])
    assert isinstance(out[1], messages.Rejected) and isinstance(out[2], HolderFault)
    whole = messages.batch_answers(messages.failure("b", -32600, "not a batch"), b"", reqs, "ws", 10, 10)
    assert all(isinstance(o, messages.Rejected) for o in whole)


def test_f16_outputs_and_f32_for_a_batch_beyond_f16_range(holder):
    """A generation's wire (f16 rows out, f16 back, issue 24 item 2): an answer in f16 within
    half a unit in the last place, and a batch whose outputs pass f16's range answered in f32,
    exactly; receipts verify either way."""
    agent, x, _ = holder
    big = x * np.float32(2e3)  # expert outputs far beyond 65504
    reqs = requests(x, carrier="f32", output="f16")[:1] + requests(big, carrier="f32", output="f16")[:1]

    async def go():
        server = await serve_http(agent.execution.http_rpc, "127.0.0.1", 0, agent.execution.http_frame)
        endpoint = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/rpc"
        client = HttpHolderClient(30)
        try:
            return [await client.execute_frame(endpoint, r) for r in reqs]
        finally:
            await client.close()
            server.close()

    answers = asyncio.run(go())
    exact = [agent.runtime.execute(MODEL, LAYER, r.expert, wire.decode_rows(r.payload, "f32", r.d_model, len(r.tokens)),
                                   len(r.tokens), r.d_model, False) for r in reqs]
    assert np.abs(exact[1]).max() > wire.F16_MAX
    np.testing.assert_array_equal(answers[0].rows, exact[0].astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(answers[1].rows, exact[1])
    check(agent, reqs, answers, answers)


def test_small_streamed_batch_runs_on_the_event_loop_and_is_answered_whole():
    """A message of a few rows (``AgentConfig.inline_work``) runs on the agent's event loop, no
    compute thread, and is answered whole although streaming was asked for: one reply frame,
    which the router reads as such; each answer equals the request sent alone, its receipt
    verifies under the message seal, a request for an expert not held fails alone."""
    import threading

    agent, x, _ = make_holder(1 << 20)
    reqs = requests(x, bad_expert=9)
    sent, threads = [], set()
    real = agent.execution._execute

    def recorded(*args, **kw):
        threads.add(threading.get_ident())
        return real(*args, **kw)

    class Socket:  # the agent's end of its socket: what it writes back
        async def send(self, frame):
            sent.append(frame)

    async def go():
        agent.session.ws, agent.session.max_message = Socket(), 1 << 20
        singles = [await agent.execution.execute_request({**messages.request_header(r), "request_id": r.request_id},
                                                         r.carrier, r.payload) for r in reqs[:-1]]
        agent.execution._execute = recorded
        header, payload = messages.batch_frame(reqs, "b1", seal=True)
        await agent.handle({**header, "stream": True}, payload)
        return singles, threading.get_ident()

    singles, loop_thread = asyncio.run(go())
    assert threads == {loop_thread} and len(sent) == 1
    answer, data = wire.unpack_frame(sent[0], wire.MESSAGE_HEADER_MAX)
    assert "more" not in answer and answer.get("seal")
    outcomes = messages.batch_answers(answer, data, reqs, "ws", 1, 1)
    assert isinstance(outcomes[-1], HolderFault) and "-32004" in str(outcomes[-1])
    for req, ans, (_, out) in zip(reqs, outcomes, singles):
        assert np.array_equal(ans.rows, wire.decode_rows(out, req.output, req.d_model, len(req.tokens)))
        verify_receipt(ans.receipt, provider=agent.provider, request_id=req.request_id, model_id=MODEL, layer=LAYER,
                       expert=req.expert, tokens=req.tokens, carrier_kind=req.carrier, carrier=req.payload,
                       rows=ans.rows, seal=ans.seal.body if ans.seal else None)
