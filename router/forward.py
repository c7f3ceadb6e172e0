"""The router's MoE layer forward over remote holders (docs/DESIGN.md §7), free of Django.

gate locally → per-token routings → planner over the live shard view →
each planned batch, whole (the transport splits it into frames below the socket cap and
the holder reassembles it), to its primary under a deadline; when the
primary errs, answers badly (rows or receipt) or stalls past the deadline, the next warm
backup gets it → when every known holder of an expert failed, the remaining (expert,
token) pairs are replanned over a view without any provider that failed, at most
``MAX_REPLANS`` times; rows already received stay. Every answer is matched to the request
it answers by the router's own request id; an answer for a pair that was never sent or
that is already filled is rejected. Rows are placed as they arrive; the final
gate-weighted sum (``moe.ffn.weighted_sum``, ``combine``'s arithmetic) adds each token's
slots in ascending expert id with the shared slot last, exactly as the monolithic forward
does, so both agree bit for bit on the same backend.

Missing pairs after the last round fail the forward (``ForwardError`` naming the experts
and tokens) unless ``allow_partial``: then each token's routed weights are renormalized
over the routed experts that answered (the shared slot keeps weight 1.0; a missing shared
expert is always fatal) and the pairs are reported in ``missing``.

Receiptless Kvasir holders (``kvasir:<worker_id>``, ``router.kvasir``) get only batches something
trusted could re-execute; a drawn audit that fails quarantines the worker, and every pair it
answered in this forward is unfilled and recomputed in the next round (``revoke_quarantined``).

Source: reference §6.3 with its §14 fixes 5 (request-keyed combine, duplicate guard),
11 (shared slot never renormalized), 12 (zero-holder experts handled by ``allow_partial``),
23 (per-batch deadline, warm backup), 24 (frames below the message size, batches executed
whole: ``moe.wire.split_frames``), 25 (large
batches split over warm replicas by the planner's ``split_threshold``).

Deadline semantics (issue 15): a holder that misses the deadline is not abandoned. The next
holder gets the batch and the first one keeps its request until ``attempt_timeout_s``; the
first verified answer wins. So a forward does not fail when every holder is merely slow
(a cold first call), and a black hole costs one deadline. A holder that missed the deadline
while another answered counts as a fault. With a scoreboard, a holder's deadline follows its
observed p99 round trip (``Scoreboard.deadline_s``; ``deadline_s`` is then the ceiling), so a
stalled holder on a 1 ms link is hedged within a second, and one 100 ms away is not hedged on
every batch (issue 22). With a ``scoreboard``
(``router.scoreboard.Scoreboard``) the planner orders holders by what this router observed,
every outcome is recorded there, and unproven or half-open backups of a proven primary get
hedged probes (copies with purpose "selftest" whose answers never enter the forward).
"""
from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Mapping

import numpy as np

from moe import wire
from moe.ffn import weighted_sum
from moe.gating import Gate, Routing, route
# The request/answer records live with the other messages; re-exported for the forward's callers.
from moe.messages import AuthRefusal, BatchAnswer, BatchRequest, HolderFault, Rejected, Send  # noqa: F401
from moe.transports.kvasir import is_kvasir
from moe.receipts import ReceiptError, entry_in_seal, is_entry, sealed, verify_entry, verify_receipt
from router.scoreboard import Scoreboard
from moe.jsonrpc import ParamError
from registry.planner import DispatchPlan, plan_expert_batches
from moe.shardmap import ShardView

MAX_REPLANS = 2


class AuditUnavailable(Exception):
    """A drawn audit of a receiptless batch could not re-execute it (its executor failed)."""


