"""Two Celery beat processes on Redis (plus one worker) run each repair period exactly once."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import psycopg
import pytest

from tests.cluster_util import ROOT, env_for, fresh_postgres_db
from tests.conftest import PG_URL, REDIS_URL, needs_services

pytestmark = [pytest.mark.services, needs_services]

INTERVAL_S = 2


def test_two_beats_run_each_period_once(tmp_path):
    with fresh_postgres_db(PG_URL) as db_url:
        env = env_for(tmp_path, database_url=db_url, redis_url=REDIS_URL)
        env["TENZRO_REPAIR_INTERVAL"] = str(INTERVAL_S)
        subprocess.run([sys.executable, str(ROOT / "manage.py"), "migrate", "-v", "0"], cwd=ROOT, env=env,
                       check=True, timeout=300)
        celery = [sys.executable, "-m", "celery", "-A", "tenzro_site"]
        procs = [subprocess.Popen(celery + ["worker", "-P", "solo", "-l", "warning"], cwd=ROOT, env=env,
                                  stdout=open(tmp_path / "worker.log", "wb"), stderr=subprocess.STDOUT)]
        for i in range(2):
            procs.append(subprocess.Popen(celery + ["beat", "-l", "info", "-s", str(tmp_path / f"beat{i}")],
                                          cwd=ROOT, env=env, stdout=open(tmp_path / f"beat{i}.log", "wb"),
                                          stderr=subprocess.STDOUT))
        try:
            deadline = time.time() + 120
            rows = []
            while time.time() < deadline:
                with psycopg.connect(db_url) as conn:
                    rows = conn.execute("SELECT period_key, period, attempts, status FROM registry_repairpass "
                                        "ORDER BY period").fetchall()
                if len([r for r in rows if r[3] == "done"]) >= 5 and sum(r[2] for r in rows) >= len(rows) + 3:
                    break
                time.sleep(1)
        finally:
            for p in procs:
                p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        logs = "\n".join((tmp_path / f).read_text()[-1500:] for f in ("worker.log", "beat0.log", "beat1.log"))
        assert len(rows) >= 5, logs
        periods = [r[1] for r in rows]
        assert len(periods) == len(set(periods)), "a period ran twice"
        # Both beats fired: more attempts than passes, every extra one refused by the period key.
        assert sum(r[2] for r in rows) >= len(rows) + 3, (rows, logs)
        assert all(r[0] == f"{INTERVAL_S}:{r[1]}" for r in rows)
