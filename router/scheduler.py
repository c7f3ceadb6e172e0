"""Continuous batching of whole-model generation (issue 21 items 1–3): one ``ModelScheduler``
per served model and event loop, kept by the process's ``router.state.Router``.

Every sequence of every generation (``tenzro_moeGenerate``, ``/v1/completions``,
``/v1/chat/completions``, streamed or not) waits in the scheduler's queue, is admitted when
its KV cache fits the budget, and from then on takes part in every step until it finishes:
one step runs the backbone once over the rows of all running sequences, so each MoE layer
is ONE distributed forward (``Router.forward``) for all of them (per distinct carrier and
fallback choice), and sixteen clients share each layer's round trip instead of paying
sixteen. Sequences join and leave between steps; each keeps its own sampling (temperature,
top-k, top-p, seed, stop ids and strings, max tokens) and its text (``router.detokenize``).

Prompts are prefilled in chunks: a step carries one row per decoding sequence plus at most
``TENZRO_PREFILL_CHUNK`` prompt rows (oldest prompt first), so a long prompt does not freeze
the others' streams. The backbone's math is row-invariant (``moe.rowwise``), so a
sequence's tokens do not depend on its neighbours or on how its prompt was chunked.

Memory and admission: a sequence reserves ``(prompt + max_new_tokens) × bytes per token`` of
KV cache (``Backbone.kv_bytes_per_token``); it waits while the running sequences'
reservations and its own exceed ``TENZRO_KV_BUDGET_BYTES`` or ``TENZRO_GEN_MAX_RUNNING``
sequences run; with ``TENZRO_GEN_QUEUE`` sequences waiting a new request gets ``Busy``
(HTTP 429 / -32005 with ``retry_after_s``). A cancelled request (its client went away) leaves
at the next step and frees its reservation.

The step loop is one task per scheduler on its event loop (started when work arrives, ended
when none is left): each step drives the backbone layer by layer (``Backbone.forward_steps``)
and awaits each layer forward on the loop it runs on, so a step pays no hand-off between
threads per layer (a worker thread waiting on ``run_coroutine_threadsafe`` per layer cost
the site, whose one GIL bounds it, about a tenth of its CPU per token for one client and
4 % at 16 clients on the shared 2-core machine). The backbone's
compute between two forwards runs on the loop while it is short (``ComputePlacement``:
under ``INLINE_MS`` per layer, measured), and in a worker thread when it is not (a large
model, a long prompt chunk), so holder traffic and other requests keep flowing meanwhile.

Micro-batch overlap (issue 22): with holders across the internet each MoE layer of a step
waits one round trip. A step therefore splits its sequences into up to
``TENZRO_GEN_MICROBATCHES`` micro-batches (whole requests each) that run the backbone at
once, each its own coroutine: while micro-batch A's expert rows are on the wire, B's
attention, norms and gating run (DeepSeek's two-micro-batch overlap, vLLM's dual-batch
overlap). Each micro-batch makes its own layer forwards, so each holder gets one message
per layer per micro-batch. ``OverlapModel`` picks the count from what earlier steps
measured (per-layer wait on the forward, per-sequence compute). Rows are row-invariant, so
the split changes no token.
"""
from __future__ import annotations

import asyncio
import collections
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from django.conf import settings

from moe.backbone import BackboneError
from moe.backbone.decode import Sampling, Sequence, next_token
from router.admission import Busy
from router.detokenize import Detokenizer
from router.forward import ForwardResult
from router.state import ForwardOutcomes, Router


@dataclass(frozen=True)
class SchedulerConfig:
    """``prefill_chunk``: prompt rows per step (≥ 1); ``kv_budget``: bytes of KV cache the
    running sequences may reserve; ``max_running``: sequences in a step; ``queue``: sequences
    that may wait for admission (beyond it: ``Busy``); ``microbatches``: most micro-batches
    of one step in flight at once (1: no overlap)."""

    prefill_chunk: int = 512
    kv_budget: int = 4 << 30
    max_running: int = 64
    queue: int = 256
    microbatches: int = 4

    @classmethod
    def from_settings(cls) -> "SchedulerConfig":
        """From ``settings.TENZRO`` (``GEN_PREFILL_CHUNK``, ``GEN_KV_BUDGET_BYTES``,
        ``GEN_MAX_RUNNING``, ``GEN_QUEUE``, ``GEN_MICROBATCHES``; README "Configuration")."""
        t = settings.TENZRO
        return cls(max(1, int(t.get("GEN_PREFILL_CHUNK", 512))), max(0, int(t.get("GEN_KV_BUDGET_BYTES", 4 << 30))),
                   max(1, int(t.get("GEN_MAX_RUNNING", 64))), max(0, int(t.get("GEN_QUEUE", 256))),
                   max(1, int(t.get("GEN_MICROBATCHES", 4))))


