"""An agent the site refuses: a key already in use (4409) is retried only for the site's
``retry_for_s`` and then ends the agent; a configuration the site refuses (4422: name,
pricing) ends it at once; the ``holder_agent`` CLI checks ``--name``, ``--key`` and
``--iroh-bind`` before connecting; an answer whose socket closed meanwhile is dropped quietly."""
from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time

import pytest
from nacl.signing import SigningKey
from websockets.asyncio.server import serve

from moe import messages
from holders.agent import AgentConfig, AuthRefused, HolderAgent, KeyInUse
from tests.cluster_util import ROOT, env_for


async def _refusing_site(handler):
    server = await serve(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


def _agent_ends_with(handler, tmp_path, exc_type, match: str) -> None:
    """An agent connecting to a site played by ``handler`` ends its socket loop with ``exc_type``."""
    async def go():
        server, url = await _refusing_site(handler)
        agent = HolderAgent(AgentConfig(url, SigningKey.generate(), tmp_path, name="n"))
        try:
            with pytest.raises(exc_type, match=match):
                await asyncio.wait_for(agent.session.run(), 20)
        finally:
            server.close()

    asyncio.run(go())


def test_a_key_in_use_is_retried_for_the_sites_window_then_ends_the_agent(tmp_path):
    hellos: list[float] = []

    async def handler(ws):
        await ws.send(json.dumps(messages.challenge(b"\x00" * 32)))
        await ws.recv()
        hellos.append(time.monotonic())
        await ws.send(json.dumps({**messages.socket_error("key is already connected", code=4409), "retry_for_s": 2}))
        await ws.close(code=4409, reason="key already connected")

    _agent_ends_with(handler, tmp_path, KeyInUse, "already connected")
    assert len(hellos) >= 2  # retried (a stale session of its own may have been in the way) ...
    assert hellos[-1] - hellos[0] < 5  # ... but only for about retry_for_s, not forever


def test_a_refused_configuration_ends_the_agent_with_the_sites_message(tmp_path):
    async def handler(ws):
        await ws.send(json.dumps(messages.challenge(b"\x00" * 32)))
        await ws.recv()
        await ws.send(json.dumps(messages.welcome("p", 1 << 20, 15)))
        await ws.recv()  # the first heartbeat
        await ws.send(json.dumps(messages.socket_error("name must be a string of at most 200 characters",
                                                       field="name", ref="heartbeat")))
        await ws.close(code=4422, reason="name")

    _agent_ends_with(handler, tmp_path, AuthRefused, "name must be a string")


def test_an_answer_after_the_socket_closed_is_dropped_with_one_line(tmp_path, caplog):
    agent = HolderAgent(AgentConfig("http://127.0.0.1:1", SigningKey.generate(), tmp_path))
    agent.session.ws = None  # the site went away while the request ran
    with caplog.at_level(logging.INFO, logger="tenzro.agent"):
        asyncio.run(agent.handle({"type": "rpc", "id": "r1", "method": "moe/status"}, b"{}"))
    assert not [r for r in caplog.records if r.exc_info]
    assert any("dropped" in r.getMessage() for r in caplog.records)


def _holder_agent(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "manage.py"), "holder_agent", "--site", "http://127.0.0.1:1",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env_for(ROOT / "var" / "test-cli"))


def test_cli_refuses_a_long_name_a_missing_key_dir_and_a_lone_iroh_bind(tmp_path):
    long = _holder_agent("--name", "x" * 201, "--key", str(tmp_path / "k"))
    assert long.returncode == 1 and "--name must be at most 200 characters" in long.stderr
    missing = _holder_agent("--key", str(tmp_path / "no" / "dir" / "key"))
    assert missing.returncode == 1 and "--key" in missing.stderr and "does not exist" in missing.stderr
    assert not (tmp_path / "no").exists()
    lone = _holder_agent("--iroh-bind", "nonsense", "--key", str(tmp_path / "k"))
    assert lone.returncode == 1 and "--iroh-bind needs --iroh" in lone.stderr
    assert "Traceback" not in long.stderr + missing.stderr + lone.stderr


def test_cli_refuses_an_address_it_cannot_bind_naming_the_flag(tmp_path):
    """A taken --http-port, a host name or an unowned address in --iroh-bind, a NaN interval: one
    CommandError naming the flag before the agent starts (the bind errors used to surface as a bare
    "[Errno 98] …" or iroh's "invalid socket address syntax" after start-up; NaN was accepted)."""
    import socket
    with socket.socket() as taken, socket.socket(type=socket.SOCK_DGRAM) as taken_udp:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        taken_udp.bind(("127.0.0.1", 0))
        key = ("--key", str(tmp_path / "k"))
        cases = {
            ("--http-port", str(taken.getsockname()[1])): "--http-host / --http-port: cannot bind 127.0.0.1:",
            ("--iroh", "--iroh-bind", f"127.0.0.1:{taken_udp.getsockname()[1]}"): "--iroh-bind: cannot bind 127.0.0.1:",
            ("--iroh", "--iroh-bind", "localhost:0"): "--iroh-bind: HOST must be an IP address",
            ("--iroh", "--iroh-bind", "::1:0"): "--iroh-bind: write an IPv6 address in brackets, [::1]:0",
            ("--iroh", "--iroh-bind", "192.0.2.1:0"): "--iroh-bind: cannot bind 192.0.2.1:0",
            ("--heartbeat-interval", "nan"): "--heartbeat-interval must be a positive number of seconds, got nan",
        }
        for args, says in cases.items():
            res = _holder_agent(*args, *key)
            assert res.returncode == 1 and says in res.stderr and "Traceback" not in res.stderr, (args, res.stderr)
