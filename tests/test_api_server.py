"""The site's real server (``tenzro_site.serve``: daphne) against clients that misbehave at the
socket (issue 24 item 10): slowloris connections trickling header lines are closed by the
request deadline (408), and the site serves on."""
from __future__ import annotations

import socket
import time
from urllib.parse import urlparse

import httpx
import pytest

from tests.cluster_util import env_for, running_cluster
from tests.conftest import QWEN

pytestmark = pytest.mark.cluster

HEADER_TIMEOUT_S = 2


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    env = {**env_for(tmp), "TENZRO_HTTP_HEADER_TIMEOUT": str(HEADER_TIMEOUT_S)}
    with running_cluster(tmp, [QWEN], holders=1, env=env) as (info, _proc):
        yield info


def _address(info: dict) -> tuple[str, int]:
    u = urlparse(info["url"])
    return u.hostname, u.port


def test_slowloris_connections_are_closed(site):
    """Sockets that send one more header line every second never finish their request: each
    is answered 408 and closed once the header deadline passes (before: held for good, 400 of
    them took the site's descriptors), and the site serves on."""
    socks = []
    for _ in range(20):
        s = socket.create_connection(_address(site), timeout=5)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    t0, closed, answers = time.monotonic(), {}, {}
    while len(closed) < len(socks) and time.monotonic() - t0 < 60:
        for i, s in enumerate(socks):
            if i in closed:
                continue
            try:
                s.sendall(f"X-Slow-{int(time.monotonic() * 10)}: a\r\n".encode())
                s.settimeout(0.05)
                data = s.recv(4096)
            except socket.timeout:
                continue
            except OSError:  # reset: closed too
                data = b""
            answers[i] = answers.get(i, b"") + data
            if not data or b"\r\n\r\n" in answers[i]:
                closed[i] = time.monotonic() - t0
        time.sleep(1.0)
    for s in socks:
        s.close()
    assert len(closed) == len(socks), f"{len(socks) - len(closed)} slow sockets still open after 60 s"
    assert max(closed.values()) < 30, closed
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers.values() if a), answers
    assert httpx.get(site["url"] + "/healthz", timeout=30).status_code in (200, 503)
