"""Prefill/Decode disaggregation on holder agents (issue 12 part 4; roles ``Prefill``
"hands off KV cache", ``Decode`` "consumes KV cache", ``PrefillDecode`` both).

An agent with role Prefill runs the prompt through the backbone (weights fetched as blobs,
every MoE / dense MLP layer through the site's distributed forward over JSON-RPC) and keeps
the resulting *handoff*: each sequence's KV cache, ids so far and RNG state. The site reads it
in binary socket frames split below the frame cap (``kv_get``) and writes them to a Decode
agent (``kv_put``), which rebuilds the sequences and continues decoding (``decode``). Greedy
and seeded sampling give the same tokens as a PrefillDecode run: the caches are bit-exact
float32 and the RNG state travels with them.

Peer to peer (issue 22): instead of relaying through its socket, the site may ask the Prefill
agent (frame ``kv_send`` with the Decode agent's advertised endpoints) to send the handoff
straight to the Decode agent: over iroh (``moe/kv_put``, the chunk base64 in ``data``) when
both serve iroh, else over HTTP (``POST /frame`` with a binary ``kv_put`` frame). Each chunk
is signed by the Prefill agent (``DOMAIN_KV_HANDOFF`` over ``kv_chunk_message``); the Decode
agent keeps the signer per session (``peer_put``) and decodes the session only when the
site's ``decode`` frame names that signer (``from``). Each chunk is one request; the
connection carries them back to back, so a handoff costs about one round trip per
``PEER_CHUNK`` bytes, not two per socket frame.

Handoff layout: ``u32 little-endian n`` + ``n`` bytes of JSON ``{"sequences": [{prompt,
output, finish_reason, rng, kv_bytes}]}`` + each sequence's ``KVCache.to_bytes()`` in order.

Imports nothing from Django (the agent imports it).
"""
from __future__ import annotations

import hashlib
import json
import struct
import threading
import time
from typing import Callable

import numpy as np

from moe import wire
from moe.backbone import Backbone, KVCache
from moe.backbone.decode import Generator, Sampling, Sequence
from moe.backbone.weights import load_backbone
from moe.identity import DOMAIN_KV_HANDOFF, SignatureError, verify

# Frame types an agent answers for the roles; the roles that accept each.
FRAME_ROLES = {"prefill": ("Prefill", "PrefillDecode"), "kv_get": ("Prefill", "PrefillDecode"),
               "kv_put": ("Decode", "PrefillDecode"), "decode": ("Decode", "PrefillDecode")}
FRAME_ROLES["kv_send"] = ("Prefill", "PrefillDecode")
GENERATION_ROLES = ("PrefillDecode", "Prefill", "Decode")
HANDOFF_TTL_S = 600.0
PEER_CHUNK = 3 << 20  # bytes per peer-to-peer kv_put: base64 of it fits iroh's 4 MiB frame


def kv_chunk_message(session: str, index: int, frames: int, chunk: bytes) -> bytes:
    """What a Prefill agent signs for chunk ``index`` of ``frames`` of ``session``:
    ``session ‖ 0x00 ‖ index ‖ 0x00 ‖ frames ‖ 0x00 ‖ sha256(chunk)``."""
    return b"%s\x00%d\x00%d\x00%s" % (session.encode(), index, frames, hashlib.sha256(chunk).digest())


class HandoffError(ValueError):
    """A malformed handoff, an unknown session, or a frame this agent's role does not take."""


def pack_handoff(seqs: list[Sequence]) -> bytes:
    """Serialize sequences (KV caches f32, ids, RNG bit-generator state) to handoff bytes."""
    caches = [s.cache.to_bytes() for s in seqs]
    meta = {"sequences": [{"prompt": [int(t) for t in s.prompt], "output": list(s.output),
                           "finish_reason": s.finish_reason, "rng": s.rng.bit_generator.state,
                           "kv_bytes": len(c)} for s, c in zip(seqs, caches)]}
    head = json.dumps(meta).encode()
    return struct.pack("<I", len(head)) + head + b"".join(caches)


def unpack_handoff(data: bytes) -> list[Sequence]:
    """Inverse of ``pack_handoff``. Raises ``HandoffError`` for a malformed buffer."""
    try:
        (n,) = struct.unpack_from("<I", data, 0)
        meta = json.loads(bytes(data[4:4 + n]))
        off, seqs = 4 + n, []
        for m in meta["sequences"]:
            cache = KVCache.from_bytes(bytes(data[off:off + m["kv_bytes"]]))
            off += m["kv_bytes"]
            rng = np.random.default_rng()
            rng.bit_generator.state = m["rng"]
            seqs.append(Sequence(np.asarray(m["prompt"], dtype=np.int64), cache, rng, list(m["output"]),
                                 m["finish_reason"]))
    except (struct.error, ValueError, KeyError, TypeError) as exc:
        raise HandoffError(f"malformed KV handoff: {exc}") from exc
    if off != len(data):
        raise HandoffError(f"KV handoff has {len(data) - off} trailing bytes")
    return seqs


