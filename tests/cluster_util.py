"""Running real site/agent/worker processes from tests."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import psycopg

ROOT = Path(__file__).resolve().parent.parent


def env_for(tmp: Path, database_url: str | None = None, redis_url: str | None = None) -> dict:
    """Environment of a child process: its own var dir and database; Redis only when given."""
    env = {k: v for k, v in os.environ.items() if k not in {"REDIS_URL", "DATABASE_URL", "TENZRO_OPERATOR_TOKEN"}}
    env.update({"TENZRO_VAR_DIR": str(tmp / "var"), "PYTHONUNBUFFERED": "1",
                "DJANGO_SETTINGS_MODULE": "tenzro_site.settings",
                "DATABASE_URL": database_url or f"sqlite:///{tmp / 'db.sqlite3'}"})
    if redis_url:
        env["REDIS_URL"] = redis_url
        env["TENZRO_CHANNEL_PREFIX"] = env["TENZRO_CELERY_QUEUE"] = f"t{uuid.uuid4().hex[:8]}"
    return env


@contextmanager
def running_cluster(tmp: Path, checkpoints: list[Path], holders: int = 3, env: dict | None = None,
                    timeout: float = 180.0, extra: tuple[str, ...] = ()):
    """Start ``manage.py tenzro_cluster`` (``extra`` flags appended); yields (info dict, process).
    Stops it with SIGINT."""
    env = env or env_for(tmp)
    cmd = [sys.executable, str(ROOT / "manage.py"), "tenzro_cluster", "--holders", str(holders), *extra]
    for c in checkpoints:
        cmd += ["--checkpoint", str(c)]
    err = open(tmp / "cluster.stderr", "wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        deadline = time.time() + timeout
        line = ""
        while time.time() < deadline and not line:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        if not line:
            raise AssertionError(f"cluster printed nothing; stderr:\n{(tmp / 'cluster.stderr').read_text()[-4000:]}")
        yield json.loads(line), proc
    finally:
        stop(proc, 30)


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """Stop a cluster or agent process as an operator would (SIGINT: it stops its children and
    closes its sockets), killing it after ``grace_s`` seconds; no-op when it already ended."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def rpc(url: str, method: str, params: dict, token: str | None = None, timeout: float = 120.0) -> dict:
    """One JSON-RPC call; returns the whole response object."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(url, json={"jsonrpc": "2.0", "id": 1, "method": method, "params": params},
                      headers=headers, timeout=timeout).json()


def rpc_served(url: str, method: str, params: dict, token: str | None = None, timeout: float = 300.0) -> dict:
    """``rpc`` that, as the API tells a client, retries a -32005 Busy answer (the router refused or
    gave up on work because it was itself saturated: "not the holder's fault") after its
    ``retry_after_s``, until ``timeout`` seconds have passed; returns the first other response
    (a result or another error) or, past the deadline, the last Busy one."""
    deadline = time.time() + timeout
    while True:
        resp = rpc(url, method, params, token, timeout=max(10.0, deadline - time.time()))
        err = resp.get("error") or {}
        if err.get("code") != -32005 or time.time() >= deadline:
            return resp
        time.sleep(min(float((err.get("data") or {}).get("retry_after_s", 1.0)), max(0.0, deadline - time.time())))


def wait_for(cond, timeout: float, what: str, poll_s: float = 0.5):
    """Poll ``cond()`` until it returns something truthy (returned) or ``timeout`` seconds pass
    (``AssertionError`` naming ``what``): a generous deadline, never a fixed sleep."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(poll_s)
    raise AssertionError(f"{what} within {timeout} s")


def pid_alive(pid: int) -> bool:
    """Whether a process id still runs (zombies count as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@contextmanager
def fresh_postgres_db(admin_url: str):
    """Create a throwaway PostgreSQL database; yields its URL; drops it afterwards."""
    name = f"tenzro_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    parts = urlsplit(admin_url)
    try:
        yield urlunsplit((parts.scheme, parts.netloc, f"/{name}", "", ""))
    finally:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def blackhole_agent(info: dict, tmp: Path, env: dict, model_id: str, layer: int, timeout: float = 60.0):
    """A ``holder_agent --fault blackhole`` process joining the cluster ``info`` (``env``: the
    cluster's; its key, blob dir and stderr under ``tmp``). Yields the black hole's provider id
    once the shard map lists it on every expert of ``layer`` at committed_tps 1,000,000; stops it
    with SIGINT on exit. Raises ``RuntimeError`` (with its stderr) when it never gets there."""
    known = {a["provider"] for a in info["agents"]}
    err = tmp / "blackhole.stderr"
    proc = subprocess.Popen([sys.executable, str(ROOT / "manage.py"), "holder_agent", "--site", info["url"],
                             "--key", str(tmp / "blackhole.key"), "--blob-dir", str(tmp / "blackhole-blobs"),
                             "--name", "blackhole", "--heartbeat-interval", "5", "--fault", "blackhole"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(err, "wb"))
    try:
        deadline = time.time() + timeout
        while True:
            shard = rpc(info["rpc"], "tenzro_moeShardMap", {"model_id": model_id})["result"]
            holes = {p for p in shard["providers"] if p not in known}
            rows = [h for h in shard["holders"] if h["layer"] == layer]
            if holes and all(any(p["provider"] in holes and p["committed_tps"] == 1_000_000 for p in h["holders"])
                             for h in rows):
                yield holes.pop()
                return
            if time.time() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the black hole never appeared on every expert: {err.read_text()[-2000:]}")
            time.sleep(0.2)
    finally:
        stop(proc, 20)
