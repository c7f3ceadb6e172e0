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
from tests.ckpt_util import make_checkpoint
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
    ck = tmp_path / "experts-only"
    make_checkpoint(ck, "qwen3_moe", experts=4, layers=1)
    publish_checkpoint(ck, "nobb")
    with pytest.raises(CommandError, match="has no published backbone: run `python manage.py prepare_experts"):
        call_command("export_gguf", "--model-id", "nobb", "--out", str(tmp_path / "x.gguf"))


def test_export_names_a_bad_out_and_leaves_no_partial_file(tmp_path):
    """--out that is a directory or in a missing directory is refused naming the flag before any
    work; an export that fails midway (an expert never published) leaves nothing at --out."""
    from django.core.management.base import CommandError

    publish_checkpoint(QWEN, "m")
    publish_backbone(QWEN, "m")
    with pytest.raises(CommandError, match="^--out: .* is a directory"):
        call_command("export_gguf", "--model-id", "m", "--out", str(tmp_path))
    with pytest.raises(CommandError, match="^--out: directory .* does not exist"):
        call_command("export_gguf", "--model-id", "m", "--out", str(tmp_path / "no" / "x.gguf"))
    with pytest.raises(CommandError, match="^--out is empty"):
        call_command("export_gguf", "--model-id", "m", "--out", "")
    ExpertBlob.objects.filter(model_id="m", layer=1, expert=3).delete()
    with pytest.raises(CommandError, match="layer 1 expert 3 was never published"):
        call_command("export_gguf", "--model-id", "m", "--out", str(tmp_path / "x.gguf"))
    assert list(tmp_path.iterdir()) == []



def _synthetic_export(layers: int):
    """An ``ExportModel`` of the qwen3 fixture's shape with ``layers`` MoE layers whose f32
    experts are generated when asked for (the backbone's layer tensors are shared, not copied)."""
    from moe.ffn import ExpertWeights
    from moe.gating import Gate
    from prepare.checkpoint import Checkpoint
    from prepare.gguf_export import ExportModel

    c = Checkpoint(QWEN)
    cfg = {**c.config, "num_hidden_layers": layers}
    backbone = {}
    for n in c.names():
        if ".mlp." in n:
            continue
        if n.startswith("model.layers.0."):
            for layer in range(layers):
                backbone[n.replace("model.layers.0.", f"model.layers.{layer}.")] = ("F32", c.read(n))
        elif not n.startswith("model.layers."):
            backbone[n] = ("F32", c.read(n))
    E, H, F = cfg["num_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    gates = {layer: Gate("qwen3_moe", np.ones((E, H), np.float32), top_k=cfg["num_experts_per_tok"], num_experts=E)
             for layer in range(layers)}

    def expert(layer, e):
        rng = np.random.default_rng(layer * 1000 + e)
        return ExpertWeights(*(rng.standard_normal(s, dtype=np.float32) for s in ((F, H), (F, H), (H, F)))), "F32"

    return ExportModel(config=cfg, backbone=backbone, gates=gates, expert=expert), E * 3 * F * H * 4


def test_export_streams_tensor_by_tensor(tmp_path):
    """The writer's peak memory is about one layer's experts, whatever the model's size: 2 and 8
    MoE layers (25 and 100 MB of experts) peak alike, far below the file (tracemalloc; numpy's
    buffers are traced)."""
    import tracemalloc

    from prepare.gguf_export import write_gguf

    peaks = {}
    for layers in (2, 8):
        model, layer_bytes = _synthetic_export(layers)
        tracemalloc.start()
        report = write_gguf(model, tmp_path / f"s{layers}.gguf")
        peaks[layers] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert report["tensors"] == 3 + layers * 12
        assert GgufCheckpoint(tmp_path / f"s{layers}.gguf").tensors["blk.%d.ffn_down_exps.weight" % (layers - 1)].shape \
            == (16, 256, 256)
    assert peaks[8] < 1.25 * peaks[2], peaks
    assert peaks[8] < 3 * layer_bytes < (tmp_path / "s8.gguf").stat().st_size / 2, (peaks, layer_bytes)


def test_byte_level_tokenizer_without_merges_keeps_an_empty_merges_array(tmp_path):
    """llama.cpp refuses a gpt2 vocabulary without ``tokenizer.ggml.merges``; gguf-py drops an
    empty array, so the exporter's writer writes it empty (n = 0) and the reader gets []."""
    import gguf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from prepare.gguf import parse_gguf_header
    from prepare.gguf_export import _writer, add_tokenizer

    tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    path = tmp_path / "v.gguf"
    w = _writer(gguf)(str(path), "qwen3moe")
    assert add_tokenizer(w, tok.to_str(), 2) is None
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = path.read_bytes()
    meta, _ = parse_gguf_header(lambda o, n: data[o:o + n], len(data), str(path))
    assert meta["tokenizer.ggml.merges"] == [] and meta["tokenizer.ggml.tokens"] == ["a", "b"]
