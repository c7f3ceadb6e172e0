"""Publishing from a GGUF file (issue 23): the same expert, gate and backbone blobs as from the
safetensors checkpoint it was written from; quantized stacks kept as the file's blocks; the
vocabulary and chat template published with the backbone; HTTP Range reads of a GGUF URL."""
from __future__ import annotations

import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from django.conf import settings
from django.core.management import call_command
from tokenizers import Tokenizer

from moe.backbone.weights import BACKBONE_KEY
from moe.blobs import BlobStore
from moe.ffn import ExpertWeights
from prepare.backbone import publish_backbone
from prepare.checkpoint import Checkpoint
from prepare.layouts import spec_from_config
from prepare.services import publish_checkpoint
from registry.models import ExpertBlob, GateBlob, MoeModel
from tests.conftest import DEEPSEEK, MIXTRAL, QWEN, QWEN2
from tests.gguf_util import train_tokenizer, write_fixture_gguf

pytestmark = pytest.mark.django_db(transaction=True)


def _hashes(model_id):
    experts = dict(((r.layer, r.expert), (r.blob_hash, r.quant))
                   for r in ExpertBlob.objects.filter(model_id=model_id))
    gates = dict((r.layer, r.blob_hash) for r in GateBlob.objects.filter(model_id=model_id))
    return experts, gates


@pytest.mark.parametrize("src", [QWEN, QWEN2, MIXTRAL, DEEPSEEK], ids=["qwen3_moe", "qwen2_moe", "mixtral",
                                                                       "deepseek_v3"])
def test_gguf_publishes_the_same_blobs_as_safetensors(tmp_path, src):
    path = write_fixture_gguf(src, tmp_path / "m.gguf")
    publish_checkpoint(src, "st")
    publish_checkpoint(path, "gg")
    assert _hashes("gg") == _hashes("st") and _hashes("st")[0]
    st, gg = MoeModel.objects.get(model_id="st"), MoeModel.objects.get(model_id="gg")
    assert (gg.family, gg.num_experts, gg.top_k, gg.hidden_size, gg.expert_d_ff, gg.moe_layers) == \
           (st.family, st.num_experts, st.top_k, st.hidden_size, st.expert_d_ff, st.moe_layers)
    a, b = publish_backbone(src, "st"), publish_backbone(path, "gg")
    store = BlobStore(settings.TENZRO["BLOB_DIR"])
    from moe.codec import loads_safetensors

    # the same values; norms are F32 in a GGUF (as llama.cpp's converter writes them), rearranged
    # tensors (llama Q/K, DeepSeek kv_b) come back as f32
    for group in a["blobs"]:
        ta, _ = loads_safetensors(store.get(a["blobs"][group]), group)
        tb, _ = loads_safetensors(store.get(b["blobs"][group]), group)
        assert set(ta) == set(tb)
        for n in ta:
            assert np.array_equal(ta[n].to_f32(n, "a"), tb[n].to_f32(n, "b")), n
    assert b["tokenizer"] is None and b["chat_template"] is None


def test_quantized_gguf_keeps_the_blocks_and_matches_a_quantized_publish(tmp_path):
    # the file's experts are what --quant q4_k_m makes of the safetensors: same blobs
    path = write_fixture_gguf(QWEN, tmp_path / "q.gguf", expert_quant={"gate": "Q4_K", "up": "Q4_K",
                                                                        "down": "Q6_K"})
    publish_checkpoint(QWEN, "st-q", quant="q4_k_m")
    publish_checkpoint(path, "gg-q")
    assert _hashes("gg-q") == _hashes("st-q")
    assert {q for _, q in _hashes("gg-q")[0].values()} == {"q4_k/q4_k/q6_k"}


def test_undecodable_types_are_published_decoded_and_reported(tmp_path, capsys):
    path = write_fixture_gguf(QWEN2, tmp_path / "q5.gguf", expert_quant={"up": "Q5_0"})
    call_command("prepare_experts", "--checkpoint", str(path), "--model-id", "q5", "--layers", "0",
                 "--experts", "0,8", "--json")
    from prepare.models import PrepareItem

    items = {i.expert: i for i in PrepareItem.objects.filter(job__model_id="q5", expert__isnull=False)}
    assert "q5_0 decoded to f32" in items[0].fallbacks["up_proj.weight"]
    assert items[8].fallbacks == {}  # the shared expert is not in the stack: bf16 as written
    store = BlobStore(settings.TENZRO["BLOB_DIR"])
    w = ExpertWeights.from_blob(store.get(items[0].blob_hash))
    spec = spec_from_config(Checkpoint(QWEN2).config)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gdq, quantize as gq

    up = Checkpoint(QWEN2).read(spec.expert_tensor_names(0, 0)["up_proj"])
    assert np.array_equal(w.up_proj, gdq(gq(up, GGMLQuantizationType.Q5_0), GGMLQuantizationType.Q5_0))


def test_tokenizer_and_chat_template_come_from_the_file(tmp_path):
    tok = train_tokenizer()
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    path = write_fixture_gguf(QWEN2, tmp_path / "t.gguf", tokenizer=tok, chat_template=template)
    publish_checkpoint(path, "tok")
    rec = publish_backbone(path, "tok")
    assert MoeModel.objects.get(model_id="tok").config[BACKBONE_KEY]["tokenizer"] == rec["tokenizer"]
    back = Tokenizer.from_str(BlobStore(settings.TENZRO["BLOB_DIR"]).get(rec["tokenizer"]).decode())
    text = "Hello, world! the experts hold the router."
    assert back.encode(text).ids == tok.encode(text).ids and back.decode(back.encode(text).ids) == text
    assert rec["chat_template"] == {"template": template, "special_tokens": {"eos_token": "<|endoftext|>"}}


class _RangeHandler(SimpleHTTPRequestHandler):
    """Static files with single-range ``Range`` support (206), as a CDN serves a GGUF."""

    def log_message(self, *a):
        pass

    def send_head(self):
        rng = self.headers.get("Range")
        path = self.translate_path(self.path)
        if not rng:
            return super().send_head()
        data = open(path, "rb").read()
        lo, hi = (int(x) for x in rng.removeprefix("bytes=").split("-"))
        hi = min(hi, len(data) - 1)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {lo}-{hi}/{len(data)}")
        self.send_header("Content-Length", str(hi - lo + 1))
        self.send_header("ETag", '"v1"')
        self.end_headers()
        import io

        return io.BytesIO(data[lo:hi + 1])


def test_gguf_over_http_range_reads(tmp_path):
    write_fixture_gguf(QWEN, tmp_path / "remote.gguf")
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_RangeHandler, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/remote.gguf"
        publish_checkpoint(url, "remote")
        publish_checkpoint(QWEN, "local")
        assert _hashes("remote") == _hashes("local")
        publish_checkpoint(tmp_path / "remote.gguf", "local-gguf")
        assert publish_backbone(url, "remote")["blobs"] == publish_backbone(tmp_path / "remote.gguf",
                                                                            "local-gguf")["blobs"]
    finally:
        server.shutdown()
