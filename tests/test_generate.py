"""Whole-model generation end to end: a real cluster (site = backbone node, agents = experts),
``tenzro_moeGenerate`` and the OpenAI-compatible endpoints with a real SSE client."""
from __future__ import annotations

import json
import time

import httpx
import numpy as np
import pytest
from httpx_sse import connect_sse
from safetensors.numpy import load_file
from tokenizers import Tokenizer, models, pre_tokenizers

from moe import wire
from tests.cluster_util import rpc, running_cluster
from tests.conftest import QWEN

pytestmark = pytest.mark.cluster


# each turn between t1 and t2, then t3 to open the answer
CHAT_TEMPLATE = ("{% for m in messages %}t1 {{ m['content'] }} t2 {% endfor %}"
                 "{% if add_generation_prompt %}t3{% endif %}")


def checkpoint_with_tokenizer(tmp_path):
    """The qwen fixture plus a word-level ``tokenizer.json`` (token ``t{i}`` is id ``i``) and
    a ``tokenizer_config.json`` with ``CHAT_TEMPLATE``."""
    d = tmp_path / "qwen3_moe_tiny"
    d.mkdir()
    for f in QWEN.iterdir():
        (d / f.name).symlink_to(f)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return d


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gen")
    ckpt = checkpoint_with_tokenizer(tmp)
    with running_cluster(tmp, [ckpt], holders=2) as (info, _proc):
        yield info


REF = load_file(str(QWEN / "generation_reference.safetensors"))
PROMPT = [int(t) for t in REF["input_ids"][0]]
GREEDY = [int(t) for t in REF["greedy_ids"][0][16:]]


def test_generate_greedy_matches_reference_with_logits(cluster):
    res = rpc(cluster["rpc"], "tenzro_moeGenerate", {"model_id": "qwen3-moe-tiny", "input_ids": PROMPT,
                                                     "max_new_tokens": 8, "carrier": "f32", "return_logits": True})
    r = res["result"]
    assert r["output_ids"] == GREEDY
    logits = wire.decode_f32(wire.b64decode(r["prompt_logits"], "prompt_logits"), 256)
    assert np.abs(logits - REF["logits"]).max() / np.abs(REF["logits"]).max() <= 1e-4
    assert r["text"] == " ".join(f"t{i}" for i in GREEDY)
    assert len(r["forward_ids"]) == 2 * 8 and r["layers"]["receipts"] > 0 and r["tokens_per_s"] > 0


def _recorded(url: str) -> tuple[int, dict]:
    """(batches served summed over providers, settled batches per forward id) of the site."""
    served = sum(p["batches_served"] for p in rpc(url, "tenzro_moeListProviders", {})["result"]["providers"])
    rows = rpc(url, "tenzro_moeListSettlements", {"model_id": "qwen3-moe-tiny", "limit": 1000})["result"]
    per_forward: dict[str, int] = {}
    for s in rows["settlements"]:
        per_forward[s["forward_id"]] = per_forward.get(s["forward_id"], 0) + s["batches"]
    return served, per_forward


def _settled(url: str, timeout: float = 30.0) -> tuple[int, dict]:
    """``_recorded`` once two reads 0.5 s apart agree (background recording done)."""
    last, deadline = _recorded(url), time.time() + timeout
    while time.time() < deadline:
        time.sleep(0.5)
        now = _recorded(url)
        if now == last:
            return now
        last = now
    return last


def test_generation_records_each_batch_once_in_outcomes_and_settlement(cluster):
    # A generation gathers its layer forwards' holder outcomes and settlement records and
    # hands them over in batches (router.state.ForwardOutcomes): every remote batch still counts
    # once in the holders' batches_served and once in a settled forward, one per layer forward.
    served0, settled0 = _settled(cluster["rpc"])
    r = rpc(cluster["rpc"], "tenzro_moeGenerate", {"model_id": "qwen3-moe-tiny", "input_ids": PROMPT,
                                                   "max_new_tokens": 4, "carrier": "f32"})["result"]
    remote = r["layers"]["batches"] - r["layers"]["transports"].get("local", 0) \
        - r["layers"]["transports"].get("fallback", 0)
    assert r["layers"]["failures"] == [] and remote == r["layers"]["receipts"] > 0
    served1, settled1 = _settled(cluster["rpc"])
    new = {f: n for f, n in settled1.items() if f not in settled0}
    assert served1 - served0 == remote
    assert len(new) == len(r["forward_ids"]) == 2 * 4 and sum(new.values()) == remote


