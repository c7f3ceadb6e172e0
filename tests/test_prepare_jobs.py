"""Preparation jobs: RPC, per-expert failures, fallbacks, cancel, SIGKILL + resume, blob serving
with Range, and the tenzro://blob resolver."""
from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time

import numpy as np
import pytest
from django.conf import settings

from moe.ffn import ExpertWeights
from prepare import jobs
from moe.blobs import BlobStore, blob_hash, fetch_blob
from moe.content import BlobError
from prepare.checkpoint import Checkpoint
from moe.codec import loads_safetensors
from prepare.models import PrepareJob
from registry.models import ExpertBlob, GateBlob, MoeModel
from registry.operator import operator_token
from tests.ckpt_util import make_checkpoint
from tests.cluster_util import ROOT, env_for
from tests.conftest import DEEPSEEK, MIXTRAL, QWEN

pytestmark = pytest.mark.django_db(transaction=True)


def call(client, method, params, operator=True):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {operator_token()}"} if operator else {}
    resp = client.post("/rpc", data=json.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}),
                       content_type="application/json", **headers)
    return resp.json()


def test_rpc_prepares_quantized_experts_and_reports_status(client):
    res = call(client, "tenzro_moePrepareExperts", {"model_id": "ds-q", "checkpoint": str(DEEPSEEK), "layer": 2,
                                                    "experts": [0, 3, 16], "quant": "q4_k_m"})
    r = res["result"]
    assert r["total_experts"] == 3 and r["layers"] == [2] and r["quant"] == "q4_k_m" and r["include_gate"]
    st = call(client, "tenzro_moePrepareStatus", {"job_id": r["job_id"]}, operator=False)["result"]
    assert st["state"] == "completed" and st["completed_experts"] == 3 and st["failed_experts"] == 0
    assert [e["expert"] for e in st["experts"]] == [0, 3, 16] and st["gate"]["layer"] == 2
    assert st["bytes_written"] == sum(e["bytes"] for e in st["experts"]) + st["gate"]["bytes"]
    store = BlobStore(settings.TENZRO["BLOB_DIR"])
    w = ExpertWeights.from_blob(store.get(st["experts"][2]["uri"].rsplit("/", 1)[1], verify=True))
    assert w.quant_kinds() == {"gate_proj": "q4_k", "up_proj": "q4_k", "down_proj": "q6_k"}
    assert ExpertBlob.objects.get(model_id="ds-q", layer=2, expert=16).quant == "q4_k/q4_k/q6_k"
    assert GateBlob.objects.filter(model_id="ds-q", layer=2).exists()
    # the web page and the admin list show it
    assert r["job_id"] in client.get("/prepare/").content.decode()
    page = client.get(f"/prepare/{r['job_id']}").content.decode()
    assert "completed" in page and "tenzro://blob/" in page


@pytest.mark.parametrize("params,field", [
    ({"layer": 0}, "layers"), ({"experts": [17]}, "experts"), ({"quant": "q3_k"}, "quant"),
    ({"quant": {"gate": "q5_k"}}, "quant"), ({"checkpoint": "/no/such/dir"}, "checkpoint"),
    ({"model_id": "a/b c"}, "model_id"), ({"model_id": "x" * 201}, "model_id"),
])
def test_rpc_bad_params_name_the_field_and_create_nothing(client, params, field):
    base = {"model_id": "bad", "checkpoint": str(DEEPSEEK), "layer": 1}
    err = call(client, "tenzro_moePrepareExperts", {**base, **params})["error"]
    assert err["code"] == -32602 and err["data"]["field"] == field, err
    assert not PrepareJob.objects.exists()
    assert call(client, "tenzro_moePrepareExperts", base, operator=False)["error"]["code"] == -32001
    err = call(client, "tenzro_moePrepareStatus", {"job_id": "00000000-0000-0000-0000-000000000000"})["error"]
    assert err["code"] == -32602 and err["data"]["field"] == "job_id"


