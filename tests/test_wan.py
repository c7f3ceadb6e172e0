"""Holders across the internet (issue 22): the user-space WAN proxy, micro-batch overlap in the
scheduler, per-holder deadlines and RTT, the reachability flags, the peer-to-peer KV handoff,
and a real cluster whose agents dial the site through a delay proxy (``--agent-site``)."""
from __future__ import annotations

import asyncio
import socket
import time

import httpx
import numpy as np
import pytest
from asgiref.sync import sync_to_async
from nacl.signing import SigningKey
from safetensors.numpy import load_file

from holders.cli import main as agent_main
from moe.handoff import HandoffError, RoleRunner, kv_chunk_message
from moe.identity import DOMAIN_KV_HANDOFF, provider_id, sign
from router.apps import current
from router.metrics import ServingMetrics
from router.scheduler import HostIdle, ModelScheduler, OverlapModel
from router.scoreboard import DEADLINE_FLOOR_S, DEADLINE_SAMPLES, Scoreboard
from tenzro_site.cluster import ClusterError, LocalCluster
from tenzro_site.console.serving import serving_state
from tests.cluster_util import env_for, rpc, running_cluster
from tests.conftest import QWEN
from tests.test_scheduler import prompts, publish, scheduler
from tests.test_scoreboard import holder, names
from tests.wan_proxy import Link, WanProxy

REF = load_file(str(QWEN / "generation_reference.safetensors"))
PROMPT = [int(t) for t in REF["input_ids"][0]]
GREEDY = [int(t) for t in REF["greedy_ids"][0][16:]]


# -- the proxy ---------------------------------------------------------------------------------

def test_link_refuses_bad_values():
    for bad in (dict(delay_s=-1), dict(jitter_s=-0.1), dict(loss=1.0), dict(loss=-0.1), dict(bandwidth_bps=0)):
        with pytest.raises(ValueError):
            Link(**bad)
    assert Link.rtt(40).delay_s == pytest.approx(0.02) and Link.rtt(40).retransmit == pytest.approx(0.2)


@pytest.mark.asyncio
async def test_tcp_proxy_delays_each_direction_and_keeps_bytes_in_order():
    async def echo(r, w):
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        w.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    with WanProxy(port, Link.rtt(30, loss=0.5), seed=1) as proxy:
        r, w = await asyncio.open_connection("127.0.0.1", proxy.port)
        blob = bytes(range(256)) * 2000
        t = time.perf_counter()
        w.write(blob)
        await w.drain()
        assert await r.readexactly(len(blob)) == blob  # loss on TCP: retransmitted, in order
        assert time.perf_counter() - t >= 0.03  # at least one round trip (a lower bound: never flaky)
        proxy.set_link(Link())
        w.write(b"x")
        assert await r.readexactly(1) == b"x"
        w.close()
        assert proxy.stats["connections"] == 1 and proxy.stats["up_bytes"] == len(blob) + 1
    server.close()


@pytest.mark.asyncio
async def test_udp_proxy_drops_what_the_seeded_loss_drops():
    class Echo(asyncio.DatagramProtocol):
        def connection_made(self, t):
            self.t = t

        def datagram_received(self, d, a):
            self.t.sendto(d, a)

    loop = asyncio.get_running_loop()
    echo, _ = await loop.create_datagram_endpoint(Echo, local_addr=("127.0.0.1", 0))
    got: asyncio.Queue = asyncio.Queue()

    class Client(asyncio.DatagramProtocol):
        def datagram_received(self, d, a):
            got.put_nowait(d)

    with WanProxy(echo.get_extra_info("sockname")[1], Link(loss=0.3), udp=True, seed=7) as proxy:
        client, _ = await loop.create_datagram_endpoint(Client, remote_addr=("127.0.0.1", proxy.port))
        client.sendto(b"first")
        while True:  # the first datagram opens the upstream socket; resend until one comes back
            try:
                await asyncio.wait_for(got.get(), 0.5)
                break
            except asyncio.TimeoutError:
                client.sendto(b"first")
        while not got.empty():  # resends that came back late
            got.get_nowait()
        dropped = proxy.stats["dropped"]
        for i in range(200):
            client.sendto(b"%d" % i)
        # Each datagram is dropped on the way up, or echoed and dropped or delivered on the way down.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and got.qsize() + proxy.stats["dropped"] - dropped < 200:
            await asyncio.sleep(0.02)
        lost = proxy.stats["dropped"] - dropped
        assert got.qsize() + lost == 200 and 0 < lost < 200
        client.close()
    echo.close()


