"""The site's real server (``tenzro_site.serve``: daphne) against clients that misbehave at the
socket (issue 24 item 10): slowloris connections trickling header lines are closed by the
request deadline (408), and the site serves on."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.cluster_util import ROOT, env_for, stop, wait_for

pytestmark = pytest.mark.cluster

HEADER_TIMEOUT_S = 2


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """``python -m tenzro_site.serve`` alone (the server is what is under test) on a free port."""
    tmp = tmp_path_factory.mktemp("server")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**env_for(tmp), "TENZRO_HTTP_HEADER_TIMEOUT": str(HEADER_TIMEOUT_S)}
    # The server claims its deployment row at start (as `make serve` does, migrate first).
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env, check=True)
    proc = subprocess.Popen([sys.executable, "-m", "tenzro_site.serve", "-b", "127.0.0.1", "-p", str(port)],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp / "serve.stderr", "wb"))
    url = f"http://127.0.0.1:{port}"

    def up():
        if proc.poll() is not None:
            raise AssertionError(f"the server exited {proc.returncode}: {(tmp / 'serve.stderr').read_text()[-2000:]}")
        try:
            return httpx.get(url + "/v1/ping", timeout=10).status_code == 404  # JSON 404, no database
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, 300, "the server to answer")
        yield {"url": url}
    finally:
        stop(proc)


def _address(info: dict) -> tuple[str, int]:
    host, port = info["url"].rsplit("/", 1)[-1].split(":")
    return host, int(port)


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
    assert httpx.get(site["url"] + "/v1/ping", timeout=30).status_code == 404  # serving on (JSON 404)


def test_a_declared_body_over_the_limit_is_413_at_once(site):
    """A request declaring a Content-Length over TENZRO_MAX_BODY is answered 413 (JSON) as soon
    as its headers arrive (before: the server waited for a body that never came, then 408), and
    what the client sends after is dropped; the site serves on."""
    with socket.create_connection(_address(site), timeout=30) as s:
        s.sendall(b"POST /rpc HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000000000\r\n\r\n" + b"{" * 4096)
        answer = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), answer[:300]
    assert b"1000000000000" in body and b"TENZRO_MAX_BODY" in body, body
    assert httpx.get(site["url"] + "/v1/ping", timeout=30).status_code == 404  # serving on (JSON 404)


@pytest.mark.parametrize("path", ["/v1/completions", "/rpc"])
def test_the_early_413_is_in_the_shape_of_the_paths_api(site, path):
    """The server's own 413 (a declared body over TENZRO_MAX_BODY, answered before the request
    reaches Django) is OpenAI's error object under ``/v1/`` and a JSON-RPC error under ``/rpc``,
    as every other error on those paths (before: ``{"error": "<text>"}`` on both, which the
    openai SDK and JSON-RPC clients cannot read)."""
    with socket.create_connection(_address(site), timeout=30) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: 1000000000000\r\n\r\n".encode())
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), answer[:300]
    doc = json.loads(body)
    if path == "/rpc":
        assert doc["jsonrpc"] == "2.0" and doc["id"] is None and doc["error"]["code"] == -32600
        assert "TENZRO_MAX_BODY" in doc["error"]["message"] and doc["error"]["data"]["field"] == "body"
    else:
        assert doc["error"]["type"] == "invalid_request_error" and "TENZRO_MAX_BODY" in doc["error"]["message"]


def test_a_chunked_json_body_reaches_the_rest_api(site):
    """A REST body sent chunked (no Content-Length, as streaming HTTP clients send it) is parsed
    like the same body with a Content-Length (before: DRF read it as empty, "model_id: This field
    is required"); a chunked body over the endpoint's limit is a JSON 413."""
    body = json.dumps({"model_id": "no-such-model", "routings": [[0, 0, [[1, 0.5]]]]}).encode()
    plain = httpx.post(site["url"] + "/api/v1/plan", content=body,
                       headers={"Content-Type": "application/json"}, timeout=30)
    chunked = httpx.post(site["url"] + "/api/v1/plan", content=iter([body[:10], body[10:]]),
                         headers={"Content-Type": "application/json"}, timeout=30)
    assert "content-length" not in chunked.request.headers  # httpx sent it chunked
    assert (chunked.status_code, chunked.json()) == (plain.status_code, plain.json()), (chunked.text, plain.text)
    assert "required" not in chunked.text, chunked.text
    big = httpx.post(site["url"] + "/api/v1/plan", content=iter([b'{"model_id": "' + b"x" * (9 << 20) + b'"}']),
                     headers={"Content-Type": "application/json"}, timeout=30)
    assert big.status_code == 413 and "limit" in big.json()["error"], big.text
