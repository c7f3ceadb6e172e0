"""The messages of the agent socket and the holder HTTP frames (docs/DESIGN.md §6), in one place.

``moe.wire`` packs and unpacks a frame (``u32 LE len ‖ JSON header ‖ payload``); this
module says what goes in the headers and in the socket's JSON text messages:

- socket control (JSON text): ``challenge`` (site → agent, a nonce), ``hello`` (agent, its
  signature over the nonce), ``welcome`` (site: frame cap, heartbeat interval),
  ``heartbeat`` (agent: signed body), ``heartbeat_ack`` and ``error`` (site);
- binary frames from the site or a router: ``execute`` (one batch; payload = carrier
  rows), ``load`` (hold an expert from a blob URI), ``rpc`` (a relayed execution method;
  payload = JSON params);
- the holder's reply to each: ``{id, ok: true, ...}`` (an execute answer adds ``rows``,
  ``d_model``, ``output``, ``token_indices``, ``receipt``; payload = output rows) or
  ``{id, ok: false, code, message}``;
- ``batch`` (coalesced executes, socket and HTTP ``/frame``): header ``{type: "batch", id,
  requests: [execute header + nbytes, ...]}``, payload = the requests' carrier bytes
  concatenated in order (``batch_frame``); the reply ``{id, ok: true, answers: [reply or
  failure header + nbytes, ...]}``, payload = the answers' output bytes concatenated
  (``batch_reply``), one answer per request in order, each with its own receipt or error
  (failure codes are JSON-RPC codes on every transport; a malformed batch as a whole gets one
  ``ok: false`` reply); agents still take single ``execute`` frames;
- a ``batch`` with ``receipts: "message"`` (``batch_frame(seal=True)``) asks for one
  signature for the whole message (``moe.receipts`` message receipts): each answer's
  ``receipt`` is then an unsigned entry (``index`` = its request's position) and the reply
  header (whole) or the last streamed message (``more: false``) carries ``seal``; a holder
  that ignores the field signs each receipt as before, which the router also accepts;
- a ``batch`` with ``stream: true`` is answered request by request as each finishes: one
  ``{id, ok: true, answers: [one answer + nbytes], more}`` message each (``batch_part``,
  payload = that answer's output bytes, ``id`` the batch's), ``more: false`` on the last; the
  router verifies the first receipts while the holder still computes the rest (HTTP carries the
  messages as the chunks of one chunked body). A holder that ignores ``stream`` answers whole;
- either direction, a message above the socket's cap as part frames ``{id, part, parts}``
  (``wire.split_frames``), acted on only once reassembled.

Heartbeat holdings go in the compact range form (``compact_holdings``), so any holding
count fits the cap.

Also the router-side request/answer records (``BatchRequest``, ``BatchAnswer``), the two
holder outcomes a router distinguishes (``HolderFault``, ``AuthRefusal``),
``answer_to_batch`` decoding a reply frame and ``MessageSeal`` (a coalesced message's one
receipt signature, shared by its answers). Pure Python + numpy (+ ``moe.receipts``, which the
agent loads anyway); imports nothing from Django and nothing of the planner, so the agent
process stays small.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Awaitable, Callable

import numpy as np

from moe import wire
from moe.receipts import ReceiptError, verify_seal
from moe.ranges import format_ranges
from moe.jsonrpc import AUTH_REFUSED, INVALID_PARAMS, INVALID_REQUEST


class HolderFault(Exception):
    """A holder answered wrongly or not at all (counts against its reputation)."""


class AuthRefusal(Exception):
    """A holder refused our credentials: try the next holder, but do not penalize this one."""


class Rejected(Exception):
    """A holder refused the request as malformed (JSON-RPC -32602/-32600): a mismatch on the
    router's or the transport's side, which the holder reports honestly. Try the next holder,
    but do not penalize this one (a wrong answer, receipt or shape stays a ``HolderFault``)."""


# Answer codes that say "your request is malformed" rather than "I failed": JSON-RPC codes (HTTP,
# iroh) and the agent socket's error class names for the same refusals (``HolderAgent.handle``).
REJECTION_CODES = (INVALID_PARAMS, INVALID_REQUEST)
SOCKET_REJECTIONS = ("WireError", "RpcError", "bad_request")


@dataclass
class BatchRequest:
    """One request to one holder: rows f32 ``[n, H]`` of ``tokens``, encoded once as ``payload``.

    ``request_id`` is fresh for every attempt (the router's own id; answers are matched by it).
    ``purpose``: "serve" (metered) or "selftest" (a router's hedged probe, not metered).
    """

    request_id: str
    model_id: str
    layer: int
    expert: int
    tokens: list[int]
    carrier: str
    payload: bytes
    output: str
    d_model: int
    purpose: str = "serve"


class MessageSeal:
    """Router side of the seal of one coalesced message (``moe.receipts`` message receipts),
    shared by the answers of its batches. It may arrive after their rows (a streamed message
    seals on its last answer): ``leaves`` waits for it and checks its signature once for all
    of them. ``seal``: the seal when it is already in (a whole reply)."""

    def __init__(self, seal: dict | None = None):
        self.body = seal
        self._in = asyncio.Event()
        self._missing = ""
        self._checked: tuple[str, object] | None = None  # (provider, its leaves or the ReceiptError)
        if seal is not None:
            self._in.set()

    def arrive(self, seal) -> None:
        """The message's seal came in (the first one counts)."""
        if not self._in.is_set():
            self.body = seal
            self._in.set()

    def close(self, why: str) -> None:
        """The message ended (or broke) without a seal: every waiting batch fails with ``why``."""
        if not self._in.is_set():
            self._missing = why
            self._in.set()

    async def leaves(self, provider: str) -> list[bytes]:
        """The seal's leaves once it is in and its signature by ``provider`` verified (once per
        message). Raises ``ReceiptError`` (no seal came, or it does not verify)."""
        await self._in.wait()
        if self.body is None:
            raise ReceiptError(self._missing or "the message carried no seal")
        if self._checked is None or self._checked[0] != provider:
            try:
                self._checked = (provider, verify_seal(self.body, provider))
            except ReceiptError as exc:
                self._checked = (provider, exc)
        if isinstance(self._checked[1], ReceiptError):
            raise self._checked[1]
        return self._checked[1]


@dataclass
class BatchAnswer:
    """A holder's answer: rows f32 ``[n, H]`` decoded from ``payload`` (``output`` encoding),
    the receipt (None for a local call), transport name and bytes each way; ``seal``: the
    ``MessageSeal`` of the message it came in when that message asked for one."""

    rows: np.ndarray
    receipt: dict | None
    transport: str
    bytes_out: int
    bytes_back: int
    seal: MessageSeal | None = None


# send(holder provider id, holder info or None, request) -> answer; raises HolderFault,
# AuthRefusal, ConnectionError, asyncio.TimeoutError or ValueError.
Send = Callable[[str, object, BatchRequest], Awaitable[BatchAnswer]]


# ---- socket control messages (JSON text frames) ----

def challenge(nonce: bytes) -> dict:
    """Site → agent on connect: ``{"type": "challenge", "nonce": hex}`` (32 random bytes)."""
    return {"type": "challenge", "nonce": nonce.hex()}


def hello(provider: str, signature: str) -> dict:
    """Agent → site: its provider id (64 hex) and its signature (hex) over the challenge nonce."""
    return {"type": "hello", "provider": provider, "signature": signature}


def welcome(provider: str, max_message: int, heartbeat_interval_s: float, deployment: str | None = None,
            site: str | None = None, sites: tuple[str, ...] = ()) -> dict:
    """Site → agent after a good hello: the socket's frame cap (bytes), heartbeat interval (s)
    and, when given, the deployment the site belongs to (every site process of it says the same),
    the answering process's id ``site`` and every site process's ``sites`` (behind a balancer:
    the agent opens a socket to each, ``<ws url>?site=<id>``)."""
    msg = {"type": "welcome", "provider": provider, "max_message": max_message,
           "heartbeat_interval_s": heartbeat_interval_s}
    if deployment:
        msg["deployment"] = deployment
    if site:
        msg["site"], msg["sites"] = site, list(sites)
    return msg


MAX_NAME = 200  # characters of a provider's display name in a heartbeat (the site refuses longer ones)


def heartbeat(body: dict, signature: str) -> dict:
    """Agent → site: a signed heartbeat ``body`` (``registry.heartbeat`` checks it)."""
    return {"type": "heartbeat", "body": body, "signature": signature}


def _tps_floor_pow2(tps: int) -> int:
    return 0 if tps <= 0 else 1 << (int(tps).bit_length() - 1)


# committed_tps at each precision, tried in order until the holdings fit: exact, rounded down to a
# power of two (at most ~31 distinct values), none. Rounding down never promises more than measured.
TPS_PRECISIONS = (lambda t: int(t), _tps_floor_pow2, lambda t: 0)


def compact_holdings(holdings: list[dict], precision: int = 0) -> list[dict]:
    """Expanded holdings (``{model_id, layer, expert, residency, committed_tps, blob_uri}``, as
    ``ExpertRuntime.holdings``) in the heartbeat's compact form (``registry.heartbeat``):
    one entry per (model, residency, committed_tps, set of experts) with the layers sharing that
    set as a range string, so a holder of whole layers sends a few hundred bytes at any count.

    ``precision`` indexes ``TPS_PRECISIONS`` (coarser committed_tps, fewer entries). Compact
    entries carry no ``blob_uri``: the site fills in its published blob of each expert.
    """
    coarse = TPS_PRECISIONS[precision]
    by_layer: dict[tuple, list[int]] = {}
    for h in holdings:
        key = (h["model_id"], h["residency"], coarse(h.get("committed_tps", 0)), h["layer"])
        by_layer.setdefault(key, []).append(h["expert"])
    by_set: dict[tuple, list[int]] = {}
    for (model_id, residency, tps, layer), experts in by_layer.items():
        by_set.setdefault((model_id, residency, tps, format_ranges(experts)), []).append(layer)
    return [{"model_id": model_id, "layers": format_ranges(layers), "experts": experts, "residency": residency,
             "committed_tps": tps}
            for (model_id, residency, tps, experts), layers in sorted(by_set.items())]


HEARTBEAT_ACK = {"type": "heartbeat_ack"}


def socket_error(message: str, *, code: int | None = None, field: str | None = None,
                 ref: str | None = None) -> dict:
    """Site → agent: ``{"type": "error", "message", ...}`` with the close ``code`` (an auth
    refusal) or the ``field`` at fault and the message ``ref`` it answers."""
    msg: dict = {"type": "error", "message": message}
    if code is not None:
        msg["code"] = code
    if field is not None:
        msg["field"] = field
        msg["ref"] = ref
    return msg


# ---- binary frame headers ----

def execute_header(*, model_id: str, layer: int, expert: int, token_indices: list[int], d_model: int,
                   carrier: str, output: str | None = None, purpose: str | None = None,
                   request_id: str | None = None) -> dict:
    """Header of an ``execute`` frame; its payload is ``token_indices`` rows of ``d_model`` in
    ``carrier`` ("f32", "f16" or "q8_0"). ``output`` (answer encoding, default f32), ``purpose``
    (default "serve", the only metered one) and ``request_id`` (``id``) only when given."""
    header: dict = {"type": "execute"}
    if request_id is not None:
        header["id"] = request_id
    header.update(model_id=model_id, layer=layer, expert=expert, token_indices=token_indices, d_model=d_model,
                  carrier=carrier)
    if output is not None:
        header["output"] = output
    if purpose is not None:
        header["purpose"] = purpose
    return header


def request_header(req: BatchRequest) -> dict:
    """The ``execute`` header of a router's ``BatchRequest`` (payload: ``req.payload``)."""
    return execute_header(request_id=req.request_id, model_id=req.model_id, layer=req.layer, expert=req.expert,
                          token_indices=req.tokens, d_model=req.d_model, carrier=req.carrier, output=req.output,
                          purpose=None if req.purpose == "serve" else req.purpose)


def load_header(model_id: str, layer: int, expert: int, uri: str) -> dict:
    """Header of a ``load`` frame: hold expert ``(model_id, layer, expert)`` from blob ``uri``."""
    return {"type": "load", "model_id": model_id, "layer": layer, "expert": expert, "uri": uri}


def rpc_header(method: str) -> dict:
    """Header of an ``rpc`` frame relaying execution method ``method``; payload = JSON params."""
    return {"type": "rpc", "method": method}


def reply(req_id, **fields) -> dict:
    """A holder's success reply header ``{id, ok: true, **fields}``."""
    return {"id": req_id, "ok": True, **fields}


def failure(req_id, code, message: str) -> dict:
    """A holder's failure reply header ``{id, ok: false, code, message}``; ``code`` is a JSON-RPC
    code (HTTP frames) or an error class name (socket)."""
    return {"id": req_id, "ok": False, "code": code, "message": message}


def batch_frame(reqs: list[BatchRequest], batch_id: str, seal: bool = False) -> tuple[dict, bytes]:
    """(header, payload) of one ``batch`` message carrying ``reqs`` to one holder: each
    request's ``execute`` header with ``nbytes`` (its carrier bytes), payloads concatenated;
    ``seal`` asks for one message receipt (``receipts: "message"``) instead of one per request."""
    header = {"type": "batch", "id": batch_id, "requests": [{**request_header(r), "nbytes": len(r.payload)}
                                                            for r in reqs]}
    if seal:
        header["receipts"] = "message"
    return header, b"".join(r.payload for r in reqs)


def wants_seal(header: dict) -> bool:
    """Holder side: whether a ``batch`` asks for one message receipt (``batch_frame(seal=True)``)."""
    return header.get("receipts") == "message"


def split_batch(header: dict, payload: bytes) -> list[tuple[dict, bytes]]:
    """Holder side: the (execute header, carrier bytes) of each request of a ``batch`` message.

    Raises ``wire.WireError`` (field ``requests``) when ``requests`` is not a non-empty list of
    objects with non-negative integer ``nbytes`` that add up to the payload's length, or holds
    more than ``MAX_BATCH_REQUESTS``.
    """
    reqs = header.get("requests")
    if not isinstance(reqs, list) or not reqs or len(reqs) > MAX_BATCH_REQUESTS:
        raise wire.WireError(f"a batch's requests must be a list of 1 to {MAX_BATCH_REQUESTS} execute headers",
                             "requests")
    out, at = [], 0
    for i, r in enumerate(reqs):
        n = r.get("nbytes") if isinstance(r, dict) else None
        if type(n) is not int or n < 0 or at + n > len(payload):
            raise wire.WireError(f"requests[{i}].nbytes must be a non-negative integer within the payload",
                                 "requests")
        out.append((r, payload[at:at + n]))
        at += n
    if at != len(payload):
        raise wire.WireError(f"the batch's nbytes add up to {at}, its payload has {len(payload)} bytes", "requests")
    return out


MAX_BATCH_REQUESTS = 256


def batch_reply(batch_id, answers: list[tuple[dict, bytes]], seal: dict | None = None) -> tuple[dict, bytes]:
    """(header, payload) of a holder's reply to a ``batch``: ``answers`` are (reply or failure
    header, output bytes) per request in order; each header gains ``nbytes``; ``seal`` the
    message receipt's seal when the batch asked for one."""
    header = reply(batch_id, answers=[{**h, "nbytes": len(b)} for h, b in answers])
    if seal is not None:
        header["seal"] = seal
    return header, b"".join(b for _, b in answers)


def batch_part(batch_id, answer: tuple[dict, bytes], more: bool, seal: dict | None = None) -> tuple[dict, bytes]:
    """(header, payload) of one streamed answer of a ``stream: true`` batch: ``answer`` is that
    request's (reply or failure header, output bytes); ``more`` is False on the batch's last,
    which carries ``seal`` when the batch asked for a message receipt."""
    header, data = answer
    out = reply(batch_id, answers=[{**header, "nbytes": len(data)}], more=bool(more))
    if seal is not None:
        out["seal"] = seal
    return out, data


class StreamedBatch:
    """Router side of one streamed ``batch``: turns each ``batch_part`` message into its
    request's outcome. ``reqs`` are the batch's requests; ``request_bytes`` the whole request
    message's size (shared out by payload, as ``batch_answers`` does)."""

    def __init__(self, reqs: list[BatchRequest], transport: str, request_bytes: int):
        self.reqs, self.transport, self.request_bytes = reqs, transport, request_bytes
        self.index = {r.request_id: i for i, r in enumerate(reqs)}
        self.outcomes: list = [None] * len(reqs)
        self._total_out = sum(len(r.payload) for r in reqs) or 1
        self.seal = MessageSeal()  # arrives with the last answer message, when the batch asked for one

    def part(self, header: dict, payload: bytes, reply_bytes: int) -> tuple[int, object]:
        """(request index, outcome: ``BatchAnswer`` or the ``HolderFault``/``AuthRefusal``/
        ``Rejected`` it failed with) of one streamed answer message of ``reply_bytes`` bytes.
        Raises ``HolderFault`` for a message that is not one answer to a request of this batch
        still unanswered (the stream is then untrustworthy as a whole)."""
        answers = header.get("answers")
        a = answers[0] if isinstance(answers, list) and len(answers) == 1 else None
        i = self.index.get(a.get("id")) if isinstance(a, dict) else None
        if i is None or self.outcomes[i] is not None:
            raise HolderFault("a streamed batch answer is not one answer to an open request of the batch")
        if a.get("nbytes") != len(payload):
            raise HolderFault(f"streamed answer nbytes {a.get('nbytes')!r} for {len(payload)} payload bytes")
        if "seal" in header:
            self.seal.arrive(header["seal"])
        req = self.reqs[i]
        try:
            out = answer_to_batch(a, payload, req, self.transport,
                                  self.request_bytes * len(req.payload) // self._total_out, reply_bytes, self.seal)
        except (HolderFault, AuthRefusal, Rejected) as exc:
            out = exc
        self.outcomes[i] = out
        return i, out

    def finish(self) -> list:
        """Every outcome, a request the stream never answered as a ``HolderFault``."""
        self.close()
        return [o if o is not None else HolderFault(f"the streamed batch ended without answering request "
                                                    f"{r.request_id}") for r, o in zip(self.reqs, self.outcomes)]

    def close(self) -> None:
        """The stream is over (also when it broke): answers still waiting for the seal fail."""
        self.seal.close("the streamed batch ended without a message seal")


def refusal(answer: dict, what: str) -> Exception:
    """The exception a holder's ``ok: false`` answer to a ``what`` ("request" or "batch") stands for:
    ``AuthRefusal`` (-32001), ``Rejected`` (-32602/-32600: ours was malformed, no holder fault) or
    ``HolderFault`` (anything else)."""
    code, message = answer.get("code"), answer.get("message")
    if code == AUTH_REFUSED:
        return AuthRefusal(str(message))
    if code in REJECTION_CODES:
        return Rejected(f"holder rejected the {what} ({code}): {message}")
    return HolderFault(f"holder error {code}: {message}")


def split_batch_reply(answer: dict, payload: bytes, n: int) -> list[tuple[dict, bytes]]:
    """Router side: the (answer header, output bytes) of each of the ``n`` requests of a batch.

    Raises ``HolderFault`` when the reply is not ``n`` answers whose ``nbytes`` tile the payload;
    ``AuthRefusal``, ``Rejected`` or ``HolderFault`` when the whole batch was refused (``ok: false``).
    """
    if not answer.get("ok"):
        raise refusal(answer, "batch")
    answers = answer.get("answers")
    if not isinstance(answers, list) or len(answers) != n:
        raise HolderFault(f"batch reply carries {len(answers) if isinstance(answers, list) else 'no'} answers "
                          f"for {n} requests")
    out, at = [], 0
    for i, a in enumerate(answers):
        k = a.get("nbytes") if isinstance(a, dict) else None
        if type(k) is not int or k < 0 or at + k > len(payload):
            raise HolderFault(f"batch reply answers[{i}].nbytes does not fit the payload")
        out.append((a, payload[at:at + k]))
        at += k
    if at != len(payload):
        raise HolderFault("batch reply's nbytes do not add up to its payload")
    return out


def batch_answers(answer: dict, payload: bytes, reqs: list[BatchRequest], transport: str,
                  request_bytes: int, reply_bytes: int) -> list:
    """Each request's outcome from a holder's reply to a ``batch``: its ``BatchAnswer`` or the
    exception ``answer_to_batch`` raises for it (``HolderFault``, ``AuthRefusal``, ``Rejected``), so one
    failed sub-request fails only itself. A reply that is malformed as a whole, or an answer
    whose ``id`` is not its request's, is a ``HolderFault`` for the requests it cannot answer.
    Bytes each way (``request_bytes``/``reply_bytes``: the whole messages) are shared out in
    proportion to each request's and answer's payload.
    """
    try:
        parts = split_batch_reply(answer, payload, len(reqs))
    except (HolderFault, AuthRefusal, Rejected) as exc:
        return [exc] * len(reqs)
    seal = MessageSeal(answer["seal"]) if "seal" in answer else None
    total_out = sum(len(r.payload) for r in reqs) or 1
    total_back = sum(len(b) for _, b in parts) or 1
    out = []
    for req, (a, data) in zip(reqs, parts):
        if a.get("id") != req.request_id:
            out.append(HolderFault(f"batch answer id {a.get('id')!r} is not its request's {req.request_id!r}"))
            continue
        try:
            out.append(answer_to_batch(a, data, req, transport, request_bytes * len(req.payload) // total_out,
                                       reply_bytes * len(data) // total_back, seal))
        except (HolderFault, AuthRefusal, Rejected) as exc:
            out.append(exc)
    return out


def answer_to_batch(answer: dict, data: bytes, req: BatchRequest, transport: str, bytes_out: int,
                    bytes_back: int, seal: MessageSeal | None = None) -> BatchAnswer:
    """Decode a holder's reply (header + output bytes) to ``req`` (``seal``: its message's, when
    it came in a message that asked for one); raises ``AuthRefusal``
    (code -32001), ``Rejected`` (-32602/-32600: the request was malformed), ``HolderFault``
    (another error, wrong tokens, bad rows)."""
    if not answer.get("ok"):
        raise refusal(answer, "request")
    if answer.get("token_indices", req.tokens) != req.tokens:
        raise HolderFault("answer's token_indices differ from the request's")
    try:
        rows = wire.decode_rows(data, answer.get("output", "f32"), req.d_model, len(req.tokens), field="outputs")
    except wire.WireError as exc:
        raise HolderFault(str(exc)) from exc
    return BatchAnswer(rows, answer.get("receipt"), transport, bytes_out, bytes_back, seal)
