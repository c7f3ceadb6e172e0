"""The iroh QUIC transport (reference §11.1) between a real holder execute path and the router's
client over loopback: framing, split batches reassembled before executing, receipts, bad input.

Each test runs a ``HolderAgent``'s execute path (decode carrier → expert FFN → encode → sign)
behind an ``IrohServer`` bound to 127.0.0.1 and dials it with ``IrohHolderClient`` by endpoint
id and direct address, as the router does. The forward over agent processes lives in
``test_transports.py`` and ``test_chaos.py``.
"""
from __future__ import annotations

import asyncio
import json
import struct
import tempfile
import uuid

import numpy as np
import pytest
from nacl.signing import SigningKey
from safetensors.numpy import load_file

from moe import wire
from holders.agent import AgentConfig, HolderAgent
from moe.messages import BatchRequest, HolderFault, Rejected, answer_to_batch
from moe.receipts import verify_receipt
from moe.transports import iroh
from prepare.checkpoint import Checkpoint
from prepare.layouts import load_expert, spec_from_config
from tests.conftest import QWEN


MODEL, LAYER, EXPERT = "m", 1, 3


@pytest.fixture(scope="module")
def holder():
    ck = Checkpoint(QWEN)
    agent = HolderAgent(AgentConfig("http://127.0.0.1:1", SigningKey.generate(), tempfile.mkdtemp(prefix="tenzro-test-iroh-")))
    agent.runtime.load_expert(MODEL, LAYER, EXPERT, load_expert(ck, spec_from_config(ck.config), LAYER, EXPERT)
                              .to_blob("f32"))
    x = load_file(str(QWEN / "reference.safetensors"))[f"layer{LAYER}.hidden_states"].astype(np.float32)
    return agent, x


def serve(agent, coro_fn, timeout=120):
    """Run ``coro_fn(server, client)`` with the holder's iroh endpoint up; both closed afterwards."""
    async def go():
        server = await iroh.IrohServer(iroh.endpoint_secret(agent.key.encode()), "127.0.0.1:0", agent.execution.execute_rpc,
                                       agent.execution.status).start()
        client = iroh.IrohHolderClient(timeout=60, bind="127.0.0.1:0")
        try:
            return await asyncio.wait_for(coro_fn(server, client), timeout)
        finally:
            await client.close()
            await server.close()
    return asyncio.run(go())


def request(x, tokens, carrier="f32", output="f32"):
    payload = wire.encode_rows(x, carrier)
    return BatchRequest(uuid.uuid4().hex, MODEL, LAYER, EXPERT, list(tokens), carrier, payload, output, x.shape[1])


async def raw_call(server, data: bytes, alpn=iroh.ALPN, finish=True) -> list[dict]:
    """Write raw bytes on a fresh connection's bi-stream and read every answer frame."""
    ep = await iroh.bind_endpoint(None, "127.0.0.1:0", [])
    try:
        addr = iroh._iroh.EndpointAddr(iroh._iroh.EndpointId.from_string(server.endpoint_id), None, server.addrs)
        conn = await ep.connect(addr, alpn)
        bi = await conn.open_bi()
        send, recv = bi.send(), bi.recv()
        try:
            await send.write_all(data)
            if finish:
                await send.finish()
        except iroh._iroh.IrohError:
            pass  # the holder stopped reading: its answer is still there
        out = []
        reader = iroh.FrameReader(recv)
        while (body := await reader.next()) is not None:
            out.append(json.loads(body))
        return out
    finally:
        await ep.close()


def test_endpoint_id_is_stable_and_derived_from_the_provider_key(holder):
    agent, _ = holder
    async def ids(server, _client):
        again = await iroh.IrohServer(iroh.endpoint_secret(agent.key.encode()), "127.0.0.1:0", agent.execution.execute_rpc,
                                      agent.execution.status).start()
        other = await iroh.IrohServer(iroh.endpoint_secret(SigningKey.generate().encode()), "127.0.0.1:0",
                                      agent.execution.execute_rpc, agent.execution.status).start()
        try:
            return server.endpoint_id, again.endpoint_id, other.endpoint_id, server.addrs
        finally:
            await again.close()
            await other.close()
    first, again, other, addrs = serve(agent, ids)
    assert first == again != other and len(first) == 64
    assert first != agent.provider  # domain-separated: the signing key never serves TLS
    assert addrs and all(a.startswith("127.0.0.1:") for a in addrs)
    with pytest.raises(ValueError):
        iroh.endpoint_secret(b"short")


