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
