"""``tenzro_cluster --checkpoint FILE.gguf --holders 2`` (real processes): the qwen2-MoE fixture
written as GGUF with a trained tokenizer and a chat template generates the transformers
reference's greedy ids over the OpenAI endpoint, and answers text in and text out."""
from __future__ import annotations

import httpx
import pytest
from safetensors.numpy import load_file

from tests.cluster_util import running_cluster
from tests.conftest import QWEN2
from tests.gguf_util import train_tokenizer, write_fixture_gguf

pytestmark = pytest.mark.cluster
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"


def test_cluster_serves_a_gguf_file_with_its_tokenizer(tmp_path):
    tok = train_tokenizer()
    path = write_fixture_gguf(QWEN2, tmp_path / "qwen2_moe.gguf", tokenizer=tok, chat_template=TEMPLATE)
    ref = load_file(str(QWEN2 / "generation_reference.safetensors"))
    prompt = ref["input_ids"][0].tolist()
    greedy = ref["greedy_ids"][0].tolist()[len(prompt):]
    with running_cluster(tmp_path, [path], holders=2) as (info, _):
        url, model = info["url"], info["model_id"]
        assert model == "qwen2-moe.gguf"
        body = {"model": model, "prompt": prompt, "max_tokens": len(greedy), "temperature": 0, "carrier": "f32"}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        assert r["choices"][0]["token_ids"] == greedy
        assert r["choices"][0]["text"] == tok.decode(greedy)
        text = "Hello, world! the experts hold the router."
        r = httpx.post(f"{url}/v1/completions", json={**body, "prompt": text, "max_tokens": 6}, timeout=120).json()
        assert r["usage"]["prompt_tokens"] == len(tok.encode(text).ids)
        assert r["choices"][0]["text"] == tok.decode(r["choices"][0]["token_ids"])
        chat = httpx.post(f"{url}/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "the quick brown fox"}], "max_tokens": 4,
            "temperature": 0, "carrier": "f32"}, timeout=120).json()
        rendered = "user: the quick brown fox\nassistant:"
        assert chat["usage"]["prompt_tokens"] == len(tok.encode(rendered).ids)
        assert isinstance(chat["choices"][0]["message"]["content"], str)


def test_cluster_executes_the_files_quantized_blocks(tmp_path):
    """Q4_K/Q6_K stacks kept as blocks on the holders: the cluster's greedy ids equal ours in
    process on the same file's (dequantized) weights."""
    import numpy as np

    from moe.backbone.decode import Generator, Sampling
    from prepare.gguf import GgufCheckpoint
    from tests.conftest import QWEN
    from tests.test_gguf import in_process

    path = write_fixture_gguf(QWEN, tmp_path / "qwen3_q4km.gguf", expert_quant={"gate": "Q4_K", "up": "Q4_K",
                                                                                "down": "Q6_K"})
    bb, mlp, ref = in_process(GgufCheckpoint(path), QWEN)
    prompt = ref["input_ids"][0].tolist()
    want = Generator(bb, mlp, Sampling(max_new_tokens=8)).run([np.asarray(prompt)])[0].output
    with running_cluster(tmp_path, [path], holders=2) as (info, _):
        r = httpx.post(f"{info['url']}/v1/completions", json={
            "model": info["model_id"], "prompt": prompt, "max_tokens": 8, "temperature": 0, "carrier": "f32"},
            timeout=120).json()
        assert r["choices"][0]["token_ids"] == want
