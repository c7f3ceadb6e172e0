"""The load balancer in front of several site processes: HAProxy, configured from the
template ``deploy/haproxy.cfg.tmpl`` (the same file operators render with ``envsubst``).

``render_config`` fills the template; ``Balancer`` writes it under a directory, checks it with
``haproxy -c`` and runs ``haproxy -db`` in the foreground as a child of the local cluster.
"""
from __future__ import annotations

import shutil
import string
import subprocess
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

TEMPLATE = settings.BASE_DIR / "deploy" / "haproxy.cfg.tmpl"
ERRORS_DIR = settings.BASE_DIR / "deploy" / "errors"


class BalancerError(RuntimeError):
    """HAProxy is not installed, or refused the rendered configuration (its message kept)."""


def render_config(bind: str, servers: list[tuple[str, str]], template: Path = TEMPLATE,
                  errors_dir: Path = ERRORS_DIR) -> str:
    """The template with ``bind`` (``HOST:PORT`` clients and agents use) and one ``server NAME
    ADDR check`` line per ``(name, "host:port")`` of ``servers``; raises ``ValueError`` for none."""
    if not servers:
        raise ValueError("the balancer needs at least one site process")
    lines = "\n".join(f"    server {name} {addr} check" for name, addr in servers)
    return string.Template(template.read_text()).safe_substitute(
        TENZRO_LB_BIND=bind, TENZRO_LB_SERVERS=lines, TENZRO_LB_ERRORS=str(errors_dir))


@dataclass
class Balancer:
    """HAProxy on ``bind`` in front of ``servers`` (``[(name, "host:port")]``), its
    configuration written to ``dir / "haproxy.cfg"``."""

    bind: str
    servers: list[tuple[str, str]]
    dir: Path

    def command(self) -> list[str]:
        """The foreground command line (``-db``: no daemon, logs to stderr). Writes and checks the
        configuration first; raises ``BalancerError``."""
        exe = shutil.which("haproxy") or next((p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy")
                                               if Path(p).exists()), None)
        if exe is None:
            raise BalancerError("--sites above 1 needs HAProxy (Debian: apt-get install haproxy)")
        self.dir.mkdir(parents=True, exist_ok=True)
        cfg = self.dir / "haproxy.cfg"
        cfg.write_text(render_config(self.bind, self.servers))
        check = subprocess.run([exe, "-c", "-q", "-f", str(cfg)], capture_output=True, text=True)
        if check.returncode != 0:
            raise BalancerError(f"haproxy refused {cfg}: {(check.stderr or check.stdout).strip()[-2000:]}")
        return [exe, "-db", "-f", str(cfg)]
