"""``python -m holders --site URL --key FILE``: run a holder agent (no Django, no database).

``manage.py holder_agent`` on the site is a thin alias that runs this program. Defaults come from
the environment: ``TENZRO_VAR_DIR`` (default ``./var``) for the key and blob directories,
``TENZRO_HEARTBEAT_INTERVAL`` (seconds, default 15), ``TENZRO_KEY_FILE``.
"""
from __future__ import annotations

import asyncio
import gc
import ipaddress
import logging
import math
import os
import signal
import socket
from pathlib import Path
from urllib.parse import urlsplit

import argparse
import sys

from nacl.signing import SigningKey
from threadpoolctl import threadpool_limits

from moe import compute
from holders.agent import AgentConfig, AuthRefused, HolderAgent, KeyInUse, ws_url
from moe.faults import Fault, parse_fault
from moe.transports import iroh
from moe.messages import MAX_NAME
from moe.identity import load_or_create_key, provider_id


IROH_BIND_DEFAULT = "127.0.0.1:0"


class CliError(Exception):
    """A flag's value the agent cannot start with; the message names the flag (exit status 1)."""


def probe_bind(flag: str, host: str, port: int, kind: int) -> None:
    """Bind ``host:port`` (``kind`` ``SOCK_STREAM`` for the HTTP endpoint, ``SOCK_DGRAM`` for
    iroh's QUIC) once and release it, so an address in use or not on this machine is refused
    naming ``flag`` before the agent starts. Raises ``CliError``."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host.strip("[]")).version == 6 else socket.AF_INET
    except ValueError:
        family = socket.AF_INET  # a host name (--http-host): resolved by bind
    try:
        with socket.socket(family, kind) as s:
            if kind == socket.SOCK_STREAM:  # as asyncio's server does: only a live listener conflicts
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host.strip("[]"), port))
    except OSError as exc:
        raise CliError(f"{flag}: cannot bind {host}:{port}: {exc.strerror or exc}") from exc


def build_parser() -> argparse.ArgumentParser:
    """The agent's flags (``python -m holders --help``)."""
    parser = argparse.ArgumentParser(
        prog="python -m holders",
        description="Run a holder agent: connect to the site, prove identity, heartbeat holdings, execute experts.")
    parser.add_argument("--site", required=True, help="site URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--key", default=os.environ.get("TENZRO_KEY_FILE"),
                        help="ed25519 seed file (created on first run; default $TENZRO_KEY_FILE or var/agent.key)")
    parser.add_argument("--blob-dir", default=None, help="where fetched blobs are kept (default var/agent-blobs)")
    parser.add_argument("--budget", type=int, default=None,
                        help="memory-tier budget in bytes "
                             "(default $TENZRO_MEMORY_BUDGET or 60%% of available memory)")
    parser.add_argument("--disk-dir", default=None, help="disk tier directory (default <blob-dir>/tier)")
    parser.add_argument("--compute", default=None, choices=["auto", "cpu", "cuda", "wgpu"],
                        help="compute backend "
                             "(default $TENZRO_COMPUTE_BACKEND or auto: CUDA when usable, else CPU)")
    parser.add_argument("--role", default="PrefillDecode", choices=["PrefillDecode", "Prefill", "Decode"],
                        help="generation role: Prefill runs prompts and hands the KV cache off, Decode "
                             "continues handed-off sequences, PrefillDecode (default) does both")
    parser.add_argument("--name", default="", help="a display name for this provider")
    parser.add_argument("--heartbeat-interval", type=float, default=None,
                        help="seconds between signed heartbeats (default $TENZRO_HEARTBEAT_INTERVAL or 15)")
    parser.add_argument("--http-port", type=int, default=None,
                        help="also serve POST /rpc (tenzro_moeExecute, moe/status) on this port and advertise it")
    parser.add_argument("--http-host", default="127.0.0.1", help="address the HTTP endpoint binds and advertises")
    parser.add_argument("--advertise-http", default="", metavar="URL",
                        help="the URL routers dial for the HTTP endpoint (behind NAT, a port forward or a proxy), "
                             "e.g. http://203.0.113.7:9000 (/rpc is added); needs --http-port "
                             "(default http://HTTP-HOST:HTTP-PORT/rpc)")
    parser.add_argument("--iroh", action="store_true",
                        help="also serve moe/execute and moe/status over iroh QUIC (ALPN tenzro/moe) and advertise "
                             "the endpoint id (derived from --key) and its direct addresses")
    parser.add_argument("--iroh-bind", default=IROH_BIND_DEFAULT, metavar="HOST:PORT",
                        help="IP address and port the iroh endpoint binds, IPv6 in brackets "
                             "(default 127.0.0.1:0, a free port; relays are off, "
                             "so routers dial the addresses this binds)")
    parser.add_argument("--advertise-iroh", action="append", default=None, metavar="IP:PORT",
                        help="a direct address routers dial for the iroh endpoint instead of the bound one "
                             "(a port forward, a proxy); repeatable; needs --iroh")
    parser.add_argument("--blas-threads", type=int, default=1,
                        help="BLAS threads per matmul (default 1: batches run concurrently, and several "
                             "spinning BLAS pools on shared cores made a 48-token forward ~40x slower)")
    parser.add_argument("--price-per-input-token", type=int, default=10,
                        help="advertised price per input token of a remote batch (default 10)")
    parser.add_argument("--minimum-price", type=int, default=100,
                        help="advertised minimum price of one forward's work (default 100)")
    parser.add_argument("--fault", default=None,
                        help="DRILL ONLY: corrupt:P signs perturbed rows for a fraction P of batches; "
                             "stall:S sleeps S seconds per batch; blackhole declares every expert on the site "
                             "Warm at committed_tps 1000000 and never answers a batch (default off)")
    return parser


