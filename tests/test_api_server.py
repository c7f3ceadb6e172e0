"""The site's real server (``tenzro_site.serve``: daphne) against clients that misbehave at the
socket (issue 24 item 10): slowloris connections trickling header lines are closed by the
request deadline, and a ``tenzro_moeGenerate`` whose client hung up is cancelled at the next
scheduler step instead of running to its end."""
from __future__ import annotations

import json
import re
import socket
import time
from urllib.parse import urlparse

import httpx
import pytest

from tests.cluster_util import env_for, running_cluster, wait_for
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


def _generated(info: dict) -> float:
    text = httpx.get(info["url"] + "/metrics", timeout=30).text
    m = re.search(r'^tenzro_generated_tokens_total\{model="%s"\} ([0-9.e+]+)$' % re.escape(info["model_id"]),
                  text, re.M)
    return float(m.group(1)) if m else 0.0


def _settled(info: dict, quiet_s: float = 3.0, timeout: float = 120.0) -> float:
    """The generated-token count once it stopped growing for ``quiet_s`` seconds."""
    last, since = _generated(info), time.monotonic()
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        time.sleep(0.5)
        now = _generated(info)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return last


@pytest.mark.parametrize("batch", [False, True])
def test_a_generation_whose_client_left_is_cancelled(site, batch):
    """``tenzro_moeGenerate`` (a single request, or inside a JSON-RPC batch) of 8 prompts × 120
    tokens; the client closes its socket once tokens flow. The scheduler drops the request at
    its next step: far fewer than the 960 tokens are generated."""
    before = _settled(site)
    warm = httpx.post(site["rpc"], json={"jsonrpc": "2.0", "id": 1, "method": "tenzro_moeGenerate", "params": {
        "model_id": site["model_id"], "input_ids": [1, 2, 3], "max_new_tokens": 2}}, timeout=120).json()
    assert len(warm["result"]["output_ids"]) == 2, warm
    assert _generated(site) >= before + 2, httpx.get(site["url"] + "/metrics", timeout=30).text[-3000:]
    before = _generated(site)
    call = {"jsonrpc": "2.0", "id": 1, "method": "tenzro_moeGenerate",
            "params": {"model_id": site["model_id"], "input_ids": [[1, 2, 3]] * 8, "max_new_tokens": 120}}
    body = json.dumps([call] if batch else call).encode()
    s = socket.create_connection(_address(site), timeout=10)
    s.sendall(b"POST /rpc HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    wait_for(lambda: _generated(site) > before, 120, "the generation to start")
    s.close()
    assert _settled(site) - before < 960 / 2
