"""What one holder agent is started with: ``AgentConfig``, built by ``holders.cli`` from the
flags (tests and benches build it directly). Imports nothing from Django."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from nacl.signing import SigningKey

from moe.faults import Fault


def _env_seconds(name: str, default: float) -> float:
    """``$name`` as seconds, ``default`` when unset or empty; raises ``ValueError`` when malformed."""
    return float(os.environ.get(name) or default)


@dataclass(frozen=True)
class AgentConfig:
    """One agent's settings (immutable once the agent starts).

    ``site``: the site's base URL, ``http(s)://host:port``. ``key``: the provider's ed25519
    signing key (its public half is the provider id). ``blob_dir``: where fetched blobs are
    kept. ``name``: display name (at most ``moe.messages.MAX_NAME`` characters).
    ``heartbeat_interval``: seconds between signed heartbeats. ``roles``: advertised roles
    (``ExpertHolder`` plus a generation role of ``moe.handoff``). ``memory_budget``: bytes of
    the memory tier (None: ``$TENZRO_MEMORY_BUDGET`` or 60% of available memory).
    ``disk_dir``: the disk tier (None: ``<blob_dir>/tier``). ``http_port`` / ``http_host``:
    also serve ``POST /rpc`` and ``POST /frame`` there and advertise it (None: off).
    ``advertise_http``: the HTTP endpoint's URL as routers should dial it (behind NAT, a port
    forward or a proxy; "" advertises ``http://http_host:http_port/rpc``).
    ``iroh_bind``: ``host:port`` of an iroh QUIC endpoint (None: off). ``advertise_iroh``:
    ``ip:port`` direct addresses routers should dial for the iroh endpoint instead of the
    bound ones (empty: the bound ones). ``compute_threads``:
    threads running batches (decode, FFN, encode, receipt); one per core is plenty.
    ``inline_work``: a message whose batches hold at most this many rows x d_model in all (a
    decode step's few rows of a small model) runs on the event loop, skipping two thread
    hand-offs, and is answered whole even when streaming was asked for (0: never).
    ``fault``: a drill fault (``moe.faults``; None: off). ``price_per_input_token`` /
    ``minimum_price``: advertised pricing, signed in every heartbeat.
    ``repair_interval_s`` / ``repair_release_grace_s``: the repair worker's seconds between
    own passes and before a surplus replica is dropped (``$TENZRO_REPAIR_INTERVAL``, default
    120, and ``$TENZRO_REPAIR_RELEASE_GRACE``, default 600; a malformed value raises
    ``ValueError`` when the config is built).
    """

    site: str
    key: SigningKey
    blob_dir: str | Path
    name: str = ""
    heartbeat_interval: float = 15.0
    roles: tuple[str, ...] = ("ExpertHolder",)
    memory_budget: int | None = None
    disk_dir: str | Path | None = None
    http_port: int | None = None
    http_host: str = "127.0.0.1"
    advertise_http: str = ""
    iroh_bind: str | None = None
    advertise_iroh: tuple[str, ...] = ()
    compute_threads: int = 1
    inline_work: int = 16384
    fault: Fault | None = None
    price_per_input_token: int = 10
    minimum_price: int = 100
    repair_interval_s: float = field(default_factory=lambda: _env_seconds("TENZRO_REPAIR_INTERVAL", 120))
    repair_release_grace_s: float = field(
        default_factory=lambda: _env_seconds("TENZRO_REPAIR_RELEASE_GRACE", 600))

    @property
    def site_base(self) -> str:
        """``site`` without a trailing slash (the base of ``/blobs/``, ``/rpc``, ...)."""
        return self.site.rstrip("/")

    @property
    def http_endpoint(self) -> str:
        """The advertised HTTP endpoint: ``advertise_http`` (its path ``/rpc`` added when it has
        none), else ``http://host:port/rpc``; "" when off."""
        if not self.http_port:
            return ""
        if self.advertise_http:
            base = self.advertise_http.rstrip("/")
            return base if base.endswith("/rpc") else base + "/rpc"
        return f"http://{self.http_host}:{self.http_port}/rpc"

    @property
    def tier_dir(self) -> Path:
        """The disk tier directory: ``disk_dir``, else ``<blob_dir>/tier``."""
        return Path(self.disk_dir) if self.disk_dir else Path(self.blob_dir) / "tier"
