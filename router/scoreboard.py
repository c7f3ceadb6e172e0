"""The router's holder scoreboard: what this router process observed of each holder, and the
holder order and probes that follow from it. Plain Python, imports nothing from Django.

Self-declared numbers (``committed_tps``) cost a holder nothing to inflate, so the forward
orders an expert's holders by observation instead (issue 15 item 2):

- **circuit breaker**: a fault (error, bad receipt, deadline missed while a backup answered,
  socket gone) opens the holder's circuit for ``cooldown_s``, doubled per consecutive fault
  up to ``max_cooldown_s``; while open it is ranked last (tried only when nobody else holds
  the expert). When the cooldown ends it is *half-open*: it gets hedged probes until one
  succeeds, which closes the circuit.
- **probation**: a holder with fewer than ``probation`` successes seen by this router ranks
  after proven ones and earns its record through hedged probes (or as primary where every
  holder is unproven, e.g. a fresh cluster).
- **observed quality**: among holders of one tier, a success-rate EWMA below 0.9 ranks
  later, then latency more than 2× (+50 ms) the best candidate's, then one whose socket is
  in another site process (``here``: reached through the channel layer), then site reputation;
  the view's own order (residency, then declared numbers, then id) only breaks ties.

A *hedged probe* is a copy of a batch whose proven primary also has it: its answer never
enters the forward (the primary's does), so a probe that stalls costs no forward any time.

**Latency record** (issue 22): each holder's last ``LATENCY_WINDOW`` verified round trips
give its p99 (``p99_ms``: the basis of its deadline, ``deadline_s``) and its minimum, the
round trip with the least queueing, i.e. the path's RTT plus the least compute
(``rtt_ms``, as TCP's and BBR's min-RTT filters estimate a path). Holders otherwise equal
are ordered nearest first.

The state is per router process on purpose: it changes on every batch (a database write per
batch would cost more than the batch), latency is a property of this router's path to the
holder, and a new process relearns it within one deadline per holder. What must outlive the
process (reputation, ``batches_served``, ``batch_failures``, latency EWMA) is recorded in
the database by ``registry.services.record_holder_outcomes`` as before, and a process
*seeds* each holder it has not seen yet from there (``seed``): a holder whose latest
recorded outcome is a recent failure (a black hole another process caught) starts
half-open, earning real batches only through a probe; one with at least ``probation``
batches served starts proven, at its recorded latency. Several site processes behind a
balancer thus share what matters without a write per batch.
"""
from __future__ import annotations

import collections
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

PROBATION_SUCCESSES = 4
COOLDOWN_S = 2.0
MAX_COOLDOWN_S = 120.0
PROBE_INTERVAL_S = 0.5
EWMA_ALPHA = 0.2
LATENCY_WINDOW = 128  # verified round trips kept per holder for its p99 and min RTT
DEADLINE_SAMPLES = 16  # round trips seen before a holder's deadline follows its p99
DEADLINE_P99_FACTOR = 3.0  # a holder's deadline: this × its p99 ...
DEADLINE_FLOOR_S = 1.0  # ... but never under this (a loss retransmit, a GC pause), nor over the site's

_RESIDENCY = {"Warm": 0, "Cold": 1}
_TIERS = {"proven": 0, "probation": 1, "half_open": 2, "open": 3}