# -- micro-batch overlap -----------------------------------------------------------------------

def test_overlap_count_covers_the_wait_with_the_others_compute():
    m = OverlapModel()
    assert m.count(4, 16, 16) == 1  # nothing measured yet
    m.observe(wait_ms=80.0, compute_ms=32.0, layers=2, sequences=16)  # W 40 ms / layer, c 1 ms / seq / layer
    assert m.count(4, 16, 16) == 4  # (M-1)/M * 16 ms >= 40 ms never holds: the cap
    assert m.count(4, 2, 2) == 2  # no more micro-batches than requests
    assert m.count(1, 16, 16) == 1  # TENZRO_GEN_MICROBATCHES=1: off
    near = OverlapModel()
    near.observe(wait_ms=2.0, compute_ms=64.0, layers=2, sequences=16)  # a 1 ms wait against 32 ms compute
    assert near.count(4, 16, 16) == 1
    mid = OverlapModel()
    mid.observe(wait_ms=20.0, compute_ms=64.0, layers=2, sequences=16)  # W 10, step compute 32
    assert mid.count(4, 16, 16) == 2  # half the compute (16 ms) already covers 10 ms


def test_overlap_split_is_dropped_when_it_does_not_pay_and_probed_again():
    m = OverlapModel()
    m.observe(wait_ms=80.0, compute_ms=32.0, layers=2, sequences=16)  # the model says 4
    m.realized(1, wall_ms=30.0, rows=1, sequences=1)  # one client alone: another size, not compared
    assert m.count(4, 16, 16) == 4  # nothing realized at this size: the model's count
    m.realized(4, wall_ms=160.0, rows=16, sequences=16)  # 10 ms a row split ...
    assert m.count(4, 16, 16) == 1  # ... then the unsplit baseline of the same size
    m.realized(1, wall_ms=96.0, rows=16, sequences=16)  # 6 ms a row: the split does not pay (shared cores)
    for _ in range(5):  # split steps that met new prompts (1.5 ms a row over 64 rows): not
        m.realized(4, wall_ms=96.0, rows=64, sequences=16)  # compared, or the split would look as if it paid
    assert m.count(4, 16, 16, rows=80) == 1  # a step with prompt rows follows the verdict and never probes
    every, most = OverlapModel.PROBE_EVERY, OverlapModel.PROBE_MAX
    picks = [m.count(4, 16, 16) for _ in range(4000)]
    probes = [i + 1 for i, p in enumerate(picks) if p == 4]  # split only to re-measure, less often while it loses
    gaps = [b - a for a, b in zip([0] + probes, probes)]
    assert gaps[:6] == [every, 2 * every, 4 * every, 8 * every, 16 * every, 32 * every]
    assert set(gaps[6:]) == {most} and len(probes) == 6 + (4000 - sum(gaps[:6])) // most
    assert all(m.count(4, 16, 16, rows=80) == 1 for _ in range(3 * most))  # prefill steps: no probe at all
    for _ in range(10):  # the link got far: split steps now cost half a row's time
        m.realized(4, wall_ms=48.0, rows=16, sequences=16)
    picks = [m.count(4, 16, 16) for _ in range(3 * every)]  # the verdict flipped: probed again soon
    assert [i + 1 for i, p in enumerate(picks) if p == 1] == [every, 3 * every]
    assert m.count(4, 16, 16, rows=80) == 4  # prompt steps split too now


def test_overlap_prompt_steps_do_not_explore():
    m = OverlapModel()
    m.observe(wait_ms=80.0, compute_ms=32.0, layers=2, sequences=16)  # the model says 4
    assert m.count(4, 16, 16, rows=120) == 1  # nothing realized at this size: a prompt step's time would not count
    assert m.count(4, 16, 16) == 4  # a decode step tries the model's count (its time is compared)