@dataclass(frozen=True)
class ForwardConfig:
    """What the site's settings fix for every forward; the router builds it once per settings
    (``router.state.Router.config``) and hands it to each ``LayerForward``.

    ``deadline_s``: seconds a holder has for one request before the next warm backup gets it
    too. ``attempt_timeout_s``: seconds a request past its deadline may still answer first
    (None: 3 × ``deadline_s``; never less than ``deadline_s``; also the transports' timeout).
    ``split_threshold``: tokens above which the planner splits a batch over warm replicas
    (0 or None: never). ``verify``: check the receipts of remote answers (local answers carry
    none). ``transport``: the preferred data path to a holder, "ws", "http" or "iroh"
    (``Router.send_batch``: the agent socket and HTTP follow it). ``view_cache_s``: seconds a
    shard view or gate hash read from the database is reused. ``iroh_bind``: HOST:PORT of the
    router's iroh endpoint.

    Raises ``ValueError`` for a negative or non-integer ``split_threshold`` or an unknown
    ``transport``.
    """

    deadline_s: float = 10.0
    attempt_timeout_s: float | None = None
    split_threshold: int | None = None
    verify: bool = True
    transport: str = "ws"
    view_cache_s: float = 0.0
    iroh_bind: str = "0.0.0.0:0"

    def __post_init__(self):
        if self.split_threshold is not None and (type(self.split_threshold) is not int or self.split_threshold < 0):
            raise ValueError(f"split_threshold must be a non-negative integer or None, got {self.split_threshold!r}")
        if self.transport not in ("ws", "http", "iroh"):
            raise ValueError(f"transport must be ws, http or iroh, got {self.transport!r}")

    @classmethod
    def from_settings(cls, t: Mapping) -> "ForwardConfig":
        """The config of the site's ``settings.TENZRO`` mapping ``t`` (``BATCH_DEADLINE_S``,
        ``BATCH_TIMEOUT_S``, ``PLAN_SPLIT_THRESHOLD``, ``DATA_TRANSPORT``, ``VIEW_CACHE_S``,
        ``IROH_BIND``)."""
        return cls(deadline_s=t["BATCH_DEADLINE_S"], attempt_timeout_s=t["BATCH_TIMEOUT_S"],
                   split_threshold=t["PLAN_SPLIT_THRESHOLD"], transport=t["DATA_TRANSPORT"],
                   view_cache_s=t["VIEW_CACHE_S"], iroh_bind=t["IROH_BIND"])

    @property
    def timeout_s(self) -> float:
        """Seconds one request may take in all (``attempt_timeout_s`` or its default)."""
        return max(self.deadline_s, self.attempt_timeout_s if self.attempt_timeout_s is not None
                   else 3 * self.deadline_s)


class ForwardError(Exception):
    """The forward cannot complete: ``kind`` is "planning" (nobody holds an expert) or
    "execution" (every holder of a batch failed); ``data`` names the (expert, tokens)."""

    def __init__(self, kind: str, message: str, data: dict | None = None):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.data = data or {}



def _request_id() -> str:
    """A fresh batch request id: 32 lowercase hex of 128 random bits (``uuid4().hex``'s form;
    building the ``UUID`` object was ~1 % of the site's GIL samples at 16 clients)."""
    return os.urandom(16).hex()


@dataclass
class VerifiedBatch:
    """One remote batch whose receipt verified: what the receipts economy keeps or settles.

    ``request`` is what was sent (its ``payload`` the exact carrier bytes), ``rows`` the
    decoded output f32 ``[n, d_model]``, ``receipt`` the holder's signed receipt. Listed in
    arrival order.
    """

    provider: str
    request: BatchRequest
    receipt: dict
    rows: np.ndarray


@dataclass
class ForwardResult:
    """Output of a distributed forward: ``output`` f32 [T, H] plus what it took."""

    output: np.ndarray
    routing: Routing
    holders: list[str]
    batches: int
    replans: int
    missing: list[dict]
    failures: list[dict] = field(default_factory=list)
    latencies_ms: dict = field(default_factory=dict)
    transports: dict = field(default_factory=dict)
    bytes_out: int = 0
    bytes_back: int = 0
    receipts: list[dict] = field(default_factory=list)
    timings_ms: dict = field(default_factory=dict)
    verified: list[VerifiedBatch] = field(default_factory=list)
    forward_id: str = ""


def renormalized(routing: Routing, missing: dict[int, set[int]]) -> Routing:
    """``routing`` with, per token, the missing routed slots at weight 0 and the routed
    weights that answered scaled so their sum is unchanged (the shared slot untouched).

    Raises ``ValueError`` when the shared slot is missing or a token lost every routed expert.
    """
    w = routing.weights.copy()
    ids = routing.expert_ids
    for e, toks in missing.items():
        if routing.shared_slot is not None and e == routing.shared_slot:
            raise ValueError(f"the shared expert {e} is missing for tokens {sorted(toks)}")
        for t in toks:
            w[t, ids[t] == e] = 0.0
    routed = ids != (routing.shared_slot if routing.shared_slot is not None else -1)
    touched = sorted({t for toks in missing.values() for t in toks})
    for t in touched:
        total = float(routing.weights[t][routed[t]].astype(np.float64).sum())
        kept = float(w[t][routed[t]].astype(np.float64).sum())
        if kept <= 0:
            raise ValueError(f"token {t} lost every routed expert")
        w[t, routed[t]] = (w[t, routed[t]].astype(np.float64) * (total / kept)).astype(np.float32)
    return Routing(ids, w, routing.router_logits, routing.top_k, routing.shared_slot)