@dataclass
class HolderStats:
    """One holder as this router saw it: counts, EWMAs (success rate 0..1, latency ms per
    batch, rows per second) and circuit state (``open_until`` on ``Scoreboard.clock``)."""

    successes: int = 0
    faults: int = 0
    consecutive_faults: int = 0
    success_rate: float = 1.0
    latency_ms: float | None = None
    rows_per_s: float | None = None
    open_until: float = 0.0
    probing: bool = False
    last_probe: float = -math.inf
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=LATENCY_WINDOW))
    appended: int = 0  # round trips ever added to ``recent`` (``add_round_trip``)
    _p99: tuple[int, float] | None = field(default=None, repr=False, compare=False)  # (appended, p99)

    def add_round_trip(self, latency_ms: float) -> None:
        """Keep one verified round trip (ms) in ``recent``."""
        self.recent.append(float(latency_ms))
        self.appended += 1

    def p99_ms(self) -> float | None:
        """The 99th percentile of the recent round trips (ms; nearest rank), None before any.
        Sorted once per new round trip: every batch of a forward asks for its holder's deadline
        before any answer comes back, and sorting the window for each was 1.5 % of the site's
        CPU at 16 clients."""
        if not self.recent:
            return None
        if self._p99 is None or self._p99[0] != self.appended:
            xs = sorted(self.recent)
            self._p99 = (self.appended, xs[min(len(xs) - 1, math.ceil(0.99 * len(xs)) - 1)])
        return self._p99[1]

    def rtt_ms(self) -> float | None:
        """The least recent round trip (ms): the path's RTT plus the least compute; None before any."""
        return min(self.recent) if self.recent else None

    def to_json(self) -> dict:
        """Counts and EWMAs as a JSON object (latency and throughput rounded)."""
        return {"successes": self.successes, "faults": self.faults, "consecutive_faults": self.consecutive_faults,
                "success_rate": round(self.success_rate, 4),
                "latency_ms": None if self.latency_ms is None else round(self.latency_ms, 3),
                "rows_per_s": None if self.rows_per_s is None else round(self.rows_per_s, 1)}


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - EWMA_ALPHA) * old + EWMA_ALPHA * new