def test_overlap_no_split_while_the_host_has_no_idle_core():
    m = OverlapModel()
    m.observe(wait_ms=80.0, compute_ms=32.0, layers=2, sequences=16)  # the model says 4
    m.idle(None)  # not measured: the gate stays open
    assert m.count(4, 16, 16) == 4
    m.idle(0.1)  # the host's cores were busy through an unsplit step: nothing to overlap with
    assert m.count(4, 16, 16) == 1
    for _ in range(10):  # the cores went idle (holders far away, the router waiting on them)
        m.idle(1.6)
    assert m.count(4, 16, 16) == 4
    m.idle(-1.0)  # a bad reading is ignored
    assert m.count(4, 16, 16) == 4


def test_host_idle_reads_idle_cores_from_proc_stat(tmp_path):
    stat = tmp_path / "stat"

    def write(user, idle, iowait):
        stat.write_text(f"cpu  {user} 0 0 {idle} {iowait} 0 0 0 0 0\ncpu0 1 0 0 1 0 0 0 0 0 0\n"
                        f"cpu1 1 0 0 1 0 0 0 0 0 0\nintr 5\n")

    write(100, 100, 0)
    h = HostIdle(str(stat))
    assert h.cpus == 2
    write(130, 160, 10)  # 100 ticks passed, 70 of them idle or waiting on I/O: 1.4 of 2 cores
    assert h.sample() == pytest.approx(1.4)
    assert h.sample() is None  # no tick passed since
    assert HostIdle(str(tmp_path / "missing")).sample() is None  # not Linux: unknown


def test_split_keeps_requests_whole_and_balances_rows():
    class Req:
        pass

    class Slot:
        def __init__(self, r):
            self.request = r

    a, b, c, d = Req(), Req(), Req(), Req()
    batch = [(Slot(a), np.zeros(1)), (Slot(a), np.zeros(1)), (Slot(b), np.zeros(1)), (Slot(c), np.zeros(8)),
             (Slot(d), np.zeros(1))]
    parts = ModelScheduler._split(batch, 3)
    assert sorted(i for p in parts for i in p) == list(range(5)) and all(parts)
    assert any({0, 1} <= set(p) for p in parts)  # a's two sequences stay together
    assert len(ModelScheduler._split(batch, 9)) == 4  # at most one per request
    assert ModelScheduler._split(batch, 1) == [[0, 1, 2, 3, 4]]


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
async def test_micro_batched_steps_give_the_tokens_of_one_batch(settings):
    """Eight greedy requests whose steps run in four micro-batches at once get exactly the
    tokens of one-batch steps, and each micro-batch made its own forward per layer."""
    from router.generate import generate
    from moe.backbone.decode import Sampling

    model = "wan-micro"
    await sync_to_async(publish)(QWEN, model)
    ps = prompts(8, seed=9)
    settings.TENZRO = {**settings.TENZRO, "GEN_MICROBATCHES": 1}
    one = await asyncio.gather(*(generate(model, p, Sampling(max_new_tokens=5)) for p in ps))
    sched = await scheduler(model)
    assert {e["microbatches"] for e in sched.timeline} == {1}
    settings.TENZRO = {**settings.TENZRO, "GEN_MICROBATCHES": 4}
    sched.overlap.count = lambda cap, units, sequences, rows=None: min(cap, units)  # as on a far link: always overlap
    steps = sched.steps
    forwards: list[int] = []
    real = current().forward

    async def counting(*args, **kw):
        forwards.append(1)
        return await real(*args, **kw)

    current().forward = counting
    try:
        many = await asyncio.gather(*(generate(model, p, Sampling(max_new_tokens=5)) for p in ps))
    finally:
        del current().forward
    assert [r["output_ids"] for r in many] == [r["output_ids"] for r in one]
    timeline = list(sched.timeline)[-(sched.steps - steps):]
    assert max(e["microbatches"] for e in timeline) == 4
    assert len(forwards) == sum(e["microbatches"] for e in timeline) * len(sched.served.moe_layers)
    assert all(e["wall"] >= 0 and e["compute"] >= 0 and e["idle"] >= 0 for e in timeline)


