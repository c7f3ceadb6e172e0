"""The router of one site process: the state its serving path keeps between requests (gate and
view caches, holder clients, the holder scoreboard, forward admission, background recording,
the site's own runtime, the fallback replica, the loaded backbones, the repair timers) and
the forward entry points over it.

``router.apps.current()`` returns the process's ``Router`` (made by ``RouterConfig.ready``);
tests build a fresh one and ``router.apps.install`` it.

Transports (docs/DESIGN.md §6): experts held by the site's own runtime run in process (no wire,
no receipt); with ``ForwardConfig.transport`` ``"iroh"`` a holder advertising an iroh
endpoint is dialed there (``moe/execute``), with ``"http"`` a holder advertising an HTTP
endpoint is reached there with binary frames; otherwise, and as the fallback when the
preferred path cannot connect, over its agent WebSocket through the channel layer, then
over its HTTP endpoint.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid

import numpy as np
from channels.db import database_sync_to_async
from django.conf import settings

from moe.blobs import BlobStore
from moe.gating import Gate
from moe.jsonrpc import ParamError
from moe.messages import BatchAnswer, BatchRequest
from moe.runtime import ExpertRuntime, GateNotLoaded
from moe.shardmap import ReplicationPolicy, ShardView
from moe.transports import iroh
from moe.transports.http import HttpHolderClient
from prepare.dense import dense_model_id, dense_routing
from registry.models import GateBlob, MoeModel
from registry.selectors import expected_experts, holder_records, iroh_peers, live_rows, provider_infos
from registry.services import record_holder_outcomes
from router import services
from router.admission import Admission, Busy, overloaded
from router.fallback import FallbackReplica
from router.metrics import ServingMetrics
from router.forward import ForwardConfig, ForwardError, ForwardResult, LayerForward
from router.hooks import ForwardRecord, emit_forwards
from router.kvasir import KvasirAudit, KvasirHolders, policy_audit_terms
from moe.transports.kvasir import is_kvasir
from router.scoreboard import Scoreboard
from router.ws import held_here

log = logging.getLogger(__name__)


class UnknownModel(GateNotLoaded):
    """No gate of any layer is published for this model id on this site."""

    field = "model_id"


class Router:
    """One site process's serving state (module docstring) and its forwards.

    ``config``: a fixed ``ForwardConfig``; None follows ``settings.TENZRO`` (rebuilt when that
    mapping is replaced, as tests do with pytest-django's ``settings``). ``scoreboard`` and
    ``site_runtime`` replace the fresh ones (tests); the site runtime is otherwise created on
    first use.
    """

    def __init__(self, config: ForwardConfig | None = None, scoreboard: Scoreboard | None = None,
                 site_runtime: ExpertRuntime | None = None):
        self._config, self._fixed = config, config is not None
        self._config_of: object = None  # the settings.TENZRO mapping ``_config`` was built from
        self.scoreboard = scoreboard if scoreboard is not None else Scoreboard(here=held_here)
        self.fallback = FallbackReplica()
        self.kvasir = KvasirHolders()  # relay-wired Kvasir workers this router coordinates
        self._site_runtime = site_runtime
        self._runtime_lock = threading.Lock()
        self._gates: dict[str, Gate] = {}  # by blob hash
        self._gate_lock = threading.Lock()
        self._ttl: dict[tuple, tuple[float, object]] = {}
        self._loading: dict[tuple, asyncio.Future] = {}  # ``fresh_or_load``'s reads in flight, by key
        self._views: dict[str, tuple[tuple, ShardView]] = {}  # model id -> (provider rows, full view)
        self._infos_of: dict[str, tuple[tuple, tuple]] = {}  # model id -> ((live rows, expected), infos)
        # Holder clients keep connections bound to the event loop that opened them: one per loop.
        self._http: dict[int, HttpHolderClient] = {}
        self._iroh: dict[int, iroh.IrohHolderClient] = {}
        self._background: set[asyncio.Task] = set()  # holder outcomes and forward listeners being recorded
        self._admission: dict[int, Admission] = {}  # by event loop
        self.timers: dict[str, asyncio.Task] = {}  # the in-process beat stand-ins (router.repair)
        # Backbones loaded by ``router.generate.served_model``, by published content.
        self.models: dict[tuple, object] = {}
        self.models_lock = threading.Lock()
        # Continuous-batching schedulers (router.scheduler.scheduler_for), by (served model, event loop).
        self.schedulers: dict[tuple, object] = {}
        self.schedulers_lock = threading.Lock()
        self.metrics = ServingMetrics(self.scoreboard)

    @property
    def config(self) -> ForwardConfig:
        """The ``ForwardConfig`` every forward of this router runs with."""
        if not self._fixed:
            t = settings.TENZRO
            if t is not self._config_of:
                self._config, self._config_of = ForwardConfig.from_settings(t), t
        return self._config

    # -- caches --------------------------------------------------------------------------------

    def fresh(self, key: tuple):
        """The value ``cached`` holds for ``key`` while it is younger than ``view_cache_s``, else
        None: lets a coroutine skip the thread hop to the DB thread on a hit."""
        hit = self._ttl.get(key)
        if hit is not None and time.monotonic() - hit[0] < self.config.view_cache_s:
            return hit[1]
        return None

    def remember(self, key: tuple, value) -> None:
        """Hold ``value`` for ``key`` as ``cached`` would, from now (a value read elsewhere)."""
        self._ttl[key] = (time.monotonic(), value)

    async def fresh_or_load(self, key: tuple, load):
        """``fresh(key)``, or else the value of ``await load()`` held for ``key`` from now; the
        concurrent callers of one expired key share one ``load`` (when the cache expired under
        16 clients, each request read the database on a thread of its own: 5 % of the site's
        samples). A value expired less than ``view_cache_s`` ago is returned at once while the
        load refreshes it in the background (stale-while-revalidate: under steady traffic no
        request waits on the read; at 16 clients the refresh held every new request about
        10 ms). Raises what ``load`` raises, to every caller that waited on it (not cached)."""
        hit = self.fresh(key)
        if hit is not None:
            return hit
        stale = self._stale(key)
        pending = self._loading.get(key)
        if pending is None:
            pending = self._loading[key] = asyncio.ensure_future(load())

            def done(f: asyncio.Future) -> None:
                self._loading.pop(key, None)
                if f.cancelled():
                    return
                if f.exception() is None:
                    self.remember(key, f.result())
                elif stale is not None:  # nobody waited on it: say so; past the window a caller reads again
                    log.warning("background refresh of %s failed: %s", key, f.exception())

            pending.add_done_callback(done)
        if stale is not None:
            return stale
        return await asyncio.shield(pending)  # a caller that goes away leaves the read to the others

    def _stale(self, key: tuple):
        """The value held for ``key`` once it expired, while it is younger than twice
        ``view_cache_s`` (``fresh_or_load`` serves it while a refresh runs), else None."""
        hit = self._ttl.get(key)
        ttl = self.config.view_cache_s
        if hit is not None and ttl > 0 and time.monotonic() - hit[0] < 2 * ttl:
            return hit[1]
        return None

    def cached(self, key: tuple, fn):
        """``fn()`` memoized for ``view_cache_s`` seconds: per-forward DB reads of the shard view
        were most of a small forward's time; failover covers a view this stale."""
        hit = self._ttl.get(key)
        now = time.monotonic()
        if hit is not None and now - hit[0] < self.config.view_cache_s:
            return hit[1]
        value = fn()
        self._ttl[key] = (now, value)
        return value

    def load_gate(self, model_id: str, layer: int) -> Gate:
        """The gate of (model_id, layer) from its published blob, cached by content hash.

        Raises ``UnknownModel`` when no layer of the model is published, ``GateNotLoaded``
        when this layer has no gate blob.
        """
        h = self.cached(("gate", model_id, layer),
                        lambda: GateBlob.objects.filter(model_id=model_id, layer=layer)
                        .values_list("blob_hash", flat=True).first())
        if h is None:
            self._ttl.pop(("gate", model_id, layer), None)
            if not GateBlob.objects.filter(model_id=model_id).exists():
                raise UnknownModel(f"model {model_id!r} is not published on this site")
            layers = sorted(GateBlob.objects.filter(model_id=model_id).values_list("layer", flat=True))
            raise GateNotLoaded(f"no gate is loaded for model {model_id!r} layer {layer}; its MoE layers are "
                                f"{layers}")
        with self._gate_lock:
            gate = self._gates.get(h)
            if gate is None:
                gate = Gate.from_blob(BlobStore(settings.TENZRO["BLOB_DIR"]).get(h, verify=True))
                self._gates[h] = gate
        return gate

    async def gate(self, model_id: str, layer: int) -> Gate:
        """``load_gate`` without a thread hop while its blob hash is fresh in the TTL cache."""
        h = self.fresh(("gate", model_id, layer))
        if h is not None:
            with self._gate_lock:
                gate = self._gates.get(h)
            if gate is not None:
                return gate
        return await database_sync_to_async(self.load_gate)(model_id, layer)

    def live_view(self, model_id: str, exclude: frozenset = frozenset()) -> ShardView:
        """The live shard view of ``model_id`` without ``exclude`` (provider rows cached briefly;
        holders this process has not seen are seeded into the scoreboard from the database)."""
        return self._built(model_id, self.live_infos(model_id), exclude)

    def live_infos(self, model_id: str) -> tuple:
        """``_infos`` of ``model_id``, cached for ``view_cache_s`` (the key ``view`` reads)."""
        return self.cached(("infos", model_id), lambda: self._infos(model_id))

    def _built(self, model_id: str, infos: tuple, exclude: frozenset) -> ShardView:
        """The shard view of the provider rows ``infos`` (``_infos``) without ``exclude`` and the
        Kvasir workers this router quarantined. The full view (nothing excluded) is kept while
        ``infos`` is the cached object it was built from: a view is immutable and materializes
        each expert's holder list on first use, so every forward in the cache window plans on
        one view instead of re-indexing every holding per layer forward."""
        exclude = frozenset(exclude) | self.kvasir.banned_now()
        if not exclude:
            hit = self._views.get(model_id)
            if hit is not None and hit[0] is infos:
                return hit[1]
        view = ShardView.build(model_id, [p for p in infos[0] if p.provider not in exclude],
                               policy=ReplicationPolicy(), expected=infos[1])
        if not exclude:
            self._views[model_id] = (infos, view)
        return view

    def _infos(self, model_id: str) -> tuple:
        """(live provider infos, expected experts) of ``model_id`` from the database, after seeding
        the scoreboard with the providers it has not seen (``Scoreboard.seed``). The holdings
        are read again only when the live provider rows (``registry.selectors.live_rows``: each
        provider's fields and ``holdings_version``), the relay-connected Kvasir workers or the
        expected experts changed; otherwise the previous object is returned, so its built view
        (``_built``) stays in use."""
        rows, expected, workers = live_rows(), expected_experts(model_id), self.kvasir.infos(model_id)
        prev = self._infos_of.get(model_id)
        if prev is not None and prev[0] == (rows, expected, workers):
            infos = prev[1]
        else:
            infos = (provider_infos(model_id, rows) + workers, expected)
            self._infos_of[model_id] = ((rows, expected, workers), infos)
        unknown = self.scoreboard.unseeded([p.provider for p in infos[0]])
        if unknown:
            self.scoreboard.seed(holder_records(unknown), unknown)
        return infos

    async def view(self, model_id: str, excluded: frozenset) -> ShardView:
        """``live_view`` from the provider rows of ``fresh_or_load`` (no thread hop while they are
        fresh, and none for a forward while rows expired less than ``view_cache_s`` ago are
        refreshed in the background; a DB read on the site's DB thread else, shared by the
        forwards that missed together). Building the view from the rows is pure and cheap."""
        infos = await self.fresh_or_load(("infos", model_id),
                                         lambda: database_sync_to_async(self.live_infos)(model_id))
        return self._built(model_id, infos, excluded)

    # -- transports ----------------------------------------------------------------------------

    def http_client(self) -> HttpHolderClient:
        """The running loop's HTTP holder client."""
        loop = id(asyncio.get_running_loop())
        client = self._http.get(loop)
        if client is None:
            client = self._http[loop] = HttpHolderClient(self.config.timeout_s)
        return client

    def iroh_client(self) -> iroh.IrohHolderClient:
        """The running loop's iroh holder client (its endpoint bound to ``config.iroh_bind``)."""
        loop = id(asyncio.get_running_loop())
        client = self._iroh.get(loop)
        if client is None:
            client = self._iroh[loop] = iroh.IrohHolderClient(self.config.timeout_s, self.config.iroh_bind)
        return client

    async def send_iroh(self, provider: str, endpoint_id: str, req: BatchRequest) -> BatchAnswer:
        """One request to ``provider``'s iroh endpoint at the direct addresses of its last heartbeat.

        Raises ``ConnectionError`` (no addresses advertised for that endpoint id, cannot connect,
        stream broke), ``HolderFault`` or ``AuthRefusal``.
        """
        peers = self.fresh(("iroh_peers",))
        if peers is None:
            peers = await database_sync_to_async(self.cached)(("iroh_peers",), iroh_peers)
        eid, addrs = peers.get(provider, ("", []))
        if eid != endpoint_id or not addrs:
            raise ConnectionError(f"holder {provider[:12]}… advertises no direct address for iroh endpoint "
                                  f"{endpoint_id[:12]}…")
        return await self.iroh_client().execute(endpoint_id, addrs, req)

    async def send_batch(self, provider: str, holder, req: BatchRequest) -> BatchAnswer:
        """Send one request by the preferred transport the holder advertises (``config.transport``),
        then over its agent socket, then over its HTTP endpoint, moving on only when a path cannot
        connect (a ``ConnectionError``); the last path's error propagates."""
        if is_kvasir(provider):  # a relay-wired Kvasir worker: its relay socket is its only path
            return await self.kvasir.send(provider, req)
        mode = self.config.transport
        endpoint = getattr(holder, "http_endpoint", None)
        iroh_id = getattr(holder, "iroh_endpoint_id", None)
        paths = []
        if mode == "iroh" and iroh_id and iroh.available():
            paths.append(lambda: self.send_iroh(provider, iroh_id, req))
        if mode == "http" and endpoint:
            paths.append(lambda: self.http_client().execute_frame(endpoint, req))
        paths.append(lambda: services.send_ws(provider, req))
        if endpoint and mode != "http":
            paths.append(lambda: self.http_client().execute_frame(endpoint, req))
        for path in paths[:-1]:
            try:
                return await path()
            except ConnectionError:
                continue
        return await paths[-1]()

    def admission(self) -> Admission:
        """The running loop's forward admission, built from ``settings.TENZRO``
        (``FORWARD_CONCURRENCY``, ``FORWARD_QUEUE``, ``FORWARD_QUEUE_WAIT_S``) on first use and
        rebuilt when those change (tests); its lag probe runs on the loop."""
        t = settings.TENZRO
        conf = (t["FORWARD_CONCURRENCY"], t["FORWARD_QUEUE"], t["FORWARD_QUEUE_WAIT_S"])
        loop = id(asyncio.get_running_loop())
        adm = self._admission.get(loop)
        if adm is None or (adm.limit, adm.queue, adm.wait_s) != (max(1, conf[0]), max(0, conf[1]), conf[2]):
            adm = self._admission[loop] = Admission(*conf, observe=self.metrics.admission)
        adm.watch()
        return adm

    # -- the site's own runtime ----------------------------------------------------------------

    @property
    def site_runtime(self) -> ExpertRuntime:
        """This site process's own expert runtime (a router may hold experts itself), created on
        first use: budget ``TENZRO_MEMORY_BUDGET`` (or 60 % of available memory), disk tier
        ``$TENZRO_VAR_DIR/site-tier`` (re-indexed when the site restarts)."""
        with self._runtime_lock:
            if self._site_runtime is None:
                self._site_runtime = ExpertRuntime(disk_dir=settings.VAR_DIR / "site-tier")
            return self._site_runtime

    # -- forwards ------------------------------------------------------------------------------

    async def forward(self, model_id: str, layer: int, hidden_states: np.ndarray, *, top_k: int | None = None,
                      allow_cold: bool = False, allow_partial: bool = False, carrier: str = "auto",
                      fallback: bool = False, outcomes: "ForwardOutcomes | None" = None) -> ForwardResult:
        """One MoE layer forward of ``hidden_states`` f32 [T, H]: gate here, experts on the
        site's runtime or the holders, gate-weighted combine; ``ForwardResult.output`` f32 [T, H].

        ``fallback``: pairs every remote holder failed run on this site from its blob store
        (``router.fallback``; transport ``fallback``). Records each holder failure
        (reputation) and success (latency) through ``registry.services.record_holder_outcomes``,
        at once or, with ``outcomes`` (a generation's), batched there with the forward's
        settlement record. Raises ``UnknownModel``, ``GateNotLoaded``, ``ParamError`` (field
        ``d_model``: H is not the gate's), ``ValueError`` (bad top_k or carrier),
        ``ForwardError`` and ``Busy``.
        """
        gate = await self.gate(model_id, layer)
        d_model = int(hidden_states.shape[1])
        if d_model != gate.d_model:
            raise ParamError(f"d_model is {d_model} but the gate of layer {layer} has d_model {gate.d_model}",
                             "d_model")
        rt = self._site_runtime

        def local(expert: int, rows: np.ndarray) -> np.ndarray | None:
            """Experts this site's own runtime holds run here (no wire, no receipt)."""
            if not rt.has(model_id, layer, expert):
                return None
            return rt.execute(model_id, layer, expert, rows, rows.shape[0], rows.shape[1])

        admission = self.admission()
        return await self._recorded(admission, outcomes, LayerForward(
            self.config, gate=gate, model_id=model_id, layer=layer, hidden_states=hidden_states,
            get_view=lambda excluded: self.view(model_id, excluded), send=self.send_batch, top_k=top_k,
            allow_cold=allow_cold, allow_partial=allow_partial, carrier=carrier,
            local=local if rt is not None else None,
            fallback=self.fallback.for_layer(model_id, layer) if fallback else None,
            scoreboard=self.scoreboard, saturated=admission.saturated_since,
            audit=lambda: self.kvasir_audit(model_id, layer)))

    async def kvasir_audit(self, model_id: str, layer: int) -> KvasirAudit:
        """The audit of one forward's Kvasir batches (``router.kvasir``): the policy's audit rate
        and dispute tolerances, the site's fallback replica of the layer as the executor of
        choice (``has_fallback``: whether it holds an expert's blob, cached like the view)."""
        terms = self.fresh(("kvasir_terms",))
        if terms is None:
            terms = await database_sync_to_async(self.cached)(("kvasir_terms",), policy_audit_terms)
        run = self.fallback.for_layer(model_id, layer)

        async def has_fallback(expert: int) -> bool:
            key = ("fallback_blob", model_id, layer, expert)
            hit = self.fresh(key)
            if hit is None:
                hit = await database_sync_to_async(self.cached)(
                    key, lambda: self.fallback.holds(model_id, layer, expert))
            return hit

        return KvasirAudit(self.kvasir, model_id, layer, terms[0], terms[1], run, has_fallback)

    async def dense_forward(self, model_id: str, layer: int, hidden_states: np.ndarray, *, carrier: str = "auto",
                            fallback: bool = False, outcomes: "ForwardOutcomes | None" = None) -> ForwardResult:
        """A dense MLP layer of ``model_id`` split by intermediate slices over holders
        (``prepare.dense``), recombined in slice order: ``ForwardResult.output`` f32 [T, H];
        its routing sends every token to each of the ``expert_ids.shape[1]`` slices, the
        experts of ``dense_model_id(model_id)``. ``fallback``, ``outcomes``: as ``forward``'s.
        Raises ``GateNotLoaded`` when no dense slices are published for the layer with this
        H, ``ValueError``, ``ForwardError`` and ``Busy``.
        """
        dense_id = dense_model_id(model_id)
        d_model = int(hidden_states.shape[1])

        def parts_of() -> int | None:
            m = MoeModel.objects.filter(model_id=dense_id).first()
            return m.num_experts if m is not None and layer in m.moe_layers and m.hidden_size == d_model else None

        key = ("dense_parts", dense_id, layer, d_model)
        parts = self.fresh(key)
        if parts is None:
            parts = await database_sync_to_async(self.cached)(key, parts_of)
        if parts is None:
            raise GateNotLoaded(f"no dense slices of model {model_id!r} layer {layer} with d_model {d_model} are "
                                f"published")
        admission = self.admission()
        return await self._recorded(admission, outcomes, LayerForward(
            self.config, gate=None, routing=dense_routing(int(hidden_states.shape[0]), parts), model_id=dense_id,
            layer=layer, hidden_states=hidden_states, get_view=lambda excluded: self.view(dense_id, excluded),
            send=self.send_batch, carrier=carrier,
            fallback=self.fallback.for_layer(dense_id, layer) if fallback else None,
            scoreboard=self.scoreboard, saturated=admission.saturated_since))

    async def _recorded(self, admission: Admission, outcomes: "ForwardOutcomes | None",
                        fwd: LayerForward) -> ForwardResult:
        """``fwd.run()`` under a forward slot of ``admission`` (``Busy`` when none is free in
        time, or when the forward failed only because deadlines expired while this router
        was saturated); each holder's
        failures and latencies are recorded afterwards, also when the forward fails. A
        successful forward gets a fresh ``forward_id`` (set on the result) and is handed to
        the forward listeners (``router.hooks``: receipt sampling, settlement) in the
        background. With ``outcomes`` the outcomes and the record are added there instead."""
        try:
            async with admission.slot():  # raises Busy (-32005) at once past the concurrency and queue bounds
                res = await fwd.run()
        except Busy:
            self.metrics.forward(fwd.model_id, "busy", [])
            raise
        except ForwardError as exc:
            failures = exc.data.get("failures", [])
            self.metrics.holder_outcomes(failures, {})
            self.metrics.forward(fwd.model_id, exc.kind, failures)
            if outcomes is not None:
                outcomes.add(failures, {}, None)
            else:
                self.record_later(failures, {})
            if exc.kind == "execution" and overloaded(failures):
                raise Busy(f"the router is saturated: {exc.message}", "capacity",
                           max(1.0, self.config.deadline_s)) from exc
            raise
        res.forward_id = uuid.uuid4().hex
        record = ForwardRecord(res.forward_id, fwd.model_id, fwd.layer, res.verified)
        self.metrics.holder_outcomes(res.failures, res.latencies_ms)
        self.metrics.forward(fwd.model_id, "ok", res.failures)
        if outcomes is not None:
            outcomes.add(res.failures, res.latencies_ms, record)
        else:
            self.record_later(res.failures, res.latencies_ms)
            self.emit([record])
        return res

    # -- background recording ------------------------------------------------------------------

    def record_later(self, failures: list[dict], latencies: dict) -> None:
        """Record holder outcomes in the background: the caller's answer does not wait on the DB."""
        counts: dict[str, int] = {}
        for f in failures:
            if f.get("fault"):
                counts[f["provider"]] = counts.get(f["provider"], 0) + 1
        self.record_counts_later(counts, latencies)

    def record_counts_later(self, counts: dict[str, int], latencies: dict) -> None:
        """``record_holder_outcomes(counts, latencies)`` as a background task of the running loop."""
        if counts or latencies:
            self._keep(asyncio.get_running_loop().create_task(
                database_sync_to_async(record_holder_outcomes)(counts, latencies)))

    def emit(self, records: list[ForwardRecord]) -> None:
        """Hand finished forwards to the forward listeners (``router.hooks``) in the background."""
        for task in emit_forwards(records):
            self._keep(task)

    def _keep(self, task: asyncio.Task) -> None:
        self._background.add(task)  # the loop holds tasks weakly
        task.add_done_callback(self._background.discard)

    async def drain(self, timeout: float = 60.0) -> None:
        """Wait (up to ``timeout`` s) for the background recording and listener tasks started
        so far: tests and benches."""
        pending = [t for t in self._background if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout)

    def presence(self, provider: str, connected: bool) -> None:
        """An agent socket of ``provider`` opened or closed (``AgentLink`` presence): the scoreboard."""
        (self.scoreboard.connected if connected else self.scoreboard.disconnected)(provider)


class ForwardOutcomes:
    """Holder outcomes (failure counts, latencies) and finished-forward records of many
    forwards (a generation's layer forwards), handed on together: one
    ``record_holder_outcomes`` transaction and one ``Router.emit`` (receipt
    sampling, settlement) per ``flush`` instead of one of each per layer and decode step,
    which competed with the decode for the site's cores and its database thread.

    ``add`` flushes by itself once ``flush_s`` seconds passed since the last flush, so a long
    generation's reputations and settlements lag by at most that; the owner calls ``close``
    at the end (also when the generation failed or was cancelled): it flushes, and any forward
    still finishing afterwards (a cancelled generation's step runs on) is handed on at
    once. ``router``: whose background recording runs the outcomes. Used on the event loop only.
    """

    def __init__(self, router: Router, flush_s: float = 5.0):
        self.router, self.flush_s = router, flush_s
        self.failures: dict[str, int] = {}
        self.latencies: dict[str, list[float]] = {}
        self.records: list[ForwardRecord] = []
        self.closed = False
        self._flushed_at = time.monotonic()

    def add(self, failures: list[dict], latencies: dict[str, list[float]], record: ForwardRecord | None) -> None:
        """Add one forward's ``failures`` (those with ``fault`` count), ``latencies`` (ms per
        provider) and its ``record`` (None: the forward failed)."""
        for f in failures:
            if f.get("fault"):
                self.failures[f["provider"]] = self.failures.get(f["provider"], 0) + 1
        for p, ms in latencies.items():
            self.latencies.setdefault(p, []).extend(ms)
        if record is not None:
            self.records.append(record)
        if self.closed or time.monotonic() - self._flushed_at >= self.flush_s:
            self.flush()

    def flush(self) -> None:
        """Start recording what was added (background tasks on the running loop) and empty it."""
        self._flushed_at = time.monotonic()
        failures, latencies, records = self.failures, self.latencies, self.records
        self.failures, self.latencies, self.records = {}, {}, []
        self.router.record_counts_later(failures, latencies)
        self.router.emit(records)

    def close(self) -> None:
        """Flush, and from now on hand every added forward on at once."""
        self.closed = True
        self.flush()
