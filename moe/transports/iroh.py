"""iroh QUIC transport of the data plane: a holder's ``tenzro/moe`` endpoint and the router's client.

Protocol (reference §11.1, docs/DESIGN.md §6): ALPN ``tenzro/moe``; one JSON-RPC 2.0 round trip per
bidirectional stream; frames ``u32 LE length ‖ UTF-8 JSON`` of at most ``MAX_FRAME_BYTES``
(4 MiB) in each direction, and each side finishes its send half. Methods ``moe/execute``
(the reference's ``ExpertExecuteRequest``: ``hidden_states`` base64 f32 or ``hidden_q8``
base64 Q8_0 blocks, or our ``hidden_f16`` base64 IEEE half rows (``wire.CARRIER_FIELDS``, the one
map of carriers to members), plus our ``request_id`` and ``output``; the result carries ``outputs`` in
the ``output`` encoding and the signed ``receipt``, as on ``POST /rpc``) and ``moe/status``.

A batch whose request or answer does not fit one frame is split by rows into ``count``
frames on the same stream, each a complete JSON-RPC message with the same ``id`` and a
``part: {index, count}`` member (in ``params`` or ``result``); a message that fits one frame
carries no ``part``, so reference peers see exactly one frame each way. The holder reads
every part, concatenates the rows and executes the reassembled batch once (frames are a
transport detail: the rows are bit-identical to one unsplit request), then splits its answer
the same way; the receipt rides in part 0.

Coalescing: a router's batches for one holder sent in the same event-loop turn share one
stream. Each request keeps its own JSON-RPC id and frames (parts as above) and carries
``stream_requests: n`` in its params; the holder reads the ``n`` requests, executes them
together (``execute_stream``, one hop to its compute pool) and writes each one's answer frames
(or its own error frame) under its id as soon as that request finishes, so the router checks the
first receipts while the holder computes the rest (answers are matched by id, not by order). A
stream without ``stream_requests`` is one request, as the reference sends; a stream carries at
most ``MAX_PARTS`` frames either way. Requests that also carry ``receipts: "message"`` get
unsigned message entries (``moe.receipts``) and, after the last answer, one frame
``{"id": 0, "result": {"seal": ...}}`` with the stream's single signature (a holder whose
``execute_stream`` takes no seal flag signs each receipt, which the router accepts as well).

Bad input never takes the holder down: a frame over the cap, a stream that ends inside a
frame, JSON that does not parse, parts that disagree, an unknown method: each is answered with
a JSON-RPC error frame (-32700, -32600, -32601, -32602) and the stream is finished; a
connection offering another ALPN fails its handshake.

Memory bounds of the holder's endpoint (issue 24 item 4): the bytes of requests still being
read are counted per peer (its endpoint id, over all its connections) and in total before each
frame body is read (``InflightBudget``; ``TENZRO_IROH_PEER_BYTES``, 512 MiB, and
``TENZRO_IROH_TOTAL_BYTES``, 1 GiB): a frame past either bound is answered with -32005 and the
stream stopped. A stream that sends no frame for ``TENZRO_IROH_PART_TIMEOUT`` seconds (30) while
a request is incomplete is answered with -32600 and stopped; a closed connection cancels its
streams. Either way the bytes are released at once.

Endpoints bind to one address (default ``127.0.0.1:0``) with relays and discovery disabled
(the ``minimal`` preset): routers dial the direct addresses holders advertise in their
signed heartbeats. A holder's secret key is derived from its provider seed
(``endpoint_secret``), so its endpoint id is stable across restarts and bound to the provider.

The ``iroh`` wheel is optional: ``available()`` says whether it imported, ``UNAVAILABLE`` why
not. Pure Python on asyncio; imports nothing from Django.
"""
from __future__ import annotations

import asyncio
import ctypes
import gc
import hashlib
import json
import logging
import os
import re
import secrets
import struct
from typing import AsyncIterator, Awaitable, Callable

from moe import wire
from moe.messages import AuthRefusal, BatchAnswer, BatchRequest, HolderFault, MessageSeal, Rejected, answer_to_batch
from moe.transports import coalesce
from moe.transports.coalesce import Coalescer
from moe.jsonrpc import (BUSY, INTERNAL_ERROR, INVALID_PARAMS, INVALID_REQUEST, METHOD_NOT_FOUND, PARSE_ERROR,
                              RpcError, error_response, result_response)

try:
    import iroh as _iroh
    from iroh import iroh_ffi as _ffi
    UNAVAILABLE = ""
except ImportError as _exc:  # the optional extra is missing: the transport degrades cleanly
    _iroh = _ffi = None
    UNAVAILABLE = f"the iroh package cannot be imported ({_exc}); install iroh==1.2.0"

log = logging.getLogger(__name__)

ALPN = b"tenzro/moe"
MAX_FRAME_BYTES = 4 * 1024 * 1024
MAX_PARTS = 64  # one batch: at most 256 MiB of frames each way
MAX_STREAM_REQUESTS = 256  # coalesced requests on one stream (its frames stay within MAX_PARTS)
MAX_STREAMS = 512  # concurrent requests per connection (a forward sends one batch per expert)
METHODS = ("moe/execute", "moe/status")
DOMAIN_ENDPOINT = b"tenzro/moe/iroh-endpoint/v1"

# execute(params, carrier kind, carrier bytes) -> (answer fields, output bytes); raises RpcError.
Execute = Callable[[dict, str, bytes], Awaitable[tuple[dict, bytes]]]
# execute_stream([(params, carrier kind, carrier bytes), ...]) -> async iterator of (index, outcome) in the
# order they finish, the outcome (answer fields, output bytes) or the RpcError it failed with (a
# coalesced stream, executed in one hop; each answer written as soon as it is ready). Called as
# execute_stream(items, True) for a stream asking for a message receipt: then it also yields
# (None, seal) after the last answer.
ExecuteStream = Callable[[list[tuple[dict, str, bytes]]], AsyncIterator[tuple[int, object]]]
# status() -> the moe/status result.
Status = Callable[[], Awaitable[dict]]