# -- deadlines, nearer holders, RTT on /metrics and the Serving page ----------------------------

def test_deadline_follows_the_holders_p99_within_floor_and_ceiling():
    sb = Scoreboard()
    assert sb.deadline_s("a", 10.0) == 10.0  # never seen: the site's deadline
    for _ in range(DEADLINE_SAMPLES):
        sb.success("a", 40.0, 4)
        sb.success("far", 900.0, 4)
    assert sb.deadline_s("a", 10.0) == DEADLINE_FLOOR_S  # 3 x 40 ms is under the floor
    assert sb.deadline_s("far", 10.0) == pytest.approx(2.7)  # 3 x its p99
    assert sb.deadline_s("far", 2.0) == 2.0  # never over the site's
    snap = sb.snapshot()
    assert snap["a"]["rtt_ms"] == 40.0 and snap["far"]["p99_ms"] == 900.0


def test_nearer_holder_first_when_otherwise_equal():
    sb = Scoreboard()
    for _ in range(4):
        sb.success("near", 12.0, 4)
        sb.success("far", 41.0, 4)  # the same latency bucket (under 2 x 12 + 50 ms)
    assert names(sb.order([holder("far"), holder("near")])) == ["near", "far"]
    assert names(sb.order([holder("far", reputation=900), holder("near")])) == ["far", "near"]  # reputation first


def test_holder_rtt_on_metrics_and_the_serving_state():
    sb = Scoreboard()
    m = ServingMetrics(sb)
    for ms in (40.0, 45.0, 60.0):
        sb.success("p1", ms, 4)
    m.holder_outcomes([], {"p1": [40.0, 45.0, 60.0]})
    text = m.exposition().decode()
    assert 'tenzro_holder_rtt_seconds{provider="p1"} 0.04' in text
    assert 'tenzro_holder_p99_seconds{provider="p1"} 0.06' in text
    m.sample(now=1.0)
    m.sample(now=3.0)
    row = serving_state(m.history)["holders"][0]
    assert row["provider"] == "p1" and row["rtt_ms"] == 40.0 and row["deadline_p99_ms"] == 60.0


# -- reachability flags ------------------------------------------------------------------------

@pytest.mark.parametrize("argv, words", [
    (["--advertise-http", "http://203.0.113.7:9000"], "--advertise-http needs --http-port"),
    (["--http-port", "1", "--advertise-http", "ftp://x"], "--advertise-http must be an http(s)://"),
    (["--http-port", "1", "--advertise-http", "http://x:99999"], "--advertise-http"),
    (["--advertise-iroh", "203.0.113.7:4433"], "--advertise-iroh needs --iroh"),
])
def test_advertise_flags_are_checked(argv, words, capsys, tmp_path):
    assert agent_main(["--site", "http://127.0.0.1:1", "--key", str(tmp_path / "k"), *argv]) == 1
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_advertise_addresses_replace_the_bound_ones():
    from holders.cli import CliError, check_socket_addr
    from holders.config import AgentConfig

    cfg = AgentConfig(site="http://s", key=SigningKey.generate(), blob_dir="/tmp/x", http_port=9000,
                      advertise_http="https://edge.example:443/")
    assert cfg.http_endpoint == "https://edge.example:443/rpc"
    assert AgentConfig(site="http://s", key=SigningKey.generate(), blob_dir="/tmp/x",
                       http_port=9000).http_endpoint == "http://127.0.0.1:9000/rpc"
    assert check_socket_addr("--advertise-iroh", "[2001:db8::1]:4433") == "[2001:db8::1]:4433"
    for bad in ("host.example:4433", "2001:db8::1:4433", "1.2.3.4:0", "1.2.3.4"):
        with pytest.raises(CliError, match="--advertise-iroh"):
            check_socket_addr("--advertise-iroh", bad)


