"""HTTP transport of the data plane: a holder's ``POST /rpc`` endpoint and the router's client.

Server (holder side, ``holder_agent --http-port``): a small HTTP/1.1 server on asyncio
streams (keep-alive, ``Content-Length`` bodies only) answering JSON-RPC 2.0 at ``POST /rpc``
with ``tenzro_moeExecute`` (alias ``moe/execute``) and ``moe/status`` (alias
``tenzro_moeExpertStatus``). Requests follow the reference's ``ExpertExecuteRequest``
(§6.1: ``hidden_states`` base64 f32 or ``hidden_q8`` base64 Q8_0 blocks) plus our
``request_id`` and ``output`` (``f32`` default, ``f16``, ``bf16``, ``q8_0``); the result mirrors the
request and carries ``outputs`` (base64 in ``output`` encoding) and the signed ``receipt``.
Bodies above ``MAX_BODY`` are refused with 413.

Client (router side): ``HttpHolderClient.execute_frame`` sends one ``BatchRequest`` as a
binary frame to ``POST /frame`` and returns a ``BatchAnswer``; a ``-32001`` answer is an
``AuthRefusal`` (not the holder's fault), any other error a ``HolderFault``, and connection
trouble a ``ConnectionError``. Batches for the same endpoint sent in the same event-loop turn
travel as one ``batch`` frame (``moe.messages.batch_frame``) in one POST; the holder answers
each request on its own in one reply frame. Pure Python on asyncio streams; imports nothing from Django.
"""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from urllib.parse import urlsplit
from typing import AsyncIterator, Awaitable, Callable

from moe import wire
from moe import messages
from moe.messages import BatchAnswer, BatchRequest, HolderFault, answer_to_batch
from moe.transports import coalesce
from moe.transports.coalesce import Coalescer
from moe import jsonrpc
from moe.jsonrpc import (INTERNAL_ERROR, INVALID_PARAMS, INVALID_REQUEST, PARSE_ERROR, RpcError,
                              error_response, result_response)

log = logging.getLogger(__name__)

MAX_BODY = wire.MESSAGE_MAX
FRAMES_TYPE = "application/x-tenzro-frames"  # a chunked body of answer frames, one per chunk

# handler(method, params) -> result dict; raises RpcError for an error envelope.
Handler = Callable[[str, dict], Awaitable[dict]]
# frame_handler(header, payload) -> (answer header, payload): the binary path POST /frame.
FrameHandler = Callable[[dict, bytes], Awaitable[tuple[dict, bytes]]]
# stream_handler(batch header, payload) -> async iterator of (answer header, payload), one per
# request of a ``batch`` sent with ``stream: true``, in the order they finish.
StreamHandler = Callable[[dict, bytes], AsyncIterator[tuple[dict, bytes]]]


async def read_headers(reader: asyncio.StreamReader) -> dict[str, str]:
    """Read HTTP/1.1 header lines up to the blank line; returns lower-cased names → values."""
    headers = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            return headers
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 411: "Length Required",
            413: "Payload Too Large"}


async def _respond(writer: asyncio.StreamWriter, status: int, body: dict | bytes, keep_alive: bool) -> None:
    binary = isinstance(body, bytes)
    data = body if binary else json.dumps(body, separators=(",", ":")).encode()
    ctype = "application/octet-stream" if binary else "application/json"
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(data)}\r\nConnection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n")
    writer.write(head.encode() + data)
    await writer.drain()


async def _rpc(handler: Handler, body: bytes) -> dict:
    try:
        msg = jsonrpc.loads(body)
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, an integer over 4,300 digits, deep nesting
        return error_response(None, RpcError(PARSE_ERROR, f"parse error: {str(exc)[:300]}", field="body"))
    if not isinstance(msg, dict) or not isinstance(msg.get("method"), str):
        return error_response(None, RpcError(INVALID_REQUEST, "expected a JSON-RPC 2.0 request", field="method"))
    rid, params = msg.get("id"), msg.get("params") or {}
    if not jsonrpc.valid_id(rid):
        return error_response(None, RpcError(INVALID_REQUEST, "id must be a string, a finite number or null",
                                             field="id"))
    if not isinstance(params, dict):
        return error_response(rid, RpcError(INVALID_PARAMS, "params must be an object", field="params"))
    try:
        return result_response(rid, await handler(msg["method"], params))
    except RpcError as exc:
        return error_response(rid, exc)
    except Exception:  # noqa: BLE001 (an answer, not a dropped connection; details stay in the log)
        log.exception("holder HTTP %s failed", msg["method"])
        return error_response(rid, RpcError(INTERNAL_ERROR, "internal error; the holder log has the details"))