def var_dir() -> Path:
    """``$TENZRO_VAR_DIR`` or ``./var``: where the default key and blob directory live."""
    return Path(os.environ.get("TENZRO_VAR_DIR") or Path.cwd() / "var").resolve()


def default_heartbeat_interval() -> float:
    """``$TENZRO_HEARTBEAT_INTERVAL`` (seconds, default 15). Raises ``CliError`` naming the variable."""
    raw = os.environ.get("TENZRO_HEARTBEAT_INTERVAL", "").strip()
    if not raw:
        return 15.0
    try:
        return float(int(raw))
    except ValueError:
        raise CliError(f"TENZRO_HEARTBEAT_INTERVAL must be a whole number of seconds, got {raw!r}") from None


def check_advertise_http(url: str) -> str:
    """``--advertise-http``'s URL, checked: ``http(s)://host[:port][/path]`` with no query or
    fragment. Raises ``CliError`` naming the flag."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError as exc:
        raise CliError(f"--advertise-http {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CliError(f"--advertise-http must be an http(s)://HOST[:PORT] URL, got {url!r}")
    if parts.query or parts.fragment:
        raise CliError(f"--advertise-http must not carry a query or fragment, got {url!r}")
    if port == 0:
        raise CliError(f"--advertise-http: port 0 cannot be dialed, got {url!r}")
    return url


def check_socket_addr(flag: str, addr: str) -> str:
    """``IP:PORT`` (IPv6 in brackets, port 1..65535) as iroh dials it. Raises ``CliError`` naming ``flag``."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise CliError(f"{flag} must be IP:PORT with a port 1..65535, got {addr!r}")
    bracketed = host.startswith("[") and host.endswith("]")
    if ":" in host and not bracketed:
        raise CliError(f"{flag}: write an IPv6 address in brackets, [{host}]:{port}")
    try:
        ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        raise CliError(f"{flag}: the host must be an IP address (iroh dials socket addresses), got {host!r}") from None
    return addr


