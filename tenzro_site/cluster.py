"""A local cluster on one machine: the site (daphne) plus N holder agents, with models placed;
in services mode (``REDIS_URL``) also one Celery worker on the site's task queue and one beat.
With ``sites`` above 1 (PostgreSQL and Redis required): that many site processes of one
deployment behind HAProxy (``tenzro_site.balancer``), clients and agents using the balancer.

Used by ``tenzro_cluster``, ``verify_forward`` and ``tenzro_demo``, and by end-to-end tests.
It owns what it starts: ``stop()`` terminates every process, and it also runs at exit. It
touches only what it started: its checkpoints are opened before anything is written, one
cluster at a time holds a ``TENZRO_VAR_DIR`` (its agent keys live there; ``cluster.lock``),
and only its own agents' stale sessions are reset.
"""
from __future__ import annotations

import atexit
import ctypes
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

import httpx
from django.conf import settings
from django.core.management import call_command

from moe.transports import iroh
from moe.identity import load_or_create_key, provider_id
from moe.jsonrpc import ParamError
from prepare.checkpoint import CheckpointError
from prepare.remote import open_checkpoint
from prepare.services import default_model_id, publish_checkpoint, publish_dense
from registry.models import Provider
from registry.services import reset_sessions
from registry.selectors import shard_view
from registry.operator import operator_token
from registry.deployment import DeploymentMismatch, check_name, claim
from registry.model_ids import validate_model_id
from tenzro_site.balancer import Balancer, BalancerError
from tenzro_site.celery import queue_workers


LISTEN_BACKLOG = 1024  # pending TCP connections the site's socket queues (Twisted's default is 50)


class ClusterError(RuntimeError):
    """The cluster could not start, place its models or reach full coverage in time."""


#: Most agents one local cluster starts: each is a Python process with its own interpreter, BLAS
#: threads and memory tier on this one machine; more belong on more machines (``holder_agent``
#: against a served site).
MAX_LOCAL_HOLDERS = 64
#: Most site processes one local cluster starts behind its balancer.
MAX_LOCAL_SITES = 16


def local_deployment_name(var_dir: Path) -> str:
    """The deployment name of a local cluster whose ``TENZRO_DEPLOYMENT`` is unset: derived from
    its var dir, so two local clusters in different var dirs refuse to share one database."""
    return "local-" + hashlib.blake2b(str(Path(var_dir).resolve()).encode(), digest_size=5).hexdigest()