def test_generate_text_prompt_and_batch(cluster):
    text = " ".join(f"t{i}" for i in PROMPT)
    r = rpc(cluster["rpc"], "tenzro_moeGenerate", {"model_id": "qwen3-moe-tiny", "prompt": text,
                                                   "max_new_tokens": 4, "carrier": "f32"})["result"]
    assert r["output_ids"] == GREEDY[:4]
    b = rpc(cluster["rpc"], "tenzro_moeGenerate", {"model_id": "qwen3-moe-tiny", "input_ids": [PROMPT, PROMPT[:5]],
                                                   "max_new_tokens": 3, "carrier": "f32"})["result"]
    assert b["output_ids"][0] == GREEDY[:3] and len(b["output_ids"][1]) == 3
    # one distributed forward per layer per step for the whole batch
    assert len(b["forward_ids"]) == 2 * 3


@pytest.mark.parametrize("params,field", [
    ({"model_id": "nope", "input_ids": [1, 2]}, "model_id"),
    ({"model_id": "qwen3-moe-tiny", "input_ids": list(range(100)) * 2}, "input_ids"),
    ({"model_id": "qwen3-moe-tiny", "input_ids": [1, 2], "temperature": -1}, "temperature"),
    ({"model_id": "qwen3-moe-tiny", "input_ids": [1, 2], "top_p": 1.5}, "top_p"),
    ({"model_id": "qwen3-moe-tiny", "input_ids": [1, 999]}, "input_ids"),
    ({"model_id": "qwen3-moe-tiny", "input_ids": [1], "prompt": "t1"}, "input_ids"),
])
def test_generate_errors_name_the_field(cluster, params, field):
    err = rpc(cluster["rpc"], "tenzro_moeGenerate", params)["error"]
    assert err["code"] == -32602 and err["data"]["field"] == field, err