def config_from(opts: dict, key: SigningKey, blob_dir: str | Path, interval: float, iroh_bind: str | None,
                fault: Fault | None) -> AgentConfig:
    """The ``AgentConfig`` of parsed and checked flags (``opts``: ``vars`` of ``build_parser``'s
    namespace) with the values ``_run`` resolved. Raises ``ValueError`` for a malformed
    ``TENZRO_REPAIR_INTERVAL`` / ``TENZRO_REPAIR_RELEASE_GRACE``."""
    return AgentConfig(site=opts["site"], key=key, blob_dir=blob_dir, name=opts["name"],
                       heartbeat_interval=interval, roles=("ExpertHolder", opts["role"]),
                       memory_budget=opts["budget"], disk_dir=opts["disk_dir"],
                       http_port=opts["http_port"], http_host=opts["http_host"], iroh_bind=iroh_bind,
                       advertise_http=opts.get("advertise_http") or "",
                       advertise_iroh=tuple(opts.get("advertise_iroh") or ()),
                       fault=fault, price_per_input_token=opts["price_per_input_token"],
                       minimum_price=opts["minimum_price"])


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), start the agent and run it until SIGINT/SIGTERM.
    Returns the exit status: 0 after a clean stop, 1 with a message naming the flag on stderr."""
    opts = vars(build_parser().parse_args(argv))
    try:
        return _run(opts)
    except CliError as exc:
        print(f"holder agent: error: {exc}", file=sys.stderr)
        return 1


def _run(opts: dict) -> int:
    try:
        ws_url(opts["site"])
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    interval = opts["heartbeat_interval"]
    if interval is None:
        interval = default_heartbeat_interval()
    if not math.isfinite(interval) or interval <= 0:
        raise CliError(f"--heartbeat-interval must be a positive number of seconds, got {interval}")
    if len(opts["name"]) > MAX_NAME or "\x00" in opts["name"]:  # the site refuses longer ones in every heartbeat
        raise CliError(f"--name must be at most {MAX_NAME} characters without NUL, "
                       f"got {len(opts['name'])} characters")
    if opts["iroh_bind"] != IROH_BIND_DEFAULT and not opts["iroh"]:
        raise CliError("--iroh-bind needs --iroh (without it no iroh endpoint is served)")
    key_path = Path(opts["key"]) if opts["key"] else var_dir() / "agent.key"
    if opts["key"] and not key_path.parent.is_dir():  # a mistyped path must not mint a new identity
        raise CliError(f"--key: directory {key_path.parent} does not exist")
    if opts["budget"] is not None and opts["budget"] <= 0:
        raise CliError("--budget must be a positive number of bytes")
    if opts["blas_threads"] < 1:
        raise CliError("--blas-threads must be at least 1")
    threadpool_limits(limits=opts["blas_threads"])
    if opts["http_port"] is not None and not 0 < opts["http_port"] < 65536:
        raise CliError("--http-port must be between 1 and 65535")
    if opts["advertise_http"]:
        if opts["http_port"] is None:
            raise CliError("--advertise-http needs --http-port (without it no HTTP endpoint is served)")
        check_advertise_http(opts["advertise_http"])
    if opts["advertise_iroh"]:
        if not opts["iroh"]:
            raise CliError("--advertise-iroh needs --iroh (without it no iroh endpoint is served)")
        for addr in opts["advertise_iroh"]:
            check_socket_addr("--advertise-iroh", addr)
    if opts["http_port"] is not None:
        probe_bind("--http-host / --http-port", opts["http_host"], opts["http_port"], socket.SOCK_STREAM)
    for name in ("price_per_input_token", "minimum_price"):
        if not 0 <= opts[name] <= 1 << 62:
            raise CliError(f"--{name.replace('_', '-')} must be between 0 and 2^62, got {opts[name]}")
    try:
        fault = parse_fault(opts["fault"])
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    iroh_bind = None
    if opts["iroh"]:
        if not iroh.available():
            raise CliError(f"--iroh: {iroh.UNAVAILABLE}")
        iroh_bind = opts["iroh_bind"]
        host, sep, port = iroh_bind.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise CliError(f"--iroh-bind must be HOST:PORT (port 0 = a free one), got {iroh_bind!r}")
        try:  # iroh takes a socket address, not a host name
            ipaddress.ip_address(host[1:-1] if host.startswith("[") and host.endswith("]") else host)
        except ValueError:
            raise CliError(f"--iroh-bind: HOST must be an IP address (IPv6 in brackets), got {host!r}") from None
        if ":" in host and not host.startswith("["):
            raise CliError(f"--iroh-bind: write an IPv6 address in brackets, [{host}]:{port}")
        probe_bind("--iroh-bind", host, int(port), socket.SOCK_DGRAM)
    # The key is created only once every flag checked out: a refused command mints no identity.
    existed = key_path.exists()
    try:
        key = load_or_create_key(key_path)
    except (ValueError, OSError) as exc:
        raise CliError(f"--key: {exc}") from exc
    if not existed:
        print(f"created a new key at {key_path}: provider id {provider_id(key)}", file=sys.stderr)
    blob_dir = opts["blob_dir"] or var_dir() / "agent-blobs"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        compute.set_backend(compute.select_backend(opts["compute"]))
        agent = HolderAgent(config_from(opts, key, blob_dir, interval, iroh_bind, fault))
    except compute.BackendUnavailable as exc:
        raise CliError(f"--compute: {exc}") from exc
    except ValueError as exc:  # TENZRO_MEMORY_BUDGET / _COMPUTE_BACKEND / _REPAIR_* malformed
        raise CliError(str(exc)) from exc
    except OSError as exc:
        raise CliError(f"--blob-dir / --disk-dir: {exc}") from exc
    if fault is not None:
        print(f"WARNING: drill fault {fault} is ON: this agent misbehaves on purpose", file=sys.stderr)
    print(f"holder agent {provider_id(key)} → {opts['site']} (compute {agent.backend.tag}, "
          f"memory budget {agent.runtime.budget} bytes, disk tier {agent.runtime.disk.root})", flush=True)

    # The agent's modules (numpy, numba, the transports, the runtime) leave ~76k long-lived
    # objects that every full collection walked again while the site waited on this agent's
    # answers: 54-66 ms of CPU each at 16 clients, in all three agents of a cluster at once.
    # Frozen, a full collection walks only what serving allocated (16-29 ms).
    gc.collect()
    gc.freeze()

    async def serve():
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, agent.stop)
        await agent.run()

    try:
        asyncio.run(serve())
    except KeyInUse as exc:
        raise CliError(f"--key {key_path}: {exc} (another agent runs with this key; give each agent "
                       f"its own --key)") from exc
    except AuthRefused as exc:
        raise CliError(str(exc)) from exc
    except OSError as exc:  # --http-port / --iroh-bind taken since the probe above
        raise CliError(f"--http-port / --iroh-bind: {exc}") from exc
    return 0