class OverlapModel:
    """How many micro-batches a step keeps in flight, from what earlier steps measured.

    ``observe(wait_ms, compute_ms, layers, sequences)`` takes one micro-batch's time blocked
    on its layer forwards (wire and holders) and its own backbone compute (attention, norms,
    gating, LM head), kept as EWMAs of the wait per layer ``W`` and of the compute per layer
    and sequence ``c``. ``count(cap, units, sequences)``: with ``n`` sequences in ``M``
    micro-batches, while one waits ``W`` the other ``M − 1`` compute ``(M − 1)·n·c / M``; the
    smallest ``M`` whose compute covers the wait, at most ``cap`` and ``units`` (requests: a
    request's sequences stay together). No split while the wait is under 10 % of the step's
    compute (nothing to hide: each split only adds a message per holder per layer) or before
    anything was measured.

    The model assumes the wait is time the router's cores are free; where the holders share
    those cores (or the forwards' own per-batch work dominates) a split only adds forwards,
    messages and receipts. So a split is also checked against what it delivers:
    ``realized(count, wall_ms, rows, sequences)`` keeps an EWMA of decode steps' wall time per row for
    each count and step size (sequences, in powers of two: a step of 16 is not compared with
    steps of one), and a split whose rows cost no less than unsplit steps' of that size (by
    ``MARGIN``) is not used. The unsplit figure is measured on the step after the first split
    one, and the other way is run again after ``PROBE_EVERY`` decode steps, so both figures
    stay current when the link or the load changes; each probe that leaves the verdict as it
    was doubles the wait for the next (up to ``PROBE_MAX`` steps), and a verdict that flips
    starts again from ``PROBE_EVERY``: on 2 shared cores a 4-way probe step took twice an
    unsplit one, and probing every 16th step cost a 16-client run 5 % of its steps' time.
    Steps that carry prompt rows follow the verdict and never probe: their time is not
    compared (``realized``), so a probe there would cost a step and teach nothing.

    A split only hides the wait where cores are idle during it; where the machine's cores are
    busy anyway (holders or other work on the router's cores, many clients), it only adds
    forwards, messages and receipts (on the shared 2-core machine at 16 clients: a quarter
    more CPU per token, site and holders together, when micro-batches ran in threads).
    ``idle(cores)`` takes the host's idle cores measured over an unsplit step (``HostIdle``),
    kept as an EWMA; below ``IDLE_MIN_CORES`` no step is split. Without measurements (not
    Linux, or never told) this gate is open.
    """

    ALPHA = 0.3
    MARGIN = 0.05
    PROBE_EVERY = 16
    PROBE_MAX = 512
    IDLE_MIN_CORES = 0.5

    def __init__(self):
        self.wait_ms: float | None = None  # per layer
        self.compute_ms: float | None = None  # per layer and sequence
        self.idle_cores: float | None = None  # the host's, during unsplit steps
        self.per_row_ms: dict[tuple[int, int], float] = {}  # (micro-batches, size class) -> wall per row
        self._probes: dict[int, list] = {}  # size class -> [verdict (split pays), probe interval, steps left]
        self._lock = threading.Lock()

    def observe(self, wait_ms: float, compute_ms: float, layers: int, sequences: int) -> None:
        """One micro-batch's measured times (ms) over ``layers`` forwards and ``sequences``."""
        if layers <= 0 or sequences <= 0:
            return
        w, c = wait_ms / layers, compute_ms / layers / sequences
        with self._lock:
            self.wait_ms = w if self.wait_ms is None else (1 - self.ALPHA) * self.wait_ms + self.ALPHA * w
            self.compute_ms = c if self.compute_ms is None else (1 - self.ALPHA) * self.compute_ms + self.ALPHA * c

    def idle(self, cores: float | None) -> None:
        """The host's idle cores averaged over one unsplit step (None: not measured)."""
        if cores is None or cores < 0:
            return
        with self._lock:
            old = self.idle_cores
            self.idle_cores = cores if old is None else (1 - self.ALPHA) * old + self.ALPHA * cores

    def count(self, cap: int, units: int, sequences: int, rows: int | None = None) -> int:
        """Micro-batches for a step of ``sequences`` in ``units`` requests and ``rows`` rows
        (None: one per sequence, a decode step) (class docstring)."""
        with self._lock:
            w, c, idle = self.wait_ms, self.compute_ms, self.idle_cores
        most = max(1, min(cap, units))
        if most == 1 or w is None or c is None or c <= 0:
            return 1
        if idle is not None and idle < self.IDLE_MIN_CORES:
            return 1  # no idle core for another micro-batch to compute on while one waits
        total = sequences * c
        if w < 0.1 * total:
            return 1
        m = next((m for m in range(2, most + 1) if (m - 1) * total / m >= w), most)
        return self._checked(m, sequences.bit_length(), rows is None or rows == sequences)

    def _checked(self, m: int, size: int, decode: bool = True) -> int:
        """``m`` (> 1, the model's count) or 1 for a step of size class ``size``, by what each
        delivered per row; only a ``decode`` step explores or probes (class docstring)."""
        with self._lock:
            one, split = self.per_row_ms.get((1, size)), self.per_row_ms.get((m, size))
            if split is None:
                return m if decode else 1
            if one is None:
                return 1  # the unsplit baseline of this size, once a split step was measured
            pays = split < (1 - self.MARGIN) * one
            probe = self._probes.get(size)
            if probe is None or probe[0] != pays:  # a new verdict: probe soon
                probe = self._probes[size] = [pays, self.PROBE_EVERY, self.PROBE_EVERY]
            if decode:
                probe[2] -= 1
                if probe[2] <= 0:  # run the other way once; the verdict held so far: wait longer next time
                    probe[1] = min(self.PROBE_MAX, 2 * probe[1])
                    probe[2] = probe[1]
                    return 1 if pays else m
            return m if pays else 1

    def realized(self, count: int, wall_ms: float, rows: int, sequences: int) -> None:
        """A step of ``sequences`` sequences and ``rows`` rows run in ``count`` micro-batches
        took ``wall_ms`` (kept for decode steps only: ``rows == sequences``)."""
        if rows <= 0 or sequences <= 0 or wall_ms < 0:
            return
        if rows != sequences:
            # Only decode steps (one row per sequence) are compared: a step carrying prompt rows
            # costs far less per row, so whichever count happened to meet new prompts looked cheap.
            return
        v, key = wall_ms / rows, (count, sequences.bit_length())
        with self._lock:
            old = self.per_row_ms.get(key)
            self.per_row_ms[key] = v if old is None else (1 - self.ALPHA) * old + self.ALPHA * v


