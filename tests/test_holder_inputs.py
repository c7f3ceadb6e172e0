"""A holder agent's answers to hostile or large requests: every request gets an answer (socket and
HTTP), a bad number is a -32602 naming its field, and HTTP ``/frame`` carries a batch whole."""
from __future__ import annotations

import asyncio
import json
import uuid

import numpy as np
import pytest
from nacl.signing import SigningKey

from moe import wire
from holders.agent import AgentConfig, HolderAgent
from moe.messages import BatchRequest
from moe.transports.http import HttpHolderClient, serve_http
from tenzro_site.cluster import free_port
from tests.test_runtime import H, expert

MODEL = "m"


class Socket:
    """What the agent writes to its site socket (frames), in order."""

    def __init__(self):
        self.sent: list[bytes] = []

    async def send(self, data):
        self.sent.append(data)


@pytest.fixture
def agent(tmp_path):
    a = HolderAgent(AgentConfig("http://127.0.0.1:1", SigningKey.generate(), tmp_path, name="h"))
    a.runtime.load_expert(MODEL, 0, 0, expert(0).to_blob("f32"))
    a.session.ws = Socket()
    return a


def _execute_header(**over):
    return {"type": "execute", "id": uuid.uuid4().hex, "model_id": MODEL, "layer": 0, "expert": 0,
            "token_indices": [0, 1], "d_model": H, "carrier": "f32", **over}


@pytest.mark.parametrize("bad, field", [({"token_indices": [0, 2**32]}, "token_indices"),
                                        ({"layer": float("inf")}, "layer"), ({"expert": "0"}, "expert"),
                                        ({"d_model": 1e400}, "d_model"),
                                        ({"purpose": "free"}, "purpose")])  # would have run unmetered
def test_socket_request_with_a_bad_number_gets_a_failure_reply(agent, bad, field):
    header = _execute_header(**bad)
    asyncio.run(agent.handle(header, np.zeros((2, H), np.float32).tobytes()))
    (frame,) = agent.session.ws.sent  # answered at once, not left to the router's 30 s timeout
    reply, _ = wire.unpack_frame(frame)
    assert reply["id"] == header["id"] and reply["ok"] is False and field in reply["message"]


def test_rows_whose_outputs_overflow_are_refused_as_the_request_not_faulted(agent):
    """Finite rows of huge magnitude (1e20) overflow an honest expert's f32 outputs: the holder
    refuses the request as a ``WireError`` naming ``hidden_states`` (the router records a rejection,
    no reputation cost) instead of answering Inf rows the router counts as the holder's fault."""
    from moe.messages import SOCKET_REJECTIONS

    header = _execute_header(output="f32")
    asyncio.run(agent.handle(header, np.full((2, H), 1e20, np.float32).tobytes()))
    reply, payload = wire.unpack_frame(agent.session.ws.sent[0])
    assert reply["ok"] is False and reply["code"] in SOCKET_REJECTIONS and not payload
    assert "hidden_states" in reply["message"] and "overflow" in reply["message"]


def test_an_unexpected_error_is_still_answered(agent, monkeypatch):
    def boom(*_a, **_k):
        raise OverflowError("unexpected")

    monkeypatch.setattr(agent.runtime, "execute", boom)
    header = _execute_header()
    asyncio.run(agent.handle(header, np.zeros((2, H), np.float32).tobytes()))
    reply, _ = wire.unpack_frame(agent.session.ws.sent[0])
    assert reply["ok"] is False and reply["code"] == "internal" and "OverflowError" in reply["message"]


async def _post(reader, writer, path: str, body: bytes) -> tuple[bytes, bytes]:
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    status = await reader.readline()
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, await reader.readexactly(int(headers["content-length"]))


def test_http_endpoint_answers_bad_numbers_on_a_kept_connection(agent):
    async def go():
        port = free_port()
        server = await serve_http(agent.execution.http_rpc, "127.0.0.1", port, agent.execution.http_frame)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            rows = wire.rows_to_b64(np.zeros((1, H), np.float32))
            out = []
            for raw in ('{"jsonrpc": "2.0", "id": 1, "method": "tenzro_moeExecute", "params": {"model_id": "m", '
                        f'"layer": 1e400, "expert": 0, "token_indices": [0], "d_model": {H}, '
                        f'"hidden_states": "{rows}"}}}}',
                        '{"jsonrpc": "2.0", "id": 2, "method": "moe/status", "params": {"x": ' + "9" * 100_000 + "}}",
                        '{"jsonrpc": "2.0", "id": 3, "method": "moe/status", "params": {}}'):
                status, body = await _post(reader, writer, "/rpc", raw.encode())
                out.append((status.split()[1], json.loads(body)))
            status, body = await _post(reader, writer, "/frame", wire.pack_frame(
                _execute_header(token_indices=[2**32]), bytes(4 * H)))
            out.append((status.split()[1], wire.unpack_frame(body)[0]))
            return out
        finally:
            writer.close()
            server.close()

    (s1, inf), (s2, digits), (s3, ok), (s4, frame) = asyncio.run(go())
    assert inf["error"]["code"] == -32602 and inf["error"]["data"]["field"] == "layer"
    assert digits["error"]["code"] == -32700
    assert ok["result"]["provider"] == agent.provider  # the same connection still serves
    assert frame["ok"] is False and frame["code"] == -32602 and "token_indices" in frame["message"]
    assert {s1, s2, s3, s4} == {b"200"}


