"""Integration with the real services: PostgreSQL + Redis channel layer forward, Celery worker on Redis."""
from __future__ import annotations

import subprocess
import sys
import time

import httpx
import psycopg
import pytest
from celery import Celery

from tests.cluster_util import ROOT, env_for, fresh_postgres_db, pid_alive, rpc, running_cluster
from tests.conftest import PG_URL, QWEN, REDIS_URL, needs_services
from tests.test_cluster import forward_matches_reference

pytestmark = [pytest.mark.services, needs_services]


def test_forward_over_redis_channel_layer_and_postgres(tmp_path):
    with fresh_postgres_db(PG_URL) as db_url:
        env = env_for(tmp_path, database_url=db_url, redis_url=REDIS_URL)
        with running_cluster(tmp_path, [QWEN], holders=3, env=env) as (info, _):
            assert forward_matches_reference(info, "qwen3-moe-tiny", QWEN, 0) <= 1e-5
            # Services mode: the cluster runs a Celery worker (and one beat), so a queued prepare
            # job completes and /healthz counts the worker.
            assert len(info["celery_pids"]) == 2
            deadline = time.time() + 30  # the site caches "no worker" (asked during start-up) for 2 s
            while (health := httpx.get(f"{info['url']}/healthz", timeout=30).json())["celery_workers"] < 1 \
                    and time.time() < deadline:
                time.sleep(0.5)
            assert health["celery_workers"] >= 1, health
            job = rpc(info["rpc"], "tenzro_moePrepareExperts", {"model_id": "svc-job", "checkpoint": str(QWEN),
                                                               "layer": 0, "experts": [0, 1]},
                      token=info["operator_token"])["result"]
            deadline, state = time.time() + 120, None
            while time.time() < deadline and state != "completed":
                time.sleep(0.5)
                state = rpc(info["rpc"], "tenzro_moePrepareStatus", {"job_id": job["job_id"]})["result"]["state"]
            assert state == "completed"
        assert not any(pid_alive(pid) for pid in info["celery_pids"])  # stopped with everything else
        with psycopg.connect(db_url) as conn:
            n_holdings = conn.execute("SELECT count(*) FROM registry_holding").fetchone()[0]
            n_providers = conn.execute("SELECT count(*) FROM registry_provider").fetchone()[0]
        assert n_providers == 3 and n_holdings == 2 * 2 * 16  # 2 layers × 16 experts × replication 2


def test_celery_task_runs_on_a_real_worker(tmp_path):
    with fresh_postgres_db(PG_URL) as db_url:
        env = env_for(tmp_path, database_url=db_url, redis_url=REDIS_URL)
        subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True)
        with psycopg.connect(db_url) as conn:
            conn.execute(
                "INSERT INTO registry_provider (provider, name, http_endpoint, iroh_endpoint_id, roles, moe_gpu, "
                "price_per_input_token, minimum_price, reputation, status, connected, agent_channel, "
                "last_heartbeat, last_heartbeat_ms, created) VALUES (%s, 'stale', '', '', '[]', false, 10, 100, 500, "
                "'Active', true, '', now() - interval '1 hour', 1, now())", ("ab" * 32,))
        queue = f"test-{tmp_path.name}"
        worker = subprocess.Popen([sys.executable, "-m", "celery", "-A", "tenzro_site", "worker", "--pool", "solo",
                                   "-Q", queue, "--without-heartbeat", "--without-gossip", "--without-mingle",
                                   "-l", "warning"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                  stderr=open(tmp_path / "worker.log", "wb"))
        try:
            client = Celery(broker=REDIS_URL, backend=REDIS_URL)
            result = client.send_task("registry.sweep_stale_providers", queue=queue)
            assert result.get(timeout=90) == 1
            with psycopg.connect(db_url) as conn:
                assert conn.execute("SELECT connected FROM registry_provider").fetchone()[0] is False
            # Idempotent: a second run changes nothing more.
            assert client.send_task("registry.sweep_stale_providers", queue=queue).get(timeout=60) == 0
        finally:
            worker.terminate()
            try:
                worker.wait(20)
            except subprocess.TimeoutExpired:
                worker.kill()
            time.sleep(0.1)
