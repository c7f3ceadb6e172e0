"""Generation input checks in process (no cluster): size caps (``router.generate.check_size``)
on ``tenzro_moeGenerate`` and the OpenAI endpoints, OpenAI parameter validation before a stream
starts, ``/v1/models`` and JSON 404/413 answers, and cancellation when the client goes away.

The model is published for real (experts and backbone in the test blob store); with no holder
online, generations run on the site's fallback replica (``router.fallback``).
"""
from __future__ import annotations

import asyncio
import base64
import json
import time
from unittest import mock

import pytest
from asgiref.sync import sync_to_async
from safetensors.numpy import load_file

from moe import wire
from moe.backbone.decode import Sampling
from prepare.backbone import publish_backbone
from prepare.services import publish_checkpoint
from tests.conftest import QWEN

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "qwen-limits-test"


def publish() -> None:
    publish_checkpoint(QWEN, MODEL)
    publish_backbone(QWEN, MODEL)


@pytest.fixture
def model(settings):
    publish()
    settings.TENZRO = {**settings.TENZRO, "GEN_MAX_PROMPTS": 3, "GEN_MAX_PROMPT_TOKENS": 40,
                       "GEN_MAX_NEW_TOKENS": 60}
    return MODEL


def rpc(client, params):
    r = client.post("/rpc", data=json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tenzro_moeGenerate",
                                             "params": params}), content_type="application/json")
    return r.json()


def openai(client, body, path="/v1/completions"):
    r = client.post(path, data=json.dumps(body), content_type="application/json")
    return r.status_code, (json.loads(b"".join(r.streaming_content)) if r.streaming else r.json())


@pytest.mark.parametrize("params,field,words", [
    ({"input_ids": [[1, 2]] * 4}, "input_ids", "TENZRO_GEN_MAX_PROMPTS"),
    ({"prompt": [[1, 2]] * 4}, "prompt", "TENZRO_GEN_MAX_PROMPTS"),
    ({"input_ids": [[1] * 30, [2] * 30]}, "input_ids", "TENZRO_GEN_MAX_PROMPT_TOKENS"),
    ({"input_ids": [[1], [2], [3]], "max_new_tokens": 21}, "max_new_tokens", "TENZRO_GEN_MAX_NEW_TOKENS"),
    ({"input_ids": [1, 2, 3], "stop": [1_000_000_000]}, "stop", "vocabulary"),
    ({"input_ids": [1, 2, 3], "stop": list(range(65))}, "stop", "at most 64"),
    ({"input_ids": "1,2"}, "input_ids", "tokenizer.json"),
    ({"input_ids": [1, 999]}, "input_ids", "0..255"),
    ({"input_ids": [1, 2], "top_p": 0}, "top_p", "(0, 1]"),
    ({"input_ids": [1, 2], "top_p": 1.5}, "top_p", "(0, 1]"),
])
def test_rpc_generation_is_checked_before_any_work(client, model, params, field, words):
    err = rpc(client, {"model_id": model, "max_new_tokens": 2, **params})["error"]
    assert err["code"] == -32602 and err["data"]["field"] == field and words in err["message"], err


def test_rpc_generation_within_the_caps_runs(client, model):
    r = rpc(client, {"model_id": model, "input_ids": [[1, 2], [3, 4], [5, 6]], "max_new_tokens": 20})["result"]
    assert [len(o) for o in r["output_ids"]] == [20, 20, 20]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body,param,words", [
    ({"prompt": [[1, 2]] * 4}, "prompt", "TENZRO_GEN_MAX_PROMPTS"),
    ({"prompt": [[1], [2], [3]], "max_tokens": 21}, "max_tokens", "TENZRO_GEN_MAX_NEW_TOKENS"),
    ({"prompt": [[1], [2], [3]], "max_completion_tokens": 21}, "max_completion_tokens", "TENZRO_GEN_MAX_NEW_TOKENS"),
    ({"prompt": [1_000_000_000]}, "prompt", "0..255"),
    ({"prompt": [1] * 41}, "prompt", "TENZRO_GEN_MAX_PROMPT_TOKENS"),
    ({"prompt": "1,2"}, "prompt", "tokenizer.json"),
    ({"prompt": [1], "stop": [99999]}, "stop", "vocabulary"),
    ({"prompt": [1], "stop": list(range(65))}, "stop", "at most 64"),
    ({"prompt": [1], "top_k": -1}, "top_k", "top_k must be ≥ 0"),
    ({"prompt": [1], "top_p": 0}, "top_p", "(0, 1]"),
    ({"prompt": [1], "logprobs": 5}, "logprobs", "not supported"),
    ({"prompt": [1], "echo": True}, "echo", "not supported"),
    ({"prompt": [1], "best_of": 2}, "best_of", "not supported"),
    ({"prompt": [1], "logit_bias": {"1": 5}}, "logit_bias", "not supported"),
    ({"prompt": [1], "suffix": "x"}, "suffix", "not supported"),
    ({"prompt": [1], "presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"prompt": [1], "frequency_penalty": -1}, "frequency_penalty", "not supported"),
    ({"prompt": [1], "frobnicate": 1}, "frobnicate", "unrecognized"),
    ({"prompt": [1], "model": 5}, "model", "model must be a string"),  # was "model is required"
    ({"prompt": [1], "model": ["m"]}, "model", "model must be a string"),
    ({"prompt": [1], "stream_options": {"include_usage": "yes"}}, "include_usage", "boolean"),
    ({"prompt": [1], "stream_options": {"include_usage": True, "chunk": 1}}, "stream_options.chunk", "unknown"),
])
def test_openai_errors_are_400_before_any_stream(client, model, stream, body, param, words):
    status, r = openai(client, {"model": model, "max_tokens": 2, **body, "stream": stream})
    assert status == 400 and r["error"]["param"] == param and words in r["error"]["message"], r