class HostIdle:
    """Idle cores of this machine between two ``sample()`` calls, from the first line of
    ``/proc/stat`` (idle + iowait ticks over all ticks, times the CPUs listed there); None
    where that file cannot be read (not Linux). In a container it counts the host's CPUs."""

    def __init__(self, path: str = "/proc/stat"):
        self.path = path
        self.cpus = 0
        try:
            with open(path, "rb") as f:
                self.cpus = sum(1 for line in f if line.startswith(b"cpu") and line[3:4].isdigit())
        except OSError:
            pass
        self._last = self._read()

    def _read(self) -> tuple[int, int] | None:
        if not self.cpus:
            return None
        try:
            with open(self.path, "rb") as f:
                fields = f.readline().split()
        except OSError:
            return None
        if len(fields) < 5 or fields[0] != b"cpu":
            return None
        ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal (guest is in user)
        return ticks[3] + ticks[4], sum(ticks)

    def sample(self) -> float | None:
        """Idle cores averaged since the previous call (None: unknown, or no tick passed)."""
        now = self._read()
        last, self._last = self._last, now
        if now is None or last is None or now[1] <= last[1]:
            return None
        return (now[0] - last[0]) / (now[1] - last[1]) * self.cpus


class ComputePlacement:
    """Where a step's backbone compute runs: on the event loop (no hand-off between threads)
    or in a worker thread (the loop stays free while it runs), from what earlier steps measured.

    ``observe(rows, segment_ms)``: one micro-batch of ``rows`` rows took ``segment_ms`` of
    CPU per segment (its compute between two layer forwards, or before the first / after the last;
    the calling thread's CPU time: preemption on a busy machine does not count, BLAS helpers do not),
    kept as an EWMA per size class (``rows.bit_length()``: a segment's cost is mostly fixed
    per call at a few rows and grows with rows at many). ``inline(rows)``: whether the
    expected segment is at most ``INLINE_MS``. A class not measured yet is estimated from the
    nearest smaller measured class, scaled by the class's rows (an overestimate where fixed
    cost dominates: at worst one step runs in the thread and is measured), else from the
    nearest larger one; with nothing measured, inline up to ``COLD_ROWS`` rows.
    """

    ALPHA = 0.3
    INLINE_MS = 2.0
    COLD_ROWS = 16

    def __init__(self):
        self.segment_ms: dict[int, float] = {}  # size class -> EWMA ms per segment
        self._lock = threading.Lock()

    def observe(self, rows: int, segment_ms: float) -> None:
        """A micro-batch of ``rows`` rows computed ``segment_ms`` per segment."""
        if rows <= 0 or segment_ms < 0:
            return
        key = rows.bit_length()
        with self._lock:
            old = self.segment_ms.get(key)
            self.segment_ms[key] = segment_ms if old is None else (1 - self.ALPHA) * old + self.ALPHA * segment_ms

    def expected_ms(self, rows: int) -> float | None:
        """The expected ms per segment of a micro-batch of ``rows`` rows (None: nothing measured)."""
        key = max(1, rows).bit_length()
        with self._lock:
            known = dict(self.segment_ms)
        if key in known:
            return known[key]
        below = [k for k in known if k < key]
        if below:
            k = max(below)
            return known[k] * 2.0 ** (key - k)
        above = [k for k in known if k > key]
        return known[min(above)] if above else None

    def inline(self, rows: int) -> bool:
        """Whether a micro-batch of ``rows`` rows computes on the loop (class docstring)."""
        ms = self.expected_ms(rows)
        return rows <= self.COLD_ROWS if ms is None else ms <= self.INLINE_MS


