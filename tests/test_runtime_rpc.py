"""Execution methods over JSON-RPC on the site's own runtime: auth, params, errors, results."""
from __future__ import annotations

import base64

import numpy as np
import pytest

from moe import wire

from router.apps import install
from router.state import Router
from moe.ffn import expert_forward
from moe.runtime import ExpertRuntime
from moe.blobs import BlobStore
from moe.content import blob_uri
from registry.operator import operator_token
from tests.test_rpc import call, req
from tests.test_runtime import EXPERT_BYTES, H, expert, gate_blob, rows

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def site_rt(tmp_path):
    """A fresh site router whose own runtime is a small one in ``tmp_path``."""
    rt = ExpertRuntime(memory_budget=2 * EXPERT_BYTES + 4096, disk_dir=tmp_path / "tier")
    previous = install(Router(site_runtime=rt))
    yield rt
    install(previous)


def op():
    return {"HTTP_AUTHORIZATION": f"Bearer {operator_token()}"}


def b64(a):
    return wire.b64encode(wire.encode_f32(a))


def test_management_methods_need_the_operator_credential(client, site_rt):
    blob = base64.b64encode(expert(0).to_blob()).decode()
    for method, params in (("tenzro_moeExpertLoad", {"model_id": "m", "layer": 0, "expert": 0, "blob_base64": blob}),
                           ("tenzro_moeGateLoad", {"model_id": "m", "layer": 0, "blob_base64": blob}),
                           ("tenzro_moeExpertUnload", {"model_id": "m", "layer": 0, "expert": 0}),
                           ("tenzro_moeGateUnload", {"model_id": "m", "layer": 0})):
        err = call(client, req(method, params))[1]["error"]
        assert err["code"] == -32001 and err["data"]["field"] == "Authorization"
    assert site_rt.holdings() == []
    assert "result" in call(client, req("tenzro_moeExpertStatus", {}))[1]


def test_site_runtime_load_by_uri_and_base64_execute_route_status(client, site_rt, settings):
    blob = expert(1).to_blob()
    h = BlobStore(settings.TENZRO["BLOB_DIR"]).put(blob)
    row = call(client, req("tenzro_moeExpertLoad", {"model_id": "m", "layer": 0, "expert": 1, "uri": blob_uri(h)}),
               **op())[1]["result"]
    assert row["tier"] == "memory" and row["source_uri"] == blob_uri(h)
    g = call(client, req("tenzro_moeGateLoad", {"model_id": "m", "layer": 0,
                                                "blob_base64": base64.b64encode(gate_blob()).decode()}), **op())[1]
    assert g["result"]["num_experts"] == 4
    x = rows(3)
    res = call(client, req("tenzro_moeExecute", {"model_id": "m", "layer": 0, "expert": 1, "d_model": H,
                                                 "token_indices": [2, 0, 1], "hidden_states": b64(x)}))[1]["result"]
    assert res["token_indices"] == [2, 0, 1] and res["d_model"] == H
    np.testing.assert_array_equal(wire.decode_f32(wire.b64decode(res["outputs"], "o"), H), expert_forward(expert(1), x))
    r = call(client, req("tenzro_moeRoute", {"model_id": "m", "layer": 0, "d_model": H, "hidden_states": b64(x)}))[1]
    assert r["result"]["tokens"] == 3 and r["result"]["top_k"] == 2
    st = call(client, req("tenzro_moeExpertStatus", {}))[1]["result"]
    assert st["memory_experts"] == 1 and st["compute_backend"] == "cpu" and st["gpu"] is False
    assert st["experts"][0]["committed_tps"] == 0 and st["tokens_last_minute"] == 3
    assert call(client, req("tenzro_moeExpertUnload", {"model_id": "m", "layer": 0, "expert": 1}), **op())[1][
        "result"]["unloaded"] is True


@pytest.mark.parametrize("params,code,field", [
    ({"d_model": H + 1}, -32602, "hidden_states"),          # bytes are not whole rows of the declared width
    ({"d_model": 2 * H, "token_indices": [0]}, -32004, "d_model"),
    ({"token_indices": [0, 1, 2]}, -32602, "token_indices"),
    ({"expert": 5}, -32004, "expert"),
    ({"hidden_states": None}, -32602, "hidden_states"),
    ({"token_indices": [-1, 0]}, -32602, "token_indices.0"),
    ({"provider": "xyz"}, -32602, "provider"),
    # relayed: refused as the holder would, not as "no agent connected" / the agent's -32004
    ({"token_indices": [2**32, 0], "provider": "ab" * 32}, -32602, "token_indices.0"),
])
def test_execute_errors_over_rpc_name_the_field(client, site_rt, params, code, field):
    site_rt.load_expert("m", 0, 0, expert(0).to_blob())
    p = {"model_id": "m", "layer": 0, "expert": 0, "d_model": H, "token_indices": [0, 1], "hidden_states": b64(rows(2))}
    p.update(params)
    p = {k: v for k, v in p.items() if v is not None}
    before = site_rt.status()
    err = call(client, req("tenzro_moeExecute", p))[1]["error"]
    assert (err["code"], err["data"]["field"]) == (code, field), err
    assert site_rt.status() == before


