"""JSON-RPC 2.0 surface: envelope errors, params validation, auth, and forward planning errors."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from moe import wire
from prepare.services import publish_checkpoint
from registry.operator import operator_token
from tests.conftest import QWEN

pytestmark = pytest.mark.django_db(transaction=True)


def call(client, body, **headers):
    resp = client.post("/rpc", data=body if isinstance(body, str) else json.dumps(body),
                       content_type="application/json", **headers)
    return resp.status_code, (resp.json() if resp.content else None)


def req(method, params=None, id=1):
    return {"jsonrpc": "2.0", "id": id, "method": method, **({"params": params} if params is not None else {})}


def test_envelope_errors(client):
    assert call(client, "{not json")[1]["error"]["code"] == -32700
    assert call(client, [])[1]["error"]["code"] == -32600
    assert call(client, {"jsonrpc": "1.0", "id": 1, "method": "x"})[1]["error"]["data"]["field"] == "jsonrpc"
    err = call(client, req("nope"))[1]["error"]
    assert err["code"] == -32601 and "nope" in err["message"]
    err = call(client, req("tenzro_moeShardMap", [1, 2]))[1]["error"]
    assert err["code"] == -32602 and err["data"]["field"] == "params"
    assert client.get("/rpc").status_code == 405


def test_params_validation_names_the_field(client):
    err = call(client, req("tenzro_moeForward", {"model_id": "m", "layer": -1, "d_model": 4, "hidden_states": ""}))[1]["error"]
    assert err["code"] == -32602 and err["data"]["field"] == "layer"
    err = call(client, req("tenzro_moeShardMap", {"model_id": "m", "bogus": 1}))[1]["error"]
    assert err["code"] == -32602 and err["data"]["field"] == "bogus"
    err = call(client, req("tenzro_moeForward", {"model_id": "m", "layer": 0, "d_model": 4,
                                                 "hidden_states": "!!!"}))[1]["error"]
    assert err["code"] == -32602 and err["data"]["field"] == "hidden_states"


def test_a_method_without_params_refuses_unknown_fields(client):
    """tenzro_moeReplicationPolicy takes no params: a stray one is named, as on every other method."""
    err = call(client, req("tenzro_moeReplicationPolicy", {"x": 1}))[1]["error"]
    assert err["code"] == -32602 and err["data"]["field"] == "x"
    assert call(client, req("tenzro_moeReplicationPolicy", {}))[1]["result"]["min_replication"] == 2


@pytest.mark.parametrize("path", ["/api/", "/api/nope", "/api/v1/", "/api/v1/nope", "/api/auth/nope",
                                  "/api/v1/providers/"])
def test_unknown_api_paths_are_a_json_404(client, path):
    """Any /api/ path without a view answers JSON like the REST mirror, never Django's HTML page."""
    from django.test import Client
    for resp in (client.get(path), Client(enforce_csrf_checks=True).post(path, data="x", content_type="text/plain")):
        assert resp.status_code == 404 and resp["Content-Type"].startswith("application/json")
        assert path in resp.json()["error"]


def test_batch_and_notification(client):
    status, body = call(client, [req("tenzro_moeReplicationPolicy", [], id=1), {"jsonrpc": "2.0", "method": "x"},
                                 req("nope", id=2)])
    assert status == 200 and [r["id"] for r in body] == [1, 2]
    assert body[0]["result"]["min_replication"] == 2 and body[1]["error"]["code"] == -32601
    status, body = call(client, {"jsonrpc": "2.0", "method": "tenzro_moeReplicationPolicy"})
    assert status == 204 and body is None


def test_operator_methods_need_the_token(client):
    err = call(client, req("tenzro_moePlaceModel", {"model_id": "m"}))[1]["error"]
    assert err["code"] == -32001
    err = call(client, req("tenzro_moePlaceModel", {"model_id": "m"}), HTTP_AUTHORIZATION="Bearer wrong")[1]["error"]
    assert err["code"] == -32001
    err = call(client, req("tenzro_moePlaceModel", {"model_id": "m"}),
               HTTP_AUTHORIZATION=f"Bearer {operator_token()}")[1]["error"]
    assert err["code"] == -32602 and err["data"]["field"] == "model_id" and "not published" in err["message"]