def chunk_size(max_message: int) -> int:
    """Payload bytes per frame that keep a frame (header + payload) under ``max_message``."""
    return max(1024, max_message - wire.FRAME_HEADER_MAX - 1024)


def sampling_from_header(s: dict) -> Sampling:
    """``Sampling`` from a frame's ``sampling`` dict (``Sampling`` field names)."""
    return Sampling(max_new_tokens=int(s["max_new_tokens"]), temperature=float(s["temperature"]),
                    top_p=float(s["top_p"]), top_k=int(s["top_k"]), seed=s.get("seed"),
                    stop=tuple(int(t) for t in s.get("stop", ())))


def sampling_to_header(s: Sampling) -> dict:
    """Inverse of ``sampling_from_header``."""
    return {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p,
            "top_k": s.top_k, "seed": s.seed, "stop": list(s.stop)}


class SiteMlp:
    """The backbone's ``mlp(layer, x)`` on an agent: MoE layers through the site's
    ``tenzro_moeForward``, dense layers through ``tenzro_moeDenseForward`` (JSON-RPC over
    HTTP, base64 f32 rows ``[N, H]``), so failover, receipts and settlement stay the site's.

    Raises ``HandoffError`` for a layer that is neither or an error answer from the site.
    """

    def __init__(self, rpc_url: str, model_id: str, moe_layers, dense_layers, carrier: str, timeout: float = 300.0):
        import httpx

        self.url, self.model_id, self.carrier = rpc_url, model_id, carrier
        self.moe, self.dense = frozenset(moe_layers), frozenset(dense_layers)
        self.client = httpx.Client(timeout=timeout)
        self.forwards, self.bytes_out = 0, 0

    def __call__(self, layer: int, x: np.ndarray) -> np.ndarray:
        method = ("tenzro_moeForward" if layer in self.moe else
                  "tenzro_moeDenseForward" if layer in self.dense else None)
        if method is None:
            raise HandoffError(f"layer {layer} of {self.model_id!r} has neither experts nor dense slices")
        body = wire.encode_f32(np.ascontiguousarray(x, dtype=np.float32))
        self.bytes_out += len(body)
        r = self.client.post(self.url, json={"jsonrpc": "2.0", "id": 1, "method": method, "params": {
            "model_id": self.model_id, "layer": layer, "d_model": int(x.shape[1]),
            "hidden_states": wire.b64encode(body), "carrier": self.carrier}}).json()
        if "error" in r:
            raise HandoffError(f"site {method} layer {layer}: {r['error'].get('message')}")
        self.forwards += 1
        return wire.decode_f32(wire.b64decode(r["result"]["outputs"], "outputs"), x.shape[1])

    def close(self) -> None:
        """Close the HTTP client."""
        self.client.close()