def _advance(steps, out) -> tuple[bool, object, float, float]:
    """One segment of ``Backbone.forward_steps``: ``steps.send(out)`` as (finished, the next
    ``(layer, x)`` or the logits when finished, wall ms, this thread's CPU ms). StopIteration
    is turned into a value so the call can run in an executor (a future cannot carry it)."""
    t, c = time.perf_counter(), time.thread_time()
    try:
        value, done = steps.send(out), False
    except StopIteration as stop:
        value, done = stop.value, True
    return done, value, (time.perf_counter() - t) * 1e3, (time.thread_time() - c) * 1e3


def kv_reservation(backbone, prompt_tokens: int, max_new_tokens: int) -> int:
    """Bytes of KV cache a sequence of ``prompt_tokens`` may grow to with ``max_new_tokens``
    more (capped at the context)."""
    positions = min(prompt_tokens + max_new_tokens, backbone.max_position)
    return positions * backbone.kv_bytes_per_token()


class Request:
    """One generation submitted to a scheduler: its sequences (``moe.backbone.decode.Sequence``,
    one per prompt), sampling, ``carrier`` and ``fallback`` of its layer forwards, ``stats``
    (an object with ``add(label, ForwardResult, step)``: ``router.generate.LayerStats``),
    ``keep_logits`` (prompt logits wanted), ``on_tokens(list[Sequence])`` (called on the
    scheduler's loop with the sequences that gained a token), and ``future`` (on the scheduler's
    loop: the sequences when all finished, or the exception that ended them).
    ``timings`` (ms): ``queued`` (submission → admission of the last sequence), ``prefill``
    (submission → every first token), ``decode`` (→ finish)."""

    def __init__(self, gen_id: str, prompts: list[np.ndarray], sampling: Sampling, carrier: str, fallback: bool,
                 stats, keep_logits: bool = False, on_tokens=None):
        self.gen_id, self.sampling, self.carrier, self.fallback = gen_id, sampling, carrier, fallback
        self.stats, self.keep_logits, self.on_tokens = stats, keep_logits, on_tokens
        seed = sampling.seed
        self.seqs = [Sequence(np.asarray(p, dtype=np.int64), None,
                              np.random.default_rng(None if seed is None else seed + i), index=i)
                     for i, p in enumerate(prompts)]
        self.future: asyncio.Future | None = None
        self.cancelled = False
        self.step = 0  # steps this request took part in (the LayerStats step index)
        self.t0 = time.perf_counter()
        self.t_admitted = self.t_first = self.t_done = None

    @property
    def timings(self) -> dict:
        """Milliseconds: ``queued``, ``prefill`` (to every first token), ``decode``, ``total``."""
        def ms(a, b):
            return round((b - a) * 1e3, 3) if a is not None and b is not None else 0.0

        return {"queued": ms(self.t0, self.t_admitted), "prefill": ms(self.t0, self.t_first),
                "decode": ms(self.t_first, self.t_done), "total": ms(self.t0, self.t_done)}


@dataclass(eq=False)
class _Slot:
    """A sequence in the scheduler: its request, prompt rows already in the cache, KV bytes
    reserved, when its last token came, its prompt logits so far, its text (stops matched)."""

    request: Request
    seq: Sequence
    reserved: int
    fed: int = 0
    last_token_at: float | None = None
    logits: list = field(default_factory=list)
    text: Detokenizer | None = None


class Reservation:
    """Room for ``sequences`` in a scheduler's waiting queue (``ModelScheduler.reserve``),
    given back once: when ``submit`` consumes it, on ``release()``, or when it is dropped
    unused (a stream whose iterator never started)."""

    def __init__(self, scheduler: "ModelScheduler", sequences: int):
        self.sequences = sequences
        self._finalizer = weakref.finalize(self, scheduler._unreserve, sequences)

    def release(self) -> None:
        """Give the room back (idempotent)."""
        self._finalizer()


