"""Operator mistakes (issue 15 item 8): a second local cluster in the same checkout, a bad
``--checkpoint`` or an absurd ``--holders`` fail with a clear message and touch nothing the
running cluster owns."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from safetensors.numpy import load_file

from moe import wire

from registry.models import AgentSession, Provider
from registry.services import agent_connected, reset_sessions
from tenzro_site.cluster import ClusterError, LocalCluster
from tenzro_site.verify import max_rel_err
from tests.cluster_util import ROOT, env_for, rpc, running_cluster
from tests.conftest import DEEPSEEK, QWEN


def _second_cluster(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "manage.py"), "tenzro_cluster", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.django_db
def test_reset_sessions_touches_only_the_named_providers():
    agent_connected("a" * 64, "chan-a")
    agent_connected("b" * 64, "chan-b")
    assert reset_sessions(["a" * 64]) == 1
    assert Provider.objects.get(provider="b" * 64).connected
    assert not Provider.objects.get(provider="a" * 64).connected
    assert list(AgentSession.objects.values_list("channel_name", flat=True)) == ["chan-b"]


def test_a_checkpoint_or_model_id_given_twice_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(ClusterError, match=r"--checkpoint .*qwen3_moe_tiny is given twice \(model id 'qwen3-moe-tiny'\)"):
        LocalCluster([QWEN, QWEN], holders=1)
    with pytest.raises(ClusterError, match="--model-id: .* would both publish as 'same'"):
        LocalCluster([QWEN, DEEPSEEK], holders=1, model_ids=["same", "same"])
    LocalCluster([QWEN, QWEN], holders=1, model_ids=[None, "qwen-again"])  # two ids: allowed
    with pytest.raises(ClusterError, match="^--model-id 'bad/id' is not a valid model id"):
        LocalCluster([QWEN], holders=1, model_ids=["bad/id"])


def _time_wait_port() -> int:
    """A 127.0.0.1 port whose listener is closed and whose served connection the server closed
    first: the kernel keeps that side in FIN-WAIT/TIME-WAIT, as after stopping a cluster."""
    with socket.socket() as lst:
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lst.bind(("127.0.0.1", 0))
        lst.listen()
        port = lst.getsockname()[1]
        cli = socket.create_connection(("127.0.0.1", port))
        conn, _ = lst.accept()
        conn.close()  # the server side closes first: it is the one left in TIME-WAIT
        cli.settimeout(30)
        assert cli.recv(1) == b""
        cli.close()
    return port


def test_restart_on_a_port_left_in_time_wait_is_allowed_but_a_listener_is_refused():
    """Rerunning ``tenzro_cluster --port P`` right after stopping one failed "port P ... is not
    free" while only TIME-WAIT sockets remained (issue 24 item 13)."""
    port = _time_wait_port()
    LocalCluster([QWEN], holders=1, port=port)._check_port()
    with socket.socket() as live:
        live.bind(("127.0.0.1", 0))
        live.listen()
        with pytest.raises(ClusterError, match=f"port {live.getsockname()[1]} on 127.0.0.1 is not free"):
            LocalCluster([QWEN], holders=1, port=live.getsockname()[1])._check_port()


@pytest.mark.cluster
def test_failed_second_cluster_leaves_the_running_one_alone(tmp_path):
    with running_cluster(tmp_path, [QWEN], holders=2) as (info, _proc):
        env = env_for(tmp_path)  # the same var dir and database as the running cluster's
        bad = _second_cluster(env, "--checkpoint", str(tmp_path / "no-such-checkpoint"), "--holders", "2")
        assert bad.returncode == 1 and "no such checkpoint" in bad.stderr
        assert "Traceback" not in bad.stderr
        _still_serving(info)

        huge = _second_cluster(env, "--checkpoint", str(QWEN), "--holders", "100000")
        assert huge.returncode == 1 and "--holders must be between 1 and 64" in huge.stderr

        # A correct second cluster on the same var dir would start agents with the running one's keys.
        twin = _second_cluster(env, "--checkpoint", str(QWEN), "--holders", "2")
        assert twin.returncode == 1 and "another local cluster" in twin.stderr, twin.stderr[-2000:]
        _still_serving(info)


def _still_serving(info: dict) -> None:
    listed = rpc(info["rpc"], "tenzro_moeListProviders", {"live": True})["result"]
    assert {p["provider"] for p in listed["providers"]} == {a["provider"] for a in info["agents"]}
    ref = load_file(str(QWEN / "reference.safetensors"))
    x = ref["layer1.hidden_states"]
    resp = rpc(info["rpc"], "tenzro_moeForward", {"model_id": "qwen3-moe-tiny", "layer": 1, "d_model": x.shape[1],
                                                  "carrier": "f32", "hidden_states": wire.b64encode(wire.encode_f32(x))})
    assert "result" in resp, resp
    out = wire.decode_f32(wire.b64decode(resp["result"]["outputs"], "outputs"), x.shape[1])
    assert max_rel_err(out, ref["layer1.output"]) <= 1e-5


def test_a_long_rpc_error_names_a_file_instead_of_flooding_the_terminal(settings, tmp_path):
    """A failed forward's ``data`` lists every attempt (several KB under load, once printed whole
    by ``make demo``): the message keeps the error's own text and names the file with the rest."""
    settings.VAR_DIR = tmp_path
    failures = [{"expert": e, "error": "no answer within its 10 s deadline", "tokens": list(range(48))}
                for e in range(40)]
    error = {"code": -32010, "message": "every holder of expert l0/e0 failed", "data": {"failures": failures}}
    text = LocalCluster.rpc_error_text("tenzro_moeForward", error)
    assert text.startswith("tenzro_moeForward: every holder of expert l0/e0 failed (the whole error object is in ")
    assert len(text) < 300
    assert (tmp_path / "last_rpc_error.json").read_text().count("deadline") == 40
    short = {"code": -32602, "message": "invalid params", "data": {"field": "layer"}}
    assert LocalCluster.rpc_error_text("m", short) == 'm: invalid params ({"field": "layer"})'
