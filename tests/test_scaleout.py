"""Several site processes of one deployment behind HAProxy (issue 26), on PostgreSQL + Redis.

``tenzro_cluster --sites 2 --holders 3``: 48 greedy ``/v1/completions`` from 16 clients
through the balancer, one site process SIGKILLed 3 s in (or once a third are answered, so
requests are in flight). Every request succeeds, or fails
with a clean retryable JSON error and succeeds on one retry; every agent heartbeats again
(its main socket on the surviving process) within 30 s; before the kill every process reaches
every agent over a socket of its own (side sockets: nothing relayed); the completions after the kill equal
those before; ``/metrics`` answers Prometheus text through the balancer. Also: a second
deployment is refused by a database another one claimed.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psycopg
import pytest

from tests.cluster_util import ROOT, env_for, fresh_postgres_db, pid_alive, running_cluster, wait_for
from tests.conftest import PG_URL, QWEN, REDIS_URL, needs_services
from tests.load_util import complete_once_retrying

pytestmark = [pytest.mark.services, pytest.mark.cluster, needs_services]

MODEL = "qwen3-moe-tiny"
PROMPTS = [[1 + i % 4, 7, 3 + i % 3, 11] for i in range(48)]  # 48 requests over 12 distinct prompts
MAX_TOKENS = 6


def _relayed(client: httpx.Client, url: str) -> float:
    """Agent requests relayed through the channel layer so far, summed over the machine's processes."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in client.get(f"{url}/metrics").text.splitlines()
               if line.startswith('tenzro_agent_requests_total{path="relay"}'))


def _heartbeats_after(db_url: str, since) -> dict[str, bool]:
    """provider → whether its last heartbeat is later than ``since`` (database time): only a
    live site process ingests heartbeats, so True means the agent's socket is on one."""
    with psycopg.connect(db_url) as conn:
        return {p: bool(hb and hb > since) for p, hb in
                conn.execute("SELECT provider, last_heartbeat FROM registry_provider").fetchall()}


