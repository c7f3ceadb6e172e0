"""Reads behind the console's Serving page: the router's metric history as chart-ready series.

Pure functions of ``router.metrics.ServingMetrics.sample()`` (a list of ``(unix time,
snapshot)``, oldest first): rates and quantiles are computed from the differences between
snapshots, as Prometheus' ``rate`` and ``histogram_quantile`` would, so the page shows the
last seconds and not the process's lifetime. Every model of the process is summed.
"""
from __future__ import annotations

import math

from tenzro_site.console.charts import bar_chart, line_chart

# Quantiles of TTFT and inter-token latency over this many seconds before each point.
WINDOW_S = 30.0


def _total(snap: dict, name: str, **match) -> float:
    """Sum of the samples ``name`` whose labels include ``match``."""
    return sum(s["value"] for s in snap.get(name, ()) if all(s["labels"].get(k) == v for k, v in match.items()))


def _buckets(snap: dict, name: str, **match) -> dict[float, float]:
    """Cumulative bucket counts ``{upper bound: count}`` of histogram ``name`` (``_bucket``
    samples), summed over the series whose labels include ``match``."""
    out: dict[float, float] = {}
    for s in snap.get(name + "_bucket", ()):
        if all(s["labels"].get(k) == v for k, v in match.items()):
            le = float(s["labels"]["le"])
            out[le] = out.get(le, 0.0) + s["value"]
    return out


def _delta(new: dict[float, float], old: dict[float, float]) -> dict[float, float]:
    return {le: n - old.get(le, 0.0) for le, n in new.items()}


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """``histogram_quantile(q)`` of cumulative ``buckets`` ``{upper bound: count}``: linear
    inside the bucket that holds rank ``q * count`` (from 0 for the first bucket); the lower
    bound of the ``+Inf`` bucket when the rank falls there. None without observations."""
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank and count > below:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = (le if not math.isinf(le) else lower), count
    return lower


def _window_start(history: list[tuple[float, dict]], i: int, window_s: float) -> int:
    j = i - 1
    while j > 0 and history[i][0] - history[j - 1][0] <= window_s:
        j -= 1
    return j


def _gauge_ms(snap: dict, name: str, provider: str) -> float | None:
    """Gauge ``name`` of ``provider`` in ms (one decimal), None when absent."""
    for s in snap.get(name, ()):
        if s["labels"].get("provider") == provider:
            return round(s["value"] * 1e3, 1)
    return None


def serving_state(history: list[tuple[float, dict]], window_s: float = WINDOW_S) -> dict:
    """The Serving page's numbers from ``history``.

    Returns ``{samples, now, charts: [LineChart], rows: BarChart, holders: [{provider,
    batches, p50_ms, p99_ms, failures, rtt_ms, deadline_p99_ms}], kv: {bytes, budget}, totals: {tokens, prompt_tokens,
    requests: {outcome: n}}}``. Time series have one point per snapshot after the first:
    sequences running and waiting, output tokens/s, TTFT and inter-token p50/p99 (ms, over
    ``window_s`` before the point; gaps without tokens), KV cache MiB. Step rows and holder
    latencies cover the whole history; holder failures count since the process started; a
    holder's RTT (its least recent round trip) and the p99 its deadline follows are the
    router scoreboard's now (``router.metrics.HolderRttCollector``).
    """
    n = len(history)
    now_t, now = history[-1] if history else (0.0, {})
    labels, running, waiting, tps, kv = [], [], [], [], []
    lat = {k: [] for k in ("ttft50", "ttft99", "itl50", "itl99")}
    for i in range(1, n):
        (t0, a), (t1, b) = history[i - 1], history[i]
        j = _window_start(history, i, window_s)
        w = history[j][1]
        labels.append(f"-{round(now_t - t1)}s")
        running.append(_total(b, "tenzro_sequences_running"))
        waiting.append(_total(b, "tenzro_sequences_waiting"))
        dt = t1 - t0
        tps.append(max(0.0, _total(b, "tenzro_generated_tokens_total") - _total(a, "tenzro_generated_tokens_total"))
                   / dt if dt > 0 else 0.0)
        kv.append(_total(b, "tenzro_kv_cache_bytes") / 2**20)
        for key, name in (("ttft", "tenzro_time_to_first_token_seconds"),
                          ("itl", "tenzro_inter_token_latency_seconds")):
            d = _delta(_buckets(b, name), _buckets(w, name))
            for q, suffix in ((0.5, "50"), (0.99, "99")):
                v = quantile(q, d)
                lat[key + suffix].append(None if v is None else v * 1e3)
    first = history[0][1] if history else {}
    charts = [
        line_chart("Sequences", labels, [("running", running, "s-running"), ("waiting", waiting, "s-waiting")]),
        line_chart("Output tokens/s", labels, [("tokens/s", tps, "s-tokens")]),
        line_chart("Time to first token", labels, [("p50", lat["ttft50"], "s-p50"), ("p99", lat["ttft99"], "s-p99")],
                   y_label="ms"),
        line_chart("Inter-token latency", labels, [("p50", lat["itl50"], "s-p50"), ("p99", lat["itl99"], "s-p99")],
                   y_label="ms"),
        line_chart("KV cache", labels, [("in use", kv, "s-kv")], y_label="MiB"),
    ]
    rows = _delta(_buckets(now, "tenzro_step_rows"), _buckets(first, "tenzro_step_rows")) if n > 1 else {}
    bars, below = [], 0.0
    for le in sorted(rows):
        bars.append(("+Inf" if math.isinf(le) else f"≤{le:g}", max(0, round(rows[le] - below)), ""))
        below = rows[le]
    holders = []
    providers = {s["labels"]["provider"] for name in ("tenzro_holder_batch_seconds_count",
                                                       "tenzro_holder_batch_failures_total",
                                                       "tenzro_holder_rtt_seconds")
                 for s in now.get(name, ())}
    for p in sorted(providers):
        d = _delta(_buckets(now, "tenzro_holder_batch_seconds", provider=p),
                   _buckets(first, "tenzro_holder_batch_seconds", provider=p)) if n > 1 else {}
        p50, p99 = quantile(0.5, d), quantile(0.99, d)
        holders.append({"provider": p, "batches": round(max(d.values(), default=0)),
                        "p50_ms": None if p50 is None else round(p50 * 1e3, 1),
                        "p99_ms": None if p99 is None else round(p99 * 1e3, 1),
                        "failures": round(_total(now, "tenzro_holder_batch_failures_total", provider=p)),
                        "rtt_ms": _gauge_ms(now, "tenzro_holder_rtt_seconds", p),
                        "deadline_p99_ms": _gauge_ms(now, "tenzro_holder_p99_seconds", p)})
    requests: dict[str, int] = {}
    for s in now.get("tenzro_requests_total", ()):
        requests[s["labels"]["outcome"]] = requests.get(s["labels"]["outcome"], 0) + round(s["value"])
    return {"samples": n, "now": now_t, "charts": charts,
            "rows": bar_chart("Rows per scheduler step", bars, x_label="rows", y_label="steps"),
            "holders": holders,
            "kv": {"bytes": round(_total(now, "tenzro_kv_cache_bytes")),
                   "budget": round(_total(now, "tenzro_kv_cache_budget_bytes"))},
            "totals": {"tokens": round(_total(now, "tenzro_generated_tokens_total")),
                       "prompt_tokens": round(_total(now, "tenzro_prompt_tokens_total")), "requests": requests}}

