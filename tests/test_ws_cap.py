"""The agent socket's message cap on a real daphne (``tenzro_site.serve``): big holders heartbeat
below it, a raised cap raises daphne's frame limit too, and a message over it is closed with 1009."""
from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
import time

import httpx
import pytest
from nacl.signing import SigningKey
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from moe import messages
from moe.identity import DOMAIN_HELLO, provider_id, sign
from tenzro_site.cluster import free_port
from tests.cluster_util import ROOT, env_for

pytestmark = [pytest.mark.cluster]


class Site:
    """``python -m tenzro_site.serve`` on a free port over its own SQLite database."""

    def __init__(self, tmp, cap: int):
        self.env = {**env_for(tmp), "TENZRO_WS_MAX_MESSAGE": str(cap)}
        self.db = tmp / "db.sqlite3"
        subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=self.env, check=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp / "site.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "tenzro_site.serve", "-b", "127.0.0.1", "-p",
                                      str(self.port)], cwd=ROOT, env=self.env, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        raise AssertionError("the site did not answer /healthz")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def holdings(self, provider: str) -> dict[str, int]:
        """Residency → count of ``provider``'s holding rows, read from the site's database."""
        with sqlite3.connect(self.db, timeout=30) as conn:
            return dict(conn.execute("SELECT residency, COUNT(*) FROM registry_holding WHERE provider_id = ? "
                                     "GROUP BY residency", (provider,)).fetchall())


@pytest.fixture
def site_factory(tmp_path):
    sites = []

    def make(cap: int = 1 << 20) -> Site:
        root = tmp_path / f"site{len(sites)}"
        root.mkdir()
        sites.append(Site(root, cap))
        return sites[-1]

    yield make
    for s in sites:
        s.stop()


async def _authed(url: str):
    key = SigningKey.generate()
    ws = await connect(url.replace("http", "ws") + "/ws/agent/", max_size=None)
    nonce = bytes.fromhex(json.loads(await ws.recv())["nonce"])
    await ws.send(json.dumps(messages.hello(provider_id(key), sign(key, DOMAIN_HELLO, nonce))))
    welcome = json.loads(await ws.recv())
    assert welcome["type"] == "welcome"
    return ws, welcome


def test_message_over_the_cap_is_closed_with_1009(site_factory):
    site = site_factory(1 << 20)

    async def go():
        ws, welcome = await _authed(site.url)
        assert welcome["max_message"] == 1 << 20
        await ws.send(json.dumps({"type": "heartbeat", "pad": "x" * (1 << 20)}))
        with pytest.raises(ConnectionClosed) as err:
            await asyncio.wait_for(ws.recv(), 20)
        return err.value.rcvd

    rcvd = asyncio.run(go())
    assert rcvd is not None and rcvd.code == 1009, rcvd  # a close frame, not a dropped socket (1006)


def test_a_raised_cap_accepts_frames_above_one_mib(site_factory):
    site = site_factory(4 << 20)

    async def go():
        ws, welcome = await _authed(site.url)
        assert welcome["max_message"] == 4 << 20
        await ws.send(json.dumps({"type": "heartbeat", "pad": "x" * (3 << 20)}))  # one 3 MiB frame
        answer = json.loads(await asyncio.wait_for(ws.recv(), 20))
        await ws.close()
        return answer

    answer = asyncio.run(go())
    assert answer["type"] == "error" and answer["ref"] == "heartbeat"  # judged, not disconnected


def test_agent_holding_100000_experts_heartbeats_below_the_cap(site_factory, tmp_path):
    from holders.agent import AgentConfig, HolderAgent

    site = site_factory(1 << 20)
    agent = HolderAgent(AgentConfig(site.url, SigningKey.generate(), tmp_path / "agent", heartbeat_interval=30))
    # 100,000 experts of 100 layers: residency and committed_tps vary per expert, the worst case for ranges.
    # A model the site does not know: a known one (Kimi K2) holds only its 60 × 385 slots.
    held = [{"model_id": "wide-test-moe", "layer": i // 1000, "expert": i % 1000,
             "residency": "Warm" if (i * 7919) % 3 else "Cold", "committed_tps": (i * 104729) % 5000,
             "blob_uri": "tenzro://blob/" + "ab" * 32} for i in range(100_000)]
    agent.runtime.holdings = lambda: held
    msg = agent.session.heartbeat_message()
    assert len(json.dumps(msg)) <= 1 << 20
    want = {"Warm": sum(h["residency"] == "Warm" for h in held), "Cold": sum(h["residency"] == "Cold" for h in held)}

    async def go():
        task = asyncio.create_task(agent.run())
        try:
            deadline = time.time() + 120
            while time.time() < deadline:
                got = await asyncio.to_thread(site.holdings, agent.provider)
                if got == want:
                    return got
                assert not task.done(), task
                await asyncio.sleep(0.5)
            return got
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    assert asyncio.run(go()) == want


def test_unknown_paths_on_a_real_daphne_are_json_404_and_a_4404_close_not_500(site_factory):
    """Issue 27 item 7 on the server where the 500 came from: daphne answered the handshake of
    ``/api/expert-relay`` (no route) with HTTP 500; now it is a 101 and a close (4404 for a path
    nothing serves, 4401 for the relay with a bad token)."""
    site = site_factory()
    r = httpx.get(f"{site.url}/api/expert-relay", timeout=30)
    assert (r.status_code, r.json()) == (404, {"error": "unknown endpoint GET /api/expert-relay"})

    async def dial(path):
        async with connect(site.url.replace("http", "ws") + path) as ws:
            assert ws.response.status_code == 101
            with pytest.raises(ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), 30)
            return closed.value.rcvd.code

    # The relay (issue 27 item 3) refuses a bad token the same way: 101, then 4401.
    for path, code in (("/api/expert-relay?session=s&token=t", 4401), ("/ws/nope/", 4404)):
        assert asyncio.run(dial(path)) == code, path