def available() -> bool:
    """Whether the ``iroh`` wheel imported (see ``UNAVAILABLE`` for why not)."""
    return _iroh is not None


def _fast_buffer_write(self, value) -> None:
    # uniffi 0.29's generated RustBufferBuilder.write copies byte by byte in Python: 4 MiB took
    # ~0.5 s (7 MB/s on loopback). One memmove into the reserved buffer does the same copy.
    value = bytes(value)
    with self._reserve(len(value)):
        ctypes.memmove(ctypes.cast(self.rbuf.data, ctypes.c_void_p).value + self.rbuf.len, value, len(value))


GENERATED_WRITE = None  # uniffi's own write, kept so bench/bench_transports.py can measure both
if _ffi is not None and hasattr(getattr(_ffi, "_UniffiRustBufferBuilder", None), "_reserve"):
    GENERATED_WRITE = _ffi._UniffiRustBufferBuilder.write
    _ffi._UniffiRustBufferBuilder.write = _fast_buffer_write


class FrameError(Exception):
    """A frame broke the framing rules: ``code`` is the JSON-RPC code to answer with."""

    def __init__(self, message: str, code: int = INVALID_REQUEST):
        super().__init__(message)
        self.code = code


def endpoint_secret(seed: bytes) -> bytes:
    """The 32-byte iroh secret key of a provider: SHA-256(``DOMAIN_ENDPOINT ‖ 0x00 ‖ seed``).

    ``seed``: the provider's 32-byte ed25519 seed. Deterministic, so the endpoint id is stable
    across restarts; domain-separated, so the provider's signing key is never used by TLS.
    """
    if len(seed) != 32:
        raise ValueError(f"an ed25519 seed has 32 bytes, got {len(seed)}")
    return hashlib.sha256(DOMAIN_ENDPOINT + b"\x00" + seed).digest()


def _require() -> None:
    if _iroh is None:
        raise RuntimeError(UNAVAILABLE)


async def bind_endpoint(secret: bytes | None, bind: str, alpns: list[bytes]):
    """Bind an iroh ``Endpoint`` on ``bind`` (``host:port``) with the minimal preset and relays
    disabled; ``secret`` None = a random key. Raises ``RuntimeError`` (wheel missing) or
    ``OSError`` (cannot bind, with iroh's message)."""
    _require()
    opts = _iroh.EndpointOptions(preset=_iroh.preset_minimal(), bind_addr=bind, alpns=alpns,
                                 relay_mode=_iroh.RelayMode.disabled(),
                                 **({"secret_key": secret} if secret is not None else {}))
    try:
        return await _iroh.Endpoint.bind(opts)
    except _iroh.IrohError as exc:
        raise OSError(f"cannot bind an iroh endpoint on {bind}: {_msg(exc)}") from exc


def _msg(exc: BaseException) -> str:
    """One line of an ``IrohError`` (its message's first line) or any exception."""
    if _iroh is not None and isinstance(exc, _iroh.IrohError):
        return (exc.message() or str(exc.kind())).splitlines()[0]
    return str(exc) or type(exc).__name__


def pack(message: dict) -> bytes:
    """One frame ``u32 LE length ‖ JSON``; raises ``FrameError`` when over ``MAX_FRAME_BYTES``."""
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(body)} bytes is over the {MAX_FRAME_BYTES}-byte cap")
    return struct.pack("<I", len(body)) + body


READ_AHEAD = 64 * 1024  # bytes asked for past the current frame (the next frames' start)


class FrameReader:
    """The frames of an iroh ``RecvStream``, read in few FFI calls.

    Each ``read`` is an FFI call with its event-loop hops (~30 µs of CPU when the bytes are
    already there) and a fresh zeroed buffer of the size asked: a read asks for the rest of
    the current frame plus ``READ_AHEAD``, so a stream of frames that has arrived takes about
    one call per frame instead of two (length, then body) or more.
    """

    def __init__(self, recv, on_length: Callable[[int], None] | None = None):
        self.recv = recv
        self.on_length = on_length  # called with each frame's length before its body is read; may raise
        self._data = b""  # bytes read and not yet returned start at self._pos
        self._pos = 0

    async def next(self) -> bytes | None:
        """The next frame's JSON bytes; None at a clean end of stream.

        Raises ``FrameError`` for a length over ``MAX_FRAME_BYTES`` (nothing more is read) or a
        stream that ends inside a frame (-32700), ``ConnectionError`` when the stream breaks.
        """
        try:
            if not await self._fill(4):
                if self._pos == len(self._data):
                    return None
                raise FrameError(f"truncated frame: the stream ended after {len(self._data) - self._pos} of 4 "
                                 "length bytes", PARSE_ERROR)
            (n,) = struct.unpack_from("<I", self._data, self._pos)
            if n > MAX_FRAME_BYTES:
                raise FrameError(f"frame of {n} bytes is over the {MAX_FRAME_BYTES}-byte cap")
            if self.on_length is not None:
                self.on_length(n)
            if not await self._fill(4 + n):
                raise FrameError(f"truncated frame: the stream ended after {len(self._data) - self._pos - 4} of "
                                 f"{n} announced bytes", PARSE_ERROR)
        except _iroh.IrohError as exc:
            raise ConnectionError(f"stream broke: {_msg(exc)}") from exc
        start = self._pos + 4
        self._pos = start + n
        return self._data[start:self._pos]  # the one copy of the body (two when it spanned reads)

    async def _fill(self, n: int) -> bool:
        """Read until ``n`` bytes are buffered (False when the stream ends first). Chunks are
        joined once, when enough have come (a frame arriving in many small reads stays linear)."""
        have = len(self._data) - self._pos
        if have >= n:
            return True
        parts = [memoryview(self._data)[self._pos:]] if have else []
        ended = False
        while have < n:
            # Past the length prefix, ask for the body's rest and the next frame's start.
            chunk = await self.recv.read(n - have + READ_AHEAD if n > 4 else READ_AHEAD)
            if not chunk:
                ended = True
                break
            parts.append(chunk)
            have += len(chunk)
        self._data = parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else b"".join(parts)
        self._pos = 0
        return not ended


