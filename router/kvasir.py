"""This site as the coordinator of relay-wired Kvasir workers (issue 27 items 4–5).

A market worker whose relay socket this site holds (``router.kvasir_relay``) is a holder of its
coverage segment: ``KvasirHolders.infos`` turns the live, connected, unquarantined workers of a
model (``registry.market.kvasir_workers``) into ``ProviderInfo`` rows (id ``kvasir:<worker_id>``,
its first segment's experts Warm) that the router adds to its shard view, so the planner,
deadlines, warm backups and replans treat them as any holder. ``send`` runs one planned batch
over the worker's relay in the worker compute protocol (``moe.transports.kvasir``: v2f16, then
v2, then v1 for a worker that closes its socket on its first request of a variant; expert ids
local to the shard); the answer's transport is ``kvasir``. A closed socket fails the request at
once (``AgentUnavailable``), so the forward fails over.

Trust without receipts: Kvasir workers sign nothing. ``audit`` (``KvasirAudit``, per forward)
first refuses to give a worker a batch that nothing trusted could re-execute (neither the site's
fallback replica, which holds the published blobs, nor a receipt-signing holder), then
re-executes the worker's first batch and about one in ``kvasir_audit_one_in`` (governance) of
the rest and compares under the dispute tolerances (``moe.transports.kvasir.compare_rows``). A
mismatch records a fraud proof and quarantines the worker (``registry.market.quarantine_worker``:
coverage no longer counted, relay closed) and fails the batch, which the forward recomputes
on another holder.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import numpy as np
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings

from moe import wire
from moe.messages import BatchAnswer, BatchRequest, HolderFault, Rejected
from moe.shardmap import HoldingInfo, ProviderInfo
from moe.transports import kvasir as codec
from registry import governance, market
from router.ws import AgentLink, AgentUnavailable, agent_group

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shard:
    """The experts ``[begin, end)`` of ``layer`` a Kvasir worker's process serves."""

    layer: int
    begin: int
    end: int


class KvasirHolders:
    """Per-router state of the Kvasir workers it coordinates: their shards (from the last view
    read), the protocol variant each speaks, the audit counters and the workers it quarantined.
    Shards are written from the database thread one key at a time; counters are touched on the
    event loop only; ``banned`` under a lock."""

    def __init__(self):
        self.shards: dict[str, Shard] = {}
        self.variant: dict[str, str] = {}  # provider → protocol variant in use
        self.proven: set[tuple[str, str]] = set()  # (provider, variant) that answered at least once
        self.served: dict[str, int] = {}  # provider → batches answered (the audit counter)
        self.banned: dict[str, float] = {}  # quarantined by this router → monotonic end of the quarantine
        self.rng = random.Random()
        self._lock = threading.Lock()

    def banned_now(self) -> set[str]:
        """The workers this router quarantined whose quarantine still runs (the database's
        ``MarketFraud`` rows keep them out of later views too; this covers the cached ones)."""
        now = time.monotonic()
        with self._lock:  # read from the database thread (views) and the event loop
            for p in [p for p, until in self.banned.items() if until <= now]:
                del self.banned[p]
            return set(self.banned)

    def infos(self, model_id: str) -> list[ProviderInfo]:
        """The relay-connected workers of ``model_id`` as shard-view rows (database read)."""
        out, banned = [], self.banned_now()
        for worker_id, layer, begin, end in market.kvasir_workers(model_id):
            pid = codec.provider_id(worker_id)
            if pid in banned:
                continue
            self.shards[pid] = Shard(layer, begin, end)
            out.append(ProviderInfo(provider=pid, roles=("ExpertHolder",), holdings=tuple(
                HoldingInfo.unchecked(model_id, layer, e, "Warm") for e in range(begin, end))))
        return out

    async def send(self, provider: str, req: BatchRequest) -> BatchAnswer:
        """One planned batch on a Kvasir worker over its relay. Raises ``ConnectionError``
        (``AgentUnavailable``: socket closed, not held, no answer in time), ``HolderFault``
        (an answer of the wrong size or with non-finite values), ``Rejected`` (a batch above the
        protocol's 8,192 rows)."""
        shard = self.shards.get(provider)
        if shard is None or req.layer != shard.layer or not shard.begin <= req.expert < shard.end:
            raise AgentUnavailable(f"Kvasir worker {provider} does not serve l{req.layer}/e{req.expert}")
        n = len(req.tokens)
        rows = wire.decode_rows(req.payload, req.carrier, req.d_model, n)
        variant = self.variant.get(provider, codec.VARIANTS[0])
        try:
            payload = codec.encode_request(variant, rows, req.expert - shard.begin)
        except codec.KvasirProtocolError as exc:  # our batch is beyond what the protocol carries: not its fault
            raise Rejected(str(exc)) from exc
        expect = codec.response_size(variant, n, req.d_model)
        link = await AgentLink.get()
        try:
            _head, data = await link.request(provider, {"type": "kvasir", "expect": expect}, payload,
                                             settings.TENZRO["BATCH_TIMEOUT_S"], req_id=req.request_id)
        except AgentUnavailable as exc:
            if exc.code == "disconnected" and (provider, variant) not in self.proven:
                nxt = codec.VARIANTS.index(variant) + 1  # it may not speak this variant (§3: it closes)
                if nxt < len(codec.VARIANTS):
                    self.variant[provider] = codec.VARIANTS[nxt]
            raise
        try:
            out = codec.decode_response(variant, data, n, req.d_model)
        except codec.KvasirProtocolError as exc:
            raise HolderFault(str(exc)) from exc
        self.proven.add((provider, variant))
        return BatchAnswer(out, None, "kvasir", len(payload), len(data))

    def should_audit(self, provider: str, one_in: int) -> bool:
        """Whether this answered batch of ``provider`` is audited: its first one, then each with
        probability 1/``one_in`` (a worker cannot tell which)."""
        n = self.served.get(provider, 0)
        self.served[provider] = n + 1
        return n == 0 or self.rng.random() * one_in < 1.0

    async def quarantine(self, provider: str, proof: dict) -> dict:
        """Record the fraud proof, quarantine the worker and close its relay (wherever it is held)."""
        with self._lock:  # at once: answers racing the database write are refused
            self.banned[provider] = float("inf")
        worker_id = provider[len(codec.PREFIX):]
        row = await database_sync_to_async(market.quarantine_worker)(
            worker_id, proof["model_id"], proof["layer"], proof["expert"], proof["tokens"], proof["verification"],
            proof["executed_by"])
        with self._lock:
            self.banned[provider] = time.monotonic() + max(0.0, row["quarantined_until_ms"] / 1000 - time.time())
        try:
            await get_channel_layer().group_send(agent_group(provider), {"type": "kvasir.quarantined"})
        except Exception:  # the relay closes at its next liveness check anyway
            log.warning("could not tell %s's relay to close", provider, exc_info=True)
        log.warning("Kvasir worker %s quarantined: audit of l%d/e%d failed", worker_id, proof["layer"],
                    proof["expert"])
        return row