class Scoreboard:
    """Thread-safe per-process record of holder outcomes (module docstring).

    ``clock``: monotonic seconds (tests pass a fake one). ``probation``: successes before a
    holder counts as proven. ``cooldown_s`` / ``max_cooldown_s``: circuit-open time after the
    first / any later consecutive fault. ``probe_interval_s``: least time between two probes
    of one holder. ``here(provider) -> bool``: whether this process holds the holder's socket
    (``router.ws.held_here``; None: every holder counts as held here).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, probation: int = PROBATION_SUCCESSES,
                 cooldown_s: float = COOLDOWN_S, max_cooldown_s: float = MAX_COOLDOWN_S,
                 probe_interval_s: float = PROBE_INTERVAL_S, here: Callable[[str], bool] | None = None):
        self.clock, self.probation, self.here = clock, probation, here
        self.cooldown_s, self.max_cooldown_s, self.probe_interval_s = cooldown_s, max_cooldown_s, probe_interval_s
        self._stats: dict[str, HolderStats] = {}
        self._lock = threading.Lock()
        # Hedged probe tasks (``router.forward``) outlive their forward: referenced here until done.
        self.probes: set = set()
        self._seeded: set[str] = set()  # providers already seeded (or looked up without a record)

    def unseeded(self, providers) -> list[str]:
        """Those of ``providers`` this scoreboard has neither seen nor seeded."""
        with self._lock:
            return [p for p in providers if p not in self._stats and p not in self._seeded]

    def seed(self, records: dict[str, dict], providers=()) -> None:
        """Start holders not seen yet from the database's records (module docstring):
        ``records`` ``{provider: {"batches_served", "latency_ms", "failing"}}``
        (``registry.selectors.holder_records``); ``providers``: looked up too (no record: they
        start in probation as before). A holder with stats of its own is left alone."""
        with self._lock:
            for provider in {*records, *providers}:
                self._seeded.add(provider)
                rec = records.get(provider)
                if rec is None or provider in self._stats:
                    continue
                s = HolderStats()
                if rec.get("failing"):
                    s.faults = s.consecutive_faults = 1  # half-open: probes only until one succeeds
                    s.success_rate = 1 - EWMA_ALPHA
                elif int(rec.get("batches_served") or 0) >= self.probation:
                    s.successes = self.probation
                    s.latency_ms = rec.get("latency_ms")
                else:
                    continue
                self._stats[provider] = s

    def _get(self, provider: str) -> HolderStats:
        s = self._stats.get(provider)
        if s is None:
            s = self._stats[provider] = HolderStats()
        return s

    def success(self, provider: str, latency_ms: float, rows: int) -> None:
        """A verified answer of ``rows`` rows after ``latency_ms`` ms: closes the circuit."""
        with self._lock:
            s = self._get(provider)
            s.successes += 1
            s.consecutive_faults = 0
            s.open_until = 0.0
            s.success_rate = _ewma(s.success_rate, 1.0)
            s.latency_ms = _ewma(s.latency_ms, float(latency_ms))
            s.add_round_trip(latency_ms)
            if latency_ms > 0:
                s.rows_per_s = _ewma(s.rows_per_s, rows * 1e3 / latency_ms)

    def fault(self, provider: str) -> None:
        """An error, bad answer or missed deadline: opens the circuit for the next cooldown.
        Faults while it is already open (requests that were in flight together) count in the
        totals but do not lengthen the cooldown."""
        with self._lock:
            s = self._get(provider)
            s.faults += 1
            s.success_rate = _ewma(s.success_rate, 0.0)
            now = self.clock()
            if s.open_until > now:
                return
            s.consecutive_faults += 1
            s.open_until = now + min(self.cooldown_s * 2 ** (s.consecutive_faults - 1), self.max_cooldown_s)

    def disconnected(self, provider: str) -> None:
        """The holder's socket closed: skip it for one cooldown (not counted as a fault)."""
        with self._lock:
            s = self._get(provider)
            s.open_until = max(s.open_until, self.clock() + self.cooldown_s)

    def connected(self, provider: str) -> None:
        """The holder's socket (re)opened: a disconnect-only circuit closes at once."""
        with self._lock:
            s = self._stats.get(provider)
            if s is not None and s.consecutive_faults == 0:
                s.open_until = 0.0

    def state(self, provider: str) -> str:
        """"open", "half_open" (cooldown over, no success since the fault), "probation" or "proven"."""
        with self._lock:
            return self._state(self._stats.get(provider))

    def _state(self, s: HolderStats | None) -> str:
        if s is None:
            return "probation"
        if s.open_until > self.clock():
            return "open"
        if s.consecutive_faults:
            return "half_open"
        return "proven" if s.successes >= self.probation else "probation"

    def order(self, holders: Sequence) -> list:
        """``holders`` (``HolderInfo``-like: ``provider``, ``residency``, ``reputation``) best
        first: residency (Warm before Cold, so split batches still deal over Warm holders),
        then tier (proven, probation, half-open, open), then success rate ≥ 0.9, then latency
        bucket against the best candidate, then held here (``here(provider)``: its socket is in
        this process, so no relay through another), then reputation descending, then the
        nearer, then input position."""
        return self.rank(holders)[0]

    def rank(self, holders: Sequence) -> tuple[list, int]:
        """(``order(holders)``, how many of its leading holders are *peers*: the run of holders
        from the first that equal it in everything ``order`` ranks by but reputation and input
        position, i.e. in residency, tier, success rate, latency bucket, held here and
        nearness (least round trips less than 5 ms apart)). The planner spreads batches over
        peers (``registry.planner.plan_expert_batches``'s ``rank``); reputation and position
        only pick among peers equally loaded, so one holder does not take every batch of the experts it shares with
        equals while they idle. A holder that is nearer or farther, or in another latency bucket,
        ends the run (a farther one would add its distance to most forwards) once both holders
        have ``DEADLINE_SAMPLES`` round trips on record: before that, nearness and latency are
        not held against it (as for its deadline). A holder that served only its first, slow
        batches (a cold start) would otherwise look far and never get another batch to show it
        is not."""
        with self._lock:
            stats = [self._stats.get(h.provider) for h in holders]
            tiers = [_TIERS[self._state(s)] for s in stats]
            raw = [None if s is None or not s.recent else s.rtt_ms() for s in stats]
            measured = [s is not None and len(s.recent) >= DEADLINE_SAMPLES for s in stats]
        # Rounded to 5 ms: jitter between equally near holders must not reorder them each call.
        rtts = [None if r is None else 5 * round(r / 5) for r in raw]
        # Among otherwise equal holders, one whose socket this process holds saves two process hops
        # and a Redis round trip each way (router.ws): under load each hop waits for a core.
        relayed = [0] * len(holders) if self.here is None else [0 if self.here(h.provider) else 1 for h in holders]
        lats = [s.latency_ms for s in stats if s is not None and s.latency_ms is not None]
        fast = 2 * min(lats) + 50.0 if lats else math.inf

        def peer_key(i: int) -> tuple:
            s = stats[i]
            lat = s.latency_ms if s is not None else None
            bucket = 0 if lat is None or lat <= fast else 1 + int(math.log2(lat / fast))
            rate = 0 if s is None or s.success_rate >= 0.9 else 1
            near = rtts[i] if rtts[i] is not None else math.inf  # equal otherwise: the nearer first
            return (_RESIDENCY.get(holders[i].residency, 2), tiers[i], rate, bucket, relayed[i], near)

        keys = [peer_key(i) for i in range(len(holders))]

        def peer(i: int, first: int) -> bool:
            (res, tier, rate, bucket, here, _), f = keys[i], keys[first]
            if (res, tier, rate, here) != (f[0], f[1], f[2], f[4]):
                return False
            # Latency and nearness count once both have DEADLINE_SAMPLES round trips on record; nearness
            # within 5 ms, not the same rounded step (2.4 and 2.6 ms are peers).
            return not (measured[i] and measured[first]) or (bucket == f[3] and abs(raw[i] - raw[first]) < 5.0)

        perm = sorted(range(len(holders)), key=lambda i: (keys[i][:-1], -int(holders[i].reputation), keys[i][-1], i))
        lead = next((j for j, i in enumerate(perm) if not peer(i, perm[0])), len(perm))
        return [holders[i] for i in perm], lead

    def planner_rank(self) -> Callable[[Sequence], tuple[list, int]]:
        """``rank`` for one planning call (``registry.planner.plan_expert_batches``): a holder
        set it already ranked in that call is not ranked again. One plan asks for the same few
        sets, one per expert (3 holders with 2 replicas: 3 sets for 16 experts), and nothing
        ``rank`` reads changes during the synchronous call; the key is what it reads of a
        holder (provider, residency, reputation) in input order."""
        ranked: dict[tuple, tuple[list[int], int]] = {}

        def rank(holders: Sequence) -> tuple[list, int]:
            key = tuple((h.provider, h.residency, h.reputation) for h in holders)
            got = ranked.get(key)
            if got is None:
                ordered, lead = self.rank(holders)
                at = {id(h): i for i, h in enumerate(holders)}
                got = ranked[key] = ([at[id(h)] for h in ordered], lead)
            return [holders[i] for i in got[0]], got[1]

        return rank

    def deadline_s(self, provider: str, ceiling_s: float) -> float:
        """Seconds ``provider`` has for one request before its backup gets a copy:
        ``DEADLINE_P99_FACTOR`` × its observed p99, at least ``DEADLINE_FLOOR_S`` and at most
        ``ceiling_s`` (the site's ``BATCH_DEADLINE_S``); ``ceiling_s`` until
        ``DEADLINE_SAMPLES`` round trips were seen."""
        with self._lock:
            s = self._stats.get(provider)
            p99 = s.p99_ms() if s is not None and len(s.recent) >= DEADLINE_SAMPLES else None
        if p99 is None:
            return ceiling_s
        return min(ceiling_s, max(DEADLINE_FLOOR_S, DEADLINE_P99_FACTOR * p99 / 1e3))

    def latency_record(self) -> dict[str, tuple[float | None, float | None, int]]:
        """``{provider: (rtt ms, p99 ms, round trips kept)}`` of every holder seen (metrics)."""
        with self._lock:
            return {p: (s.rtt_ms(), s.p99_ms(), len(s.recent)) for p, s in self._stats.items()}

    def failed_recently(self, provider: str) -> bool:
        """Open or half-open: no real batch should be dealt to it while others can take it."""
        return self.state(provider) in ("open", "half_open")

    def claim_probe(self, provider: str) -> bool:
        """Whether ``provider`` should get a hedged probe now (probation or half-open, none in
        flight, the probe interval passed); a True answer marks one in flight until
        ``probe_done``."""
        with self._lock:
            s = self._get(provider)
            now = self.clock()
            if self._state(s) not in ("probation", "half_open") or s.probing or now - s.last_probe < \
                    self.probe_interval_s:
                return False
            s.probing, s.last_probe = True, now
            return True

    def probe_done(self, provider: str) -> None:
        """The probe claimed by ``claim_probe`` ended (its outcome recorded separately)."""
        with self._lock:
            self._get(provider).probing = False

    def snapshot(self) -> dict:
        """``{provider: {state, successes, faults, consecutive_faults, success_rate, latency_ms,
        rows_per_s, rtt_ms, p99_ms}}`` for status pages and benchmarks."""
        with self._lock:
            return {p: {"state": self._state(s), **s.to_json(),
                        "rtt_ms": None if not s.recent else round(s.rtt_ms(), 3),
                        "p99_ms": None if not s.recent else round(s.p99_ms(), 3)}
                    for p, s in sorted(self._stats.items())}