@pytest.mark.parametrize("carrier,output", [(c, o) for c in wire.CARRIERS for o in wire.OUTPUTS])
def test_execute_matches_the_socket_path_and_receipt_verifies(holder, carrier, output):
    agent, x = holder
    tokens = list(range(x.shape[0]))
    req = request(x, tokens, carrier, output)

    async def go(server, client):
        ans = await client.execute(server.endpoint_id, server.addrs, req)
        direct, data = await agent.execution.execute_request(
            {"request_id": req.request_id, "model_id": MODEL, "layer": LAYER, "expert": EXPERT, "token_indices": tokens,
             "d_model": req.d_model, "output": output}, carrier, req.payload)
        status = await client.status(server.endpoint_id, server.addrs)
        return ans, wire.decode_rows(data, output, req.d_model, len(tokens), "outputs"), status

    ans, want, status = serve(agent, go)
    assert ans.transport == "iroh" and np.array_equal(ans.rows, want)
    verify_receipt(ans.receipt, provider=agent.provider, request_id=req.request_id, model_id=MODEL, layer=LAYER,
                   expert=EXPERT, tokens=tokens, carrier_kind=carrier, carrier=req.payload, rows=ans.rows)
    assert ans.bytes_out > len(req.payload) and ans.bytes_back > 0
    assert status["provider"] == agent.provider and status["experts"]