WRITE_BYTES = 8 * 1024 * 1024  # frames joined into one write up to this size


async def write_frames(send, frames: list[bytes]) -> None:
    """Write ``frames`` on an iroh ``SendStream``, consecutive frames joined up to ``WRITE_BYTES``
    per write: each write is an FFI call with its own buffer conversion and event-loop hops,
    a join only a memcpy. Raises ``IrohError`` when the stream breaks."""
    batch: list[bytes] = []
    size = 0
    for f in frames:
        if batch and size + len(f) > WRITE_BYTES:
            await send.write_all(b"".join(batch))
            batch, size = [], 0
        batch.append(f)
        size += len(f)
    if batch:
        await send.write_all(batch[0] if len(batch) == 1 else b"".join(batch))


def _dumps(message: dict, blob: bytes, slot: str) -> list[bytes]:
    """The JSON of ``message`` whose string ``slot`` is replaced by the base64 of ``blob``, in
    pieces to join (the frame is assembled once, with its length prefix).

    The base64 text is spliced in as bytes: JSON-escaping megabytes that need no escaping
    was the largest cost of a frame (3 ms per MiB, more than the base64 itself).
    """
    head, _, tail = json.dumps(message, separators=(",", ":")).partition(json.dumps(slot))
    return [head.encode(), b'"', wire.b64encode_bytes(blob), b'"', tail.encode()]


# A member carrying rows as base64 text (a request's carrier, an answer's outputs).
_ROW_MEMBER = re.compile(rb'"(%s|outputs)"\s*:\s*"' % "|".join(wire.CARRIER_FIELDS.values()).encode())
_VIEW_MIN = 4096  # shorter members are left to json.loads
_SENTINEL = secrets.token_hex(16)  # stands in for the member while the rest is parsed
_SENTINEL_B = _SENTINEL.encode()


def loads_frame(body: bytes):
    """The JSON value of a frame's body, its base64 rows member as a view of ``body``.

    When the body's first ``_ROW_MEMBER`` (``params.hidden_*`` or ``result.outputs``) is a
    string of at least ``_VIEW_MIN`` characters, the rest of the frame is parsed with the
    string replaced by ``_SENTINEL`` and the member comes back as a ``memoryview`` of its
    ASCII text (``wire.b64decode`` takes it): ``json.loads`` would scan and copy megabytes
    that base64 never escapes. The view is used only when provably the member's value: the
    body is ASCII, the text has no backslash (so the next quote ends the string), the
    sentinel occurs nowhere else, and after parsing exactly that member holds it (a
    duplicate key, a nested look-alike or a match inside another string fails the test);
    otherwise, and for any parse error, this is ``json.loads(body)``, errors included.
    A member whose text is not base64 (a raw control character, say) is refused later by
    ``wire.b64decode`` (-32602) rather than by the parser (-32700).
    """
    if len(body) > _VIEW_MIN and (m := _ROW_MEMBER.search(body)) is not None:
        j = m.end()
        k = body.find(b'"', j)
        if k - j >= _VIEW_MIN and body.find(b"\\", j, k) < 0 and body.isascii():
            head, tail = body[:j], body[k:]
            if _SENTINEL_B not in head and _SENTINEL_B not in tail:
                try:
                    msg = json.loads(head + _SENTINEL_B + tail)
                except (ValueError, RecursionError):
                    msg = None  # the whole body's parse raises the error
                name = m.group(1).decode()
                if isinstance(msg, dict):
                    for outer in (msg.get("params"), msg.get("result")):
                        if isinstance(outer, dict) and outer.get(name) == _SENTINEL:
                            outer[name] = memoryview(body)[j:k]
                            return msg
    return json.loads(body)


