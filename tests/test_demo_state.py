"""The demo keeps its own state (issue 24 item 12): ``tenzro_demo`` runs in ``$TENZRO_VAR_DIR/demo``
with its own database, so a ``tenzro_cluster`` started afterwards in the same checkout sees none of
the demo's providers, models or the holder its failover scene killed."""
from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tenzro_site.management.commands.tenzro_demo import DEMO_MARKER, demo_environment
from tests.cluster_util import ROOT, env_for, rpc, running_cluster
from tests.conftest import QWEN


def test_demo_environment_is_its_own(tmp_path):
    operator = {"DATABASE_URL": "postgres://op@db/site", "REDIS_URL": "redis://op:6379/0",
                "TENZRO_VAR_DIR": str(tmp_path), "TENZRO_OPERATOR_TOKEN": "op-token", "TENZRO_KEY_FILE": "/op.key",
                "TENZRO_BLOB_DIR": "/op/blobs", "PATH": "/usr/bin"}
    env = demo_environment(operator, tmp_path)
    assert env["TENZRO_VAR_DIR"] == str(tmp_path / "demo") and env[DEMO_MARKER] == "1"
    assert env["DATABASE_URL"] == f"sqlite:///{tmp_path / 'demo' / 'db.sqlite3'}"
    assert not {"REDIS_URL", "TENZRO_OPERATOR_TOKEN", "TENZRO_KEY_FILE", "TENZRO_BLOB_DIR"} & set(env)
    assert env["PATH"] == "/usr/bin"
    env = demo_environment({**operator, "TENZRO_DEMO_DATABASE_URL": "postgres://op@db/demo",
                            "TENZRO_DEMO_REDIS_URL": "redis://op:6379/3"}, tmp_path)
    assert env["DATABASE_URL"] == "postgres://op@db/demo" and env["REDIS_URL"] == "redis://op:6379/3"
    assert env["TENZRO_CELERY_QUEUE"] == env["TENZRO_CHANNEL_PREFIX"] == "tenzro-demo"


@pytest.mark.cluster
def test_cluster_after_demo_sees_none_of_it(tmp_path):
    env = env_for(tmp_path)
    demo = subprocess.run([sys.executable, str(ROOT / "manage.py"), "tenzro_demo", "--checkpoint", str(QWEN),
                           "--holders", "2", "--quant", "q8_0"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert demo.returncode == 0, demo.stdout[-4000:] + demo.stderr[-4000:]
    assert "ALL CHECKS PASSED" in demo.stdout and "qwen3-moe-tiny-q8-0" in demo.stdout
    assert (tmp_path / "var" / "demo" / "db.sqlite3").is_file()
    assert not (tmp_path / "var" / "keys").exists(), "the demo wrote agent keys into the operator's var dir"

    with running_cluster(tmp_path, [QWEN], holders=2, env=env) as (info, _):
        ours = {a["provider"] for a in info["agents"]}
        providers = {p["provider"] for p in rpc(info["rpc"], "tenzro_moeListProviders", {})["result"]["providers"]}
        assert providers == ours
        models = {m["id"] for m in httpx.get(f"{info['url']}/v1/models", timeout=30).json()["data"]}
        assert models and not any(m.endswith("-q8-0") for m in models), models
        health = httpx.get(f"{info['url']}/healthz", timeout=30).json()
        assert not health["failing_holders"] and not health["unserved_models"], health
        assert health["status"] == "ok", health


def test_demo_refuses_fewer_than_two_holders_before_starting(tmp_path):
    """Its failover scene stops a holder, so one holder cannot pass: refused at once naming
    --holders, before any state is made or any checkpoint published."""
    demo = subprocess.run([sys.executable, str(ROOT / "manage.py"), "tenzro_demo", "--holders", "1"], cwd=ROOT,
                          env=env_for(tmp_path), capture_output=True, text=True, timeout=300)
    assert demo.returncode != 0 and "--holders 1" in demo.stderr and "at least 2" in demo.stderr, demo.stderr
    assert "publishing" not in demo.stdout and not (tmp_path / "var" / "demo").exists()


def test_demo_names_a_checkpoint_that_does_not_exist(tmp_path):
    demo = subprocess.run([sys.executable, str(ROOT / "manage.py"), "tenzro_demo", "--checkpoint",
                           str(tmp_path / "nonexistent")], cwd=ROOT, env=env_for(tmp_path), capture_output=True,
                          text=True, timeout=300)
    assert demo.returncode != 0 and f"--checkpoint {tmp_path / 'nonexistent'}: no such file or directory" in demo.stderr
    assert not (tmp_path / "var" / "demo").exists()
