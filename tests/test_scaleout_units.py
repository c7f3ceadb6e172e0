"""Pieces of the several-process deployment that need no processes: the balancer's configuration
(checked by HAProxy itself when installed), the once-per-period claim of beat's sweeps, the
deployment claim, and the multiprocess metrics exposition."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from registry.deployment import DeploymentMismatch, check_name, claim, current
from registry.periodic import claim_period
from tenzro_site.balancer import ERRORS_DIR, Balancer, render_config


def test_the_balancer_config_names_every_site_and_answers_errors_in_json(tmp_path):
    cfg = render_config("127.0.0.1:8000", [("site0", "127.0.0.1:9001"), ("site1", "127.0.0.1:9002")])
    assert "bind 127.0.0.1:8000" in cfg and "${" not in cfg
    assert "    server site0 127.0.0.1:9001 check\n    server site1 127.0.0.1:9002 check" in cfg
    for code in (502, 503, 504):
        raw = (ERRORS_DIR / f"{code}.http").read_bytes()
        head, body = raw.split(b"\r\n\r\n", 1)
        assert head.startswith(f"HTTP/1.1 {code} ".encode()) and b"Content-Type: application/json" in head
        assert f"Content-Length: {len(body)}".encode() in head and b'"retryable": true' in body
    with pytest.raises(ValueError):
        render_config("127.0.0.1:8000", [])
    if shutil.which("haproxy"):
        cmd = Balancer("127.0.0.1:18999", [("site0", "127.0.0.1:9001")], tmp_path).command()  # runs haproxy -c
        assert cmd[-1] == str(tmp_path / "haproxy.cfg")
        assert subprocess.run([cmd[0], "-c", "-f", cmd[-1]], capture_output=True).returncode == 0


def test_claim_period_lets_one_caller_run_each_period():
    assert claim_period("t.sweep", 60, now=600.0)
    assert not claim_period("t.sweep", 60, now=659.0)  # another beat, same period
    assert claim_period("t.other", 60, now=659.0)
    assert claim_period("t.sweep", 60, now=660.0)  # the next period
    with pytest.raises(ValueError):
        claim_period("t.sweep", 0)


@pytest.mark.django_db
def test_one_deployment_per_database():
    assert current() is None
    assert claim("alpha") == "alpha" and claim("alpha") == "alpha" and current() == "alpha"
    with pytest.raises(DeploymentMismatch, match="belongs to deployment 'alpha'"):
        claim("beta")
    with pytest.raises(ValueError, match="TENZRO_DEPLOYMENT"):
        check_name("Has Spaces")


def test_multiprocess_metrics_sum_every_process(tmp_path):
    # prometheus-client picks multiprocess storage at import: a fresh interpreter per "process".
    import sys

    code = ("import os, sys; from router.metrics import ServingMetrics; m = ServingMetrics(); "
            "m.forward('q', 'ok', [{'fault': True}]); m.admission(2, 1); "
            "sys.stdout.buffer.write(m.exposition()) if sys.argv[1] == 'show' else None")
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    from prometheus_client import multiprocess

    for _ in range(2):
        done = subprocess.Popen([sys.executable, "-c", code, "run"], env=env, cwd=ERRORS_DIR.parent.parent)
        assert done.wait() == 0
        multiprocess.mark_process_dead(done.pid, str(tmp_path))  # as the cluster does for a dead site
    out = subprocess.run([sys.executable, "-c", code, "show"], env=env, check=True, capture_output=True,
                         cwd=ERRORS_DIR.parent.parent, text=True).stdout
    assert 'tenzro_forwards_total{model="q",outcome="ok"} 3.0' in out
    assert 'tenzro_batch_failures_total{kind="fault"} 3.0' in out
    assert "tenzro_forward_slots_busy 2.0" in out  # livesum: dead processes' gauges dropped, counters kept


def test_the_grafana_dashboard_queries_metrics_the_site_exports():
    import json
    import re

    from router.metrics import ServingMetrics

    dash = json.loads((ERRORS_DIR.parent / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    names = {n for e in exprs for n in re.findall(r"\b(tenzro_[a-z_]+?)(?:_bucket|_count|_sum)?\{", e)}
    exported = {s.name for fam in ServingMetrics().registry.collect() for s in fam.samples} | \
               {fam.name + "_total" for fam in ServingMetrics().registry.collect() if fam.type == "counter"}
    families = {fam.name for fam in ServingMetrics().registry.collect()}
    missing = {n for n in names if n not in exported and n not in families}
    assert names and not missing, missing


@pytest.mark.django_db
def test_a_fresh_router_seeds_its_scoreboard_from_the_outcomes_other_processes_recorded():
    from datetime import timedelta

    from django.utils import timezone

    from registry.models import Provider
    from router.state import Router

    now = timezone.now()
    live = dict(connected=True, last_heartbeat=now, last_heartbeat_ms=1)
    Provider.objects.create(provider="a" * 64, last_failure=now - timedelta(seconds=5), **live)  # a caught black hole
    Provider.objects.create(provider="b" * 64, batches_served=50, latency_ms_ewma=7.5, last_success=now, **live)
    Provider.objects.create(provider="c" * 64, batches_served=50, last_success=now - timedelta(seconds=60),
                            last_failure=now - timedelta(hours=2), **live)  # failed long ago, served since
    router = Router()
    router.live_view("no-such-model")
    assert router.scoreboard.state("a" * 64) == "half_open"
    assert router.scoreboard.state("b" * 64) == "proven"
    assert router.scoreboard.snapshot()["b" * 64]["latency_ms"] == 7.5
    assert router.scoreboard.state("c" * 64) == "proven"
    assert router.scoreboard.unseeded(["a" * 64, "b" * 64, "c" * 64]) == []