async def _frame(frame_handler: FrameHandler, header: dict, payload: bytes) -> bytes:
    try:
        answer, out = await frame_handler(header, payload)
    except RpcError as exc:
        return wire.pack_frame(messages.failure(header.get("id"), exc.code, exc.message[:2000]))
    except Exception:  # noqa: BLE001 (an answer, not a dropped connection; details stay in the log)
        log.exception("holder HTTP frame failed")
        return wire.pack_frame(messages.failure(header.get("id"), INTERNAL_ERROR,
                                                "internal error; the holder log has the details"))
    return wire.pack_frame(messages.reply(header.get("id"), **answer), out, wire.MESSAGE_HEADER_MAX)


async def _stream(writer: asyncio.StreamWriter, stream_handler: StreamHandler, header: dict, payload: bytes,
                  keep_alive: bool) -> bool:
    """Answer a streamed ``batch``: a chunked 200 whose every chunk is one answer frame, written as
    soon as that request finishes. Returns False when the batch was refused as a whole before
    the stream started (the caller then answers it with one failure frame)."""
    answers = stream_handler(header, payload)
    try:
        first = await anext(answers)
    except StopAsyncIteration:
        first = None
    except (wire.WireError, RpcError):
        return False
    writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: {FRAMES_TYPE}\r\nTransfer-Encoding: chunked\r\n"
                 f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n".encode())
    item = first
    while item is not None:
        frame = wire.pack_frame(item[0], item[1], wire.MESSAGE_HEADER_MAX)
        writer.write(b"%x\r\n%b\r\n" % (len(frame), frame))
        await writer.drain()
        item = await anext(answers, None)
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    return True


async def serve_http(handler: Handler, host: str, port: int, frame_handler: FrameHandler | None = None,
                     stream_handler: StreamHandler | None = None) -> asyncio.AbstractServer:
    """Start the holder's HTTP endpoint on ``host:port``; returns the asyncio server (close it to stop).

    ``POST /rpc``: JSON-RPC through ``handler``. ``POST /frame`` (when ``frame_handler`` is
    given): one binary frame (``wire.pack_frame``, docs/DESIGN.md §6) in, one frame out; errors come
    back as a frame with ``ok: false``. A ``batch`` frame with ``stream: true`` (when
    ``stream_handler`` is given) is answered request by request: ``Transfer-Encoding: chunked``,
    one answer frame per chunk as each request finishes, so the router checks the first receipts
    while the holder still computes the rest; a batch refused as a whole gets one failure frame.
    """

    async def conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                parts = line.decode("latin-1").split()
                headers = await read_headers(reader)
                keep = headers.get("connection", "").lower() != "close"
                if len(parts) < 2:
                    await _respond(writer, 400, {"error": "malformed request line"}, False)
                    return
                method, path = parts[0], parts[1]
                if path not in ("/rpc", "/frame") or (path == "/frame" and frame_handler is None):
                    await _respond(writer, 404, {"error": f"no such path {path}; use POST /rpc"}, keep)
                    if "content-length" in headers:
                        await reader.readexactly(int(headers["content-length"]))
                    continue
                if method != "POST":
                    await _respond(writer, 405, {"error": "use POST /rpc"}, keep)
                    continue
                if "content-length" not in headers:
                    await _respond(writer, 411, {"error": "Content-Length is required"}, False)
                    return
                try:
                    n = int(headers["content-length"])
                except ValueError:
                    n = -1
                if n < 0:
                    await _respond(writer, 400, {"error": "Content-Length must be a non-negative integer, got "
                                                          f"{headers['content-length'][:40]!r}"}, False)
                    return
                if n > MAX_BODY:
                    await _respond(writer, 413, {"error": f"body of {n} bytes; the limit is {MAX_BODY}"}, False)
                    return
                body = await reader.readexactly(n)
                if path == "/frame":
                    try:
                        header, payload = wire.unpack_frame(body, wire.MESSAGE_HEADER_MAX)  # whole batch: no cap
                    except wire.WireError as exc:
                        await _respond(writer, 200, wire.pack_frame(messages.failure(None, PARSE_ERROR, str(exc))),
                                       keep)
                        continue
                    if not (stream_handler is not None and header.get("type") == "batch" and header.get("stream")
                            and await _stream(writer, stream_handler, header, payload, keep)):
                        await _respond(writer, 200, await _frame(frame_handler, header, payload), keep)
                else:
                    await _respond(writer, 200, await _rpc(handler, body), keep)
                if not keep:
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    return await asyncio.start_server(conn, host, port)