def test_forward_to_an_expert_nobody_holds_is_a_clear_error(client):
    publish_checkpoint(QWEN, "qwen-rpc-test")
    x = load_file(str(QWEN / "reference.safetensors"))["layer0.hidden_states"]
    params = {"model_id": "qwen-rpc-test", "layer": 0, "d_model": 256,
              "hidden_states": wire.b64encode(wire.encode_f32(x))}
    err = call(client, req("tenzro_moeForward", params))[1]["error"]
    assert err["code"] == -32000
    assert "no live holder for expert l0/e" in err["message"]
    missing = err["data"]["missing"]
    assert missing and {"layer", "expert", "tokens"} <= set(missing[0])
    # Wrong d_model and an unknown layer are params / execution errors, not crashes.
    err = call(client, req("tenzro_moeForward", {**params, "d_model": 128,
                                                 "hidden_states": wire.b64encode(wire.encode_f32(x[:, :128]))}))[1]["error"]
    assert err["code"] == -32602 and err["data"]["field"] == "d_model"
    for layer in (7, 10**30):  # not an MoE layer of the published model: a bad param naming the layer
        err = call(client, req("tenzro_moeForward", {**params, "layer": layer}))[1]["error"]
        assert err["code"] == -32602 and err["data"]["field"] == "layer" and "its MoE layers are" in err["message"]
    bad = np.full((2, 256), np.nan, dtype=np.float32)
    err = call(client, req("tenzro_moeForward", {**params, "hidden_states": wire.b64encode(wire.encode_f32(bad))}))[1]["error"]
    assert err["code"] == -32602 and "non-finite" in err["message"]


def test_malformed_requests_without_id_are_still_answered(client):
    for body in ({}, {"jsonrpc": "2.0"}, {"jsonrpc": "2.0", "method": 1, "params": "bar"}):
        status, resp = call(client, body)
        assert status == 200 and resp["id"] is None and resp["error"]["code"] in (-32600, -32602), body
    status, resp = call(client, [{}])
    assert status == 200 and resp[0]["error"]["code"] == -32600


def test_json_types_are_strict(client):
    base = {"model_id": "m", "layer": 0, "d_model": 4, "hidden_states": "AAAAAA=="}
    for field, value in (("layer", "0"), ("layer", 1.5), ("layer", True), ("allow_cold", "yes"), ("model_id", 5),
                         ("hidden_states", 123), ("top_k", "2")):
        err = call(client, req("tenzro_moeForward", {**base, field: value}))[1]["error"]
        assert err["code"] == -32602 and err["data"]["field"] == field, (field, value, err)


def test_bearer_scheme_is_case_insensitive(client):
    err = call(client, req("tenzro_moePlaceModel", {"model_id": "m"}),
               HTTP_AUTHORIZATION=f"bearer {operator_token()}")[1]["error"]
    assert err["code"] == -32602  # past the credential check: the model is unknown


def test_unknown_model_names_the_model_id(client):
    x = np.zeros((2, 256), dtype=np.float32)
    err = call(client, req("tenzro_moeForward", {"model_id": "nope", "layer": 0, "d_model": 256,
                                                 "hidden_states": wire.b64encode(wire.encode_f32(x))}))[1]["error"]
    assert err["code"] == -32602 and err["data"]["field"] == "model_id" and "not published" in err["message"]


def test_an_integer_of_100000_digits_is_a_parse_error_not_a_500(client):
    status, body = call(client, '{"jsonrpc": "2.0", "id": 1, "method": "tenzro_moeShardMap", "params": {"x": '
                        + "9" * 100_000 + "}}")
    assert status == 200 and body["error"]["code"] == -32700 and body["error"]["data"]["field"] == "body"
    assert "digits" in body["error"]["message"]


def test_a_non_finite_id_is_refused_not_echoed(client):
    for raw, code in (('{"jsonrpc": "2.0", "id": NaN, "method": "tenzro_moeShardMap", "params": {}}', -32700),
                      ('{"jsonrpc": "2.0", "id": Infinity, "method": "tenzro_moeShardMap", "params": {}}', -32700),
                      ('{"jsonrpc": "2.0", "id": 1e400, "method": "tenzro_moeShardMap", "params": {}}', -32600)):
        status, body = call(client, raw)
        assert status == 200 and body["error"]["code"] == code and body["id"] is None, raw
