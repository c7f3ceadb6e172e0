"""Serving metrics: ``/metrics`` exposition, holder outcomes from forwards, the Serving page's numbers."""
from __future__ import annotations

import math

import pytest

from router.apps import install
from router.metrics import ServingMetrics
from router.state import Router
from tenzro_site.console.charts import line_chart
from tenzro_site.console.serving import quantile, serving_state

FAMILIES = ["tenzro_sequences_running gauge", "tenzro_sequences_waiting gauge", "tenzro_generated_tokens_total counter",
            "tenzro_prompt_tokens_total counter", "tenzro_requests_total counter", "tenzro_time_to_first_token_seconds histogram",
            "tenzro_inter_token_latency_seconds histogram", "tenzro_step_rows histogram",
            "tenzro_step_seconds histogram", "tenzro_kv_cache_bytes gauge", "tenzro_kv_cache_budget_bytes gauge",
            "tenzro_holder_batch_seconds histogram", "tenzro_holder_batch_failures_total counter"]


@pytest.fixture
def router():
    """A fresh process router (fresh metrics), restored afterwards."""
    r = Router()
    previous = install(r)
    yield r
    install(previous)


def busy(m: ServingMetrics, tokens: int = 10) -> None:
    """Some serving: a model with running and waiting sequences, tokens, latencies, a holder."""
    m.running.labels("q").set(3)
    m.waiting.labels("q").set(1)
    m.tokens.labels("q").inc(tokens)
    m.prompt_tokens.labels("q").inc(32)
    m.requests.labels("q", "ok").inc()
    m.ttft.labels("q").observe(0.2)
    for _ in range(tokens):
        m.itl.labels("q").observe(0.04)
    m.step_rows.labels("q").observe(4)
    m.kv_bytes.labels("q").set(2**20)
    m.kv_budget.set(2**30)
    m.holder_outcomes([{"provider": "bad", "expert": 1, "fault": True, "error": "x"},
                       {"provider": "late", "expert": 2, "fault": False, "error": "late"}],
                      {"good": [12.0, 20.0], "local": [0.5]})


def test_metrics_endpoint_exposes_every_name(client, router):
    busy(router.metrics)
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r["Content-Type"].startswith("text/plain")
    text = r.content.decode()
    for family in FAMILIES:
        assert f"# TYPE {family}\n" in text, family
    assert 'tenzro_generated_tokens_total{model="q"} 10.0' in text
    assert 'tenzro_time_to_first_token_seconds_bucket{le="0.25",model="q"} 1.0' in text
    assert 'tenzro_holder_batch_failures_total{provider="bad"} 1.0' in text
    assert 'tenzro_holder_batch_seconds_count{provider="good"} 2.0' in text
    assert 'provider="late"' not in text  # not a fault: the holder is not blamed
    assert client.post("/metrics").status_code == 405


def test_quantile_interpolates_like_prometheus():
    b = {0.1: 0.0, 0.5: 10.0, 1.0: 10.0, math.inf: 10.0}
    assert quantile(0.5, b) == pytest.approx(0.3)
    assert quantile(0.99, {0.1: 0.0, 0.5: 0.0, math.inf: 4.0}) == 0.5  # past the last bound: its bound
    assert quantile(0.5, {}) is None and quantile(0.5, {1.0: 0.0, math.inf: 0.0}) is None


def test_serving_state_rates_and_windowed_quantiles():
    m = ServingMetrics()
    h = m.sample(now=100.0)
    assert serving_state(h)["samples"] == 1
    busy(m, tokens=10)
    m.sample(now=101.0)  # too soon after the last: not kept
    h = m.sample(now=102.0)
    assert len(h) == 2
    s = serving_state(h)
    by = {c.title: c for c in s["charts"]}
    assert by["Output tokens/s"].lines[0].last == 5.0  # 10 tokens in 2 s
    assert by["Sequences"].lines[0].last == 3.0 and by["Sequences"].lines[1].last == 1.0
    assert 25 < by["Inter-token latency"].lines[0].last <= 50  # ms, inside the (25, 50] ms bucket
    assert by["KV cache"].lines[0].last == 1.0
    assert [(b.label, b.value) for b in s["rows"].bars if b.value] == [("≤4", 1)]
    holders = {x["provider"]: x for x in s["holders"]}
    assert holders["bad"]["failures"] == 1 and holders["good"]["batches"] == 2 and holders["good"]["p50_ms"] > 10
    assert s["totals"] == {"tokens": 10, "prompt_tokens": 32, "requests": {"ok": 1}}
    assert s["kv"] == {"bytes": 2**20, "budget": 2**30}
    h = m.sample(now=200.0)  # nothing new: the rate drops to 0, latency has a gap
    by = {c.title: c for c in serving_state(h)["charts"]}
    assert by["Output tokens/s"].lines[0].last == 0.0 and by["Inter-token latency"].lines[0].last is None


def test_line_chart_geometry_and_gaps():
    c = line_chart("t", ["a", "b", "c"], [("x", [0.0, None, 2.0], "k")], width=100, height=60)
    assert c.peak == 2.0 and len(c.lines[0].points) == 2  # the gap splits the line
    assert c.lines[0].points[0] == f"8.0,{c.baseline}"
    with pytest.raises(ValueError):
        line_chart("t", ["a"], [("x", [-1.0], "k")])
    with pytest.raises(ValueError):
        line_chart("t", ["a", "b"], [("x", [1.0], "k")])


def test_serving_page_and_panel_render(client, router):
    busy(router.metrics)
    router.metrics.sample(now=1.0)
    page = client.get("/serving/")
    assert page.status_code == 200
    html = page.content.decode()
    assert 'aria-current="page">Serving<' in html and 'id="serving-panel"' in html and "hx-trigger=\"every 2s\"" in html
    panel = client.get("/serving/panel").content.decode()
    assert panel.startswith('<div id="serving-panel"') and "Output tokens/s" in panel and "<code>bad</code>" in panel
    assert "<html" not in panel