def test_http_frame_carries_a_whole_batch_with_a_long_token_list(agent):
    n = 20_000  # its header alone is over one socket frame's 64 KiB header limit
    x = np.random.default_rng(0).standard_normal((n, H), dtype=np.float32)

    async def go():
        port = free_port()
        server = await serve_http(agent.execution.http_rpc, "127.0.0.1", port, agent.execution.http_frame)
        client = HttpHolderClient(60)
        try:
            req = BatchRequest(uuid.uuid4().hex, MODEL, 0, 0, list(range(n)), "f32", wire.encode_f32(x), "f32", H)
            return await client.execute_frame(f"http://127.0.0.1:{port}/rpc", req)
        finally:
            await client.close()
            server.close()

    ans = asyncio.run(go())
    assert ans.rows.shape == (n, H)
    assert np.array_equal(ans.rows, agent.runtime.execute(MODEL, 0, 0, x, n, H, False))


def test_http_rpc_names_the_field_at_fault_and_refuses_a_non_finite_id(agent):
    async def go():
        port = free_port()
        server = await serve_http(agent.execution.http_rpc, "127.0.0.1", port, agent.execution.http_frame)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        rows = wire.rows_to_b64(np.zeros((1, H), np.float32))
        base = {"model_id": MODEL, "layer": 0, "expert": 0, "token_indices": [0], "d_model": H, "hidden_states": rows}
        try:
            out = []
            for raw in (json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tenzro_moeExecute", "params": base}),
                        json.dumps({"jsonrpc": "2.0", "id": 2, "method": "tenzro_moeExecute",
                                    "params": {**base, "request_id": "r", "hidden_states": "!!"}}),
                        '{"jsonrpc": "2.0", "id": NaN, "method": "moe/status", "params": {}}',
                        '{"jsonrpc": "2.0", "id": 1e400, "method": "moe/status", "params": {}}'):
                _status, body = await _post(reader, writer, "/rpc", raw.encode())
                json.loads(body, parse_constant=lambda c: pytest.fail(f"{c} in a response"))
                out.append(json.loads(body))
            return out
        finally:
            writer.close()
            server.close()

    no_request_id, bad_b64, nan_id, inf_id = asyncio.run(go())
    assert no_request_id["error"]["code"] == -32602 and no_request_id["error"]["data"]["field"] == "request_id"
    assert bad_b64["error"]["data"]["field"] == "hidden_states"
    assert nan_id["error"]["code"] == -32700 and nan_id["id"] is None
    assert inf_id["error"]["code"] == -32600 and inf_id["error"]["data"]["field"] == "id"


@pytest.mark.parametrize("length, status, words", [("-5", b"400", "non-negative"), ("abc", b"400", "non-negative"),
                                                   (None, b"411", "required"), (str(1 << 40), b"413", "limit")])
def test_http_endpoint_answers_a_bad_content_length_with_the_right_status(agent, length, status, words):
    """A negative or non-numeric Content-Length is a 400 naming the header; a missing one 411;
    one above the body cap 413. The server stays up for the next connection."""
    async def go():
        port = free_port()
        server = await serve_http(agent.execution.http_rpc, "127.0.0.1", port, agent.execution.http_frame)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            head = "POST /rpc HTTP/1.1\r\nHost: x\r\n" + (f"Content-Length: {length}\r\n" if length else "") + "\r\n"
            writer.write(head.encode())
            await writer.drain()
            got = await reader.read()
            writer.close()
            r2, w2 = await asyncio.open_connection("127.0.0.1", port)
            ok, body = await _post(r2, w2, "/rpc", b'{"jsonrpc": "2.0", "id": 1, "method": "moe/status"}')
            w2.close()
            return got, ok
        finally:
            server.close()

    got, ok = asyncio.run(go())
    assert got.split()[1] == status and words in got.decode()
    assert ok.split()[1] == b"200"