class _Rows:
    """Per-expert row buffers filled as answers arrive; refuses pairs not routed or already filled.

    Every routed (token, slot) pair has one row of ``all`` f32 ``[pairs, d_model]``, expert by
    expert as ``Routing.tokens_by_expert`` lists them; ``rows[e]`` and ``filled[e]`` are views of
    expert ``e``'s block and ``gather`` (``Routing.pair_rows``) is the row of each (token, slot),
    so ``LayerForward.finish`` combines with ``moe.ffn.weighted_sum`` without regrouping."""

    def __init__(self, routing: Routing, d_model: int):
        self.tokens = routing.tokens_by_expert()
        self.gather = routing.pair_rows()
        self.all = np.zeros((self.gather.size, d_model), dtype=np.float32)
        self.all_filled = np.zeros(self.gather.size, dtype=bool)
        self.pos, self.rows, self.filled = {}, {}, {}
        at = 0
        for e, toks in self.tokens.items():
            self.pos[e] = {t: i for i, t in enumerate(toks.tolist())}
            self.rows[e] = self.all[at:at + toks.size]
            self.filled[e] = self.all_filled[at:at + toks.size]
            at += toks.size

    def check(self, expert: int, tokens: list[int]) -> list[int]:
        """The rows of ``expert``'s block for ``tokens``; raises ``HolderFault`` for a pair that
        was never routed or is already filled."""
        pos = self.pos.get(expert)
        try:
            idx = [pos[t] for t in tokens]
        except (KeyError, TypeError):  # TypeError: no pairs of this expert at all (pos is None)
            raise HolderFault(f"answer for pairs of expert {expert} that were never routed") from None
        if self.filled[expert][idx].any():
            raise HolderFault(f"answer for pairs of expert {expert} that are already filled")
        return idx

    def put(self, expert: int, tokens: list[int], rows: np.ndarray) -> None:
        idx = self.check(expert, tokens)
        self.rows[expert][idx] = rows
        self.filled[expert][idx] = True

    def unfill(self, expert: int, tokens: list[int]) -> None:
        """Forget the rows of these pairs (an answer revoked after its holder was caught lying)."""
        idx = [self.pos[expert][t] for t in tokens]
        self.rows[expert][idx] = 0.0
        self.filled[expert][idx] = False

    def outstanding(self) -> dict[int, list[int]]:
        if self.all_filled.all():  # the usual case: one check instead of one per expert
            return {}
        return {e: self.tokens[e][~f].tolist() for e, f in self.filled.items() if not f.all()}