def split_rows(n_rows: int, build: Callable[[int, int, dict | None, str], tuple[dict, bytes]]) -> list[bytes]:
    """Frames of one message over ``n_rows`` rows, as few as fit ``MAX_FRAME_BYTES`` each.

    ``build(lo, hi, part, slot)`` returns the JSON-RPC message of rows ``lo:hi`` with the
    string ``slot`` where their bytes go (base64), and those bytes (a slice or memoryview). ``part`` is None for a
    single frame, else ``{"index", "count"}``. Raises ``FrameError`` when one row alone does
    not fit a frame or more than ``MAX_PARTS`` frames would be needed.
    """
    slot = "\x00" + secrets.token_hex(16)  # unique: no other value of the message can equal it
    count = 1
    while True:
        per = -(-n_rows // count) if n_rows else 1
        count = -(-n_rows // per) if n_rows else 1
        if count > MAX_PARTS:
            raise FrameError(f"the message needs more than {MAX_PARTS} frames of {MAX_FRAME_BYTES} bytes")
        bodies = [_dumps(*build(lo, min(lo + per, n_rows), {"index": i, "count": count} if count > 1 else None, slot),
                         slot=slot)
                  for i, lo in enumerate(range(0, max(n_rows, 1), per))]
        sizes = [sum(map(len, b)) for b in bodies]
        big = max(sizes)
        if big <= MAX_FRAME_BYTES:
            return [b"".join((struct.pack("<I", n), *b)) for n, b in zip(sizes, bodies)]
        if per == 1:
            raise FrameError(f"one row takes a {big}-byte frame, over the {MAX_FRAME_BYTES}-byte cap")
        count = max(count + 1, -(-count * big // (MAX_FRAME_BYTES - 4096)))


# ---- holder side ----------------------------------------------------------------------------

def _carrier_of(params: dict, index: int) -> tuple[str, bytes]:
    """(carrier kind, bytes) of one execute part; raises ``RpcError`` (-32602) naming the field."""
    try:
        return wire.carrier_in_params(params)
    except wire.WireError as exc:
        raise RpcError(INVALID_PARAMS, f"part {index}: {exc}", field=exc.field or "hidden_states") from exc


_PART_KEYS = ("model_id", "layer", "expert", "d_model", "request_id", "output", "purpose", "stream_requests")


def assemble(requests: list[dict]) -> tuple[dict, str, bytes]:
    """One execute batch from its request parts (JSON-RPC messages in stream order).

    Returns (params with every part's ``token_indices`` concatenated, carrier kind, carrier
    bytes concatenated). Raises ``RpcError`` (-32600/-32602) when parts are missing, out of
    order, or disagree on the batch (model, layer, expert, d_model, request id, encodings).
    """
    first = requests[0]["params"]
    part = first.get("part")
    count = 1 if part is None else part.get("count") if isinstance(part, dict) else None
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_PARTS:
        raise RpcError(INVALID_REQUEST, f"part.count must be an integer in [1, {MAX_PARTS}]", field="part")
    if len(requests) != count:
        raise RpcError(INVALID_REQUEST, f"the stream carried {len(requests)} frame(s) for a {count}-part batch",
                       field="part")
    tokens: list = []
    chunks: list[bytes] = []
    kind = None
    for i, msg in enumerate(requests):
        p = msg["params"]
        if msg.get("method") != "moe/execute" or msg.get("id") != requests[0].get("id"):
            raise RpcError(INVALID_REQUEST, f"part {i}: every part must be moe/execute with the same id", field="id")
        if count > 1 and p.get("part") != {"index": i, "count": count}:
            raise RpcError(INVALID_REQUEST, f"part {i}: expected part {{index: {i}, count: {count}}}", field="part")
        if any(p.get(k) != first.get(k) for k in _PART_KEYS):
            raise RpcError(INVALID_PARAMS, f"part {i} disagrees with part 0 on the batch's key", field="params")
        if not isinstance(p.get("token_indices"), list):
            raise RpcError(INVALID_PARAMS, f"part {i}: token_indices must be a list", field="token_indices")
        k, data = _carrier_of(p, i)
        if kind is not None and k != kind:
            raise RpcError(INVALID_PARAMS, f"part {i} uses another carrier than part 0", field="hidden_states")
        kind = k
        tokens += p["token_indices"]
        chunks.append(data)
    params = {k: v for k, v in first.items()
              if k not in ("part", "stream_requests") and k not in wire.CARRIER_FIELDS.values()}
    params["token_indices"] = tokens
    return params, kind, b"".join(chunks)


def answer_frames(rid, params: dict, answer: dict, out: bytes) -> list[bytes]:
    """The result frames of an executed batch (split by rows when over the cap; receipt in part 0)."""
    d_model, output, tokens = answer["d_model"], answer["output"], answer["token_indices"]
    row = wire.encoded_nbytes(output, 1, d_model)

    def build(lo: int, hi: int, part: dict | None, slot: str) -> tuple[dict, bytes]:
        result = {"model_id": params.get("model_id"), "layer": params.get("layer"), "expert": params.get("expert"),
                  "token_indices": tokens[lo:hi], "d_model": d_model, "output": output, "outputs": slot}
        if part is None or part["index"] == 0:
            result["receipt"] = answer["receipt"]
        if part is not None:
            result["part"] = part
        return result_response(rid, result), memoryview(out)[lo * row:hi * row]

    return split_rows(len(tokens), build)


def _env_number(name: str, default: float) -> float:
    """A positive number from the environment (``default`` when unset); raises ``ValueError``
    naming the variable."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name} must be a number above 0, got {raw!r}")
    return value


TRIM_BYTES = 32 << 20  # abandoned request bytes after which freed heap pages go back to the system
CLOSE_TRIM_S = 3.0  # seconds after a connection closes that its freed buffers are trimmed


def _trim_heap() -> None:
    """``malloc_trim(0)`` where glibc has it: frames of 4 MiB are served from the heap once
    glibc's mmap threshold has grown, and freed heap pages stay in the process until trimmed,
    so an abandoned request's memory would not leave the holder's RSS."""
    gc.collect()  # an abandoned stream's frames can sit in reference cycles (its traceback)
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class InflightBudget:
    """Bytes of requests still being read, per peer and in total, each with its bound.

    ``take`` raises ``FrameError`` (-32005) instead of going past either bound; the caller
    gives back what it took when its request is read whole or abandoned."""

    def __init__(self, peer_bytes: int, total_bytes: int):
        self.peer_bytes, self.total_bytes = int(peer_bytes), int(total_bytes)
        self.by_peer: dict[str, int] = {}
        self.total = 0
        self.released = 0  # bytes of abandoned requests given back since the heap was last trimmed

    def take(self, peer: str, n: int) -> None:
        """Count ``n`` more bytes for ``peer``, or raise ``FrameError`` (nothing counted)."""
        held = self.by_peer.get(peer, 0)
        if held + n > self.peer_bytes:
            raise FrameError(f"this peer has {held} bytes of unfinished requests in flight; the holder takes at "
                             f"most {self.peer_bytes} per peer (finish or close streams first)", BUSY)
        if self.total + n > self.total_bytes:
            raise FrameError(f"the holder has {self.total} bytes of unfinished requests in flight (at most "
                             f"{self.total_bytes}); retry shortly", BUSY)
        self.by_peer[peer] = held + n
        self.total += n

    def give(self, peer: str, n: int, abandoned: bool = False) -> None:
        """Release ``n`` bytes ``peer`` took; ``abandoned``: their request was never read whole
        (refused, timed out, cut off), so its memory is garbage now."""
        if n <= 0:
            return
        left = self.by_peer.get(peer, 0) - n
        if left > 0:
            self.by_peer[peer] = left
        else:
            self.by_peer.pop(peer, None)
        self.total = max(0, self.total - n)
        if abandoned:
            self.released += n

    def trim(self) -> None:
        """Collect and return freed heap pages to the system once ``TRIM_BYTES`` of abandoned
        requests were given back (call it once the streams that held them are gone)."""
        if self.released >= TRIM_BYTES:
            self.released = 0
            _trim_heap()


class IrohServer:
    """A holder's iroh endpoint serving ``moe/execute`` and ``moe/status`` under ``ALPN``.

    ``secret``: 32-byte secret key (``endpoint_secret``); ``bind``: ``host:port``;
    ``execute``/``status``: the holder's handlers (errors as ``RpcError``); ``execute_stream``:
    the handler of a coalesced stream's requests (default: ``execute`` on each in turn). Start with
    ``await start()``, stop with ``await close()``. ``endpoint_id`` (64 hex) and ``addrs``
    (direct ``ip:port`` addresses) are what the holder advertises. ``peer_bytes``,
    ``total_bytes``, ``part_timeout_s``: the memory bounds of the module doc (default: the
    ``TENZRO_IROH_*`` variables, else 512 MiB, 1 GiB, 30 s). ``methods``: further one-frame
    methods, ``{name: handler(params, peer endpoint id) -> result}`` (errors as ``RpcError``),
    e.g. the agent's ``moe/kv_put`` (``moe.handoff``).
    """

    def __init__(self, secret: bytes, bind: str, execute: Execute, status: Status,
                 execute_stream: ExecuteStream | None = None, peer_bytes: int | None = None,
                 total_bytes: int | None = None, part_timeout_s: float | None = None,
                 methods: dict[str, Callable[[dict, str], Awaitable[dict]]] | None = None):
        self.secret, self.bind = secret, bind
        self.execute, self.status = execute, status
        self.methods = dict(methods or {})
        self.execute_stream = execute_stream
        self.endpoint = None
        self.endpoint_id = ""
        self.addrs: list[str] = []
        self._tasks: set[asyncio.Task] = set()
        self.budget = InflightBudget(peer_bytes or _env_number("TENZRO_IROH_PEER_BYTES", 512 << 20),
                                     total_bytes or _env_number("TENZRO_IROH_TOTAL_BYTES", 1 << 30))
        self.part_timeout_s = part_timeout_s or _env_number("TENZRO_IROH_PART_TIMEOUT", 30.0)

    async def start(self) -> "IrohServer":
        """Bind and start accepting. Raises ``RuntimeError`` (no wheel) or ``OSError`` (bind)."""
        self.endpoint = await bind_endpoint(self.secret, self.bind, [ALPN])
        self.endpoint_id = str(self.endpoint.id())
        addr = self.endpoint.addr()
        self.addrs = list(addr.direct_addresses()) or [
            a for a in self.endpoint.bound_sockets() if not a.startswith(("0.0.0.0:", "[::]:"))]
        self._spawn(self._accept())
        return self

    async def close(self) -> None:
        """Close the endpoint and cancel the streams in flight."""
        for t in list(self._tasks):
            t.cancel()
        if self.endpoint is not None:
            await self.endpoint.close()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _accept(self) -> None:
        while True:
            try:
                incoming = await self.endpoint.accept_next()
            except _iroh.IrohError as exc:  # keep serving unless the endpoint itself is gone
                if self.endpoint.is_closed():
                    return
                log.warning("iroh accept failed: %s", _msg(exc))
                await asyncio.sleep(0.1)
                continue
            if incoming is None:  # endpoint closed
                return
            self._spawn(self._connection(incoming))

    async def _connection(self, incoming) -> None:
        try:
            conn = await (await incoming.accept()).connect()
        except _iroh.IrohError as exc:  # handshake failed: wrong ALPN, not QUIC, gone
            log.info("iroh handshake refused: %s", _msg(exc))
            return
        if conn.alpn() != ALPN:  # the endpoint offers only ALPN; never serve another protocol
            conn.close(1, b"unsupported ALPN")
            return
        conn.set_max_concurrent_bi_streams(MAX_STREAMS)
        peer = str(conn.remote_id())
        streams: set[asyncio.Task] = set()
        try:
            while True:
                try:
                    bi = await conn.accept_bi()
                except _iroh.IrohError:  # the peer closed the connection
                    return
                task = self._spawn(self._stream(bi, peer))
                streams.add(task)
                task.add_done_callback(streams.discard)
        finally:
            for task in list(streams):  # nobody can read their answers: free what they hold now
                task.cancel()
            # The connection's buffered stream data is dropped once it has drained (a moment
            # after the close): return those pages to the system then.
            asyncio.get_running_loop().call_later(CLOSE_TRIM_S, self.budget.trim)

    async def _stream(self, bi, peer: str = "") -> None:
        try:
            await self._serve_stream(bi, peer)
        finally:  # on the next loop turn, when this task and its frames are gone
            asyncio.get_running_loop().call_soon(self.budget.trim)

    async def _serve_stream(self, bi, peer: str) -> None:
        recv, send = bi.recv(), bi.send()
        try:
            answer = await self._answer(recv, peer)
        except ConnectionError as exc:
            log.info("iroh stream dropped: %s", exc)
            return
        try:
            if isinstance(answer, list):
                await write_frames(send, answer)
            else:  # a coalesced stream: each request's frames as it finishes
                async for frames in answer:
                    await write_frames(send, frames)
            await send.finish()
        except _iroh.IrohError as exc:
            log.info("iroh answer not delivered: %s", _msg(exc))

    async def _answer(self, recv, peer: str = ""):
        """Read one request (all its parts), or the ``stream_requests`` requests of a coalesced
        stream; return the answer frames (a list), or for a coalesced stream an async iterator
        of each request's frames as it finishes; errors as an envelope. The bytes read count
        against ``peer``'s in-flight budget until the reading ends."""
        rid = None
        held, complete = 0, False

        def take(n: int) -> None:
            nonlocal held
            self.budget.take(peer, n)
            held += n

        try:
            groups: list[list[dict]] = []
            requests: list[dict] = []
            want_requests, frames = 1, 0
            reader = FrameReader(recv, take)
            try:
                while True:
                    try:
                        body = await asyncio.wait_for(reader.next(), self.part_timeout_s)
                    except asyncio.TimeoutError:
                        raise FrameError(f"incomplete request: no frame for {self.part_timeout_s:g} s after "
                                         f"{frames} frame(s)") from None
                    if body is None:
                        break
                    frames += 1
                    if frames > MAX_PARTS:
                        raise FrameError(f"the stream carries more than {MAX_PARTS} frames")
                    try:
                        msg = loads_frame(body)
                    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
                        raise FrameError(f"parse error: {str(exc)[:200]}", PARSE_ERROR) from exc
                    if not isinstance(msg, dict) or not isinstance(msg.get("method"), str):
                        raise FrameError("expected a JSON-RPC 2.0 request object with a method")
                    rid = msg.get("id") if rid is None else rid
                    if not isinstance(msg.get("params", {}), dict):
                        raise RpcError(INVALID_PARAMS, "params must be an object", field="params")
                    msg.setdefault("params", {})
                    requests.append(msg)
                    part = msg["params"].get("part")
                    want = part.get("count") if isinstance(part, dict) else 1
                    if len(requests) >= (want if isinstance(want, int) and 1 <= want <= MAX_PARTS else 1):
                        groups.append(requests)  # all parts of one request read
                        requests = []
                        if len(groups) == 1:
                            want_requests = _stream_requests(groups[0][0]["params"])
                        if len(groups) >= want_requests:
                            break  # every request read; anything after them is ignored
                complete = not requests
            finally:
                self.budget.give(peer, held, abandoned=not complete)  # read whole or abandoned: no longer in flight
                held = 0
            if requests:
                groups.append(requests)  # an unfinished request: assemble() names what is missing
            if not groups:
                raise FrameError("the stream carried no frame")
            method = groups[0][0]["method"]
            if method == "moe/status":
                return [pack(result_response(rid, await self.status()))]
            if method in self.methods:
                return [pack(result_response(rid, await self.methods[method](groups[0][0]["params"], peer)))]
            if method != "moe/execute":
                raise RpcError(METHOD_NOT_FOUND, f"unknown method {method!r}; this endpoint serves "
                               f"{', '.join(METHODS)}", field="method")
            if want_requests == 1:
                params, carrier, payload = assemble(groups[0])
                answer, out = await self.execute(params, carrier, payload)
                return answer_frames(rid, params, answer, out)
            return self._answer_many(groups, want_requests)
        except FrameError as exc:
            await _stop(recv)  # the rest of an oversized or broken request is not read
            return [pack(error_response(rid, RpcError(exc.code, str(exc), field="frame")))]
        except RpcError as exc:
            await _stop(recv)
            return [pack(error_response(rid, exc))]
        except ConnectionError:
            raise  # the peer went away: nobody to answer (``_stream`` logs one line, no traceback)
        except Exception as exc:  # a bug must not take the endpoint down: answer -32603, keep serving
            log.exception("iroh request failed")
            return [pack(error_response(rid, RpcError(INTERNAL_ERROR, f"internal error: {type(exc).__name__}")))]

    def _answer_many(self, groups: list[list[dict]], want: int) -> AsyncIterator[list[bytes]]:
        """The answers of a coalesced stream: an async iterator of each request's frames under its
        own id (its result frames, or its own error frame), refused requests first, then the rest
        as ``execute_stream`` finishes them. Raises ``RpcError`` (before anything is written) when
        the stream is not ``want`` requests with distinct ids."""
        ids = [g[0].get("id") for g in groups]
        if len(groups) != want or len({json.dumps(i) for i in ids}) != want:
            raise RpcError(INVALID_REQUEST, f"a stream of {want} requests carried {len(groups)} with "
                           f"{len({json.dumps(i) for i in ids})} distinct ids", field="stream_requests")
        assembled: list = []
        for g in groups:
            try:
                if g[0].get("method") != "moe/execute":
                    raise RpcError(INVALID_REQUEST, "every request of a coalesced stream must be moe/execute",
                                   field="method")
                assembled.append(assemble(g))
            except RpcError as exc:
                assembled.append(exc)
        return self._answers(ids, assembled)

    async def _answers(self, ids: list, assembled: list) -> AsyncIterator[list[bytes]]:
        for rid, a in zip(ids, assembled):
            if isinstance(a, RpcError):
                yield [pack(error_response(rid, a))]
        runnable = [(rid, a) for rid, a in zip(ids, assembled) if not isinstance(a, RpcError)]
        if self.execute_stream is not None and runnable and runnable[0][1][0].get("receipts") == "message":
            outcomes = self.execute_stream([a for _, a in runnable], True)
        elif self.execute_stream is not None:
            outcomes = self.execute_stream([a for _, a in runnable])
        else:
            async def one_by_one():
                for j, (_, item) in enumerate(runnable):
                    try:
                        yield j, await self.execute(*item)
                    except RpcError as exc:
                        yield j, exc
            outcomes = one_by_one()
        async for j, outcome in outcomes:
            if j is None:  # the message receipt's seal, after every answer
                yield [pack(result_response(0, {"seal": outcome}))]
                continue
            rid, a = runnable[j]
            if isinstance(outcome, RpcError):
                yield [pack(error_response(rid, outcome))]
                continue
            try:
                yield answer_frames(rid, a[0], *outcome)
            except FrameError as exc:
                yield [pack(error_response(rid, RpcError(exc.code, str(exc), field="frame")))]


def _stream_requests(params: dict) -> int:
    """The ``stream_requests`` of a stream's first request (requests coalesced on the stream, 1
    when absent); raises ``RpcError`` (-32600) outside [1, ``MAX_STREAM_REQUESTS``]."""
    n = params.get("stream_requests", 1)
    if type(n) is not int or not 1 <= n <= MAX_STREAM_REQUESTS:
        raise RpcError(INVALID_REQUEST, f"stream_requests must be an integer in [1, {MAX_STREAM_REQUESTS}]",
                       field="stream_requests")
    return n


async def _stop(recv) -> None:
    try:
        await recv.stop(0)
    except _iroh.IrohError:
        pass


# ---- router side ----------------------------------------------------------------------------

def execute_params(req: BatchRequest) -> dict:
    """The ``moe/execute`` params of a router's batch without its carrier member
    (``wire.CARRIER_FIELDS``) and ``token_indices`` (both added per frame)."""
    return {"request_id": req.request_id, "model_id": req.model_id, "layer": req.layer, "expert": req.expert,
            "d_model": req.d_model, "output": req.output}


def request_frames(req: BatchRequest, rid: int = 1, stream_requests: int = 1, seal: bool = False) -> list[bytes]:
    """The request frames of ``req`` (split by rows when over the cap) under JSON-RPC id ``rid``;
    ``stream_requests`` > 1 marks it one of that many requests coalesced on a stream (``seal``:
    asking for one message receipt). Raises ``FrameError``."""
    base = execute_params(req)
    if stream_requests > 1:
        base["stream_requests"] = stream_requests
        if seal:
            base["receipts"] = "message"
    row = wire.encoded_nbytes(req.carrier, 1, req.d_model)
    field = wire.CARRIER_FIELDS[req.carrier]

    def build(lo: int, hi: int, part: dict | None, slot: str) -> tuple[dict, bytes]:
        params = {**base, "token_indices": req.tokens[lo:hi], field: slot}
        if part is not None:
            params["part"] = part
        message = {"jsonrpc": "2.0", "id": rid, "method": "moe/execute", "params": params}
        return message, memoryview(req.payload)[lo * row:hi * row]

    return split_rows(len(req.tokens), build)


class IrohHolderClient:
    """Router-side client of holders' iroh endpoints: one QUIC connection per holder (endpoint
    id and addresses), reused; one bi-stream per call. A call that fails or is cancelled (a
    deadline) retires its connection, so a restarted or stalled holder gets a fresh one.

    ``timeout``: seconds one exchange may take; ``bind``: the client endpoint's address
    (``host:port``). Connection trouble is a ``ConnectionError`` (the caller falls back to
    the socket and HTTP); a JSON-RPC error answer a ``HolderFault`` or ``AuthRefusal``.
    """

    def __init__(self, timeout: float = 60.0, bind: str = "127.0.0.1:0"):
        self.timeout, self.bind = timeout, bind
        self._endpoint: asyncio.Future | None = None
        self._conns: dict[tuple, asyncio.Future] = {}
        self._coalescer: Coalescer = Coalescer()

    async def close(self) -> None:
        """Close the connections and the client endpoint."""
        self._conns.clear()
        ep, self._endpoint = self._endpoint, None
        if ep is not None and ep.done() and ep.exception() is None:
            await ep.result().close()

    async def _connect(self, endpoint_id: str, addrs: list[str]):
        # One endpoint for every connection: concurrent first calls share its bind (a second
        # endpoint would replace the first, and dropping an endpoint kills its connections).
        if self._endpoint is None or (self._endpoint.done() and self._endpoint.exception() is not None):
            self._endpoint = asyncio.ensure_future(bind_endpoint(None, self.bind, []))
        endpoint = await asyncio.shield(self._endpoint)
        try:
            eid = _iroh.EndpointId.from_string(endpoint_id)
        except _iroh.IrohError as exc:
            raise ConnectionError(f"iroh endpoint id {endpoint_id[:16]}… is malformed: {_msg(exc)}") from exc
        try:
            return await asyncio.wait_for(endpoint.connect(_iroh.EndpointAddr(eid, None, list(addrs)), ALPN),
                                          min(self.timeout, 10.0))
        except (_iroh.IrohError, asyncio.TimeoutError) as exc:
            raise ConnectionError(f"cannot connect to iroh endpoint {endpoint_id[:12]}… at {addrs}: "
                                  f"{_msg(exc)}") from exc

    async def _connection(self, key: tuple):
        fut = self._conns.get(key)
        if fut is not None and fut.done() and (fut.exception() is not None or fut.result().close_reason() is not None):
            fut = None
        if fut is None:
            fut = self._conns[key] = asyncio.ensure_future(self._connect(key[0], list(key[1])))
        try:
            return await asyncio.shield(fut)
        except ConnectionError:
            if self._conns.get(key) is fut:
                del self._conns[key]
            raise

    async def call(self, endpoint_id: str, addrs: list[str], frames: list[bytes],
                   on_message: Callable[[object, int], None] | None = None) -> tuple[list[dict], int]:
        """Write ``frames`` on a new bi-stream, finish, and read every answer frame to the end;
        ``on_message(message, frame bytes)`` is called with each as it arrives.

        Returns (answer messages, answer bytes). Raises ``ConnectionError`` (connect, stream
        or timeout), ``HolderFault`` (an answer frame that is not JSON or breaks the cap) and
        what ``on_message`` raises.
        """
        _require()
        key = (endpoint_id, tuple(addrs))
        conn = await self._connection(key)
        out: list[dict] = []
        nbytes = 0
        try:
            async with asyncio.timeout(self.timeout):
                bi = await conn.open_bi()
                send, recv = bi.send(), bi.recv()
                await write_frames(send, frames)
                await send.finish()
                reader = FrameReader(recv)
                while (body := await reader.next()) is not None:
                    nbytes += 4 + len(body)
                    out.append(loads_frame(body))
                    if on_message is not None:
                        on_message(out[-1], 4 + len(body))
        except asyncio.CancelledError:  # the caller's deadline: other streams on it may still finish
            self._retire(key, conn, close=False)
            raise
        except TimeoutError as exc:
            self._retire(key, conn)
            raise ConnectionError(f"iroh {endpoint_id[:12]}…: no answer within {self.timeout:g} s") from exc
        except (ConnectionError, _iroh.IrohError) as exc:
            self._retire(key, conn)
            raise ConnectionError(f"iroh {endpoint_id[:12]}…: {_msg(exc)}") from exc
        except (FrameError, ValueError, RecursionError) as exc:
            raise HolderFault(f"iroh {endpoint_id[:12]}…: bad answer frame: {str(exc)[:200]}") from exc
        if not out or not all(isinstance(m, dict) for m in out):
            raise HolderFault(f"iroh {endpoint_id[:12]}…: no JSON-RPC answer")
        return out, nbytes

    def _retire(self, key: tuple, conn, close: bool = True) -> None:
        """New calls to ``key`` get a new connection; ``close``: also close ``conn`` now."""
        fut = self._conns.get(key)
        if fut is not None and fut.done() and not fut.cancelled() and fut.exception() is None and fut.result() is conn:
            del self._conns[key]
        if close:
            try:
                conn.close(0, b"retired after a failed call")
            except _iroh.IrohError:
                pass

    async def status(self, endpoint_id: str, addrs: list[str]) -> dict:
        """``moe/status`` of a holder. Raises ``ConnectionError`` or ``HolderFault`` (error answer)."""
        answers, _ = await self.call(endpoint_id, addrs, [pack({"jsonrpc": "2.0", "id": 1, "method": "moe/status"})])
        if "result" not in answers[0]:
            raise HolderFault(f"moe/status failed: {answers[0].get('error')}")
        return answers[0]["result"]

    async def execute(self, endpoint_id: str, addrs: list[str], req: BatchRequest) -> BatchAnswer:
        """One batch as ``moe/execute`` (split into frames when over the cap), answer reassembled.
        Batches for the same endpoint in the same loop turn share one stream (``stream_requests``
        on each, answered each under its own id; ``coalesce.Coalescer``).

        Raises ``ConnectionError``, ``AuthRefusal`` (-32001), ``HolderFault`` (another error,
        parts missing or out of order, wrong rows) and ``ValueError`` (a batch too large for
        ``MAX_PARTS`` frames, before anything is sent).
        """
        key = (endpoint_id, tuple(addrs))
        return await self._coalescer.submit(key, req, lambda r: self._one(endpoint_id, addrs, r),
                                            lambda reqs, deliver: self._many(endpoint_id, addrs, reqs, deliver),
                                            streaming=True)

    async def _one(self, endpoint_id: str, addrs: list[str], req: BatchRequest) -> BatchAnswer:
        try:
            frames = request_frames(req)
        except FrameError as exc:
            raise ValueError(str(exc)) from exc
        answers, back = await self.call(endpoint_id, addrs, frames)
        return _decode(answers, req, sum(len(f) for f in frames), back)

    async def _many(self, endpoint_id: str, addrs: list[str], reqs: list[BatchRequest], deliver) -> list:
        """Outcomes of ``reqs`` on one stream, in order: each its ``BatchAnswer`` or its exception,
        each also handed to ``deliver(index, outcome)`` as soon as all its frames are in (the
        holder answers each request as it finishes). Requests whose frames would take the stream
        past ``MAX_PARTS`` go alone."""
        n = len(reqs)
        sealed = coalesce.message_receipts()
        frames: list[list[bytes]] = []
        for i, r in enumerate(reqs):
            try:
                frames.append(request_frames(r, i + 1, n, sealed))
            except FrameError:
                frames.append([])
        if any(not f for f in frames) or sum(map(len, frames)) > MAX_PARTS:
            return list(await asyncio.gather(*(self._one(endpoint_id, addrs, r) for r in reqs),
                                             return_exceptions=True))
        got: dict[int, list[dict]] = {}
        back: dict[int, int] = {}
        out: list = [None] * n
        seal = MessageSeal()

        def on_message(a, size: int) -> None:
            i = a.get("id") if isinstance(a, dict) else None
            if i == 0 and type(i) is int and isinstance(a.get("result"), dict) and "seal" in a["result"]:
                seal.arrive(a["result"]["seal"])
                return
            if type(i) is not int or not 1 <= i <= n or out[i - 1] is not None:
                return  # not one of ours (or a whole-stream error): judged when the stream ends
            mine = got.setdefault(i, [])
            mine.append(a)
            back[i] = back.get(i, 0) + size
            r = a.get("result")
            part = r.get("part") if isinstance(r, dict) else None
            count = part.get("count") if isinstance(part, dict) and type(part.get("count")) is int else 1
            if "result" in a and len(mine) < count:
                return  # more parts of this answer to come
            try:
                out[i - 1] = _decode(mine, reqs[i - 1], sum(map(len, frames[i - 1])), back[i], seal)
            except (HolderFault, AuthRefusal, Rejected) as exc:
                out[i - 1] = exc
            deliver(i - 1, out[i - 1])

        try:
            answers, _ = await self.call(endpoint_id, addrs, [f for fs in frames for f in fs], on_message)
        finally:
            seal.close("the iroh stream ended without a message seal")  # delivered answers stop waiting
        for i in range(n):
            if out[i] is None:
                err = answers[0].get("error") if len(answers) == 1 else None  # the stream as a whole refused
                out[i] = HolderFault(f"iroh {endpoint_id[:12]}…: no answer to request {i + 1} of the stream"
                                     + (f" ({err.get('message')})" if isinstance(err, dict) else ""))
        return out


def _decode(answers: list[dict], req: BatchRequest, bytes_out: int, bytes_back: int,
            seal: MessageSeal | None = None) -> BatchAnswer:
    """``req``'s ``BatchAnswer`` from its answer messages (parts in order, receipt in part 0;
    ``seal``: its stream's message seal when the stream asked for one).
    Raises ``AuthRefusal`` (-32001), ``Rejected`` (-32602/-32600) or ``HolderFault`` (another
    error, parts missing or out of order, wrong rows)."""
    first = answers[0]
    if "result" not in first:
        err = first.get("error") if isinstance(first.get("error"), dict) else {}
        return answer_to_batch({"ok": False, "code": err.get("code"), "message": err.get("message")}, b"", req,
                               "iroh", 0, 0)
    results = [a.get("result") for a in answers]
    count = len(results)
    tokens: list = []
    chunks: list[bytes] = []
    for i, r in enumerate(results):
        if not isinstance(r, dict) or (count > 1 and r.get("part") != {"index": i, "count": count}):
            raise HolderFault(f"iroh answer part {i} of {count} is missing or out of order")
        if r.get("output") != results[0].get("output"):
            raise HolderFault(f"iroh answer part {i} uses another output encoding")
        tokens += r.get("token_indices") or []
        try:
            chunks.append(wire.b64decode(r.get("outputs"), "outputs"))
        except wire.WireError as exc:
            raise HolderFault(str(exc)) from exc
    answer = {"ok": True, "token_indices": tokens, "output": results[0].get("output", "f32"),
              "receipt": results[0].get("receipt")}
    return answer_to_batch(answer, b"".join(chunks), req, "iroh", bytes_out, bytes_back, seal)