def test_batch_over_the_frame_cap_is_split_and_executed_reassembled(holder):
    agent, x = holder
    big = np.concatenate([x * np.float32(1 + i / 64) for i in range(-(-5000 // x.shape[0]))])[:5000]
    tokens = list(range(5000))
    req = request(big, tokens)
    frames = iroh.request_frames(req)
    assert len(frames) >= 2 and all(len(f) - 4 <= iroh.MAX_FRAME_BYTES for f in frames)

    async def go(server, client):
        return await client.execute(server.endpoint_id, server.addrs, req)

    ans = serve(agent, go)
    # One execution of the whole batch: bit-identical to the runtime on all 5,000 rows at once.
    want = agent.runtime.execute(MODEL, LAYER, EXPERT, big, 5000, big.shape[1], False)
    assert np.array_equal(ans.rows, want)
    assert ans.bytes_back > iroh.MAX_FRAME_BYTES  # the answer came back in parts too
    verify_receipt(ans.receipt, provider=agent.provider, request_id=req.request_id, model_id=MODEL, layer=LAYER,
                   expert=EXPERT, tokens=tokens, carrier_kind="f32", carrier=req.payload, rows=ans.rows)


def test_bad_input_gets_an_error_and_the_holder_stays_up(holder):
    agent, x = holder
    req = request(x[:4], [0, 1, 2, 3])

    async def go(server, client):
        seen = {}
        frame = iroh.request_frames(req)[0]
        # A length prefix over the 4 MiB cap: answered at once, the rest is not read.
        seen["oversize"] = await raw_call(server, struct.pack("<I", iroh.MAX_FRAME_BYTES + 1) + b"{" * 1000)
        # A stream that ends inside a frame.
        seen["truncated"] = await raw_call(server, frame[:len(frame) // 2])
        seen["short_head"] = await raw_call(server, b"\x05\x00")
        seen["not_json"] = await raw_call(server, struct.pack("<I", 5) + b"nope!")
        seen["unknown"] = await raw_call(server, iroh.pack({"jsonrpc": "2.0", "id": 9, "method": "moe/nope"}))
        seen["bad_params"] = await raw_call(server, iroh.pack({"jsonrpc": "2.0", "id": 3, "method": "moe/execute",
                                                               "params": {"model_id": MODEL, "layer": LAYER,
                                                                          "expert": EXPERT, "token_indices": [0],
                                                                          "d_model": 256, "hidden_states": "!!"}}))
        two = iroh.request_frames(request(np.tile(x, (-(-5000 // x.shape[0]), 1))[:5000], list(range(5000))))
        assert len(two) == 2
        seen["missing_part"] = await raw_call(server, two[0])
        seen["empty"] = await raw_call(server, b"")
        # Another ALPN: the handshake fails; the endpoint is not affected.
        try:
            await asyncio.wait_for(raw_call(server, frame, alpn=b"tenzro/other"), 30)
            seen["alpn"] = "connected"
        except (iroh._iroh.IrohError, asyncio.TimeoutError) as exc:
            seen["alpn"] = type(exc).__name__
        ans = await client.execute(server.endpoint_id, server.addrs, req)
        # A holder error (expert not held) is a holder fault, not a transport error.
        try:
            await client.execute(server.endpoint_id, server.addrs,
                                 BatchRequest("r", MODEL, LAYER, 99, [0], "f32", wire.encode_f32(x[:1]), "f32", 256))
            seen["not_held"] = "answered"
        except HolderFault as exc:
            seen["not_held"] = str(exc)
        return seen, ans

    seen, ans = serve(agent, go)
    codes = {k: v[0]["error"]["code"] for k, v in seen.items() if isinstance(v, list)}
    assert codes == {"oversize": -32600, "truncated": -32700, "short_head": -32700, "not_json": -32700,
                     "unknown": -32601, "bad_params": -32602, "missing_part": -32600, "empty": -32600}, seen
    assert "4194304-byte cap" in seen["oversize"][0]["error"]["message"]
    assert "truncated" in seen["truncated"][0]["error"]["message"]
    assert "moe/execute" in seen["unknown"][0]["error"]["message"] and seen["unknown"][0]["id"] == 9
    assert seen["alpn"] != "connected"
    assert "-32004" in seen["not_held"] and "not loaded" in seen["not_held"]
    assert ans.rows.shape == (4, 256) and ans.transport == "iroh"  # still serving after all of it


def test_unreachable_endpoint_is_a_connection_error():
    async def go():
        client = iroh.IrohHolderClient(timeout=3, bind="127.0.0.1:0")
        try:
            with pytest.raises(ConnectionError):
                await client.call("zz", ["127.0.0.1:9"], [])
            other = iroh.endpoint_secret(b"\x07" * 32)
            eid = str(iroh._iroh.SecretKey.from_bytes(other).public())
            with pytest.raises(ConnectionError):
                await client.call(eid, ["127.0.0.1:9"], [iroh.pack({"jsonrpc": "2.0", "id": 1, "method": "moe/status"})])
        finally:
            await client.close()
    asyncio.run(go())


def test_concurrent_first_calls_share_one_client_endpoint_and_a_cancelled_call_leaves_it_usable(holder):
    agent, x = holder
    req = request(x[:8], list(range(8)))

    async def go(server, client):
        other = await iroh.IrohServer(iroh.endpoint_secret(SigningKey.generate().encode()), "127.0.0.1:0",
                                      agent.execution.execute_rpc, agent.execution.status).start()
        try:
            # The first calls to two holders race to bind the client endpoint: both must answer.
            first = await asyncio.gather(*(client.execute(s.endpoint_id, s.addrs, req) for s in (server, other)
                                           for _ in range(4)))
            # A call cut by the caller's deadline retires its connection; the next call dials anew.
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(client.execute(server.endpoint_id, server.addrs, req), 0.0005)
            again = await client.execute(server.endpoint_id, server.addrs, req)
            return first, again
        finally:
            await other.close()

    first, again = serve(agent, go)
    assert all(a.transport == "iroh" and np.array_equal(a.rows, first[0].rows) for a in first)
    assert np.array_equal(again.rows, first[0].rows)


@pytest.mark.django_db(transaction=True)
def test_router_prefers_iroh_then_falls_back_to_the_socket_and_http(holder, settings):
    """``send_batch`` with ``DATA_TRANSPORT=iroh``: the advertised endpoint when it answers; when
    it cannot be dialed (no address advertised) or the wheel is missing, the socket (no agent
    socket here: it times out) and then the holder's HTTP endpoint answer."""
    from types import SimpleNamespace

    from router.apps import current
    from moe.transports.http import serve_http
    from registry.heartbeat import ingest
    from registry.models import Provider
    from tests.conftest import signed_heartbeat

    agent, x = holder
    settings.TENZRO = {**settings.TENZRO, "DATA_TRANSPORT": "iroh", "VIEW_CACHE_S": 0, "BATCH_TIMEOUT_S": 3.0}
    req = request(x[:4], [0, 1, 2, 3])

    async def go(server, _client):
        http = await serve_http(agent.execution.http_rpc, "127.0.0.1", 0, agent.execution.http_frame)
        endpoint = f"http://127.0.0.1:{http.sockets[0].getsockname()[1]}/rpc"
        holder_info = SimpleNamespace(iroh_endpoint_id=server.endpoint_id, http_endpoint=endpoint)
        seen = []
        try:
            for addrs, wheel in ((server.addrs, True), ([], True), (server.addrs, False)):
                await asyncio.to_thread(ingest, signed_heartbeat(agent.key, iroh_endpoint_id=server.endpoint_id,
                                                                 iroh_addrs=addrs, http_endpoint=endpoint))
                await asyncio.to_thread(lambda: Provider.objects.update(connected=True))
                saved = iroh._iroh
                iroh._iroh = iroh._iroh if wheel else None  # as if the optional wheel were missing
                try:
                    seen.append((await current().send_batch(agent.provider, holder_info, req)).transport)
                finally:
                    iroh._iroh = saved
                await asyncio.sleep(0.002)  # heartbeat timestamps strictly increase
        finally:
            http.close()
        return seen

    assert serve(agent, go) == ["iroh", "http", "http"]


def test_without_the_wheel_the_agent_refuses_iroh_with_a_clear_message(tmp_path):
    """``holder_agent --iroh`` on a machine where ``import iroh`` fails: exit 1 naming the flag."""
    import subprocess
    import sys

    from tests.cluster_util import ROOT, env_for

    code = ("import sys; sys.modules['iroh'] = None; from holders.cli import main; "
            f"sys.exit(main(['--site', 'http://127.0.0.1:9', '--key', {str(tmp_path / 'k')!r}, '--iroh']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env_for(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1
    assert "--iroh: the iroh package cannot be imported" in done.stderr and "Traceback" not in done.stderr


def test_answer_codes_that_reject_the_request_are_not_holder_faults():
    """A holder refusing a malformed request (-32602/-32600) is honest (``Rejected``); any other
    error, or a wrong answer, is a ``HolderFault``."""
    x = np.ones((2, 256), np.float32)
    req = request(x, [0, 1])
    for code in (-32602, -32600):
        with pytest.raises(Rejected, match="1536 bytes"):
            answer_to_batch({"ok": False, "code": code, "message": "1536 bytes"}, b"", req, "iroh", 0, 0)
    with pytest.raises(HolderFault):
        answer_to_batch({"ok": False, "code": -32004, "message": "not loaded"}, b"", req, "iroh", 0, 0)
    with pytest.raises(HolderFault):  # three rows for two tokens: the holder's answer is wrong
        answer_to_batch({"ok": True, "token_indices": [0, 1], "output": "f32"}, wire.encode_f32(np.ones((3, 256))),
                        req, "iroh", 0, 0)


def test_a_split_f16_batch_reassembles(holder):
    """f16 rows over the frame cap: split by rows, each part in ``hidden_f16``, executed once."""
    agent, x = holder
    big = np.tile(x, (-(-9000 // x.shape[0]), 1))[:9000]
    req = request(big, list(range(9000)), "f16", "bf16")
    frames = iroh.request_frames(req)
    assert len(frames) >= 2 and all(b'"hidden_f16"' in f for f in frames)

    async def go(server, client):
        return await client.execute(server.endpoint_id, server.addrs, req)

    ans = serve(agent, go)
    assert ans.rows.shape == (9000, 256)


class ScriptedRecv:
    """A ``RecvStream`` stand-in returning scripted chunks (at most ``size`` bytes each), then b"" (end)."""

    def __init__(self, data: bytes, cuts: list[int]):
        self.chunks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)]) if b > a]
        self.asked: list[int] = []

    async def read(self, size: int) -> bytes:
        self.asked.append(size)
        if not self.chunks:
            return b""
        chunk = self.chunks[0][:size]
        self.chunks[0] = self.chunks[0][size:]
        if not self.chunks[0]:
            self.chunks.pop(0)
        return chunk


def read_all(data: bytes, cuts: list[int]) -> tuple[list[bytes], ScriptedRecv]:
    async def go():
        reader, out = iroh.FrameReader(recv := ScriptedRecv(data, cuts)), []
        while (body := await reader.next()) is not None:
            out.append(body)
        return out, recv
    return asyncio.run(go())


def test_frame_reader_returns_frames_whatever_the_chunking_and_refuses_broken_streams():
    bodies = [b"{}", b"x" * 70000, b"", b'{"a":1}' * 9000, b"y"]
    data = b"".join(struct.pack("<I", len(b)) + b for b in bodies)
    rng = np.random.default_rng(0)
    for cuts in ([], [1], [3, 5], list(range(1, len(data), 4093)), sorted(rng.choice(len(data), 50, replace=False))):
        got, _ = read_all(data, [int(c) for c in cuts])
        assert got == bodies
    _, recv = read_all(data, [])  # all there at once: one read per frame plus the end
    assert len(recv.asked) <= len(bodies) + 1
    with pytest.raises(iroh.FrameError, match="after 2 of 4 length bytes"):
        read_all(data + b"\x01\x00", [])
    with pytest.raises(iroh.FrameError, match="after 69999 of 70000 announced"):
        read_all(data[:6 + 4 + 69999], [100, 5000])
    with pytest.raises(iroh.FrameError, match="byte cap") as err:
        read_all(struct.pack("<I", iroh.MAX_FRAME_BYTES + 1) + b"z" * 10, [])
    assert err.value.code == -32600


def test_loads_frame_gives_the_rows_member_as_a_view_only_when_it_is_that_member():
    rows = np.random.default_rng(1).standard_normal((40, 256)).astype(np.float32)
    req = BatchRequest("r", MODEL, LAYER, EXPERT, list(range(40)), "f32", wire.encode_f32(rows), "f32", 256)
    body = iroh.request_frames(req)[0][4:]
    msg = iroh.loads_frame(body)
    assert isinstance(msg["params"]["hidden_states"], memoryview)  # the fast path was taken
    plain = json.loads(body)
    assert bytes(msg["params"].pop("hidden_states")) == plain["params"].pop("hidden_states").encode()
    assert msg == plain
    assert iroh.assemble([iroh.loads_frame(body)])[2] == req.payload

    def plain(v):  # the message json.loads gives
        return {k: plain(x) for k, x in v.items()} if isinstance(v, dict) else \
            bytes(v).decode() if isinstance(v, memoryview) else v

    def viewed(v):
        return isinstance(v, memoryview) or isinstance(v, dict) and any(viewed(x) for x in v.values())

    b64 = wire.b64encode(req.payload)
    # The look-alike inside a string is escaped, so the real member is the first match: a view.
    look_alike = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "moe/execute",
                             "params": {"note": f'"hidden_states":"{b64}"', "hidden_states": b64}}).encode()
    # A later duplicate wins in JSON; a first match nested elsewhere; an escape inside the text: no view.
    duplicate = (b'{"jsonrpc":"2.0","id":1,"method":"moe/execute","params":{"hidden_states":"' + b64.encode()
                 + b'","hidden_states":"QUJD"}}')
    nested = json.dumps({"result": {"receipt": {"outputs": b64}, "outputs": "QUJD"}}).encode()
    escaped = json.dumps({"params": {"hidden_states": b64[:5000] + "\\/" + b64[5000:]}}).encode()
    for text, view in ((look_alike, True), (duplicate, False), (nested, False), (escaped, False)):
        got = iroh.loads_frame(text)
        assert plain(got) == json.loads(text) and viewed(got) == view, text[:80]
    for broken in (body[:-1], body.replace(b'"params"', b"'params'"), body[:100] + b"\xff" + body[101:], body + b"x"):
        with pytest.raises(ValueError) as want:
            json.loads(broken)
        with pytest.raises(type(want.value)) as got:
            iroh.loads_frame(broken)
        assert str(got.value) == str(want.value)
    # A raw control character inside the rows text: JSON refuses it (-32700); the view is refused
    # when decoded, as bad base64 (-32602).
    ctrl = body.replace(b',"hidden_states":"', b',"hidden_states":"\n')
    with pytest.raises(ValueError):
        json.loads(ctrl)
    with pytest.raises(wire.WireError, match="not valid base64"):
        wire.carrier_in_params(iroh.loads_frame(ctrl)["params"])


def test_b64decode_accepts_and_refuses_what_binascii_does():
    import base64

    rng = np.random.default_rng(2)
    alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="
    for n in range(3000):
        text = bytes(rng.choice(list(alphabet), int(rng.integers(0, 14))))
        if n % 3 == 0:
            text = base64.b64encode(rng.bytes(int(rng.integers(0, 40))))
        try:
            want = base64.b64decode(text, validate=True)
        except ValueError:
            want = None
        for given in (text, text.decode(), memoryview(b"[" + text + b"]")[1:-1]):
            try:
                got = wire.b64decode(given, "x")
            except wire.WireError:
                got = None
            assert got == want, text
    big = rng.bytes(1 << 20)
    assert wire.b64decode(wire.b64encode(big), "x") == big and wire.b64encode(big) == base64.b64encode(big).decode()
    for bad in ("ab=c", "abc", "ab\ncd==", "é===", 5):
        with pytest.raises(wire.WireError):
            wire.b64decode(bad, "x")


async def _until(pred, deadline_s: float = 60.0) -> None:
    """Wait (generously) until ``pred()`` holds; the assertion after it says what did not."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not pred() and loop.time() < end:
        await asyncio.sleep(0.05)


def test_unfinished_parts_are_bounded_timed_out_and_freed_and_the_holder_serves_on(holder):
    """Streams sending some parts of a request and never the rest held the holder's memory for
    good (issue 24 item 4): in-flight bytes are bounded per peer, an idle incomplete request is
    answered -32600 after the part timeout, and a closed connection frees its streams."""
    agent, x = holder
    rows = 12_000
    big = np.tile(x, (-(-rows // x.shape[0]), 1))[:rows]
    frames = iroh.request_frames(request(big, range(rows)))
    assert len(frames) >= 3
    first = len(frames[0]) - 4  # body bytes the holder counts for a stream's first part

    async def go():
        server = await iroh.IrohServer(iroh.endpoint_secret(agent.key.encode()), "127.0.0.1:0", agent.execution.execute_rpc,
                                       agent.execution.status, peer_bytes=first * 3 // 2, total_bytes=first * 4,
                                       part_timeout_s=5.0).start()
        client = iroh.IrohHolderClient(timeout=60, bind="127.0.0.1:0")
        ep = await iroh.bind_endpoint(None, "127.0.0.1:0", [])
        try:
            addr = iroh._iroh.EndpointAddr(iroh._iroh.EndpointId.from_string(server.endpoint_id), None, server.addrs)
            conn = await ep.connect(addr, iroh.ALPN)

            async def partial(n_frames: int):
                bi = await conn.open_bi()
                try:
                    await bi.send().write_all(b"".join(frames[:n_frames]))  # never finished
                except iroh._iroh.IrohError:
                    pass  # the holder stopped reading: its answer is still there
                return bi

            async def answers(bi) -> list[dict]:
                reader, out = iroh.FrameReader(bi.recv()), []
                while (body := await reader.next()) is not None:
                    out.append(json.loads(body))
                return out

            a = await partial(1)
            await _until(lambda: server.budget.total == first)
            b = await partial(1)  # the same peer past its bound: refused at once
            refused = await asyncio.wait_for(answers(b), 30)
            timed_out = await asyncio.wait_for(answers(a), 60)  # no second part within 5 s
            await _until(lambda: server.budget.total == 0)
            after_timeout = server.budget.total
            c = await partial(1)
            await _until(lambda: server.budget.total == first)
            conn.close(0, b"bye")
            await _until(lambda: server.budget.total == 0)
            after_close = server.budget.total
            del c
            ans = await client.execute(server.endpoint_id, server.addrs, request(x[:4], [0, 1, 2, 3]))
            return refused, timed_out, after_timeout, after_close, ans
        finally:
            await ep.close()
            await client.close()
            await server.close()

    refused, timed_out, after_timeout, after_close, ans = asyncio.run(asyncio.wait_for(go(), 180))
    assert refused[0]["error"]["code"] == -32005 and "per peer" in refused[0]["error"]["message"], refused
    assert timed_out[0]["error"]["code"] == -32600 and "incomplete request" in timed_out[0]["error"]["message"]
    assert after_timeout == 0 and after_close == 0
    assert ans.rows.shape == (4, 256) and ans.transport == "iroh"  # still serving after all of it
