"""Serving metrics of one site process (Prometheus text format, ``prometheus-client``).

One ``ServingMetrics`` per ``router.state.Router``, with its own ``CollectorRegistry`` (no
process-global default registry: tests build a fresh router and read fresh numbers). The
scheduler reports steps and sequences, the forward reports each holder batch; ``/metrics``
renders ``exposition()``; the console's Serving page reads ``snapshot()``.

Several processes on one machine (site processes behind a balancer, Celery workers): with
``PROMETHEUS_MULTIPROC_DIR`` set (an empty directory per machine, before the processes start)
prometheus-client's multiprocess mode keeps every process's values in files there, and
``exposition()`` of any process sums them (gauges over live processes), so a scrape through
the balancer sees the machine's totals. ``snapshot()`` stays this process's own.
"""
from __future__ import annotations

import os
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Seconds: TTFT and inter-token latency from loopback (ms) to WAN holders (seconds).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
# Snapshots kept for the console's live charts: 150 at >= 2 s apart is five minutes.
HISTORY_LEN = 150
HISTORY_INTERVAL_S = 2.0


class HolderRttCollector:
    """Per-holder round trips read from a ``router.scoreboard.Scoreboard`` at each scrape (no
    per-batch cost): ``tenzro_holder_rtt_seconds`` (the least recent round trip: the path's
    RTT plus the least compute) and ``tenzro_holder_p99_seconds`` (the p99 its deadline
    follows), per provider."""

    def __init__(self, scoreboard):
        self.scoreboard = scoreboard

    def describe(self):
        return []

    def collect(self):
        rtt = GaugeMetricFamily("tenzro_holder_rtt_seconds", "Least recent holder round trip (path RTT plus least "
                                "compute)", labels=["provider"])
        p99 = GaugeMetricFamily("tenzro_holder_p99_seconds", "p99 of recent holder round trips (deadline basis)",
                                labels=["provider"])
        for provider, (r, p, n) in sorted(self.scoreboard.latency_record().items()):
            if n:
                rtt.add_metric([provider], r / 1e3)
                p99.add_metric([provider], p / 1e3)
        yield rtt
        yield p99