def test_one_expert_failing_keeps_the_others_and_fallbacks_are_recorded(tmp_path):
    make_checkpoint(tmp_path / "ck", "qwen3_moe", experts=4, hidden=64, inter=80, layers=1)
    ck = Checkpoint(tmp_path / "ck")
    name = "model.layers.0.mlp.experts.2.up_proj.weight"
    _, off, _ = ck.location(name)
    with open(tmp_path / "ck" / "model.safetensors", "r+b") as fh:
        fh.seek(off + 6)
        fh.write(np.array([0x7FC0], np.uint16).tobytes())  # bf16 NaN
    job = jobs.create_job(str(tmp_path / "ck"), "fails", quant="q4_k_m")
    job = jobs.run_job(job.job_id)
    st = jobs.job_status(job)
    assert job.state == "failed" and job.completed_experts == 3 and job.failed_experts == 1
    assert st["failures"] == [{"layer": 0, "expert": 2, "error": f"tensor '{name}' holds NaN or infinity "
                                                                  f"(first at index (0, 3))"}]
    notes = {(f["expert"], f["tensor"]): f["note"] for f in st["fallbacks"]}
    assert notes[(0, "gate_proj.weight")].startswith("q4_k -> q8_0: row length 64")
    assert notes[(0, "down_proj.weight")].startswith("q6_k -> dense (source dtype): row length 80")
    blob = BlobStore(settings.TENZRO["BLOB_DIR"]).get(st["experts"][0]["uri"].rsplit("/", 1)[1])
    tensors, meta = loads_safetensors(blob)
    assert meta["down_proj.weight.fallback"] == notes[(0, "down_proj.weight")]
    assert tensors["down_proj.weight"].dtype == "BF16" and meta["gate_proj.weight.quant"] == "q8_0"
    # running the failed job again retries only the failed expert (and fails it again)
    again = jobs.run_job(job.job_id)
    assert again.attempts == 2 and again.failed_experts == 1 and again.completed_experts == 3


def test_cancel_stops_before_the_next_expert(tmp_path):
    job = jobs.create_job(str(DEEPSEEK), "cancel-me", layers=[1])
    seen = []

    def progress(j):
        seen.append(j.completed_experts)
        if j.completed_experts == 2:
            jobs.cancel_job(j.job_id)

    job = jobs.run_job(job.job_id, progress)
    assert job.state == "cancelled" and job.completed_experts == 2 and job.total_experts == 17
    assert jobs.run_job(job.job_id).state == "cancelled"  # a cancelled job stays cancelled
    pending = jobs.create_job(str(DEEPSEEK), "cancel-pending", layers=[2])
    assert jobs.cancel_job(pending.job_id).state == "cancelled"


def _job_row(db: str):
    with sqlite3.connect(db, timeout=30) as conn:
        return conn.execute("select job_id, state, completed_experts, total_experts from prepare_preparejob").fetchone()


