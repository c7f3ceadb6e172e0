"""GGUF import (issue 23): the fixtures written as GGUF by gguf-py's GGUFWriter (llama.cpp's
converter conventions) read back tensor for tensor, run whole-model in process to the
transformers reference, published as the same blobs as from safetensors, quantized expert
blocks kept byte for byte, other types decoded and reported, and bad files refused naming
the key."""
from __future__ import annotations

import struct

import numpy as np
import pytest
from safetensors.numpy import load_file

from moe.backbone import build_backbone
from moe.backbone.decode import Generator, Sampling
from moe.codec import CheckpointError
from moe.config import ConfigError, ModelConfig
from moe.ffn import ExpertWeights, expert_forward, moe_layer_forward
from moe.quant import QuantizedMatrix, quantize
from prepare.backbone import backbone_groups
from prepare.checkpoint import Checkpoint
from prepare.gguf import GgufCheckpoint, parse_gguf_header
from prepare.layouts import load_expert, load_gate, spec_from_config
from prepare.remote import open_checkpoint
from tests.conftest import DEEPSEEK, MIXTRAL, QWEN, QWEN2
from tests.gguf_util import write_fixture_gguf

FAMILIES = {"qwen3_moe": QWEN, "qwen2_moe": QWEN2, "mixtral": MIXTRAL, "deepseek_v3": DEEPSEEK}


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    for fam, src in FAMILIES.items():
        write_fixture_gguf(src, d / f"{fam}.gguf")
    write_fixture_gguf(DEEPSEEK, d / "deepseek_v3_kvb.gguf", kv_b_split=False)
    write_fixture_gguf(MIXTRAL, d / "mixtral_old.gguf", stacked=False)
    return d


def in_process(c, ref_dir):
    """(backbone, MLP callback, generation reference) of checkpoint-like ``c``."""
    spec = spec_from_config(c.config)
    w = {n: c.read(n) for names in backbone_groups(c).values() for n in names}
    gates, experts, dense = {}, {}, {}

    def mlp(layer, x):
        if spec.is_moe_layer(layer):
            if layer not in gates:
                gates[layer] = load_gate(c, spec, layer)
            return moe_layer_forward(gates[layer], lambda e: experts.setdefault(
                (layer, e), load_expert(c, spec, layer, e)), x)[0]
        if layer not in dense:
            dense[layer] = ExpertWeights(*(c.read(f"model.layers.{layer}.mlp.{p}.weight")
                                           for p in ("gate_proj", "up_proj", "down_proj")))
        return expert_forward(dense[layer], x)

    return build_backbone(c.config, w), mlp, load_file(str(ref_dir / "generation_reference.safetensors"))


@pytest.mark.parametrize("fam", [*FAMILIES, "deepseek_v3_kvb", "mixtral_old"])
def test_every_tensor_reads_back_exactly(gguf_dir, fam):
    src = FAMILIES[fam.removesuffix("_kvb").removesuffix("_old")]
    g, h = open_checkpoint(gguf_dir / f"{fam}.gguf"), Checkpoint(src)
    assert isinstance(g, GgufCheckpoint)
    assert g.names() == h.names()
    for name in h.names():
        a, b = h.read(name), g.read(name)
        assert a.shape == b.shape and np.array_equal(a, b), name
        assert g.info(name).shape == h.info(name).shape


@pytest.mark.parametrize("fam", list(FAMILIES))
def test_model_config_from_gguf_equals_config_json(gguf_dir, fam):
    g = open_checkpoint(gguf_dir / f"{fam}.gguf")
    a = ModelConfig.from_hf(Checkpoint(FAMILIES[fam]).config)
    b = ModelConfig.from_gguf(g.metadata, vocab_size=g.tensors["token_embd.weight"].shape[0])
    skip = {"head_dim"} if fam == "deepseek_v3" else set()  # MLA: head_dim is unused (qk_* sizes are)
    for f in a.__dataclass_fields__:
        if f not in skip and f not in ("architecture", "quantization_config"):
            assert getattr(a, f) == getattr(b, f), f
    assert spec_from_config(g.config) == spec_from_config(Checkpoint(FAMILIES[fam]).config)


@pytest.mark.parametrize("fam", [*FAMILIES, "deepseek_v3_kvb"])
def test_whole_model_from_gguf_matches_transformers(gguf_dir, fam):
    bb, mlp, ref = in_process(open_checkpoint(gguf_dir / f"{fam}.gguf"), FAMILIES[fam.removesuffix("_kvb")])
    prompt = ref["input_ids"][0]
    seq = Generator(bb, mlp, Sampling(max_new_tokens=8)).run([prompt], keep_logits=True)[0]
    err = np.abs(seq.prompt_logits - ref["logits"]).max() / np.abs(ref["logits"]).max()
    assert err <= 1e-4
    assert list(prompt) + seq.output == ref["greedy_ids"][0].tolist()


