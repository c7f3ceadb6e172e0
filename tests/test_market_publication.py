"""Issue 27 items 1–2: a published model listed on the market by id alone, and its expert-shard
download (kvasir_market_contract.md §1.10) in both query dialects, read back with gguf-py."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from django.core.management import CommandError, call_command
from gguf import GGUFReader

from moe.blobs import BlobStore
from moe.codec import loads_safetensors
from prepare.services import publish_checkpoint
from registry import market
from registry.models import ExpertBlob, MarketModel
from registry.operator import operator_token
from tests.conftest import DEEPSEEK, QWEN
from tests.test_market import get, login, post

pytestmark = pytest.mark.django_db(transaction=True)


def rpc(client, params, auth=True):
    req = {"jsonrpc": "2.0", "id": 1, "method": "tenzro_moeMarketAddModel", "params": params}
    headers = {"HTTP_AUTHORIZATION": f"Bearer {operator_token()}"} if auth else {}
    return client.post("/rpc", data=json.dumps(req), content_type="application/json", **headers).json()


# ------------------------------------------------------------------ item 1: listing a published model

def test_rpc_lists_a_published_model_by_id_and_demand_covers_its_moe_layers(client):
    publish_checkpoint(DEEPSEEK, "ds")  # layer 0 dense, layers 1-2 MoE, 16 routed experts, H 256
    r = rpc(client, {"model_id": "ds"})["result"]
    assert r == {"model_id": "ds", "name": "", "n_embd": 256, "n_layer": 3, "n_expert": 16,
                 "expert_layers": [1, 2], "created": True, "published": True}
    _, tok = login(client)
    status, body = get(client, "/api/expert-demand?model=ds", token=tok)
    assert status == 200
    (m,) = body["models"]
    assert [x["layer"] for x in m["layers"]] == [1, 2]
    assert m["layers"][0]["segments"] == [{"experts": [0, 16], "replicas": 0, "target": body["target_replicas"],
                                           "scarcity": 1.0}]
    status, a = post(client, "/api/expert-volunteer", {"max_experts": 4}, token=tok)
    assert (status, a["assigned"], a["model"], a["layer"], a["experts"]) == (200, True, "ds", 1, [0, 4])
    assert (a["n_embd"], a["n_layer"], a["n_expert"]) == (256, 3, 16)


def test_published_shape_must_agree_and_bad_ids_name_the_field(client):
    publish_checkpoint(QWEN, "q")
    r = rpc(client, {"model_id": "q", "n_expert": 8})
    assert r["error"]["data"]["field"] == "n_expert" and "published with n_expert 16" in r["error"]["message"]
    assert rpc(client, {"model_id": "q", "n_expert": 16, "expert_layers": [0, 1]})["result"]["published"] is True
    r = rpc(client, {"model_id": "nope"})
    assert r["error"]["data"]["field"] == "model_id" and "no model 'nope' is published" in r["error"]["message"]
    r = rpc(client, {"model_id": "a/b c"})
    assert r["error"]["code"] == -32602 and r["error"]["data"]["field"] == "model_id"
    assert rpc(client, {"model_id": "q"}, auth=False)["error"]["code"] == -32001
    assert list(MarketModel.objects.values_list("model_id", flat=True)) == ["q"]


def test_command_lists_a_published_model_and_refuses_an_unknown_one(capsys):
    publish_checkpoint(QWEN, "q")
    call_command("market_add_model", "--model-id", "q")
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["n_embd"], out["n_layer"], out["n_expert"], out["expert_layers"]) == (256, 2, 16, [0, 1])
    with pytest.raises(CommandError, match=r"--model-id: no model 'other' is published"):
        call_command("market_add_model", "--model-id", "other")
    with pytest.raises(CommandError, match=r"--n-layer: 'q' is published with n_layer 2"):
        call_command("market_add_model", "--model-id", "q", "--n-layer", "5")
    # an external listing still works with its full shape
    call_command("market_add_model", "--model-id", "ext", "--n-embd", "8", "--n-layer", "2", "--n-expert", "4",
                 "--expert-layers", "1")
    assert market.published_shape("ext") is None and MarketModel.objects.get(model_id="ext").n_expert == 4


# ------------------------------------------------------------------ item 2: shard download (§1.10)

SERVICE = "svc-secret-for-tests"


@pytest.fixture
def service(settings):
    settings.TENZRO = {**settings.TENZRO, "MARKET_SERVICE_TOKEN": SERVICE}
    return SERVICE


def shard(client, model, query, token=None, **headers):
    if token:
        headers["HTTP_AUTHORIZATION"] = f"Bearer {token}"
    return client.get(f"/api/proxy/models/{model}/expert-shard?{query}", **headers)


def body_of(r) -> bytes:
    return b"".join(r.streaming_content)


def read_shard(tmp_path, data: bytes) -> GGUFReader:
    p = tmp_path / f"s{hashlib.sha256(data).hexdigest()[:8]}.gguf"
    p.write_bytes(data)
    return GGUFReader(p)


def field(reader, key):
    return reader.fields[key].contents()


def assert_shard_is_the_published_blobs(tmp_path, r, model_id, layer, begin, end, n_total):
    assert r.status_code == 200, r.content
    data = body_of(r)
    assert int(r["Content-Length"]) == len(data)
    assert r["X-Kvasir-Shard-Digest"] == hashlib.sha256(data).hexdigest()
    g = read_shard(tmp_path, data)
    assert int(r["X-Kvasir-Shard-Manifest-Bytes"]) == g.data_offset
    rows = {x.expert: x.blob_hash for x in ExpertBlob.objects.filter(model_id=model_id, layer=layer)}
    hashes = [rows[e] for e in range(begin, end)]
    assert {k: field(g, "kvasir.expert_shard." + k) for k in
            ("model", "layer", "expert_begin", "expert_end", "n_expert_total", "source_digest")} == {
        "model": model_id, "layer": layer, "expert_begin": begin, "expert_end": end, "n_expert_total": n_total,
        "source_digest": hashlib.sha256("\n".join(hashes).encode()).hexdigest()}
    arch = field(g, "general.architecture")
    assert field(g, f"{arch}.expert_count") == n_total
    store = BlobStore(__import__("django.conf").conf.settings.TENZRO["BLOB_DIR"])
    tensors = {t.name: t for t in g.tensors}
    assert sorted(tensors) == sorted(f"blk.{layer}.ffn_{p}_exps.weight" for p in ("gate", "up", "down"))
    for p in ("gate", "up", "down"):
        t = tensors[f"blk.{layer}.ffn_{p}_exps.weight"]
        assert int(t.shape[-1]) == end - begin  # GGUF lists the expert dimension last
        stacked = np.asarray(t.data).reshape(end - begin, -1)
        for i, h in enumerate(hashes):
            raw, _ = loads_safetensors(store.get(h))
            assert stacked[i].tobytes() == bytes(raw[f"{p}_proj.weight"].data), (p, begin + i)
    return g, data


def test_quantized_shard_holds_the_published_blocks_in_both_dialects(client, tmp_path, service):
    publish_checkpoint(QWEN, "q", quant="q4_k_m")
    _, tok = login(client)
    r = shard(client, "q", "layer=1&expert_begin=4&expert_end=9", token=tok)
    g, data = assert_shard_is_the_published_blobs(tmp_path, r, "q", 1, 4, 9, 16)
    assert [t.tensor_type.name for t in g.tensors] == ["Q4_K", "Q4_K", "Q6_K"]
    assert (field(g, "qwen3moe.embedding_length"), field(g, "qwen3moe.block_count")) == (256, 2)
    # the phones' dialect, the service token as a header and as a query parameter: the same bytes
    for query, headers in [("layers=1:2&experts=4:9", {"HTTP_X_KVASIR_SERVICE_TOKEN": SERVICE}),
                           ("layers=1&experts=4:9", {"HTTP_X_LINKCPP_SERVICE_TOKEN": tok}),
                           (f"layers=1:1&experts=4:9&service_token={SERVICE}", {})]:
        r2 = shard(client, "q", query, **headers)
        assert r2.status_code == 200, (query, r2.content)
        assert body_of(r2) == data and r2["X-Kvasir-Shard-Digest"] == r["X-Kvasir-Shard-Digest"]
    # a market listing's name reaches the same model; a trailing slash is accepted
    market.add_model("q", name="tiny-q")
    r3 = client.get("/api/proxy/models/tiny-q/expert-shard/?layer=1&expert_begin=4&expert_end=9",
                    HTTP_AUTHORIZATION=f"Bearer {tok}")
    assert body_of(r3) == data


def test_dense_shard_and_the_refusals(client, tmp_path, service):
    publish_checkpoint(DEEPSEEK, "ds")  # dense experts in the source dtype; layer 0 is a dense MLP
    _, tok = login(client)
    assert_shard_is_the_published_blobs(tmp_path, shard(client, "ds", "layer=2&expert_begin=0&expert_end=16",
                                                        token=tok), "ds", 2, 0, 16, 16)
    cases = [
        ("ds", "layer=0&expert_begin=0&expert_end=4", 400, "layer 0 holds no routed experts"),
        ("ds", "layer=3&expert_begin=0&expert_end=4", 400, "layer 3 is outside [0, 3) of model 'ds'"),
        ("ds", "layer=1&expert_begin=8&expert_end=17", 400, "expert range [8, 17) is outside [0, 16)"),
        ("ds", "layer=1&expert_begin=5&expert_end=5", 400, "invalid expert range [5, 5)"),
        ("ds", "layer=1&expert_begin=-1&expert_end=5", 400, "invalid expert range [-1, 5)"),
        ("ds", "expert_begin=0&expert_end=4", 400, "layer is required"),
        ("ds", "layer=1&expert_end=4", 400, "expert_begin is required"),
        ("ds", "layer=1&expert_begin=0", 400, "expert_end is required"),
        ("ds", "", 400, "layer is required"),
        ("ds", "layer=x&expert_begin=0&expert_end=4", 400, "layer must be an integer"),
        ("ds", "layers=1:2&experts=4", 400, "experts must be A:B"),
        ("ds", "layers=1:2&experts=a:b", 400, "experts must be A:B"),
        ("ds", "layers=1:2&experts=9:4", 400, "invalid expert range [9, 4)"),
        ("ds", "layers=x&experts=0:4", 400, "layers must be A:B or a comma list"),
        ("ds", "layers=&experts=0:4", 400, "no layers requested"),
        ("ds", "experts=0:4", 400, "no layers requested"),
        ("ds", "layers=1:3&experts=0:4", 400, "a shard holds one layer"),
        ("nope", "layer=1&expert_begin=0&expert_end=4", 404, "unknown model 'nope'"),
    ]
    for model, query, status, message in cases:
        r = shard(client, model, query, token=tok)
        assert (r.status_code, r["Content-Type"]) == (status, "application/json"), (query, r.content)
        assert message in r.json()["error"], (query, r.json())
    assert shard(client, "ds", "layer=1&expert_begin=0&expert_end=4").json() == {"error": "authentication required"}
    assert shard(client, "ds", "layer=1&expert_begin=0&expert_end=4&service_token=wrong").status_code == 401
    assert shard(client, "ds", "layer=1&expert_begin=0&expert_end=4&service_token=" + tok).status_code == 401
    r = client.post("/api/proxy/models/ds/expert-shard?layer=1&expert_begin=0&expert_end=4",
                    HTTP_AUTHORIZATION=f"Bearer {tok}")
    assert (r.status_code, r.json()) == (405, {"error": "use GET"})
    ExpertBlob.objects.filter(model_id="ds", layer=1, expert=3).delete()
    r = shard(client, "ds", "layer=1&expert_begin=0&expert_end=4", token=tok)
    assert r.status_code == 404 and "experts [3] of model 'ds' are not published" in r.json()["error"]


def test_more_than_64_experts_is_413(client):
    from registry.models import MoeModel

    MoeModel.objects.create(model_id="wide", family="qwen3_moe", num_experts=128, top_k=8, hidden_size=64,
                            expert_d_ff=32, moe_layers=[0], config={"num_hidden_layers": 1})
    _, tok = login(client)
    r = shard(client, "wide", "layer=0&expert_begin=0&expert_end=65", token=tok)
    assert (r.status_code, r.json()) == (413, {"error": "at most 64 experts per request"})
    r = shard(client, "wide", "layers=0:1&experts=63:128", token=tok)
    assert r.status_code == 413
    r = shard(client, "wide", "layer=0&expert_begin=0&expert_end=64", token=tok)  # 64 passes the cap
    assert r.status_code == 404 and "not published" in r.json()["error"]
    # volunteering never hands out a window the download would refuse
    market.add_model("wide")
    # (each assignment is claimed as one replica, so the next goes to the next scarcest window)
    for body, want in [({}, [0, 64]), ({"max_experts": 128}, [64, 128]), ({"max_experts": 16}, [0, 16])]:
        status, a = post(client, "/api/expert-volunteer", body, token=tok)
        assert (status, a["experts"]) == (200, want), body