class KvasirAudit:
    """The audit of one forward's receiptless batches (module docstring).

    ``holders``: the router's ``KvasirHolders``; ``one_in`` and ``tolerances``
    (min_overlap, max_rel_delta, min_rows_passed) from the policy in force; ``fallback(expert,
    rows) -> rows | None``: the site's fallback replica of the layer (None: it lacks the blob);
    ``has_fallback(expert) -> bool``: whether it holds the blob (cached by the router).
    """

    def __init__(self, holders: KvasirHolders, model_id: str, layer: int, one_in: int,
                 tolerances: tuple[float, float, float], fallback: Callable[[int, np.ndarray], np.ndarray | None],
                 has_fallback: Callable[[int], Awaitable[bool]]):
        self.holders, self.model_id, self.layer = holders, model_id, layer
        self.one_in, self.tolerances = one_in, tolerances
        self.fallback, self.has_fallback = fallback, has_fallback

    async def executor_for(self, expert: int, view) -> str | None:
        """What would re-execute a batch of ``expert``: "site" (the fallback replica), a
        receipt-signing holder's id from ``view``, or None (receiptless work is refused)."""
        if await self.has_fallback(expert):
            return "site"
        for h in view.holders(self.layer, expert, allow_cold=False) if view is not None else ():
            if not codec.is_kvasir(h.provider):
                return h.provider
        return None

    async def check(self, provider: str, expert: int, tokens: list[int], x: np.ndarray, rows: np.ndarray,
                    redo: Callable[[str], Awaitable[np.ndarray]], executor: str) -> None:
        """Audit one answered batch when it is drawn: re-execute ``x`` f32 [n, H] on
        ``executor`` (``redo(executor)``) and compare with the worker's ``rows``. Raises
        ``HolderFault`` after quarantining the worker when they disagree."""
        if not self.holders.should_audit(provider, self.one_in):
            return
        redone = await redo(executor)
        verdict = codec.compare_rows(rows, redone, *self.tolerances)
        if verdict["pass"]:
            return
        await self.holders.quarantine(provider, {"model_id": self.model_id, "layer": self.layer, "expert": expert,
                                                 "tokens": tokens, "verification": verdict, "executed_by": executor})
        raise HolderFault(f"audit failed: {verdict['rows_total'] - verdict['rows_passed']} of "
                          f"{verdict['rows_total']} rows differ from {executor}'s re-execution; quarantined")


def policy_audit_terms() -> tuple[int, tuple[float, float, float]]:
    """(``kvasir_audit_one_in``, dispute tolerances) of the policy in force (database read)."""
    p = governance.current_policy()
    return p.kvasir_audit_one_in, (p.dispute_min_overlap, p.dispute_max_rel_delta, p.dispute_min_rows_passed)