def test_quantized_expert_blocks_are_the_files_bytes(tmp_path):
    path = write_fixture_gguf(QWEN, tmp_path / "q.gguf", expert_quant={"gate": "Q4_K", "up": "Q8_0",
                                                                        "down": "Q6_K"})
    g, h = open_checkpoint(path), Checkpoint(QWEN)
    spec = spec_from_config(g.config)
    for e in (0, 15):
        names = spec.expert_tensor_names(1, e)
        w, notes = g.load_expert_blocks(names, "x")
        assert notes == {}
        assert w.quant_kinds() == {"gate_proj": "q4_k", "up_proj": "q8_0", "down_proj": "q6_k"}
        for proj, q in (("gate_proj", "q4_k"), ("up_proj", "q8_0"), ("down_proj", "q6_k")):
            m = getattr(w, proj)
            assert isinstance(m, QuantizedMatrix)
            assert np.array_equal(m.blocks.reshape(-1), quantize(h.read(names[proj]), q).reshape(-1))
            # the slab is exactly the file's bytes for expert e
            t = g.tensors[f"blk.1.ffn_{proj.split('_')[0]}_exps.weight"]
            size = t.nbytes // t.shape[0]
            assert m.blocks.tobytes() == path.read_bytes()[t.offset + e * size:t.offset + (e + 1) * size]


def test_types_without_a_kernel_are_decoded_and_reported(tmp_path):
    path = write_fixture_gguf(QWEN2, tmp_path / "q5.gguf", expert_quant={"up": "Q5_0"})
    g = open_checkpoint(path)
    spec = spec_from_config(g.config)
    w, notes = g.load_expert_blocks(spec.expert_tensor_names(0, 2), "layer 0 expert 2")
    assert set(notes) == {"up_proj.weight"} and "q5_0 decoded to f32" in notes["up_proj.weight"]
    assert w.quant_kinds() == {"gate_proj": "f32", "up_proj": "f32", "down_proj": "f32"}
    assert g.blob_dtype(spec.expert_tensor_names(0, 2)) == "f32"
    # the shared expert (not in the stack) keeps bf16
    assert g.blob_dtype(spec.expert_tensor_names(0, spec.shared_slot)) == "bf16"


def _minimal_gguf(path, arch="llama", expert_count=None, version=3, magic=b"GGUF"):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_head_count(2)
    if expert_count is not None:
        w.add_expert_count(expert_count)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = bytearray(path.read_bytes())
    data[0:4] = magic
    data[4:8] = struct.pack("<I", version)
    path.write_bytes(bytes(data))
    return path


def test_bad_files_are_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="general.architecture='gpt-oss' is not supported: there is no gpt-oss "
                                          "backbone"):
        ModelConfig.from_gguf({"general.architecture": "gpt-oss"})
    with pytest.raises(CheckpointError, match="general.architecture='gemma3' is not supported"):
        GgufCheckpoint(_minimal_gguf(tmp_path / "a.gguf", arch="gemma3"))
    with pytest.raises(CheckpointError, match="llama.expert_count is absent or 0"):
        GgufCheckpoint(_minimal_gguf(tmp_path / "b.gguf", arch="llama"))
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        GgufCheckpoint(_minimal_gguf(tmp_path / "c.gguf", magic=b"GGML"))
    with pytest.raises(CheckpointError, match="GGUF version 1 is not supported"):
        GgufCheckpoint(_minimal_gguf(tmp_path / "d.gguf", version=1))
    full = (tmp_path / "a.gguf").read_bytes()
    (tmp_path / "e.gguf").write_bytes(full[:60])
    with pytest.raises(CheckpointError, match="runs past the end"):
        GgufCheckpoint(tmp_path / "e.gguf")
    with pytest.raises(ConfigError) as exc:
        ModelConfig.from_gguf({"general.architecture": "deepseek2", "deepseek2.expert_gating_func": 1,
                               "deepseek2.expert_count": 8})
    assert exc.value.key == "deepseek2.expert_gating_func"
    with pytest.raises(ConfigError) as exc:
        ModelConfig.from_gguf({"general.architecture": "qwen3moe", "qwen3moe.attention.head_count": [4, 4]})
    assert exc.value.key == "qwen3moe.attention.head_count"


def test_header_parser_reads_only_ranges(tmp_path, gguf_dir):
    path = gguf_dir / "qwen3_moe.gguf"
    data = path.read_bytes()
    reads = []

    def read_range(off, n):
        reads.append((off, n))
        return data[off:off + n]

    meta, tensors = parse_gguf_header(read_range, len(data), str(path))
    assert meta["general.architecture"] == "qwen3moe" and "blk.0.ffn_down_exps.weight" in tensors
    assert sum(n for _, n in reads) <= 2 * (1 << 20)  # the header, never the tensor data beyond a chunk