class ServingMetrics:
    """Counters, gauges and histograms of the serving path (names prefixed ``tenzro_``).

    Sequences: ``running`` / ``waiting`` gauges per model; tokens generated and prompt tokens
    prefilled (counters); time to first token and inter-token latency (histograms, seconds);
    rows per scheduler step (histogram); where a step's time goes (``step_timeline``:
    router compute, wire wait of a micro-batch, router idle, seconds; micro-batches per step);
    KV cache bytes in use and budget (gauges). Holders: batch latency (histogram, seconds)
    and failures (counter) per provider; with ``scoreboard`` also each holder's RTT and p99
    (``HolderRttCollector``). Forwards: layer forwards by model and outcome ("ok" or the
    ``ForwardError`` kind, "busy"), holder batch failures by kind ("fault", "saturated",
    "other"), requests to agent sockets by path (``local``: a socket this process holds, ``relay``:
    through the channel layer), forward slots in use and forwards queued for one (gauges). Repair passes by
    outcome; forwards handed to settlement and settlement tasks queued (counters).
    """

    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self, scoreboard=None):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.multiprocess_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None
        live = {"multiprocess_mode": "livesum"}  # gauges: summed over the machine's live processes
        self.running = Gauge("tenzro_sequences_running", "Sequences in the running batch", ["model"], registry=r,
                             **live)
        self.waiting = Gauge("tenzro_sequences_waiting", "Sequences queued for admission", ["model"], registry=r,
                             **live)
        self.tokens = Counter("tenzro_generated_tokens", "Output tokens generated", ["model"], registry=r)
        self.prompt_tokens = Counter("tenzro_prompt_tokens", "Prompt tokens prefilled", ["model"], registry=r)
        self.requests = Counter("tenzro_requests", "Finished generation requests by outcome",
                                ["model", "outcome"], registry=r)
        self.ttft = Histogram("tenzro_time_to_first_token_seconds", "Time to first token", ["model"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tenzro_inter_token_latency_seconds", "Time between a sequence's tokens", ["model"],
                             buckets=LATENCY_BUCKETS, registry=r)
        self.step_rows = Histogram("tenzro_step_rows", "Rows (tokens of all sequences) per scheduler step",
                                   ["model"], buckets=ROW_BUCKETS, registry=r)
        self.step_seconds = Histogram("tenzro_step_seconds", "Wall time of one scheduler step", ["model"],
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.kv_bytes = Gauge("tenzro_kv_cache_bytes", "KV cache bytes held by running sequences", ["model"],
                              registry=r, **live)
        self.kv_budget = Gauge("tenzro_kv_cache_budget_bytes", "KV cache budget of this process", registry=r, **live)
        self.holder_latency = Histogram("tenzro_holder_batch_seconds", "Holder batch round trip (verified answers)",
                                        ["provider"], buckets=LATENCY_BUCKETS, registry=r)
        self.holder_failures = Counter("tenzro_holder_batch_failures", "Holder batches that failed or timed out",
                                       ["provider"], registry=r)
        self.step_compute = Histogram("tenzro_step_compute_seconds", "Router compute of one scheduler step "
                                      "(attention, norms, gating, LM head; summed over micro-batches)", ["model"],
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.step_wire = Histogram("tenzro_step_wire_seconds", "Time one micro-batch of a step waited on its layer "
                                   "forwards (wire and holders)", ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.step_forward = Histogram("tenzro_step_forward_seconds", "Of a micro-batch's wait, the time its layer "
                                      "forwards ran on the event loop (the rest: thread and loop hand-offs)",
                                      ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.step_idle = Histogram("tenzro_step_idle_seconds", "Wall time of a step the router did not compute "
                                   "(waiting on holders)", ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.microbatches = Histogram("tenzro_step_microbatches", "Micro-batches in flight per scheduler step",
                                      ["model"], buckets=(1, 2, 3, 4, 6, 8, 16), registry=r)
        # This process's view of holder RTT: also exported in multiprocess mode (not a file metric).
        self.rtt = HolderRttCollector(scoreboard) if scoreboard is not None else None
        if self.rtt is not None:
            r.register(self.rtt)
        self.forwards = Counter("tenzro_forwards", "Layer forwards by outcome (ok, a ForwardError kind, busy)",
                                ["model", "outcome"], registry=r)
        self.batch_failures = Counter("tenzro_batch_failures", "Holder batches that did not answer, by kind",
                                      ["kind"], registry=r)
        self.agent_requests = Counter("tenzro_agent_requests", "Requests to agent sockets by path: local (a socket "
                                      "this process holds) or relay (the channel layer to another process's)",
                                      ["path"], registry=r)
        self.slots_busy = Gauge("tenzro_forward_slots_busy", "Forward slots in use", registry=r, **live)
        self.queue_depth = Gauge("tenzro_forward_queue_depth", "Forwards waiting for a slot", registry=r, **live)
        self.repair_passes = Counter("tenzro_repair_passes", "Repair passes this process ran, by outcome",
                                     ["outcome"], registry=r)
        self.settled_forwards = Counter("tenzro_settlement_forwards", "Verified forwards handed to settlement",
                                        registry=r)
        self.settlement_tasks = Counter("tenzro_settlement_tasks",
                                        "Settlement runs started (one per flush: a Celery task, or inline)",
                                        registry=r)
        self.history: deque[tuple[float, dict]] = deque(maxlen=HISTORY_LEN)

    def step_timeline(self, model: str, entry: dict) -> None:
        """One scheduler step's timeline (``router.scheduler.ModelScheduler.timeline`` entry:
        ``compute``, ``wire``, ``forward``, ``idle`` in ms and ``microbatches``)."""
        self.step_compute.labels(model).observe(entry["compute"] / 1e3)
        self.step_wire.labels(model).observe(entry["wire"] / 1e3)
        self.step_forward.labels(model).observe(entry.get("forward", 0.0) / 1e3)
        self.step_idle.labels(model).observe(entry["idle"] / 1e3)
        self.microbatches.labels(model).observe(entry["microbatches"])

    def forward(self, model: str, outcome: str, failures: list[dict]) -> None:
        """One layer forward of ``model`` ended with ``outcome``; its holder ``failures`` by kind."""
        self.forwards.labels(model, outcome).inc()
        for f in failures:
            self.batch_failures.labels("fault" if f.get("fault") else "saturated" if f.get("saturated")
                                       else "other").inc()

    def admission(self, running: int, queued: int) -> None:
        """The forward admission's slots in use and queue length changed (``router.admission``)."""
        self.slots_busy.set(running)
        self.queue_depth.set(queued)

    def holder_batch(self, provider: str, seconds: float, ok: bool) -> None:
        """One batch sent to ``provider``: its round trip in seconds when ``ok``, else a failure."""
        if ok:
            self.holder_latency.labels(provider).observe(seconds)
        else:
            self.holder_failures.labels(provider).inc()

    def holder_outcomes(self, failures: list[dict], latencies_ms: dict[str, list[float]]) -> None:
        """One forward's holder outcomes (as ``LayerForward`` reports them): each latency (ms,
        per provider) a successful batch, each failure with ``fault`` a failed one."""
        for provider, values in latencies_ms.items():
            for ms in values:
                self.holder_batch(provider, ms / 1e3, True)
        for f in failures:
            if f.get("fault"):
                self.holder_batch(f["provider"], 0.0, False)

    def exposition(self) -> bytes:
        """The Prometheus text exposition of every metric (``Content-Type: CONTENT_TYPE``): with
        ``PROMETHEUS_MULTIPROC_DIR``, summed over every process of the machine (module docstring)."""
        if self.multiprocess_dir:
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry, self.multiprocess_dir)
            if self.rtt is not None:
                registry.register(self.rtt)
            return generate_latest(registry)
        return generate_latest(self.registry)

    def snapshot(self) -> dict:
        """``{metric name: [{labels, value}]}`` of every sample (for pages and tests)."""
        out: dict[str, list] = {}
        for family in self.registry.collect():
            for s in family.samples:
                out.setdefault(s.name, []).append({"labels": dict(s.labels), "value": s.value})
        return out

    def sample(self, now: float | None = None, min_interval_s: float = HISTORY_INTERVAL_S) -> list[tuple[float, dict]]:
        """The history of ``(unix time, snapshot())`` pairs, oldest first, after appending a
        fresh snapshot when the last one is ``min_interval_s`` old (readers poll: several
        open pages do not crowd the history)."""
        now = time.time() if now is None else now
        if not self.history or now - self.history[-1][0] >= min_interval_s:
            # ``_created`` timestamps are a third of the samples and no chart reads them.
            snap = {k: v for k, v in self.snapshot().items() if not k.endswith("_created")}
            self.history.append((now, snap))
        return list(self.history)