def test_nonfinite_rows_corrupt_blob_and_hash_mismatch_over_rpc(client, site_rt):
    site_rt.load_expert("m", 0, 0, expert(0).to_blob())
    x = rows(1)
    x[0, 1] = np.nan
    err = call(client, req("tenzro_moeExecute", {"model_id": "m", "layer": 0, "expert": 0, "d_model": H,
                                                 "token_indices": [0], "hidden_states": b64(x)}))[1]["error"]
    assert err["code"] == -32602 and "non-finite" in err["message"]
    err = call(client, req("tenzro_moeExpertLoad", {"model_id": "m", "layer": 0, "expert": 1,
                                                    "blob_base64": base64.b64encode(b"\x00" * 64).decode()}), **op())[1]
    assert err["error"]["code"] == -32004 and "corrupt" in err["error"]["message"]
    err = call(client, req("tenzro_moeExpertLoad", {"model_id": "m", "layer": 0, "expert": 1,
                                                    "uri": blob_uri("ab" * 32)}), **op())[1]["error"]
    assert err["data"]["field"] == "uri"
    err = call(client, req("tenzro_moeExpertLoad", {"model_id": "m", "layer": 0, "expert": 1}), **op())[1]["error"]
    assert err["code"] == -32602 and err["data"]["field"] == "uri"
    err = call(client, req("tenzro_moeRoute", {"model_id": "m", "layer": 3, "d_model": H,
                                               "hidden_states": b64(rows(1))}))[1]["error"]
    assert err["code"] == -32004 and err["data"]["field"] == "layer"
    assert [h["expert"] for h in site_rt.holdings()] == [0]


def test_relay_to_unconnected_provider_is_a_clear_error(client, site_rt):
    err = call(client, req("tenzro_moeExpertStatus", {"provider": "ab" * 32}))[1]["error"]
    assert err["code"] == -32004 and err["data"]["field"] == "provider" and "no agent connected" in err["message"]


def test_route_loads_the_published_gate_on_demand(client, site_rt):
    from safetensors.numpy import load_file

    from prepare.services import publish_checkpoint
    from tests.conftest import QWEN

    publish_checkpoint(QWEN, "qwen-route")
    x = load_file(str(QWEN / "reference.safetensors"))["layer0.hidden_states"][:4].astype(np.float32)
    r = call(client, req("tenzro_moeRoute", {"model_id": "qwen-route", "layer": 0, "d_model": x.shape[1],
                                             "hidden_states": b64(x)}))[1]
    assert r["result"]["tokens"] == 4 and len(r["result"]["routed"]) == 4, r
    err = call(client, req("tenzro_moeRoute", {"model_id": "qwen-route", "layer": 99, "d_model": x.shape[1],
                                               "hidden_states": b64(x)}))[1]["error"]
    assert err["code"] == -32004 and "no gate" in err["message"]  # unpublished layer: still a clear error


@pytest.mark.parametrize("indices,field", [([0] * 200_000 + [-1], "token_indices.200000"),
                                           ([0, 1.5], "token_indices.1"), ([0, "x"], "token_indices.1"),
                                           ([True], "token_indices.0")])
def test_execute_token_indices_are_validated_in_one_pass(client, site_rt, indices, field):
    """Plain in-range ids pass without DRF's per-item validators (3 million of them held the
    event loop 5 s); the first bad one is still named."""
    from rest_framework import serializers

    calls = []
    real = serializers.IntegerField.run_validation

    def counting(self, data=serializers.empty):
        calls.append(1)
        return real(self, data)

    site_rt.load_expert("m", 0, 0, expert(0).to_blob())
    p = {"model_id": "m", "layer": 0, "expert": 0, "d_model": H, "token_indices": indices,
         "hidden_states": b64(rows(2))}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(serializers.IntegerField, "run_validation", counting)
        err = call(client, req("tenzro_moeExecute", p))[1]["error"]
    assert err["code"] == -32602 and err["data"]["field"] == field, err
    assert len(calls) < 100, len(calls)