def test_openai_completions_plain_and_streamed(cluster):
    url = cluster["url"]
    body = {"model": "qwen3-moe-tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "carrier": "f32"}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    assert r["choices"][0]["token_ids"] == GREEDY and r["usage"]["completion_tokens"] == 8
    ids, texts, finish = [], [], None
    with httpx.Client(timeout=120) as client:
        with connect_sse(client, "POST", f"{url}/v1/completions", json={**body, "stream": True}) as es:
            assert es.response.headers["content-type"].startswith("text/event-stream")
            for ev in es.iter_sse():
                if ev.data == "[DONE]":
                    break
                c = json.loads(ev.data)["choices"][0]
                ids += c["token_ids"]
                texts.append(c["text"])
                finish = c["finish_reason"] or finish
    assert ids == GREEDY and len(texts) == 8 and finish == "length"
    assert "".join(texts).split() == [f"t{i}" for i in GREEDY]


def test_openai_chat_streams_text(cluster):
    body = {"model": "qwen3-moe-tiny", "messages": [{"role": "user", "content": "t5 t6 t7"}], "max_tokens": 4,
            "temperature": 0.7, "seed": 3, "stream": True}
    content = []
    with httpx.Client(timeout=120) as client:
        with connect_sse(client, "POST", f"{cluster['url']}/v1/chat/completions", json=body) as es:
            for ev in es.iter_sse():
                if ev.data == "[DONE]":
                    break
                content.append(json.loads(ev.data)["choices"][0]["delta"]["content"])
    assert len(content) == 4 and all(w.startswith("t") for w in "".join(content).split())


def test_openai_chat_applies_the_checkpoint_template(cluster):
    url, msgs = cluster["url"], [{"role": "user", "content": "t5 t6 t7"}, {"role": "assistant", "content": "t8"},
                                 {"role": "user", "content": "t4"}]
    params = {"model": "qwen3-moe-tiny", "max_tokens": 4, "temperature": 0, "carrier": "f32"}
    chat = httpx.post(f"{url}/v1/chat/completions", json={**params, "messages": msgs}, timeout=120).json()
    rendered = [1, 5, 6, 7, 2, 1, 8, 2, 1, 4, 2, 3]
    plain = httpx.post(f"{url}/v1/completions", json={**params, "prompt": rendered}, timeout=120).json()
    assert chat["usage"]["prompt_tokens"] == len(rendered)
    assert chat["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
    assert chat["choices"][0]["message"]["content"] == plain["choices"][0]["text"]


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", {"model": "nope", "prompt": [1]}, 404, "model"),
    ("/v1/completions", {"model": "qwen3-moe-tiny"}, 400, "prompt"),
    ("/v1/completions", {"model": "qwen3-moe-tiny", "prompt": [1], "temperature": 5}, 400, "temperature"),
    ("/v1/completions", {"model": "qwen3-moe-tiny", "prompt": [1], "n": 2}, 400, "n"),
    ("/v1/chat/completions", {"model": "qwen3-moe-tiny", "messages": []}, 400, "messages"),
])
def test_openai_errors(cluster, path, body, status, param):
    r = httpx.post(cluster["url"] + path, json=body, timeout=60)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_concurrent_clients_get_their_solo_tokens(cluster):
    """Batch invariance on a real cluster (issue 21): twelve greedy ``/v1/completions`` (and
    a ``tenzro_moeGenerate``) sent at once share the scheduler's steps, and each gets exactly
    the tokens it gets alone; none fails."""
    import asyncio

    url = cluster["url"]
    rng = np.random.default_rng(21)
    prompts = [[int(t) for t in rng.integers(0, 256, size=int(rng.integers(3, 14)))] for _ in range(12)]

    def body(p):
        return {"model": "qwen3-moe-tiny", "prompt": p, "max_tokens": 10, "temperature": 0}

    solo = [httpx.post(f"{url}/v1/completions", json=body(p), timeout=120).json()["choices"][0]["token_ids"]
            for p in prompts]
    alone_rpc = rpc(cluster["rpc"], "tenzro_moeGenerate", {"model_id": "qwen3-moe-tiny", "input_ids": prompts[0],
                                                           "max_new_tokens": 10})["result"]["output_ids"]
    assert alone_rpc == solo[0]

    async def together():
        async with httpx.AsyncClient(timeout=300) as client:
            calls = [client.post(f"{url}/v1/completions", json=body(p)) for p in prompts]
            calls.append(client.post(cluster["rpc"], json={"jsonrpc": "2.0", "id": 1, "method": "tenzro_moeGenerate",
                                                           "params": {"model_id": "qwen3-moe-tiny",
                                                                      "input_ids": prompts[0],
                                                                      "max_new_tokens": 10}}))
            return await asyncio.gather(*calls)

    answers = asyncio.run(together())
    assert [a.status_code for a in answers] == [200] * 13
    assert [a.json()["choices"][0]["token_ids"] for a in answers[:12]] == solo
    assert answers[12].json()["result"]["output_ids"] == solo[0]


def test_fallback_replica_serves_when_every_holder_is_gone(cluster):
    """Runs last: SIGKILL every agent; the site's fallback replica serves every batch."""
    import os
    import signal

    for a in cluster["agents"]:
        os.kill(a["pid"], signal.SIGKILL)
    params = {"model_id": "qwen3-moe-tiny", "input_ids": PROMPT, "max_new_tokens": 8, "carrier": "f32"}
    r = rpc(cluster["rpc"], "tenzro_moeGenerate", params)["result"]
    assert r["output_ids"] == GREEDY
    assert r["layers"]["transports"].get("fallback", 0) > 0 and r["layers"]["holders"] == []
    err = rpc(cluster["rpc"], "tenzro_moeGenerate", {**params, "fallback": False})["error"]
    assert err["code"] in (-32000, -32004)