class ModelScheduler:
    """The continuous-batching scheduler of one served model (``router.generate.ServedModel``)
    on one event loop (module docstring). ``submit`` (on the loop) queues a ``Request`` and
    raises ``Busy`` when the queue is full; ``cancel`` makes its sequences leave at the next
    step. ``steps`` counts steps run, ``step_sizes`` keeps the rows of the last 1,000 steps
    (tests, benches)."""

    def __init__(self, router: Router, served, loop: asyncio.AbstractEventLoop):
        self.router, self.served, self.loop = router, served, loop
        self.model_id = served.model_id
        self.outcomes = ForwardOutcomes(router)
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Slot] = collections.deque()
        self._running: list[_Slot] = []
        self._reserved = 0
        self._reserved_seqs = 0  # room taken by reserve() for submits to come
        self._task: asyncio.Task | None = None  # the step loop, while sequences wait or run
        self.steps = 0
        self.step_sizes: collections.deque[tuple[int, int]] = collections.deque(maxlen=1000)  # (sequences, rows)
        # Per step: {wall, compute, wire, idle (ms), microbatches, rows} (benches, tests).
        self.timeline: collections.deque[dict] = collections.deque(maxlen=1000)
        self.overlap = OverlapModel()
        self.placement = ComputePlacement()
        self.host = HostIdle()
        self._pool: ThreadPoolExecutor | None = None  # compute segments too long for the loop
        self._m = router.metrics

    # -- the loop's side -----------------------------------------------------------------------

    def _full(self, config: SchedulerConfig, sequences: int) -> Busy | None:
        """``Busy`` when ``sequences`` more would overflow the waiting queue (waiting and
        reserved count alike), else None. Called under ``_cond``."""
        queued = len(self._waiting) + self._reserved_seqs
        if queued + sequences > config.queue and (queued or sequences > config.max_running):
            return Busy(f"the router is busy: {queued} sequences wait for model {self.model_id!r} "
                        f"(TENZRO_GEN_QUEUE {config.queue})", "capacity", 1.0)
        return None

    def reserve(self, sequences: int = 1) -> Reservation:
        """Take room for ``sequences`` in the waiting queue now, for a ``submit`` to come (the
        streaming endpoint decides its 429 before its 200 goes out, and the requests admitted
        meanwhile cannot take that room). Raises ``Busy`` when the queue is full."""
        with self._cond:
            busy = self._full(SchedulerConfig.from_settings(), sequences)
            if busy is not None:
                raise busy
            self._reserved_seqs += sequences
        return Reservation(self, sequences)

    def _unreserve(self, sequences: int) -> None:
        with self._cond:
            self._reserved_seqs -= sequences

    def submit(self, request: Request, reservation: Reservation | None = None) -> None:
        """Queue ``request``'s sequences (called on the scheduler's loop; sets
        ``request.future``). Raises ``Busy`` when the waiting queue is full (never with a
        ``reservation`` from ``reserve``, which it consumes) and ``BackboneError`` (field
        ``max_new_tokens``) when one sequence alone needs more KV cache than the whole budget."""
        config = SchedulerConfig.from_settings()
        bb = self.served.backbone
        slots = []
        for seq in request.seqs:
            need = kv_reservation(bb, int(seq.prompt.size), request.sampling.max_new_tokens)
            if need > config.kv_budget:
                raise BackboneError(f"max_new_tokens: the sequence may grow to {need} bytes of KV cache, over this "
                                    f"site's budget of {config.kv_budget} (TENZRO_KV_BUDGET_BYTES)", "max_new_tokens")
            seq.cache = bb.new_cache(int(seq.prompt.size) + request.sampling.max_new_tokens)
            slots.append(_Slot(request, seq, need, text=self.served.detokenizer(request.sampling)))
        request.future = self.loop.create_future()
        with self._cond:
            if reservation is not None:  # admitted when reserved: its room becomes these waiting sequences
                reservation.release()
            else:
                busy = self._full(config, len(slots))
                if busy is not None:
                    raise busy
            self._waiting.extend(slots)
            self._m.waiting.labels(self.model_id).set(len(self._waiting))
            if self._task is None:
                self._task = self.loop.create_task(self._run(), name=f"scheduler-{self.model_id}")

    def cancel(self, request: Request) -> None:
        """Make ``request``'s sequences leave at the next step (its client went away)."""
        with self._cond:
            request.cancelled = True

    def counts(self) -> tuple[int, int]:
        """(sequences waiting, sequences running) now."""
        with self._cond:
            return len(self._waiting), len(self._running)

    def idle(self) -> bool:
        """No sequence waits or runs."""
        with self._cond:
            return not self._waiting and not self._running

    # -- the step loop -------------------------------------------------------------------------

    def _settle(self, request: Request, result=None, exc: BaseException | None = None) -> None:
        """End ``request``'s future (on the loop; ignored once the future is done)."""
        fut = request.future
        if fut is not None and not fut.done():
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

    def _drop(self, request: Request, exc: BaseException | None, outcome: str) -> None:
        """Remove every slot of ``request`` (caller holds the lock), release its reservations
        and settle it with ``exc`` (None: cancelled, nothing to hand back)."""
        for slot in [s for s in self._running if s.request is request]:
            self._running.remove(slot)
            self._reserved -= slot.reserved
        for slot in [s for s in self._waiting if s.request is request]:
            self._waiting.remove(slot)
        self._m.requests.labels(self.model_id, outcome).inc()
        if exc is not None:
            self._settle(request, exc=exc)

    def _admit(self, config: SchedulerConfig) -> None:
        """Move waiting slots to running, first come first served, while they fit (lock held).
        One sequence always runs when none does (its own need was checked at submit)."""
        while self._waiting:
            slot = self._waiting[0]
            if self._running and (len(self._running) >= config.max_running
                                  or self._reserved + slot.reserved > config.kv_budget):
                break
            self._waiting.popleft()
            self._running.append(slot)
            self._reserved += slot.reserved
            req = slot.request
            if not any(s.request is req for s in self._waiting):
                req.t_admitted = time.perf_counter()

    async def _run(self) -> None:
        try:
            while True:
                config = SchedulerConfig.from_settings()
                with self._cond:
                    for req in {s.request for s in list(self._running) + list(self._waiting) if s.request.cancelled}:
                        self._drop(req, None, "cancelled")
                    self._admit(config)
                    m = self._m
                    m.waiting.labels(self.model_id).set(len(self._waiting))
                    m.running.labels(self.model_id).set(len(self._running))
                    m.kv_budget.set(config.kv_budget)
                    if not self._running:
                        self._task = None
                        m.kv_bytes.labels(self.model_id).set(0)
                        break
                    batch = self._plan(config)
                try:
                    await self._step(batch, config)
                except BaseException as exc:  # a layer forward failed: every sequence of the step ends with it
                    with self._cond:
                        for req in {s.request for s, _ in batch}:
                            self._drop(req, exc if isinstance(exc, Exception) else RuntimeError(str(exc)), "error")
                    if not isinstance(exc, Exception):
                        raise
                await asyncio.sleep(0)  # what arrived during the step (requests, cancels) runs before the next
        finally:
            with self._cond:
                if self._task is asyncio.current_task():  # cancelled (the loop is closing): a later submit starts anew
                    self._task = None
        self.outcomes.flush()

    def _plan(self, config: SchedulerConfig) -> list[tuple[_Slot, np.ndarray]]:
        """This step's rows (lock held): the last token of each decoding slot, then prompt
        chunks of prefilling slots in admission order within ``prefill_chunk`` rows."""
        batch, budget = [], config.prefill_chunk
        for slot in self._running:
            p = slot.seq.prompt
            if slot.fed >= p.size:
                batch.append((slot, np.array([slot.seq.output[-1]], dtype=np.int64)))
            elif budget > 0:
                n = min(budget, p.size - slot.fed)
                batch.append((slot, p[slot.fed:slot.fed + n]))
                budget -= n
        return batch

    def _mlp(self, batch: list[tuple[_Slot, np.ndarray]], spent: list[float] | None = None):
        """A coroutine function ``mlp(layer, x)`` (x float32 ``[N, H]`` → ``[N, H]``), the MLP
        of one step's layer: one distributed forward for each (carrier, fallback) group of rows
        (one group unless requests differ); each request's ``stats`` records the forwards it
        took part in; ``spent[0]`` adds the forwards' own time (ms, the longest of a layer's
        groups)."""
        served, router = self.served, self.router
        groups: dict[tuple[str, bool], list[int]] = {}
        requests: dict[tuple[str, bool], list[Request]] = {}
        row = 0
        for slot, ids in batch:
            key = (slot.request.carrier, slot.request.fallback)
            groups.setdefault(key, []).extend(range(row, row + ids.size))
            if slot.request not in requests.setdefault(key, []):
                requests[key].append(slot.request)
            row += ids.size
        index = {k: np.asarray(v, dtype=np.int64) for k, v in groups.items()}

        def call(layer: int, x: np.ndarray, carrier: str, fallback: bool):
            if layer in served.moe_layers:
                return router.forward(served.model_id, layer, x, carrier=carrier, fallback=fallback,
                                      outcomes=self.outcomes)
            if layer in served.dense_layers:
                return router.dense_forward(served.model_id, layer, x, carrier=carrier, fallback=fallback,
                                            outcomes=self.outcomes)
            raise BackboneError(f"layer {layer} of {served.model_id!r} has neither published experts nor dense "
                                f"slices")

        async def run_all(layer: int, x: np.ndarray) -> list[ForwardResult]:
            if len(index) == 1:
                (carrier, fallback), = index
                return [await call(layer, x, carrier, fallback)]
            return list(await asyncio.gather(*(call(layer, np.ascontiguousarray(x[ix]), c, f)
                                               for (c, f), ix in index.items())))

        async def mlp(layer: int, x: np.ndarray) -> np.ndarray:
            results = await run_all(layer, x)
            if len(results) == 1:
                out = results[0].output
            else:
                out = np.empty_like(x)
                for ix, res in zip(index.values(), results):
                    out[ix] = res.output
            if spent is not None:
                spent[0] += max(r.timings_ms.get("total", 0.0) for r in results)
            for key, res in zip(index, results):
                for req in requests[key]:
                    req.stats.add(f"{req.gen_id}/{req.step}/{layer}", res, req.step)
            return out

        return mlp

    @staticmethod
    def _split(batch: list[tuple[_Slot, np.ndarray]], count: int) -> list[list[int]]:
        """Indices of ``batch`` in ``count`` micro-batches of whole requests, contiguous in
        first-seen request order, balanced by rows (fewer when there are fewer requests)."""
        units: dict[int, list[int]] = {}
        for i, (slot, _) in enumerate(batch):
            units.setdefault(id(slot.request), []).append(i)
        groups = list(units.values())
        count = max(1, min(count, len(groups)))
        if count == 1:
            return [list(range(len(batch)))]
        rows = [sum(int(batch[i][1].size) for i in g) for g in groups]
        total, parts, acc = sum(rows), [[]], 0
        for k, (g, r) in enumerate(zip(groups, rows)):
            left = len(groups) - k  # requests not placed yet, this one included
            if parts[-1] and len(parts) < count and (acc >= total * len(parts) / count or left <= count - len(parts)):
                parts.append([])
            parts[-1].extend(g)
            acc += r
        return parts

    def _workers(self, count: int) -> ThreadPoolExecutor:
        """The threads that run compute segments too long for the loop (one per micro-batch)."""
        if self._pool is None or self._pool._max_workers < count:
            self._pool = ThreadPoolExecutor(max_workers=max(4, count), thread_name_prefix=f"compute-{self.model_id}")
        return self._pool

    async def _micro(self, part: list[tuple[_Slot, np.ndarray]], select: list[str],
                     count: int) -> tuple[list, float, float, int, float]:
        """Run the backbone over one micro-batch (of ``count``), its compute between layer
        forwards on the loop or in a worker thread (``ComputePlacement``): (logits, wall ms,
        ms not computing (blocked on layer forwards, or on the others' compute), forwards
        made, ms the forwards themselves took on the loop)."""
        t0 = time.perf_counter()
        spent = [0.0]
        mlp = self._mlp(part, spent)
        rows = int(sum(ids.size for _, ids in part))
        inline = self.placement.inline(rows)
        steps = self.served.backbone.forward_steps([ids for _, ids in part], [s.seq.cache for s, _ in part],
                                                   select=select)
        computed, cpu, calls, out = 0.0, 0.0, 0, None
        while True:
            if inline:
                done, value, ms, cpu_ms = _advance(steps, out)
            else:
                done, value, ms, cpu_ms = await self.loop.run_in_executor(self._workers(count), _advance, steps, out)
            computed += ms
            cpu += cpu_ms
            if done:
                break
            layer, x = value
            out = await mlp(layer, x)
            calls += 1
        # CPU time, not wall: on a loaded machine preemption would make short segments look long.
        self.placement.observe(rows, cpu / (calls + 1))
        wall = (time.perf_counter() - t0) * 1e3
        return value, wall, max(0.0, wall - computed), calls, spent[0]

    async def _forward(self, batch: list[tuple[_Slot, np.ndarray]], select: list[str],
                       count: int) -> tuple[list, dict]:
        """The step's logits in ``batch`` order, its micro-batches run at once (one coroutine
        each), and the step's timeline entry (ms: ``compute`` summed over micro-batches,
        ``wire`` a micro-batch's mean wait on its forwards, ``forward`` of which the forwards
        ran on the loop (the rest: the other micro-batches' compute, hand-offs to compute
        threads), ``idle`` the wall the router did not compute); the first micro-batch error
        is raised after all ended."""
        parts = self._split(batch, count)
        runs = [([batch[i] for i in p], [select[i] for i in p]) for p in parts]
        t0 = time.perf_counter()
        if len(runs) > 1:
            results = await asyncio.gather(*(self._micro(p, s, len(runs)) for p, s in runs), return_exceptions=True)
            error = next((r for r in results if isinstance(r, BaseException)), None)
            if error is not None:
                raise error
        else:
            results = [await self._micro(*runs[0], 1)]
        wall = (time.perf_counter() - t0) * 1e3
        logits: list = [None] * len(batch)
        compute = wire = forward = 0.0
        for p, (lg, ms, waited, calls, spent) in zip(parts, results):
            for i, out in zip(p, lg):
                logits[i] = out
            compute += ms - waited
            wire += waited
            forward += spent
            self.overlap.observe(waited, ms - waited, calls, len(p))
        entry = {"wall": round(wall, 3), "compute": round(compute, 3), "wire": round(wire / len(parts), 3),
                 "forward": round(forward / len(parts), 3),
                 "idle": round(max(0.0, wall - compute), 3), "microbatches": len(parts),
                 "rows": int(sum(ids.size for _, ids in batch))}
        return logits, entry

    async def _step(self, batch: list[tuple[_Slot, np.ndarray]], config: SchedulerConfig | None = None) -> None:
        """Run one step over ``batch`` (in micro-batches, ``OverlapModel``) and hand out its
        tokens and finished requests."""
        config = config or SchedulerConfig.from_settings()
        t0 = time.perf_counter()
        bb = self.served.backbone
        select, gains = [], []
        for slot, ids in batch:
            last = slot.fed + ids.size >= slot.seq.prompt.size  # decode rows, or a prompt's final chunk
            keep = slot.request.keep_logits and slot.fed < slot.seq.prompt.size
            select.append("all" if keep else "last" if last else "none")
            gains.append(last)
        count = self.overlap.count(config.microbatches, len({id(s.request) for s, _ in batch}), len(batch),
                                   int(sum(ids.size for _, ids in batch)))
        self.host.sample()  # the step's idle cores are counted from here
        logits, entry = await self._forward(batch, select, count)

        def choose() -> list[int | None]:  # each sequence's own RNG: the order of the draws changes nothing
            return [next_token(lg[-1], slot.request.sampling, slot.seq.rng) if gain else None
                    for (slot, _), lg, gain in zip(batch, logits, gains)]

        # Sampling a large vocabulary (top-p sorts it) goes where the step's compute went.
        if all(slot.request.sampling.temperature == 0 for slot, _ in batch) or self.placement.inline(entry["rows"]):
            chosen = choose()
        else:
            chosen = await self.loop.run_in_executor(self._workers(1), choose)
        idle = self.host.sample()
        if entry["microbatches"] == 1:
            self.overlap.idle(idle)
        self.overlap.realized(entry["microbatches"], entry["wall"], entry["rows"], len(batch))
        now = time.perf_counter()
        rows = entry["rows"]
        self.steps += 1
        self.step_sizes.append((len(batch), rows))
        self.timeline.append(entry)
        m, model = self._m, self.model_id
        m.step_rows.labels(model).observe(rows)
        m.step_seconds.labels(model).observe(now - t0)
        m.step_timeline(model, entry)
        advanced: dict[int, list[Sequence]] = {}
        reqs: dict[int, Request] = {}
        prompt_rows = 0
        for (slot, ids), lg, tok in zip(batch, logits, chosen):
            req, seq = slot.request, slot.seq
            reqs[id(req)] = req
            prefilling = slot.fed < seq.prompt.size
            if prefilling:
                slot.fed += ids.size
                prompt_rows += ids.size
                if req.keep_logits:
                    slot.logits.append(lg)
                if slot.fed < seq.prompt.size:
                    continue
                if req.keep_logits:
                    seq.prompt_logits = np.concatenate(slot.logits)
                    slot.logits = []
            seq.output.append(tok)
            if slot.text.push(tok):  # a stop id or stop string (router.detokenize)
                seq.finish_reason = "stop"
            elif len(seq.output) >= req.sampling.max_new_tokens or seq.cache.length + 1 > bb.max_position:
                seq.finish_reason = "length"
                slot.text.flush()
            seq.text = slot.text.text
            if slot.last_token_at is None:
                m.ttft.labels(model).observe(now - req.t0)
            else:
                m.itl.labels(model).observe(now - slot.last_token_at)
            slot.last_token_at = now
            advanced.setdefault(id(req), []).append(seq)
        m.tokens.labels(model).inc(sum(len(v) for v in advanced.values()))
        if prompt_rows:
            m.prompt_tokens.labels(model).inc(prompt_rows)
        finished, done_slots = [], [slot for slot, _ in batch if slot.seq.finish_reason is not None]
        for key, req in reqs.items():
            req.step += 1
            if key in advanced and req.on_tokens is not None and not req.cancelled:
                try:
                    req.on_tokens(advanced[key])
                except Exception:  # a consumer's callback must not stop the others' step
                    pass
            if req.t_first is None and all(s.output for s in req.seqs):
                req.t_first = now
            if all(s.finish_reason is not None for s in req.seqs):
                req.t_done = now
                finished.append(req)
        with self._cond:
            for slot in done_slots:  # a finished sequence leaves now, its request's others run on
                if slot in self._running:
                    self._running.remove(slot)
                    self._reserved -= slot.reserved
            for req in finished:
                self._m.requests.labels(model, "ok").inc()
                self._settle(req, result=req.seqs)
            m.kv_bytes.labels(model).set(sum(s.seq.cache.nbytes for s in self._running))


def scheduler_for(router: Router, served, loop: asyncio.AbstractEventLoop | None = None) -> ModelScheduler:
    """The scheduler of ``served`` on ``loop`` (default: the running loop), made on first use
    and kept in ``router.schedulers``; schedulers of closed loops are forgotten."""
    loop = loop or asyncio.get_running_loop()
    key = (id(served), id(loop))
    with router.schedulers_lock:
        for k in [k for k, s in router.schedulers.items() if s.loop.is_closed() and s.idle()]:
            del router.schedulers[k]
        sched = router.schedulers.get(key)
        if sched is None or sched.served is not served or sched.loop is not loop:
            sched = router.schedulers[key] = ModelScheduler(router, served, loop)
        return sched