class RoleRunner:
    """An agent's Prefill/Decode side: frames ``prefill``, ``kv_get``, ``kv_put``, ``decode``.

    ``roles``: the agent's roles (frames are refused unless one of ``FRAME_ROLES[type]``
    is held); ``site``: the site's base URL (``/rpc`` for the MLP layers); ``fetch(uri)``:
    blob bytes (backbone weights). ``handle(type, header, payload)`` runs blocking work and is
    meant for a worker thread; returns (reply fields, reply payload).
    """

    def __init__(self, roles, site: str, fetch: Callable[[str], bytes], max_message: Callable[[], int]):
        self.roles, self.site, self.fetch, self.max_message = tuple(roles), site.rstrip("/"), fetch, max_message
        self._backbones: dict[tuple, Backbone] = {}
        self._out: dict[str, tuple[float, bytes]] = {}  # session → (created, handoff bytes) on the Prefill side
        self._in: dict[str, tuple[float, list[bytes | None]]] = {}  # session → received chunks on the Decode side
        # session → (first chunk's time, the Prefill provider whose signed chunks arrived peer to peer)
        self._senders: dict[str, tuple[float, str]] = {}
        self._lock = threading.Lock()

    def _backbone(self, h: dict) -> Backbone:
        record = h["record"]
        key = (h["model_id"], tuple(sorted(record["blobs"].items())))
        with self._lock:
            bb = self._backbones.get(key)
        if bb is None:
            bb = load_backbone(h["config"], record, lambda x: self.fetch(f"tenzro://blob/{x}"))
            with self._lock:
                self._backbones[key] = bb
        return bb

    def _expire(self) -> None:
        cut = time.monotonic() - HANDOFF_TTL_S
        for store in (self._out, self._in, self._senders):
            for k in [k for k, (t, _) in store.items() if t < cut]:
                store.pop(k, None)

    def outgoing(self, session: str) -> bytes:
        """The Prefill side's handoff bytes of ``session`` (kept until ``sent``). Raises
        ``HandoffError`` when there is none (expired or never prefilled here)."""
        with self._lock:
            entry = self._out.get(session)
        if entry is None:
            raise HandoffError(f"no handoff {session!r} here (expired or never prefilled)")
        return entry[1]

    def sent(self, session: str) -> None:
        """The Decode agent has every chunk of ``session``: drop it here."""
        with self._lock:
            self._out.pop(session, None)

    def peer_put(self, h: dict, payload: bytes) -> dict:
        """A ``kv_put`` chunk sent peer to peer by a Prefill agent: ``h`` has ``session``,
        ``index``, ``frames``, ``from`` (its provider id) and ``sig`` (over
        ``kv_chunk_message``). Raises ``HandoffError`` (bad signature, a second sender for the
        session, the ``kv_put`` checks)."""
        session, sender = str(h.get("session") or ""), h.get("from")
        try:
            index, frames = int(h["index"]), int(h["frames"])
            verify(sender, DOMAIN_KV_HANDOFF, kv_chunk_message(session, index, frames, bytes(payload)), h.get("sig"))
        except (KeyError, TypeError, ValueError) as exc:
            raise HandoffError(f"kv_put: index and frames must be integers ({exc})") from None
        except SignatureError as exc:
            raise HandoffError(f"kv_put from {str(sender)[:12]}…: {exc}") from None
        with self._lock:
            _, known = self._senders.setdefault(session, (time.monotonic(), sender))
        if known != sender:
            raise HandoffError(f"session {session!r} already receives chunks from {known[:12]}…")
        return self.handle("kv_put", h, payload)[0]

    def _mlp(self, h: dict) -> SiteMlp:
        return SiteMlp(f"{self.site}/rpc", h["model_id"], h["moe_layers"], h["dense_layers"], h.get("carrier", "auto"))

    def handle(self, kind: str, h: dict, payload: bytes) -> tuple[dict, bytes]:
        """Answer one frame. Raises ``HandoffError`` (role, session, malformed data),
        ``BackboneError`` and the blob fetch's errors."""
        if not any(r in self.roles for r in FRAME_ROLES[kind]):
            raise HandoffError(f"this agent's roles {list(self.roles)} do not take {kind!r} frames")
        session = str(h.get("session") or "")
        if not session:
            raise HandoffError("session is required")
        with self._lock:
            self._expire()
        if kind == "prefill":
            gen = Generator(self._backbone(h), mlp := self._mlp(h), sampling_from_header(h["sampling"]))
            try:
                seqs = gen.prefill([np.asarray(p, dtype=np.int64) for p in h["prompts"]])
            finally:
                mlp.close()
            data = pack_handoff(seqs)
            size = chunk_size(self.max_message())
            with self._lock:
                self._out[session] = (time.monotonic(), data)
            return {"bytes": len(data), "frames": -(-len(data) // size), "chunk": size,
                    "kv_bytes": sum(s.cache.nbytes for s in seqs), "forwards": mlp.forwards,
                    "prefill_ms": round(gen.timings["prefill_ms"], 3)}, b""
        if kind == "kv_get":
            i, size = int(h["index"]), int(h["chunk"])
            with self._lock:
                entry = self._out.get(session)
            if entry is None:
                raise HandoffError(f"no handoff {session!r} here (expired or never prefilled)")
            data = entry[1]
            if (i + 1) * size >= len(data):
                with self._lock:
                    self._out.pop(session, None)  # the last chunk was read: the Decode side has it all
            return {"index": i}, data[i * size:(i + 1) * size]
        if kind == "kv_put":
            i, n = int(h["index"]), int(h["frames"])
            if not 0 <= i < n:
                raise HandoffError(f"index {i} is outside 0..{n - 1}")
            with self._lock:
                _, parts = self._in.setdefault(session, (time.monotonic(), [None] * n))
                if len(parts) != n:
                    raise HandoffError(f"session {session!r} was started with {len(parts)} frames, not {n}")
                parts[i] = bytes(payload)
            return {"index": i}, b""
        if kind == "kv_send":  # answered by the agent itself (it has the network clients)
            raise HandoffError("kv_send is answered by the agent, not the role runner")
        # decode
        with self._lock:
            entry = self._in.pop(session, None)
            sender = self._senders.pop(session, (0.0, None))[1]
        if entry is None or any(p is None for p in entry[1]):
            raise HandoffError(f"handoff {session!r} is missing or incomplete")
        if sender is not None and h.get("from") != sender:  # chunks came peer to peer: from the agent the site chose
            raise HandoffError(f"handoff {session!r} came from {sender[:12]}…, not from the Prefill agent the site "
                               f"named")
        seqs = unpack_handoff(b"".join(entry[1]))
        gen = Generator(self._backbone(h), mlp := self._mlp(h), sampling_from_header(h["sampling"]))
        try:
            gen.resume(seqs)
        finally:
            mlp.close()
        return {"output_ids": [s.output for s in seqs], "finish_reasons": [s.finish_reason for s in seqs],
                "forwards": mlp.forwards, "decode_ms": round(gen.timings["decode_ms"], 3)}, b""
