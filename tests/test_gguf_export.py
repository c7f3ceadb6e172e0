"""``export_gguf`` (issue 23): a published model written as GGUF reads back as the same model —
whole-model greedy ids of the transformers reference per family, the same expert and gate
blobs when published again (quantized blocks included), the vocabulary and template."""
from __future__ import annotations

import json

import numpy as np
import pytest
from django.core.management import call_command

from moe.backbone.decode import Generator, Sampling
from prepare.backbone import publish_backbone
from prepare.gguf import GgufCheckpoint
from prepare.services import publish_checkpoint, publish_dense
from registry.models import ExpertBlob, GateBlob
from tests.conftest import DEEPSEEK, MIXTRAL, QWEN, QWEN2
from tests.gguf_util import train_tokenizer, write_fixture_gguf
from tests.test_gguf import in_process

pytestmark = pytest.mark.django_db(transaction=True)


def _hashes(model_id):
    return ({(r.layer, r.expert): r.blob_hash for r in ExpertBlob.objects.filter(model_id=model_id)},
            {r.layer: r.blob_hash for r in GateBlob.objects.filter(model_id=model_id)})


def _export(model_id, out, capsys):
    call_command("export_gguf", "--model-id", model_id, "--out", str(out), "--json")
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("src", [QWEN, QWEN2, MIXTRAL, DEEPSEEK], ids=["qwen3_moe", "qwen2_moe", "mixtral",
                                                                       "deepseek_v3"])
def test_export_round_trip_per_family(tmp_path, capsys, src):
    publish_checkpoint(src, "m")
    publish_backbone(src, "m")
    publish_dense(src, "m", 2)
    report = _export("m", tmp_path / "m.gguf", capsys)
    assert report["notes"] == {}
    g = GgufCheckpoint(tmp_path / "m.gguf")
    bb, mlp, ref = in_process(g, src)
    prompt = ref["input_ids"][0]
    seq = Generator(bb, mlp, Sampling(max_new_tokens=8)).run([prompt], keep_logits=True)[0]
    assert list(prompt) + seq.output == ref["greedy_ids"][0].tolist()
    assert np.abs(seq.prompt_logits - ref["logits"]).max() / np.abs(ref["logits"]).max() <= 1e-4
    publish_checkpoint(tmp_path / "m.gguf", "again")
    assert _hashes("again") == _hashes("m")


def test_quantized_model_exports_its_blocks(tmp_path, capsys):
    publish_checkpoint(QWEN, "q", quant="q4_k_m")
    publish_backbone(QWEN, "q")
    _export("q", tmp_path / "q.gguf", capsys)
    g = GgufCheckpoint(tmp_path / "q.gguf")
    assert [g.tensors[f"blk.0.ffn_{p}_exps.weight"].type for p in ("gate", "up", "down")] == [12, 12, 14]
    publish_checkpoint(tmp_path / "q.gguf", "q-again")
    assert _hashes("q-again") == _hashes("q")


def test_export_carries_the_tokenizer_and_template(tmp_path, capsys):
    tok = train_tokenizer()
    path = write_fixture_gguf(QWEN2, tmp_path / "t.gguf", tokenizer=tok, chat_template="{{ messages[0].content }}")
    publish_checkpoint(path, "t")
    publish_backbone(path, "t")
    _export("t", tmp_path / "out.gguf", capsys)
    g = GgufCheckpoint(tmp_path / "out.gguf")
    from tokenizers import Tokenizer

    back = Tokenizer.from_str(g.tokenizer_json())
    text = "Hello, world! the experts hold the router."
    assert back.encode(text).ids == tok.encode(text).ids
    assert g.chat_template()["template"] == "{{ messages[0].content }}"
    assert g.vocab_metadata() == GgufCheckpoint(path).vocab_metadata()  # the file's keys, verbatim


def test_export_refuses_an_unpublished_model(tmp_path):
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="no published model 'nope'"):
        call_command("export_gguf", "--model-id", "nope", "--out", str(tmp_path / "x.gguf"))
    publish_checkpoint(QWEN, "nobb")
    with pytest.raises(CommandError, match="has no published backbone"):
        call_command("export_gguf", "--model-id", "nobb", "--out", str(tmp_path / "x.gguf"))