def _manage(env, *args, timeout=300):
    return subprocess.run([sys.executable, str(ROOT / "manage.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _uris(status: dict) -> list:
    return sorted((e["layer"], e["expert"], e["uri"]) for e in status["experts"]) + \
        sorted((g["layer"], g["uri"]) for g in status["gates"])


def test_sigkill_mid_job_then_resume_gives_identical_blob_uris(tmp_path):
    ck = tmp_path / "ck"
    make_checkpoint(ck, "qwen3_moe", experts=16, hidden=512, inter=512, layers=2)
    env = env_for(tmp_path)
    assert _manage(env, "migrate", "-v", "0").returncode == 0
    db = str(tmp_path / "db.sqlite3")
    cmd = [sys.executable, str(ROOT / "manage.py"), "prepare_experts", "--checkpoint", str(ck), "--model-id", "kill",
           "--quant", "q4_k_m", "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline, row = time.time() + 120, None
    while time.time() < deadline:
        try:
            row = _job_row(db)
        except sqlite3.OperationalError:
            row = None
        if row and row[2] >= 3:
            break
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    job_id, state, done, total = _job_row(db)
    assert state == "running" and 3 <= done < total == 32, (state, done, total)
    res = _manage(env, "prepare_experts", "--resume", job_id, "--json", "--no-progress")
    assert res.returncode == 0, res.stderr
    resumed = json.loads(res.stdout.strip().splitlines()[-1])
    assert resumed["state"] == "completed" and resumed["attempts"] == 2 and resumed["completed_experts"] == 32
    fresh = _manage(env, "prepare_experts", "--checkpoint", str(ck), "--model-id", "kill", "--quant", "q4_k_m",
                    "--json", "--no-progress")
    assert fresh.returncode == 0, fresh.stderr
    assert _uris(resumed) == _uris(json.loads(fresh.stdout.strip().splitlines()[-1]))


def test_republishing_a_model_id_with_another_shape_needs_replace():
    first = jobs.run_job(jobs.create_job(str(MIXTRAL), "same-id", layers=[0], experts=[0]).job_id)
    assert first.state == PrepareJob.State.COMPLETED
    with pytest.raises(jobs.JobParamError, match="already published from .*mixtral_tiny.*hidden_size") as exc:
        jobs.create_job(str(QWEN), "same-id", layers=[0], experts=[0])
    assert exc.value.field == "model_id"
    assert MoeModel.objects.get(model_id="same-id").family == "mixtral"
    # The same checkpoint again is fine (idempotent publish), and replace republishes.
    jobs.create_job(str(MIXTRAL), "same-id", layers=[0], experts=[1])
    done = jobs.run_job(jobs.create_job(str(QWEN), "same-id", layers=[0], experts=[0], replace=True).job_id)
    assert done.state == PrepareJob.State.COMPLETED
    model = MoeModel.objects.get(model_id="same-id")
    assert model.family == "qwen3_moe" and model.moe_layers == [0]


def test_prepare_experts_command_errors_name_the_flag(tmp_path):
    env = env_for(tmp_path)
    assert _manage(env, "migrate", "-v", "0").returncode == 0
    for args, flag in ((["--quant", "q9"], "--quant"), (["--layers", "0"], "--layers"),
                       (["--experts", "3-1"], "--experts"), (["--experts", "40"], "--experts")):
        res = _manage(env, "prepare_experts", "--checkpoint", str(DEEPSEEK), "--model-id", "x", *args)
        assert res.returncode != 0 and flag in res.stderr, res.stderr
        assert "Traceback" not in res.stderr
        if args[1] == "3-1":  # what is wrong, not only the syntax
            assert "lo <= hi" in res.stderr, res.stderr
    for job_id, says in (("not-a-uuid", "is not a job id"), ("00000000-0000-0000-0000-000000000001", "no preparation job")):
        res = _manage(env, "prepare_experts", "--resume", job_id)
        assert res.returncode != 0 and "--resume" in res.stderr and says in res.stderr, res.stderr
        assert "Traceback" not in res.stderr
    done = _manage(env, "prepare_experts", "--checkpoint", str(MIXTRAL), "--model-id", "mx", "--layers", "0",
                   "--experts", "0", "--json", "--no-progress")
    assert done.returncode == 0, done.stderr
    job_id = json.loads(done.stdout.strip().splitlines()[-1])["job_id"]
    for args, flag in ((["--model-id", "other"], "--model-id"), (["--checkpoint", str(QWEN)], "--checkpoint")):
        res = _manage(env, "prepare_experts", "--resume", job_id, *args)
        assert res.returncode != 0 and flag in res.stderr and "does not match" in res.stderr, res.stderr
    other = _manage(env, "prepare_experts", "--checkpoint", str(QWEN), "--model-id", "mx", "--layers", "0",
                    "--experts", "0")
    assert other.returncode != 0 and "--model-id" in other.stderr and "--replace" in other.stderr, other.stderr
    assert _manage(env, "prepare_experts", "--checkpoint", str(QWEN), "--model-id", "mx", "--layers", "0",
                   "--experts", "0", "--replace", "--no-progress").returncode == 0


def test_blob_range_requests(client):
    store = BlobStore(settings.TENZRO["BLOB_DIR"])
    data = bytes(range(256)) * 40
    h = store.put(data)
    full = client.get(f"/blobs/{h}")
    assert full.status_code == 200 and b"".join(full.streaming_content) == data
    assert full["Accept-Ranges"] == "bytes" and full["ETag"] == f'"{h}"'
    part = client.get(f"/blobs/{h}", HTTP_RANGE="bytes=100-199")
    assert part.status_code == 206 and part["Content-Range"] == f"bytes 100-199/{len(data)}"
    assert b"".join(part.streaming_content) == data[100:200] and part["Content-Length"] == "100"
    tail = client.get(f"/blobs/{h}", HTTP_RANGE="bytes=-10")
    assert b"".join(tail.streaming_content) == data[-10:]
    opened = client.get(f"/blobs/{h}", HTTP_RANGE=f"bytes={len(data) - 5}-")
    assert b"".join(opened.streaming_content) == data[-5:]
    bad = client.get(f"/blobs/{h}", HTTP_RANGE=f"bytes={len(data)}-")
    assert bad.status_code == 416 and bad["Content-Range"] == f"bytes */{len(data)}"
    assert client.get(f"/blobs/{'0' * 64}").status_code == 404
    assert client.get("/blobs/XYZ").status_code == 400
    assert client.post(f"/blobs/{h}").status_code == 405
    from django.test import Client

    strict = Client(enforce_csrf_checks=True)  # as a real server: the CSRF check ran first (HTML 403)
    for method in ("post", "put"):
        r = getattr(strict, method)(f"/blobs/{h}")
        assert r.status_code == 405 and r["Content-Type"].startswith("application/json"), (method, r.status_code)


def test_resolver_local_first_then_peers_and_hash_checked(tmp_path):
    import httpx

    data = b"expert bytes" * 100
    h = blob_hash(data)
    uri = f"tenzro://blob/{h}"
    served = {"http://bad": b"tampered" * 10, "http://good": data}
    calls = []

    def handler(request: httpx.Request):
        base = f"{request.url.scheme}://{request.url.host}"
        calls.append(base)
        if base not in served:
            return httpx.Response(404)
        return httpx.Response(200, content=served[base])

    client = httpx.Client(transport=httpx.MockTransport(handler))
    store = BlobStore(tmp_path / "store")
    with pytest.raises(BlobError, match="no endpoint served it.*http://bad/blobs/.*hash mismatch"):
        fetch_blob(uri, store, ["http://bad", "http://missing"], client=client)
    assert fetch_blob(uri, store, ["http://bad", "http://missing", "http://good"], client=client) == data
    assert store.has(h)
    calls.clear()
    assert fetch_blob(uri, store, ["http://good"], client=client) == data and calls == []  # local store first
    with pytest.raises(BlobError, match="must look like"):
        fetch_blob("http://x", store, [], client=client)


def test_prepare_experts_publishes_the_backbone_so_the_model_generates_and_exports(client, tmp_path):
    """README's operator way (``prepare_experts``, then place) gives a model that generates and
    exports: the job publishes the checkpoint's backbone with its experts. An experts-only
    checkpoint publishes experts only, and generating with it names the command to run."""
    from django.core.management import call_command

    from moe.backbone.weights import BACKBONE_KEY

    call_command("prepare_experts", "--checkpoint", str(QWEN), "--model-id", "q3x", "--quant", "q8_0",
                 "--no-progress")
    assert MoeModel.objects.get(model_id="q3x").config[BACKBONE_KEY]["blobs"]
    r = client.post("/v1/completions", data=json.dumps({"model": "q3x", "prompt": [1, 2, 3], "max_tokens": 2}),
                    content_type="application/json")
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2, r.content
    call_command("export_gguf", "--model-id", "q3x", "--out", str(tmp_path / "q3x.gguf"))
    assert (tmp_path / "q3x.gguf").stat().st_size > 0

    ck = tmp_path / "experts-only"
    make_checkpoint(ck, "qwen3_moe", experts=4, layers=1)
    call_command("prepare_experts", "--checkpoint", str(ck), "--model-id", "eo", "--no-progress")
    assert BACKBONE_KEY not in MoeModel.objects.get(model_id="eo").config
    r = client.post("/v1/completions", data=json.dumps({"model": "eo", "prompt": [1], "max_tokens": 1}),
                    content_type="application/json")
    msg = r.json()["error"]["message"]
    assert r.status_code == 404 and "prepare_experts --checkpoint" in msg and "publish_backbone" not in msg, msg
