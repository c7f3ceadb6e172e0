"""Pieces of the several-process deployment that need no processes: the balancer's configuration
(checked by HAProxy itself when installed), the once-per-period claim of beat's sweeps, the
deployment claim, and the multiprocess metrics exposition."""
from __future__ import annotations

import json
import shutil
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from registry.deployment import DeploymentMismatch, check_name, claim, current
from registry.periodic import claim_period
from tenzro_site.balancer import ERRORS_DIR, Balancer, render_config
from tenzro_site.cluster import free_port
from tests.cluster_util import wait_for


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



class _NameServer(ThreadingHTTPServer):
    """A stand-in site process: answers every request with its name (JSON)."""

    def __init__(self, name: str):
        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = json.dumps({"site": name}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="needs HAProxy")
def test_the_balancer_sends_a_models_requests_to_one_process_and_fails_over(tmp_path):
    sites = [_NameServer("site0"), _NameServer("site1")]
    port = free_port()
    cmd = Balancer(f"127.0.0.1:{port}", [(s_name, f"127.0.0.1:{srv.server_address[1]}")
                                         for s_name, srv in zip(("site0", "site1"), sites)], tmp_path).command()
    lb = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=30) as client:
            def site(method="GET", path="/healthz", body=None):
                try:
                    return client.request(method, url + path, json=body).json()["site"]
                except (httpx.HTTPError, ValueError):
                    return None

            wait_for(lambda: site(), 30, "HAProxy answering")
            assert {site() for _ in range(4)} == {"site0", "site1"}  # round robin for the rest
            for model in ("m-a", "m-b", "m-c", "m-d"):  # each model's generations and calls: one process
                got = {site("POST", "/v1/completions", {"model": model, "prompt": [1]}) for _ in range(4)}
                got |= {site("POST", "/v1/chat/completions", {"model": model, "messages": []}) for _ in range(2)}
                got |= {site("POST", "/rpc", {"jsonrpc": "2.0", "id": i, "method": "tenzro_moeGenerate",
                                              "params": {"model_id": model}}) for i in range(2)}
                assert len(got) == 1 and None not in got, (model, got)
            owner = site("POST", "/v1/completions", {"model": "m-a"})
            # A body without a model (a JSON-RPC batch here) goes round robin.
            assert {site("POST", "/rpc", [{"jsonrpc": "2.0", "id": 1, "method": "x"}]) for _ in range(4)} \
                == {"site0", "site1"}
            dead = sites[int(owner[-1])]
            dead.shutdown()
            dead.server_close()  # connections refused now, before any health check notices
            other = "site1" if owner == "site0" else "site0"
            assert {site("POST", "/v1/completions", {"model": "m-a"}) for _ in range(4)} == {other}
    finally:
        lb.terminate()
        lb.wait(10)
        for srv in sites:
            srv.server_close()

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