def _die_with_parent() -> None:
    """In a child before exec: ask Linux for SIGTERM when the parent dies (no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def check_agent_site(url: str) -> str:
    """``--agent-site``'s URL, checked as the agents check ``--site``: ``http(s)://host[:port]``
    with a valid port. Raises ``ClusterError`` naming the flag."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError as exc:
        raise ClusterError(f"--agent-site {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port == 0:
        raise ClusterError(f"--agent-site must be an http(s)://HOST[:PORT] URL the agents can dial, got {url!r}")
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise ClusterError(f"--agent-site must be the site's base URL without a path or query, got {url!r}")
    return url


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalCluster:
    """Site + ``holders`` agents on 127.0.0.1, each checkpoint published and placed with ``replication``.

    ``model_ids`` and ``quants`` (preset name, per-projection object or None = dense) are
    per checkpoint; the same checkpoint may appear twice (dense and quantized, under two
    ids). ``say`` receives progress lines (default: silent). ``agent_http``: each agent also
    serves its HTTP endpoint (``--http-port``) on a free port and advertises it; ``agent_iroh``:
    each agent also serves an iroh endpoint on 127.0.0.1 (``--iroh``) and advertises it.
    ``dense_parts``: dense MLP layers are split into this many intermediate slices and
    placed like experts (``prepare.dense``; model ids in ``dense_ids``). ``repair_interval``:
    seconds between repair passes of the site and of every agent (``TENZRO_REPAIR_INTERVAL``;
    None = the policy's). ``agent_faults``:
    ``{agent index: "corrupt:P" | "stall:S"}`` drill faults (``holder_agent --fault``). ``roles``: agent ``i``
    starts with ``--role roles[i % len(roles)]`` (``Prefill``, ``Decode`` or ``PrefillDecode``,
    the default). ``agent_site``: the URL the agents dial instead of the site's own (a reverse
    proxy or latency emulator in front of it; the site still listens on ``port``). ``sites``:
    site processes behind HAProxy on ``port`` (above 1 needs a PostgreSQL ``DATABASE_URL`` and
    ``REDIS_URL``: the processes share the database, the channel layer relays requests to
    agents whose socket another process holds); ``url`` is then the balancer's. ``balancer``:
    HAProxy in front even of one site process (benches compare 1 and N processes on the same
    path). Raises ``ClusterError``.
    """

    def __init__(self, checkpoints: list[str | Path], holders: int = 4, port: int = 0, replication: int = 2,
                 heartbeat_interval: int = 5, say: Callable[[str], None] | None = None,
                 model_ids: list[str | None] | None = None, quants: list | None = None,
                 agent_http: bool = False, agent_iroh: bool = False, dense_parts: int = 2, repair_interval: int | None = None,
                 agent_faults: dict[int, str] | None = None, roles: list[str] | None = None,
                 agent_site: str | None = None, sites: int = 1, balancer: bool = False):
        if not 1 <= sites <= MAX_LOCAL_SITES:
            raise ClusterError(f"--sites must be between 1 and {MAX_LOCAL_SITES} on one machine, got {sites}")
        if sites > 1 and not (settings.REDIS_URL and settings.DATABASES["default"]["ENGINE"].endswith("postgresql")):
            raise ClusterError("--sites above 1 needs REDIS_URL (the channel layer between site processes) and a "
                               "PostgreSQL DATABASE_URL (one database for all of them)")
        if not 1 <= holders <= MAX_LOCAL_HOLDERS:
            raise ClusterError(f"--holders must be between 1 and {MAX_LOCAL_HOLDERS} on one machine, got {holders}")
        if port and not 0 < port < 65536:
            raise ClusterError(f"--port must be between 1 and 65535, got {port}")
        self.checkpoints = [Path(c) for c in checkpoints]
        self.model_id_overrides = model_ids or [None] * len(self.checkpoints)
        self.quants = quants or [None] * len(self.checkpoints)
        if len(self.quants) != len(self.checkpoints) or len(self.model_id_overrides) != len(self.checkpoints):
            raise ClusterError("give one model id and one quant plan per checkpoint")
        seen: dict[str, Path] = {}
        for ckpt, mid in zip(self.checkpoints, self.model_id_overrides):
            if mid is not None:  # refused here, before "publishing …", not by the job afterwards
                try:
                    validate_model_id(mid, "--model-id")
                except ParamError as exc:
                    raise ClusterError(str(exc)) from None
            mid = mid or default_model_id(ckpt)
            if mid in seen:  # the second publish would overwrite the first under the same id
                if seen[mid].resolve() == ckpt.resolve():
                    raise ClusterError(f"--checkpoint {ckpt} is given twice (model id {mid!r}); give it once, or "
                                       "each its own --model-id")
                raise ClusterError(f"--model-id: {seen[mid]} and {ckpt} would both publish as {mid!r}; give each "
                                   "its own --model-id")
            seen[mid] = ckpt
        self.holders = holders
        self.agent_faults = dict(agent_faults or {})
        bad = [i for i in self.agent_faults if not 0 <= i < holders]
        if bad:
            raise ClusterError(f"--agent-fault: agent index {bad[0]} is out of range 0..{holders - 1}")
        self.roles = list(roles or ["PrefillDecode"])
        bad = [r for r in self.roles if r not in ("PrefillDecode", "Prefill", "Decode")]
        if bad:
            raise ClusterError(f"--agent-role must be PrefillDecode, Prefill or Decode, got {bad[0]!r}")
        self.agent_http = agent_http
        if agent_iroh and not iroh.available():
            raise ClusterError(f"--agent-iroh: {iroh.UNAVAILABLE}")
        self.agent_iroh = agent_iroh
        self.port = port or free_port()
        self.replication = replication
        self.heartbeat_interval = heartbeat_interval
        self.say = say or (lambda s: None)
        self.url = f"http://127.0.0.1:{self.port}"
        self.rpc_url = f"{self.url}/rpc"
        if agent_site:
            check_agent_site(agent_site)
        self.agent_site = agent_site or self.url
        self.log_dir = settings.VAR_DIR / "logs"
        self.site: subprocess.Popen | None = None  # the first site process (the only one when sites == 1)
        self.sites: list[subprocess.Popen] = []
        self.n_sites = sites
        self.use_balancer = balancer or sites > 1
        self.site_urls: list[str] = []
        self.balancer: subprocess.Popen | None = None
        self.deployment = os.environ.get("TENZRO_DEPLOYMENT", "").strip() or local_deployment_name(settings.VAR_DIR)
        self.agents: list[tuple[str, subprocess.Popen]] = []
        self.celery: list[subprocess.Popen] = []  # worker and beat, in services mode (REDIS_URL)
        self.model_ids: list[str] = []
        self.dense_ids: list[str] = []
        self.dense_parts = dense_parts
        self.repair_interval = repair_interval
        self._req_id = 0
        self._lock = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, timeout: float = 90.0) -> "LocalCluster":
        """Check inputs, lock the var dir, migrate, publish, start site and agents, place every
        model, wait for full coverage. Nothing shared is written before the checks pass."""
        for ckpt in self.checkpoints:
            try:
                open_checkpoint(ckpt)
            except CheckpointError as exc:
                raise ClusterError(f"--checkpoint: {exc}") from None
        self._check_port()
        self._acquire_lock()
        atexit.register(self.stop)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        call_command("migrate", verbosity=0, interactive=False)
        try:
            claim(check_name(self.deployment))  # before anything is written: another deployment's database is refused
        except (DeploymentMismatch, ValueError) as exc:
            raise ClusterError(str(exc)) from None
        for ckpt, mid, quant in zip(self.checkpoints, self.model_id_overrides, self.quants):
            self.say(f"publishing {ckpt}{f' as {quant}' if quant else ''} ...")
            # experts, gates and (its job's last step) the backbone: the site generates
            self.model_ids.append(publish_checkpoint(ckpt, mid, quant=quant).model_id)
            if quant is None:
                dense = publish_dense(ckpt, self.model_ids[-1], self.dense_parts)
                if dense is not None:
                    self.dense_ids.append(dense.model_id)
        env = {**os.environ, "TENZRO_HEARTBEAT_INTERVAL": str(self.heartbeat_interval),
               "TENZRO_VAR_DIR": str(settings.VAR_DIR), "TENZRO_BLOB_DIR": str(settings.TENZRO["BLOB_DIR"]),
               "TENZRO_OPERATOR_TOKEN": operator_token(), "PYTHONUNBUFFERED": "1",
               "TENZRO_DEPLOYMENT": self.deployment}
        if self.use_balancer and not env.get("PROMETHEUS_MULTIPROC_DIR"):
            # Several site processes: /metrics of any of them sums this machine's (router.metrics).
            metrics_dir = settings.VAR_DIR / "prometheus"
            shutil.rmtree(metrics_dir, ignore_errors=True)
            metrics_dir.mkdir(parents=True)
            env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
        if self.repair_interval:
            env["TENZRO_REPAIR_INTERVAL"] = str(self.repair_interval)
        # The agents share this machine's cores: each gets its share for the quantized kernels'
        # row threads (numba / native), so N agents do not run N x cores spinning threads.
        env.setdefault("NUMBA_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // max(1, self.holders))))
        # An explicit listen backlog: Twisted's default of 50 resets connections when hundreds of
        # clients connect while the loop is busy with forwards.
        if not self.use_balancer:
            self.site = self._spawn("site", [sys.executable, "-m", "tenzro_site.serve",
                                             "-e", f"tcp:port={self.port}:interface=127.0.0.1:backlog={LISTEN_BACKLOG}",
                                             "--websocket_timeout", "-1"], env)
            self.sites = [self.site]
            self._wait(lambda: self._healthy(), timeout, "the site did not answer /healthz")
        else:
            self._start_sites(env, timeout)
        if settings.REDIS_URL:  # services mode: queued tasks need a worker, the periodic sweeps one beat
            self._start_celery(env)
        self.say(f"site up at {self.url}; starting {self.holders} holder agents ...")
        ids = [provider_id(load_or_create_key(settings.VAR_DIR / "keys" / f"agent-{i}.key"))
               for i in range(self.holders)]
        # Our agents are not running yet (we hold the var dir's lock): sessions of theirs still
        # marked open are left over from a killed run. Nobody else's are touched.
        reset_sessions(ids)
        for i, pid in enumerate(ids):
            key_path = settings.VAR_DIR / "keys" / f"agent-{i}.key"
            proc = self._spawn(f"agent-{i}", [sys.executable, "-m", "holders",  # the standalone agent
                                              "--site", self.agent_site, "--key", str(key_path), "--name", f"agent-{i}",
                                              "--blob-dir", str(settings.VAR_DIR / "agents" / f"agent-{i}" / "blobs"),
                                              "--heartbeat-interval", str(self.heartbeat_interval),
                                              "--role", self.roles[i % len(self.roles)]]
                               + (["--http-port", str(free_port())] if self.agent_http else [])
                               + (["--iroh"] if self.agent_iroh else [])
                               + (["--fault", self.agent_faults[i]] if i in self.agent_faults else []), env)
            self.agents.append((pid, proc))
        self._wait(lambda: Provider.objects.filter(provider__in=ids, connected=True,
                                                   last_heartbeat__isnull=False).count() == len(ids),
                   timeout, "not every agent connected and sent a heartbeat")
        for mid in self.model_ids + self.dense_ids:
            res = self.rpc("tenzro_moePlaceModel", {"model_id": mid, "replication": self.replication}, operator=True)
            if res["failed"]:
                raise ClusterError(f"placing {mid}: {len(res['failed'])} loads failed, first: {res['failed'][0]}")
            want = min(self.replication, self.holders)
            self._wait(lambda mid=mid, want=want: shard_view(mid).covers(min_replication=want), timeout,
                       f"{mid} did not reach replication {want} on every expert")
            self.say(f"{mid}: every expert held by {want} agents")
        if self.celery:
            self._wait(lambda: queue_workers() > 0, timeout,
                       f"the Celery worker did not consume queue {settings.CELERY_TASK_DEFAULT_QUEUE!r}")
            self.say(f"Celery worker and beat up on queue {settings.CELERY_TASK_DEFAULT_QUEUE!r}")
        return self

    def _start_sites(self, env: dict, timeout: float) -> None:
        """``n_sites`` site processes on free ports (X-Forwarded-For trusted: only the balancer
        reaches them), then HAProxy on ``port`` in front of them; waits until each process and
        the balancer answer /healthz."""
        ports = [free_port() for _ in range(self.n_sites)]
        names = [f"site{i}" for i in range(self.n_sites)]  # the balancer's server names
        for i, port in enumerate(ports):
            # Each process knows its server name and every one's: agents hold a socket to each.
            self.sites.append(self._spawn(f"site-{i}", [
                sys.executable, "-m", "tenzro_site.serve", "--proxy-headers",
                "-e", f"tcp:port={port}:interface=127.0.0.1:backlog={LISTEN_BACKLOG}", "--websocket_timeout", "-1"],
                {**env, "TENZRO_SITE_ID": names[i], "TENZRO_SITE_IDS": ",".join(names)}))
            self.site_urls.append(f"http://127.0.0.1:{port}")
        self.site = self.sites[0]
        for i, url in enumerate(self.site_urls):
            self._wait(lambda url=url: self._healthy(url), timeout, f"site process {i} did not answer /healthz")
        try:
            cmd = Balancer(f"127.0.0.1:{self.port}", [(name, url.removeprefix("http://"))
                                                      for name, url in zip(names, self.site_urls)],
                           settings.VAR_DIR / "balancer").command()
        except BalancerError as exc:
            raise ClusterError(str(exc)) from None
        self.balancer = self._spawn("balancer", cmd, env)
        self._wait(lambda: self._healthy(), timeout, "the balancer did not answer /healthz")

    def _start_celery(self, env: dict) -> None:
        """One worker on this site's task queue and exactly one beat (the periodic sweeps and
        repair passes; its schedule lives in the database, its pid file in the var dir we lock)."""
        celery = [sys.executable, "-m", "celery", "-A", "tenzro_site"]
        self.celery.append(self._spawn("celery-worker", celery + [
            "worker", "--concurrency", "2", "--without-gossip", "--without-mingle", "-l", "info",
            "-n", f"tenzro-{os.getpid()}@%h"], env))
        self.celery.append(self._spawn("celery-beat", celery + [
            "beat", "-l", "info", "--pidfile", str(settings.VAR_DIR / "celerybeat.pid")], env))

    def stop(self) -> None:
        """Terminate agents then the site (SIGTERM, then SIGKILL after 5 s). Safe to call twice."""
        procs = [p for _, p in self.agents] + self.celery + self.sites + ([self.balancer] if self.balancer else [])
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.time() + 5
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.agents, self.celery, self.site, self.sites, self.balancer = [], [], None, [], None
        if self._lock is not None:
            self._lock.close()  # releases the flock
            self._lock = None

    def info(self) -> dict:
        """The JSON line ``tenzro_cluster`` prints."""
        return {"url": self.url, "rpc": self.rpc_url, "agent_site": self.agent_site,
                "model_id": self.model_ids[0] if self.model_ids else None,
                "model_ids": self.model_ids, "operator_token": operator_token(),
                "agents": [{"provider": pid, "pid": p.pid, "fault": self.agent_faults.get(i)}
                           for i, (pid, p) in enumerate(self.agents)],
                "site_pid": self.site.pid if self.site else None,
                "site_pids": [p.pid for p in self.sites], "sites": self.site_urls or [self.url],
                "balancer_pid": self.balancer.pid if self.balancer else None, "deployment": self.deployment,
                "celery_pids": [p.pid for p in self.celery], "logs": str(self.log_dir)}

    # -- helpers ---------------------------------------------------------------------------
    def rpc(self, method: str, params: dict, operator: bool = False, timeout: float = 120.0) -> dict:
        """Call a JSON-RPC method on the site; raises ``ClusterError`` with the error object."""
        self._req_id += 1
        headers = {"Authorization": f"Bearer {operator_token()}"} if operator else {}
        resp = httpx.post(self.rpc_url, json={"jsonrpc": "2.0", "id": self._req_id, "method": method,
                                              "params": params}, headers=headers, timeout=timeout)
        body = resp.json()
        if "error" in body:
            raise ClusterError(self.rpc_error_text(method, body["error"]))
        return body["result"]

    #: Longest error ``data`` printed inline; a longer one (a failed forward lists every attempt)
    #: is written to ``VAR_DIR/last_rpc_error.json`` and the message names the file.
    ERROR_DATA_INLINE = 400

    @classmethod
    def rpc_error_text(cls, method: str, error: dict) -> str:
        """One readable line for a JSON-RPC error object: its message, its ``data`` when short."""
        data = error.get("data")
        if data is None:
            return f"{method}: {error.get('message')}"
        detail = json.dumps(data, default=str)
        if len(detail) > cls.ERROR_DATA_INLINE:
            path = settings.VAR_DIR / "last_rpc_error.json"
            path.write_text(json.dumps(error, indent=1, default=str))
            detail = f"the whole error object is in {path}"
        return f"{method}: {error.get('message')} ({detail})"

    def _acquire_lock(self) -> None:
        """Hold ``VAR_DIR/cluster.lock`` (flock, released when this process ends however it ends):
        a second cluster on the same var dir would start agents with the same keys and take over
        the running cluster's providers. Raises ``ClusterError`` naming the holder's pid and url."""
        path = settings.VAR_DIR / "cluster.lock"
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise ClusterError(f"another local cluster ({holder}) is running with TENZRO_VAR_DIR={settings.VAR_DIR}; "
                               "stop it, or give this one its own TENZRO_VAR_DIR and DATABASE_URL") from None
        f.truncate(0)
        f.write(f"pid {os.getpid()}, {self.url}")
        f.flush()
        self._lock = f

    def _check_port(self) -> None:
        """Fail before any work when the site's port is taken by a live socket. SO_REUSEADDR as
        the site's listener (Twisted) sets it: TIME-WAIT sockets of a cluster just stopped do
        not block a restart, a listener still does."""
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", self.port))
            except OSError as exc:
                raise ClusterError(f"port {self.port} on 127.0.0.1 is not free: {exc.strerror}") from exc

    def _spawn(self, name: str, cmd: list[str], env: dict) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")
        # Own session: a terminal Ctrl-C reaches only the cluster, which stops children in order.
        # Parent-death signal: children go too when the cluster itself is SIGKILLed.
        return subprocess.Popen(cmd, cwd=settings.BASE_DIR, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)

    def site_died(self, proc: subprocess.Popen) -> None:
        """A site process of several exited: drop its live gauges from the shared metrics
        directory (its counters stay in the sums, as Prometheus expects of counters)."""
        metrics_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or str(settings.VAR_DIR / "prometheus")
        if self.use_balancer and Path(metrics_dir).is_dir():
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(proc.pid, metrics_dir)

    def live_sites(self) -> list[subprocess.Popen]:
        """The site processes still running."""
        return [p for p in self.sites if p.poll() is None]

    def _healthy(self, url: str | None = None) -> bool:
        for i, p in enumerate(self.sites):
            if p.poll() is not None:
                log = self.log_dir / (f"site-{i}.log" if self.use_balancer else "site.log")
                raise ClusterError(f"the site exited with code {p.returncode}; see {log}")
        if self.balancer is not None and self.balancer.poll() is not None:
            raise ClusterError(f"the balancer exited with code {self.balancer.returncode}; see "
                               f"{self.log_dir / 'balancer.log'}")
        try:
            return httpx.get(f"{url or self.url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _wait(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for pid, p in self.agents:
                if p.poll() is not None:
                    raise ClusterError(f"agent {pid[:12]}… exited with code {p.returncode}; see {self.log_dir}")
            for p in self.celery:
                if p.poll() is not None:
                    raise ClusterError(f"the Celery {p.args[5]} exited with code {p.returncode}; see {self.log_dir}")
            if cond():
                return
            time.sleep(0.2)
        raise ClusterError(f"{what} within {timeout:g} s; logs in {self.log_dir}")