class LayerForward:
    """One MoE layer forward over remote holders, as named steps (module docstring).

    Construct, then ``await run()``. ``config``: the site's ``ForwardConfig`` (deadlines,
    split threshold, receipt checks). Per call: ``gate``, ``model_id``, ``layer``,
    ``hidden_states`` f32 [T, H] with H == gate.d_model; ``routing``: use this routing instead
    of the gate's (``gate`` may then be None; a split dense layer routes every token to every
    slice, ``prepare.dense.dense_routing``); the request's ``top_k``, ``allow_cold``,
    ``allow_partial`` and ``carrier`` (``wire.choose_carrier``).

    Collaborators: ``get_view(excluded)`` returns the live shard view without the ``excluded``
    providers; ``send(provider, holder_info, BatchRequest)`` executes one request on one
    holder. ``local(expert, rows f32 [n, H])``: the router's own runtime; returns the
    expert's output rows when it holds that expert (exact f32, no wire, no receipt), else
    None; a local error sends those pairs to the remote holders in the next round.
    ``fallback(expert, rows)``: the same for pairs every remote holder failed
    (``router.fallback``). ``scoreboard``: the router's ``router.scoreboard.Scoreboard``
    (holder order, outcomes, hedged probes); None keeps the view's order.
    ``saturated(t)``: whether the router itself was saturated since monotonic time ``t``; a
    deadline that expires then still moves the batch to the backup but is recorded with
    ``fault: False, saturated: True`` (the holder is not blamed for the router's own overload).
    ``audit()``: returns the forward's ``router.kvasir.KvasirAudit`` for receiptless Kvasir
    holders (``kvasir:<worker_id>``, transport "kvasir"), called once on a Kvasir holder's first
    batch; None refuses them work.

    Steps: ``route`` (gate or given routing, carrier choice, carrier rows encoded once),
    ``run_local`` (experts the router holds), ``plan_round`` (planner over the live view minus
    excluded providers), ``run_batch`` (one planned batch, whole, primary then warm backups),
    ``attempt`` (one request to one holder: deadline, shape, duplicate guard, receipt),
    ``finish`` (missing pairs, renormalization, combine).

    ``run`` raises ``ValueError`` for bad input (from ``route``, ``wire.choose_carrier``) and
    ``ForwardError`` with ``data["missing"] = [{layer, expert, tokens}]`` when pairs stay
    unserved and ``allow_partial`` is false, or the shared expert is missing.
    """

    def __init__(self, config: ForwardConfig, *, gate: Gate | None, model_id: str, layer: int,
                 hidden_states: np.ndarray, get_view: Callable[[frozenset], Awaitable[ShardView]], send: Send,
                 top_k: int | None = None, allow_cold: bool = False, allow_partial: bool = False,
                 carrier: str = "auto", routing: Routing | None = None,
                 local: Callable[[int, np.ndarray], np.ndarray | None] | None = None,
                 fallback: Callable[[int, np.ndarray], np.ndarray | None] | None = None,
                 scoreboard: Scoreboard | None = None, saturated: Callable[[float], bool] | None = None,
                 audit: Callable[[], Awaitable[object]] | None = None):
        self.gate, self.model_id, self.layer = gate, model_id, layer
        self.audit_of, self.audit = audit, None
        self.view_now: ShardView | None = None  # the last round's view (audit executors are found in it)
        self.scoreboard, self.saturated = scoreboard, saturated
        self.deadline_s, self.attempt_timeout_s = config.deadline_s, config.timeout_s
        # 0 (TENZRO_PLAN_SPLIT_THRESHOLD=0) never splits, as tenzro_moePlanDispatch reads it.
        self.split_threshold, self.verify = config.split_threshold or None, config.verify
        self.fallback = fallback
        self.hidden_states, self.get_view, self.send = hidden_states, get_view, send
        self.top_k, self.allow_cold, self.allow_partial = top_k, allow_cold, allow_partial
        self.carrier = carrier
        self.local, self.routing = local, routing
        self.excluded: set[str] = set()
        self.failures: list[dict] = []
        self.latencies: dict[str, list[float]] = {}
        self.transports: dict[str, int] = {"local": 0, "ws": 0, "http": 0, "iroh": 0, "kvasir": 0}
        self.receipts: list[dict] = []
        self.verified: list[VerifiedBatch] = []
        self.used: set[str] = set()
        self.receiptless: dict[str, list[tuple[int, list[int]]]] = {}  # kvasir holder → its accepted pairs
        self.batches = 0
        self.bytes_out = 0
        self.bytes_back = 0
        self.replans = 0
        self.local_ok = local is not None

    def route(self) -> None:
        """Routing, carrier/output encodings and the carrier rows encoded once.

        Raises ``ValueError`` for bad input (from ``route``, ``wire.choose_carrier``).
        """
        hs = self.hidden_states
        if self.routing is None:
            self.routing = route(self.gate, hs, self.top_k)
            self.d_model = self.gate.d_model
        else:
            self.d_model = int(hs.shape[1])
            if self.routing.expert_ids.shape[0] != hs.shape[0]:
                raise ParamError(f"routing has {self.routing.expert_ids.shape[0]} tokens, "
                             f"hidden_states {hs.shape[0]}", "hidden_states")
        self.x = np.ascontiguousarray(hs, dtype=np.float32)
        self.carrier_kind, self.output_kind = wire.choose_carrier(self.carrier, self.d_model, self.x)
        self.rows = _Rows(self.routing, self.d_model)
        # Rows encode independently, so each token's carrier row is encoded once and batches
        # gather their rows' bytes (a token routed to k experts is not quantized k times).
        self.encoded = np.frombuffer(wire.encode_rows(self.x, self.carrier_kind),
                                     dtype=np.uint8).reshape(self.x.shape[0], -1)

    async def run_local(self, expert: int, tokens: list[int]) -> None:
        """Execute ``expert`` on ``tokens`` with the router's own runtime (exact f32, no receipt);
        a local error disables local execution and leaves the pairs to the remote holders."""
        t = time.perf_counter()
        try:
            out = await asyncio.to_thread(self.local, expert, self.x[np.asarray(tokens, dtype=np.int64)])
            if out is None:
                return
            self.rows.put(expert, tokens, np.asarray(out, dtype=np.float32).reshape(len(tokens), self.d_model))
        except (ValueError, LookupError, HolderFault) as exc:
            self.local_ok = False
            self.failures.append({"provider": "local", "expert": expert, "error": str(exc), "fault": False})
            return
        self.latencies.setdefault("local", []).append((time.perf_counter() - t) * 1e3)
        self.transports["local"] += 1
        self.batches += 1

    async def attempt(self, provider: str, info, expert: int, tokens: list[int], payload: bytes) -> str:
        """One request to one holder, given up after ``attempt_timeout_s``; returns "ok", "late"
        (another answer filled the pairs first), "refused" (auth or a rejected request, no penalty) or "fault"
        (exclude the holder). Outcomes are recorded on the scoreboard."""
        layer, d_model = self.layer, self.d_model
        receiptless = is_kvasir(provider)
        executor = None
        if receiptless:  # nothing signs its rows: only work something trusted can re-execute goes there
            if self.audit is None and self.audit_of is not None:
                self.audit = await self.audit_of()
            executor = await self.audit.executor_for(expert, self.view_now) if self.audit is not None else None
            if executor is None:
                self.failures.append({"provider": provider, "expert": expert, "fault": False,
                                      "error": "receiptless work refused: no fallback replica or receipt-signing "
                                               "holder could audit it"})
                return "refused"
        req = BatchRequest(_request_id(), self.model_id, layer, expert, tokens, self.carrier_kind, payload,
                           self.output_kind, d_model)
        t = time.perf_counter()
        sent_at = time.monotonic()
        try:
            async with asyncio.timeout(self.attempt_timeout_s):  # in this task: wait_for would start one per batch
                ans = await self.send(provider, info, req)
                receipt = ans.receipt
                if ans.rows.shape != (len(tokens), d_model):
                    raise HolderFault(f"returned rows of shape {ans.rows.shape}, expected {(len(tokens), d_model)}")
                try:
                    self.rows.check(expert, tokens)
                except HolderFault as exc:  # a concurrent answer (a backup's) filled the pairs first
                    self.failures.append({"provider": provider, "expert": expert, "error": str(exc), "fault": False})
                    return "late"
                if receiptless:
                    try:
                        await self.audit.check(provider, expert, tokens, self.x[np.asarray(tokens, dtype=np.int64)],
                                               ans.rows, lambda ex: self.redo(ex, expert, tokens, payload), executor)
                    except AuditUnavailable as exc:  # a drawn audit that cannot run: the answer is not trusted
                        self.failures.append({"provider": provider, "expert": expert, "fault": False,
                                              "error": f"audit could not run: {exc}"})
                        return "refused"
                elif self.verify and ans.transport != "local":
                    receipt = await self.verified_receipt(provider, req, ans)
        except AuthRefusal as exc:
            self.failures.append({"provider": provider, "expert": expert, "error": f"auth refused: {exc}",
                                  "fault": False})
            return "refused"
        except Rejected as exc:  # our request was malformed: the holder is honest to refuse it
            self.failures.append({"provider": provider, "expert": expert, "error": str(exc), "fault": False})
            return "refused"
        except asyncio.TimeoutError:
            self._timed_out(provider, expert, sent_at, f"no answer within {self.attempt_timeout_s:g} s")
            return "fault"
        except (HolderFault, ReceiptError, ConnectionError, ValueError, OSError) as exc:
            self._fault(provider, expert, str(exc) or type(exc).__name__)
            return "fault"
        ms = (time.perf_counter() - t) * 1e3
        if self.scoreboard is not None:
            self.scoreboard.success(provider, ms, len(tokens))
        try:
            self.rows.put(expert, tokens, ans.rows)
        except HolderFault as exc:  # a concurrent answer filled the pairs first
            self.failures.append({"provider": provider, "expert": expert, "error": str(exc), "fault": False})
            return "late"
        self.latencies.setdefault(provider, []).append(ms)
        if receiptless:
            self.receiptless.setdefault(provider, []).append((expert, tokens))
        self.transports[ans.transport] = self.transports.get(ans.transport, 0) + 1
        self.bytes_out += ans.bytes_out
        self.bytes_back += ans.bytes_back
        self.used.add(provider)
        if receipt is not None:
            self.receipts.append({"provider": provider, "expert": expert, "tokens": len(tokens),
                                  "commitment": receipt["commitment"]})
            if self.verify and ans.transport != "local":
                self.verified.append(VerifiedBatch(provider, req, receipt, ans.rows))
        return "ok"

    async def redo(self, executor: str, expert: int, tokens: list[int], payload: bytes) -> np.ndarray:
        """Re-execute a receiptless batch for its audit on ``executor``: "site" (the fallback
        replica, from the exact f32 rows) or a receipt-signing holder of the last view (its
        receipt verified). Raises ``AuditUnavailable`` when that fails."""
        x = self.x[np.asarray(tokens, dtype=np.int64)]
        try:
            if executor == "site":
                out = await asyncio.to_thread(self.audit.fallback, expert, x)
                if out is None:
                    raise AuditUnavailable("the fallback replica lacks the expert's blob")
                return np.asarray(out, dtype=np.float32).reshape(len(tokens), self.d_model)
            info = next((h for h in (self.view_now.holders(self.layer, expert) if self.view_now else ())
                         if h.provider == executor), None)
            req = BatchRequest(_request_id(), self.model_id, self.layer, expert, tokens, self.carrier_kind,
                               payload, self.output_kind, self.d_model, purpose="selftest")
            async with asyncio.timeout(self.attempt_timeout_s):
                ans = await self.send(executor, info, req)
                if ans.rows.shape != (len(tokens), self.d_model):
                    raise HolderFault(f"returned rows of shape {ans.rows.shape}")
                if self.verify and ans.transport != "local":
                    await self.verified_receipt(executor, req, ans)
            return ans.rows
        except AuditUnavailable:
            raise
        except (asyncio.TimeoutError, HolderFault, ReceiptError, AuthRefusal, Rejected, ConnectionError,
                ValueError, LookupError, OSError) as exc:
            raise AuditUnavailable(f"{executor}: {str(exc) or type(exc).__name__}") from exc

    async def verified_receipt(self, provider: str, req: BatchRequest, ans: BatchAnswer) -> dict:
        """The receipt of ``req``'s remote answer once verified: a single receipt as it came, a
        message entry in its stored (sealed) form. The rows are checked against it at once
        (inline on the loop: a few hundred µs of small numpy calls, which a worker thread
        would only slow with GIL hand-offs); an entry then waits for its message's seal, whose
        signature is verified once per message (``MessageSeal.leaves``). Raises ``ReceiptError``."""
        kw = dict(provider=provider, request_id=req.request_id, model_id=self.model_id, layer=req.layer,
                  expert=req.expert, tokens=req.tokens, carrier_kind=req.carrier, carrier=req.payload, rows=ans.rows)
        if ans.seal is None or not is_entry(ans.receipt):
            return verify_receipt(ans.receipt, **kw)
        leaf = verify_entry(ans.receipt, **kw)
        entry_in_seal(ans.receipt, leaf, await ans.seal.leaves(provider))
        return sealed(ans.receipt, ans.seal.body)

    def _fault(self, provider: str, expert: int, error: str) -> None:
        self.failures.append({"provider": provider, "expert": expert, "error": error, "fault": True})
        if self.scoreboard is not None:
            self.scoreboard.fault(provider)

    def _timed_out(self, provider: str, expert: int, sent_at: float, error: str) -> None:
        """A request sent at monotonic ``sent_at`` ran out of time: the holder's fault, unless
        the router itself was saturated since then (recorded ``fault: False, saturated: True``)."""
        if self.saturated is not None and self.saturated(sent_at):
            self.failures.append({"provider": provider, "expert": expert, "fault": False, "saturated": True,
                                  "error": error + " while the router was saturated (not the holder's fault)"})
        else:
            self._fault(provider, expert, error)

    async def probe(self, provider: str, info, expert: int, tokens: list[int], payload: bytes) -> None:
        """A hedged probe: the batch's copy to ``provider`` (purpose "selftest", not metered)
        whose answer only scores the holder (verified receipt: success; error, bad answer or
        no answer within the deadline: fault). A receiptless Kvasir holder's probe is audited
        like its batches (``KvasirAudit.check``: a liar is quarantined on a drawn probe) and
        skipped when nothing trusted could re-execute it. Never touches the forward's rows or
        result."""
        sb = self.scoreboard
        req = BatchRequest(_request_id(), self.model_id, self.layer, expert, tokens, self.carrier_kind, payload,
                           self.output_kind, self.d_model, purpose="selftest")
        t = time.perf_counter()
        try:
            executor = None
            if is_kvasir(provider):  # unsigned rows earn no record unaudited: a liar's probes are its first batches
                if self.audit is None and self.audit_of is not None:
                    self.audit = await self.audit_of()
                executor = await self.audit.executor_for(expert, self.view_now) if self.audit is not None else None
                if executor is None:
                    return
            ans = await asyncio.wait_for(self.send(provider, info, req), self.deadline_s)
            if ans.rows.shape != (len(tokens), self.d_model):
                raise HolderFault(f"returned rows of shape {ans.rows.shape}")
            if executor is not None:
                await self.audit.check(provider, expert, tokens, self.x[np.asarray(tokens, dtype=np.int64)],
                                       ans.rows, lambda ex: self.redo(ex, expert, tokens, payload), executor)
            elif self.verify and ans.transport != "local":
                async with asyncio.timeout(self.deadline_s):
                    await self.verified_receipt(provider, req, ans)
        except (AuthRefusal, Rejected, AuditUnavailable):
            pass
        except (asyncio.TimeoutError, HolderFault, ReceiptError, ConnectionError, ValueError, OSError):
            sb.fault(provider)
        else:
            sb.success(provider, (time.perf_counter() - t) * 1e3, len(tokens))
        finally:
            sb.probe_done(provider)

    async def run_batch(self, batch, tokens: list[int]) -> None:
        """Send ``tokens`` of a planned batch to its primary; each time the newest request
        passes its holder's deadline (``holder_deadline``: from the holder's observed p99), or
        a request faults, the next warm backup not excluded gets it
        too, while the earlier requests keep running; the first verified answer wins. A
        holder that faulted, or missed the deadline while another answered, is excluded for
        the rest of the forward."""
        payload = self.encoded[np.asarray(tokens, dtype=np.int64)].tobytes()
        self.batches += 1
        queue = [(batch.provider, batch)] + [(b.provider, b) for b in batch.backups]
        queue = [t for t in queue if t[0] not in self.excluded]
        sb = self.scoreboard
        if sb is not None and queue and sb.state(queue[0][0]) == "proven":
            for provider, info in queue[1:]:
                if sb.claim_probe(provider):
                    task = asyncio.get_running_loop().create_task(
                        self.probe(provider, info, batch.expert, tokens, payload))
                    sb.probes.add(task)  # a probe outlives its forward: keep it referenced
                    task.add_done_callback(sb.probes.discard)
        loop = asyncio.get_running_loop()
        inflight: dict[asyncio.Task, tuple[str, float, float]] = {}  # task → (provider, sent, due)
        try:
            while True:
                newest = max(inflight.values(), key=lambda v: v[1]) if inflight else None
                if newest is None or (queue and loop.time() >= newest[2]):
                    while queue and queue[0][0] in self.excluded:
                        queue.pop(0)
                    if not queue and not inflight:
                        return
                    if queue:
                        provider, info = queue.pop(0)
                        now = loop.time()
                        inflight[loop.create_task(self.attempt(provider, info, batch.expert, tokens, payload))] = \
                            (provider, now, now + self.holder_deadline(provider))
                        newest = max(inflight.values(), key=lambda v: v[1])
                wait = max(0.0, newest[2] - loop.time()) if queue else None
                done, _ = await asyncio.wait(inflight, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    provider, _, _ = inflight.pop(task)
                    outcome = task.result()
                    if outcome in ("ok", "late"):
                        return
                    if outcome == "fault":
                        self.excluded.add(provider)
        finally:
            now = loop.time()
            for task, (provider, started, due) in inflight.items():
                if task.done():  # finished alongside the winner: its outcome is already recorded
                    continue
                task.cancel()
                if now >= due:  # a backup answered while this one was past its deadline
                    self.excluded.add(provider)
                    self._timed_out(provider, batch.expert, started,
                                    f"no answer within its {due - started:.3g} s deadline")

    def holder_deadline(self, provider: str) -> float:
        """Seconds ``provider`` has before the batch's next backup gets a copy: from its observed
        p99 (``Scoreboard.deadline_s``), at most ``deadline_s``; ``deadline_s`` without a scoreboard."""
        sb = self.scoreboard
        return sb.deadline_s(provider, self.deadline_s) if sb is not None else self.deadline_s

    async def plan_round(self, todo: dict[int, list[int]]) -> DispatchPlan:
        """Plan the outstanding pairs ``{expert: [tokens]}`` over the live view without the
        excluded providers. Raises ``ForwardError("planning")`` when the planner cannot."""
        view = await self.get_view(frozenset(self.excluded))
        self.view_now = view
        # The pairs are already grouped by expert with ascending tokens: the planner's batch step
        # directly, without plan_dispatch's per-token regrouping and validation.
        batches, unplanned, _ = plan_expert_batches(
            view, {(self.layer, e): toks for e, toks in todo.items()}, allow_cold=self.allow_cold,
            split_threshold=self.split_threshold,
            rank=self.scoreboard.planner_rank() if self.scoreboard is not None else None,
            avoid=self.scoreboard.failed_recently if self.scoreboard is not None else None)
        return DispatchPlan(view.model_id, batches, [], unplanned)

    async def execute(self) -> None:
        """Rounds of local execution, planning and batches until every pair is filled, nothing
        was plannable, or ``MAX_REPLANS`` replans were spent."""
        rows = self.rows
        while True:
            if self.local_ok:  # experts the router holds itself: no wire, no receipt
                await asyncio.gather(*(self.run_local(e, toks) for e, toks in sorted(rows.outstanding().items())))
            todo = rows.outstanding()
            if not todo:
                break
            plan = await self.plan_round(todo)
            # Each planned batch goes whole: the holder runs exactly the rows the monolithic forward
            # runs together (bit for bit); the transport splits it into frames and reassembles it.
            await asyncio.gather(*(self.run_batch(b, b.token_indices) for b in plan.batches))
            revoked = self.revoke_quarantined()
            if not rows.outstanding() or (self.replans >= MAX_REPLANS and not revoked):
                break
            if not plan.batches:
                break  # nothing was plannable: another round cannot change that
            self.replans += 1

    def revoke_quarantined(self) -> bool:
        """Unfill the pairs answered by Kvasir holders an audit quarantined during this forward (their
        unaudited answers are lies too, likely), so the next round recomputes them elsewhere;
        whether any were."""
        banned = self.audit.holders.banned_now() if self.audit is not None else set()
        revoked = False
        for provider in [p for p in self.receiptless if p in banned]:
            for expert, tokens in self.receiptless.pop(provider):
                self.rows.unfill(expert, tokens)
                revoked = True
            self.used.discard(provider)
            self.excluded.add(provider)
        return revoked

    async def run_fallback(self) -> None:
        """Pairs every remote holder failed, executed by the router's fallback replica
        (Kvasir's churn tolerance: the backbone node keeps every expert on disk); counted in
        ``transports["fallback"]``. A fallback that returns None or fails leaves them missing."""
        for expert, tokens in sorted(self.rows.outstanding().items()):
            try:
                out = await asyncio.to_thread(self.fallback, expert, self.x[np.asarray(tokens, dtype=np.int64)])
                if out is None:
                    continue
                self.rows.put(expert, tokens, np.asarray(out, dtype=np.float32).reshape(len(tokens), self.d_model))
            except (ValueError, LookupError, OSError) as exc:
                self.failures.append({"provider": "fallback", "expert": expert, "error": str(exc), "fault": False})
                continue
            self.transports["fallback"] = self.transports.get("fallback", 0) + 1
            self.batches += 1

    def finish(self) -> tuple[np.ndarray, Routing, list[dict]]:
        """The combined output f32 [T, H], the routing used and the missing pairs.

        Raises ``ForwardError`` when pairs stay unserved and ``allow_partial`` is false, the
        shared expert is missing, or renormalization fails.
        """
        routing, layer, rows, failures = self.routing, self.layer, self.rows, self.failures
        todo = rows.outstanding()
        missing = [{"layer": layer, "expert": int(e), "tokens": [int(t) for t in toks]}
                   for e, toks in sorted(todo.items())]
        use = routing
        if missing:
            shared_missing = routing.shared_slot is not None and routing.shared_slot in todo
            if not self.allow_partial or shared_missing:
                m = next((m for m in missing if m["expert"] == routing.shared_slot), missing[0]) if shared_missing \
                    else missing[0]
                last = next((f["error"] for f in reversed(failures) if f["expert"] == m["expert"]), None)
                what = "the shared expert" if shared_missing else "expert"
                if last is None:
                    raise ForwardError("planning", f"no live holder for {what} l{layer}/e{m['expert']} (tokens "
                                       f"{m['tokens']}); {len(missing)} expert(s) unserved",
                                       {"missing": missing, "failures": failures})
                raise ForwardError("execution", f"every holder of {what} l{layer}/e{m['expert']} failed (tokens "
                                   f"{m['tokens']}) after {self.replans} replan(s): {last}",
                                   {"missing": missing, "failures": failures})
            try:
                use = renormalized(routing, {e: set(t) for e, t in todo.items()})
            except ValueError as exc:
                raise ForwardError("execution", str(exc), {"missing": missing, "failures": failures}) from exc
            for e, toks in todo.items():
                rows.put(e, toks, np.zeros((len(toks), self.d_model), dtype=np.float32))
        output = weighted_sum(use.weights, rows.gather, rows.all)
        return output, use, missing

    async def run(self) -> ForwardResult:
        """route → execute → fallback → finish; the ``ForwardResult`` with timings (ms)."""
        t0 = time.perf_counter()
        self.route()
        t_gate = time.perf_counter()
        try:
            await self.execute()
        except ForwardError as exc:  # no live holder left to plan on: the fallback replica may still serve
            if self.fallback is None:
                raise
            self.failures.append({"provider": "planner", "expert": -1, "error": exc.message, "fault": False})
        if self.fallback is not None and self.rows.outstanding():
            await self.run_fallback()
        t_exec = time.perf_counter()
        output, use, missing = self.finish()
        t_end = time.perf_counter()
        return ForwardResult(
            output=output, routing=use, holders=sorted(self.used), batches=self.batches, replans=self.replans,
            missing=missing, failures=self.failures, latencies_ms=dict(self.latencies), transports=self.transports,
            bytes_out=self.bytes_out, bytes_back=self.bytes_back, receipts=self.receipts, verified=self.verified,
            timings_ms={"gate": round((t_gate - t0) * 1e3, 3), "execute": round((t_exec - t_gate) * 1e3, 3),
                        "combine": round((t_end - t_exec) * 1e3, 3), "total": round((t_end - t0) * 1e3, 3)})