@pytest.mark.parametrize("url", ["ws://127.0.0.1:1", "http://", "http://127.0.0.1:70000", "http://h:1/site?x=1"])
def test_agent_site_is_checked(url):
    with pytest.raises(ClusterError, match="--agent-site"):
        LocalCluster([QWEN], holders=1, agent_site=url)


# -- KV handoff peer to peer -------------------------------------------------------------------

def test_peer_chunks_must_be_signed_by_the_prefill_agent_the_site_names():
    runner = RoleRunner(("ExpertHolder", "Decode"), "http://127.0.0.1:1", lambda u: b"", lambda: 1 << 20)
    pre, other = SigningKey.generate(), SigningKey.generate()
    chunk = b"kv bytes"

    def header(key, session="s1", index=0, frames=1, data=chunk):
        return {"session": session, "index": index, "frames": frames, "from": provider_id(key),
                "sig": sign(key, DOMAIN_KV_HANDOFF, kv_chunk_message(session, index, frames, data))}

    with pytest.raises(HandoffError, match="signature"):
        runner.peer_put({**header(pre), "sig": header(other)["sig"]}, chunk)  # someone else's signature
    with pytest.raises(HandoffError, match="signature"):
        runner.peer_put(header(pre), b"tampered")
    assert runner.peer_put(header(pre, frames=2), chunk) == {"index": 0}
    with pytest.raises(HandoffError, match="already receives chunks"):
        runner.peer_put(header(other, index=1, frames=2), chunk)
    runner.peer_put(header(pre, index=1, frames=2), chunk)
    with pytest.raises(HandoffError, match="not from the Prefill agent the site named"):
        runner.handle("decode", {"session": "s1", "from": provider_id(other)}, b"")


# -- a real cluster through the delay proxy ----------------------------------------------------

async def _completions(url: str, model: str, ps: list[list[int]], tokens: int) -> list[list[int]]:
    async with httpx.AsyncClient() as client:
        async def one(p):
            r = await client.post(f"{url}/v1/completions", json={"model": model, "prompt": p, "max_tokens": tokens,
                                                                 "temperature": 0}, timeout=600)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        return list(await asyncio.gather(*(one(p) for p in ps)))


@pytest.mark.cluster
def test_cluster_through_a_delay_proxy_gives_the_direct_tokens(tmp_path):
    """Three agents dial the site through a 20 ms RTT proxy with jitter and 1 % loss
    (``tenzro_cluster --agent-site``): concurrent greedy completions give the tokens of the
    same cluster with a zero-delay link and the reference's greedy ids; a disaggregated run
    moves its KV cache peer to peer (HTTP) with the same tokens. No timing asserts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = env_for(tmp_path)
    env["TENZRO_BATCH_DEADLINE"] = "60"  # generous: a loaded machine must not turn into faults
    with WanProxy(port, Link()) as proxy, running_cluster(
            tmp_path, [QWEN], holders=3, env=env,
            extra=("--port", str(port), "--agent-site", proxy.url, "--agent-http")) as (info, _):
        assert info["agent_site"] == proxy.url
        url, ps = info["url"], [PROMPT] + prompts(5, seed=21)
        direct = asyncio.run(_completions(url, "qwen3-moe-tiny", ps, 6))
        assert direct[0] == GREEDY[:6]
        proxy.set_link(Link.rtt(20, jitter_ms=4, loss=0.01))
        far = asyncio.run(_completions(url, "qwen3-moe-tiny", ps, 6))
        assert far == direct
        assert proxy.stats["up_bytes"] > 0 and proxy.stats["down_bytes"] > 0  # the agents' traffic crossed it
        r = rpc(info["rpc"], "tenzro_moeGenerate", {"model_id": "qwen3-moe-tiny", "input_ids": PROMPT,
                                                    "max_new_tokens": 6, "handoff": True}, timeout=600)["result"]
        assert r["output_ids"] == GREEDY[:6]
        assert r["kv_handoff"]["path"] == "http" and r["kv_handoff"]["bytes"] > r["kv_handoff"]["kv_bytes"]
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert "tenzro_holder_rtt_seconds{" in metrics and "tenzro_step_microbatches_count" in metrics