async def _read_chunk(reader: asyncio.StreamReader) -> bytes | None:
    """One chunk of a chunked HTTP/1.1 body (``size-hex CRLF data CRLF``); None after the last
    (zero-size) chunk and its trailer. Raises ``ValueError`` for a malformed chunk (the
    connection is then dropped) and ``asyncio.IncompleteReadError``."""
    size = int((await reader.readline()).split(b";")[0].strip() or b"x", 16)
    if size < 0 or size > MAX_BODY:
        raise ValueError(f"chunk of {size} bytes")
    if size == 0:
        while (await reader.readline()) not in (b"\r\n", b"\n", b""):  # trailer fields, then the blank line
            pass
        return None
    data = await reader.readexactly(size)
    if await reader.readexactly(2) != b"\r\n":
        raise ValueError("chunk not followed by CRLF")
    return data


class HttpHolderClient:
    """Router-side client of holders' HTTP endpoints: pooled keep-alive connections per host.

    ``timeout``: seconds one exchange (request written, answer read) may take; the
    connection is dropped when it runs out (a ``ConnectionError``).
    """

    def __init__(self, timeout: float = 60.0):
        self.timeout = timeout
        self._idle: dict[tuple[str, int], list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}
        self._coalescer: Coalescer = Coalescer()

    async def close(self) -> None:
        """Close pooled connections."""
        for conns in self._idle.values():
            for _, writer in conns:
                writer.close()
        self._idle.clear()

    async def execute_frame(self, endpoint: str, req: BatchRequest) -> BatchAnswer:
        """One request as a binary frame to ``POST /frame`` (``endpoint`` is the advertised
        ``…/rpc`` URL) over a pooled keep-alive connection. Raises ``AuthRefusal`` (code
        -32001), ``HolderFault`` (another error or a malformed answer) and ``ConnectionError``.

        Requests to the same endpoint in the same loop turn go as one ``batch`` frame in one
        POST (``coalesce.Coalescer``; each still gets its own answer or error).
        """
        return await self._coalescer.submit(endpoint, req, lambda r: self._one(endpoint, r),
                                            lambda reqs, deliver: self._many(endpoint, reqs, deliver), streaming=True)

    async def frame(self, endpoint: str, header: dict, payload: bytes = b"") -> tuple[dict, bytes]:
        """One binary frame (``header``, ``payload``) to ``POST /frame`` of ``endpoint`` (an
        advertised ``…/rpc`` URL); the answer frame. Raises ``ConnectionError`` and
        ``HolderFault`` (a malformed answer); an ``ok: false`` answer is returned as it came."""
        data = await self._exchange(endpoint, wire.pack_frame(header, payload, wire.MESSAGE_HEADER_MAX))
        try:
            return wire.unpack_frame(data or b"", wire.MESSAGE_HEADER_MAX)
        except wire.WireError as exc:
            raise HolderFault(f"{endpoint}: {exc}") from exc

    async def _one(self, endpoint: str, req: BatchRequest) -> BatchAnswer:
        body = wire.pack_frame(messages.request_header(req), req.payload, wire.MESSAGE_HEADER_MAX)
        data = await self._exchange(endpoint, body)
        try:
            answer, out = wire.unpack_frame(data, wire.MESSAGE_HEADER_MAX)
        except wire.WireError as exc:
            raise HolderFault(f"{endpoint}: {exc}") from exc
        return answer_to_batch(answer, out, req, "http", len(body), len(data))

    async def _many(self, endpoint: str, reqs: list[BatchRequest], deliver: Callable[[int, object], None]) -> list:
        """Outcomes of ``reqs`` sent as one streamed ``batch`` frame: each answer is handed to
        ``deliver(index, outcome)`` as its chunk arrives, and the list of every outcome is returned
        (``messages.batch_answers`` when the holder answers the batch whole, as holders without
        streaming do). A request the stream never answered is a ``HolderFault``."""
        header, payload = messages.batch_frame(reqs, uuid.uuid4().hex, seal=coalesce.message_receipts())
        body = wire.pack_frame({**header, "stream": coalesce.stream_answers()}, payload, wire.MESSAGE_HEADER_MAX)
        stream = messages.StreamedBatch(reqs, "http", len(body))
        try:
            return await self._streamed(endpoint, reqs, body, stream, deliver)
        finally:
            stream.close()  # a broken exchange: answers already delivered stop waiting for the seal

    async def _streamed(self, endpoint: str, reqs: list[BatchRequest], body: bytes, stream: messages.StreamedBatch,
                        deliver: Callable[[int, object], None]) -> list:
        """``_many``'s exchange of the packed ``body``."""

        def on_frame(data: bytes) -> None:
            try:
                answer, out = wire.unpack_frame(data, wire.MESSAGE_HEADER_MAX)
            except wire.WireError as exc:
                raise HolderFault(f"{endpoint}: {exc}") from exc
            deliver(*stream.part(answer, out, len(data) + len(b"%x" % len(data)) + 4))  # + chunk size line, CRLFs

        whole = await self._exchange(endpoint, body, on_frame)
        if whole is not None:  # answered as one batch reply
            try:
                answer, out = wire.unpack_frame(whole, wire.MESSAGE_HEADER_MAX)
            except wire.WireError as exc:
                raise HolderFault(f"{endpoint}: {exc}") from exc
            return messages.batch_answers(answer, out, reqs, "http", len(body), len(whole))
        return stream.finish()

    async def _exchange(self, endpoint: str, body: bytes,
                        on_frame: Callable[[bytes], None] | None = None) -> bytes | None:
        """POST ``body`` to the endpoint's ``/frame``; the answer body, or None for a chunked
        answer, whose chunks (one frame each) went to ``on_frame`` as they arrived. Raises
        ``ConnectionError``, and what ``on_frame`` raises.

        A lean HTTP/1.1 exchange on asyncio streams rather than httpx: with a hundred
        batches in flight, httpx's pool bookkeeping was most of the router's time.
        """
        parts = urlsplit(endpoint)
        if parts.scheme != "http" or not parts.hostname:
            raise ConnectionError(f"{endpoint}: only http:// endpoints are supported")
        host, port = parts.hostname, parts.port or 80
        idle = self._idle.setdefault((host, port), [])
        try:
            reader, writer = idle.pop() if idle else await asyncio.wait_for(
                asyncio.open_connection(host, port, limit=1 << 20), 5.0)
        except (OSError, asyncio.TimeoutError) as exc:
            raise ConnectionError(f"{endpoint}: cannot connect: {exc}") from exc
        ok = False
        try:
            async with asyncio.timeout(self.timeout):
                writer.write(f"POST /frame HTTP/1.1\r\nHost: {host}:{port}\r\n"
                             f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                             + body)
                await writer.drain()
                status = (await reader.readline()).split()
                headers = await read_headers(reader)
                if len(status) < 2 or status[1] != b"200":
                    raise ConnectionError(f"{endpoint}: HTTP {status[1:2]}")
                if headers.get("transfer-encoding", "").lower() == "chunked" and on_frame is not None:
                    data = None
                    while (chunk := await _read_chunk(reader)) is not None:
                        on_frame(chunk)
                else:
                    data = await reader.readexactly(int(headers.get("content-length", "0")))
            ok = headers.get("connection", "").lower() != "close"
        except TimeoutError as exc:
            raise ConnectionError(f"{endpoint}: no answer within {self.timeout:g} s") from exc
        except (OSError, ValueError, asyncio.IncompleteReadError) as exc:
            raise ConnectionError(f"{endpoint}: {exc}") from exc
        finally:
            if ok:
                idle.append((reader, writer))
            else:
                writer.close()
        return data