@pytest.mark.timeout(1800)  # a cluster of 2 sites, 3 agents, worker and beat on a shared 2-core machine
def test_two_sites_behind_haproxy_survive_a_site_process_kill(tmp_path):
    with fresh_postgres_db(PG_URL) as db_url:
        env = env_for(tmp_path, database_url=db_url, redis_url=REDIS_URL)
        with running_cluster(tmp_path, [QWEN], holders=3, env=env, extra=("--sites", "2")) as (info, proc):
            url = info["url"]
            assert len(info["site_pids"]) == 2 and info["balancer_pid"] and info["url"] not in info["sites"]
            # Both processes serve through the balancer (round robin) and name one deployment.
            seen = {}
            with httpx.Client(timeout=300) as client:
                for _ in range(6):
                    h = client.get(f"{url}/healthz").json()
                    seen[h["pid"]] = h["deployment"]
                assert set(seen) == set(info["site_pids"]) and set(seen.values()) == {info["deployment"]}
                # Before the kill: each distinct prompt twice, one answer. (The balancer hashes the
                # model: every generation of it goes to one process, the one killed below.)
                before: dict[tuple, list[int]] = {}
                distinct = sorted({tuple(p) for p in PROMPTS})
                relayed = _relayed(client, url)
                with ThreadPoolExecutor(4) as pool:
                    warm = list(pool.map(lambda p: complete_once_retrying(client, url, MODEL, list(p), MAX_TOKENS),
                                         distinct * 2))
                for p, c in zip(distinct * 2, warm):
                    assert c.first == 200, c
                    assert before.setdefault(p, c.token_ids) == c.token_ids, p
                # Every agent holds a (side) socket on every process: no batch went through the relay.
                assert _relayed(client, url) == relayed

            # The process serving the model's generations (HAProxy logs "backend/server" per request).
            owner = re.findall(r" by_model/site(\d+) .*\"POST /v1/completions ",
                               (Path(info["logs"]) / "balancer.log").read_text())
            assert owner and len(set(owner)) == 1, owner
            victim = info["site_pids"][int(owner[0])]
            # The kill must find requests in flight: "3 s in" alone came after the last of the 48
            # answers on a fast machine (48 in about 1 s), so the process dies 3 s in or once a
            # third of the requests are answered, whichever comes first.
            done_at: list[float] = []
            third = threading.Event()

            def one(p):
                c = complete_once_retrying(client, url, MODEL, p, MAX_TOKENS)
                done_at.append(time.monotonic())
                if len(done_at) >= len(PROMPTS) // 3:
                    third.set()
                return c

            with httpx.Client(timeout=300, limits=httpx.Limits(max_connections=32)) as client, \
                    ThreadPoolExecutor(16) as pool:
                futures = [pool.submit(one, p) for p in PROMPTS]
                third.wait(3.0)
                os.kill(victim, signal.SIGKILL)
                killed_at = time.monotonic()
                with psycopg.connect(db_url) as conn:
                    t0 = conn.execute("SELECT now()").fetchone()[0]
                # Every agent heartbeats again after the kill, so on the surviving process
                # (those whose main socket was on the victim reconnected through the balancer).
                wait_for(lambda: all(_heartbeats_after(db_url, t0).values()) and len(_heartbeats_after(db_url, t0)) == 3,
                         30, "the 3 agents heartbeating again after the kill")
                reconnect_s = time.monotonic() - killed_at
                outcomes = [f.result() for f in futures]
            after_kill = sum(t > killed_at for t in done_at)
            assert after_kill >= len(PROMPTS) // 3, f"only {after_kill} of 48 requests were answered after the kill"
            assert not pid_alive(victim) and proc.poll() is None  # the cluster serves on with one process
            failed = [(p, c) for p, c in zip(PROMPTS, outcomes) if c.token_ids is None]
            assert not failed, f"{len(failed)} of 48 requests did not succeed (on one retry): {failed[:3]}"
            retried = [c for c in outcomes if c.retried]
            assert all(c.first in (429, 502, 503, 504) and c.first_error.get("message") for c in retried), retried
            for p, c in zip(PROMPTS, outcomes):
                assert c.token_ids == before[tuple(p)], f"prompt {p}: {c.token_ids} after the kill, {before[tuple(p)]} before"
            with httpx.Client(timeout=300) as client:
                for p in sorted({tuple(p) for p in PROMPTS})[:6]:  # and a quiet round after it
                    c = complete_once_retrying(client, url, MODEL, list(p), MAX_TOKENS)
                    assert c.token_ids == before[p], c
                metrics = client.get(f"{url}/metrics")
            assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
            assert "tenzro_generated_tokens_total" in metrics.text and "tenzro_forwards_total" in metrics.text
            print(f"\nsite kill: {after_kill} of 48 answered after it, {len(retried)} retried (first statuses "
                  f"{sorted({c.first for c in retried})}), agents heartbeating again {reconnect_s:.1f} s after the kill")


def test_a_database_belongs_to_one_deployment(tmp_path):
    with fresh_postgres_db(PG_URL) as db_url:
        env = {**env_for(tmp_path, database_url=db_url), "TENZRO_DEPLOYMENT": "alpha"}
        subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True)
        serve = [sys.executable, "-m", "tenzro_site.serve", "-p", "0"]
        out = subprocess.run(serve, cwd=ROOT, env={**env, "TENZRO_DEPLOYMENT": "Not A Name"},
                             capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and "TENZRO_DEPLOYMENT must be" in out.stderr
        claim = [sys.executable, "manage.py", "shell", "-c", "from registry.deployment import claim; print(claim())"]
        assert subprocess.run(claim, cwd=ROOT, env=env, capture_output=True, text=True,
                              check=True).stdout.strip().splitlines()[-1] == "alpha"
        out = subprocess.run(serve, cwd=ROOT, env={**env, "TENZRO_DEPLOYMENT": "beta"}, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode != 0 and "belongs to deployment 'alpha'" in out.stderr, out.stderr
        # A local cluster in another var dir (its own deployment name) is refused before it writes.
        other = env_for(tmp_path / "other", database_url=db_url)
        out = subprocess.run([sys.executable, "manage.py", "tenzro_cluster", "--checkpoint", str(QWEN),
                              "--holders", "1"], cwd=ROOT, env=other, capture_output=True, text=True, timeout=300)
        assert out.returncode != 0 and "belongs to deployment 'alpha'" in out.stderr, out.stderr[-2000:]
        with psycopg.connect(db_url) as conn:
            assert conn.execute("SELECT count(*) FROM registry_moemodel").fetchone()[0] == 0