def test_openai_stream_options_need_a_stream(client, model):
    """OpenAI refuses ``stream_options`` on a request that does not stream (before: accepted and ignored)."""
    status, r = openai(client, {"model": model, "prompt": [1], "max_tokens": 2,
                                "stream_options": {"include_usage": True}})
    assert status == 400 and r["error"]["param"] == "stream_options" and "only allowed" in r["error"]["message"], r
    status, r = openai(client, {"model": model, "prompt": [1], "max_tokens": 2, "stream_options": None})
    assert status == 200, r


def test_openai_stream_must_be_a_boolean_and_noop_values_are_accepted(client, model):
    status, r = openai(client, {"model": model, "prompt": [1], "stream": "yes"})
    assert status == 400 and r["error"]["param"] == "stream"
    r = client.post("/v1/completions", data=json.dumps({
        "model": model, "prompt": [1, 2], "max_tokens": 2, "logprobs": None, "echo": False, "best_of": 1,
        "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0, "user": "u", "stream": False}),
        content_type="application/json")
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2


def test_openai_body_over_the_limit_is_a_json_413(client, model, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = client.post(path, data=json.dumps({"model": model, "prompt": [1] * 1000}), content_type="application/json")
        assert r.status_code == 413 and "1000-byte limit" in r.json()["error"]["message"]


def test_v1_models_and_unknown_v1_paths(client, model):
    r = client.get("/v1/models")
    assert r.status_code == 200 and r.json()["object"] == "list"
    ids = {m["id"]: m for m in r.json()["data"]}
    assert ids[MODEL]["object"] == "model" and isinstance(ids[MODEL]["created"], int)
    for method in (client.get, client.post):
        r = method("/v1/embeddings")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": [1]}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
@pytest.mark.parametrize("stream", [False, True])
def test_an_unknown_model_is_model_not_found_like_openai(client, model, path, body, stream):
    """The error OpenAI (and ``GET /v1/models/{model}``) gives: 404 invalid_request_error,
    code model_not_found, param model."""
    status, r = openai(client, {"model": "nope", **body, "stream": stream}, path)
    assert status == 404 and r["error"]["type"] == "invalid_request_error", r
    assert r["error"]["code"] == "model_not_found" and r["error"]["param"] == "model"
    assert client.get("/v1/models/nope").json()["error"]["code"] == "model_not_found"


@pytest.mark.asyncio
async def test_a_generation_passes_arrays_not_base64_between_its_layers():
    """Each MoE layer of each decode step hands the forward numpy arrays and gets arrays back:
    with every base64 codec refusing, the generation (here on the fallback replica, exact f32)
    still gives the checkpoint's reference greedy tokens."""
    from router.generate import generate

    await sync_to_async(publish)()
    ref = load_file(str(QWEN / "generation_reference.safetensors"))
    prompt = [int(t) for t in ref["input_ids"][0]]
    greedy = [int(t) for t in ref["greedy_ids"][0][len(prompt):]]

    def refuse(*_args, **_kw):
        raise AssertionError("base64 inside a generation")

    with mock.patch.object(wire, "b64encode_bytes", refuse), mock.patch.object(wire, "b64decode", refuse), \
            mock.patch.object(base64, "b64encode", refuse), mock.patch.object(base64, "b64decode", refuse):
        r = await generate(MODEL, prompt, Sampling(max_new_tokens=4), carrier="f32")
    assert r["output_ids"] == greedy[:4]
    assert r["layers"]["transports"].get("fallback", 0) > 0 and len(r["forward_ids"]) == 2 * 4


# -- cancellation: a client that goes away stops the site's work ---------------------------------

async def settle(calls: list) -> int:
    """Wait until ``calls`` stops growing for 1 s (the worker thread is done); its length."""
    n, since = len(calls), time.monotonic()
    while time.monotonic() - since < 1.0:
        await asyncio.sleep(0.1)
        if len(calls) != n:
            n, since = len(calls), time.monotonic()
    return n


STEPS = 120  # without cancellation the worker thread runs every one of them


@pytest.mark.asyncio
async def test_cancelled_generation_stops_its_worker_thread():
    from router.generate import generate

    await sync_to_async(publish)()
    calls: list = []
    started = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_tokens(seqs):
        calls.append(len(seqs))
        loop.call_soon_threadsafe(started.set)

    task = asyncio.ensure_future(generate(MODEL, [1, 2, 3], Sampling(max_new_tokens=STEPS), on_tokens=on_tokens))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await settle(calls) < STEPS // 2


@pytest.mark.asyncio
async def test_closed_stream_cancels_its_generation():
    from router import openai_api
    from router.generate import served_model

    await sync_to_async(publish)()
    served = await sync_to_async(served_model)(MODEL)
    calls: list = []
    gen = openai_api._stream(served, [[1, 2, 3]], Sampling(max_new_tokens=STEPS), "auto", {"id": "x"}, False)
    real = openai_api.generate

    async def counting(*args, on_tokens=None, **kw):  # count the worker thread's steps
        def count(seqs):
            calls.append(1)
            on_tokens(seqs)
        return await real(*args, on_tokens=count, **kw)

    openai_api.generate = counting
    try:
        first = await gen.__anext__()
        assert first.startswith("data: ")
        await gen.aclose()  # what the ASGI server does when the client disconnects
    finally:
        openai_api.generate = real
    assert await settle(calls) < STEPS // 2


@pytest.mark.parametrize("name,noop,value", [
    ("store", False, True), ("metadata", {}, {"a": "b"}), ("service_tier", "auto", "flex"),
    ("response_format", {"type": "text"}, {"type": "json_object"}), ("tools", [], [{"type": "function"}]),
    ("tool_choice", "none", "auto"), ("parallel_tool_calls", False, "yes"), ("modalities", ["text"], ["audio"]),
    ("reasoning_effort", None, "low"), ("audio", None, {"voice": "x"}),
])
def test_openai_chat_parameters_this_server_lacks_are_not_supported_not_unrecognized(client, model, name, noop, value):
    """OpenAI's own chat parameters (tools, structured output, stored completions, …) are known
    names: accepted at their no-op value, else 400 "not supported" naming them (before: 400
    "unrecognized request argument", as for a field OpenAI does not have either)."""
    from router.openai_api import check_params

    check_params({"model": model, "messages": [], name: noop}, chat=True)  # no-op: accepted
    status, r = openai(client, {"model": model, "messages": [{"role": "user", "content": "hi"}], name: value},
                       "/v1/chat/completions")
    assert status == 400 and r["error"]["param"] == name and "not supported" in r["error"]["message"], r
    status, r = openai(client, {"model": model, "prompt": [1], name: noop})  # not a completions parameter
    assert status == 400 and r["error"]["param"] == name and "unrecognized" in r["error"]["message"], r


def test_rpc_too_many_stops_is_refused_before_each_is_checked(client, model):
    """``stop`` over ``MAX_STOPS`` is refused by its length before any item is validated
    (before: DRF validated all 3 million ids, 3.5 s of the event loop, then said "at most 64")."""
    from rest_framework import serializers

    calls = []
    real = serializers.IntegerField.to_internal_value

    def counting(self, data):
        calls.append(1)
        return real(self, data)

    with mock.patch.object(serializers.IntegerField, "to_internal_value", counting):
        err = rpc(client, {"model_id": model, "input_ids": [1], "stop": [1] * 100_000})["error"]
    assert err["code"] == -32602 and err["data"]["field"] == "stop", err
    assert "100000 stops; at most 64" in err["message"] and len(calls) < 100, (err, len(calls))
