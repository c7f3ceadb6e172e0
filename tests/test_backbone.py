"""Backbone forward per family against transformers' whole-model reference, KV-cache decode,
sampling, and backbone blobs (publish by ranged reads → load)."""
from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file

from moe.backbone import BackboneError, KVCache, build_backbone
from moe.backbone.common import Rotary
from moe.config import ModelConfig
from moe.backbone.decode import Generator, Sampling, next_token
from moe.backbone.weights import load_backbone
from moe.codec import loads_safetensors
from moe.ffn import ExpertWeights, expert_forward, moe_layer_forward
from prepare.backbone import backbone_groups, group_blob
from prepare.checkpoint import Checkpoint
from prepare.layouts import load_expert, load_gate, spec_from_config
from tests.conftest import DEEPSEEK, MIXTRAL, QWEN, QWEN2, QWEN2_TRAINED


def local_model(path):
    """(backbone straight from the checkpoint, in-process MLP callback, reference tensors)."""
    c = Checkpoint(path)
    spec = spec_from_config(c.config)
    groups = backbone_groups(c)
    w = {n: c.read(n) for names in groups.values() for n in names}
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

    return build_backbone(c.config, w), mlp, load_file(str(path / "generation_reference.safetensors"))


@pytest.fixture(scope="module", params=[QWEN, DEEPSEEK, QWEN2, MIXTRAL, QWEN2_TRAINED],
                ids=["qwen3_moe", "deepseek_v3", "qwen2_moe", "mixtral", "qwen2_moe_trained"])
def model(request):
    return local_model(request.param)


def test_prompt_logits_and_greedy_match_transformers(model):
    bb, mlp, ref = model
    prompt = ref["input_ids"][0]
    seqs = Generator(bb, mlp, Sampling(max_new_tokens=8)).run([prompt], keep_logits=True)
    err = np.abs(seqs[0].prompt_logits - ref["logits"]).max() / np.abs(ref["logits"]).max()
    assert err <= 1e-4
    assert list(prompt) + seqs[0].output == ref["greedy_ids"][0].tolist()
    assert seqs[0].finish_reason == "length"


def test_batched_decode_equals_one_by_one(model):
    bb, mlp, ref = model
    prompt = ref["input_ids"][0]
    prompts = [prompt, prompt[:9], prompt[3:]]
    together = Generator(bb, mlp, Sampling(max_new_tokens=5)).run(prompts)
    alone = [Generator(bb, mlp, Sampling(max_new_tokens=5)).run([p])[0] for p in prompts]
    assert [s.output for s in together] == [s.output for s in alone]
    calls = []
    Generator(bb, lambda layer, x: calls.append(x.shape[0]) or mlp(layer, x), Sampling(max_new_tokens=3)).run(prompts)
    # one MLP call per layer per step carries every sequence's rows
    assert calls[:bb.num_layers] == [sum(p.size for p in prompts)] * bb.num_layers
    assert calls[bb.num_layers:] == [3] * (2 * bb.num_layers)


def test_sampling_is_seeded_and_stop_ends(model):
    bb, mlp, ref = model
    prompt = ref["input_ids"][0]
    s = Sampling(max_new_tokens=6, temperature=0.9, top_p=0.9, top_k=20, seed=7)
    a = Generator(bb, mlp, s).run([prompt])[0].output
    b = Generator(bb, mlp, s).run([prompt])[0].output
    assert a == b and len(a) == 6
    greedy = ref["greedy_ids"][0][16:].tolist()
    stop = greedy[1]
    stopped = Generator(bb, mlp, Sampling(max_new_tokens=8, stop=(stop,))).run([prompt])[0]
    assert stopped.output == greedy[:greedy.index(stop) + 1] and stopped.finish_reason == "stop"


def test_cache_handoff_roundtrip(model):
    bb, mlp, ref = model
    prompt = ref["input_ids"][0]
    g = Generator(bb, mlp, Sampling(max_new_tokens=8))
    seqs = g.prefill([prompt])
    moved = KVCache.from_bytes(seqs[0].cache.to_bytes())
    assert moved.length == 16 and moved.nbytes == seqs[0].cache.nbytes
    seqs[0].cache = moved
    g.resume(seqs)
    assert list(prompt) + seqs[0].output == ref["greedy_ids"][0].tolist()


def test_next_token_filters():
    logits = np.array([0.0, 5.0, 4.9, -3.0], dtype=np.float32)
    rng = np.random.default_rng(0)
    assert next_token(logits, Sampling(), rng) == 1
    draws = {next_token(logits, Sampling(temperature=1.0, top_k=2), rng) for _ in range(200)}
    assert draws == {1, 2}
    draws = {next_token(logits, Sampling(temperature=1.0, top_p=0.3), rng) for _ in range(50)}
    assert draws == {1}


@pytest.mark.parametrize("field,kwargs", [("temperature", {"temperature": -1.0}), ("top_p", {"top_p": 0.0}),
                                          ("top_k", {"top_k": -2}), ("max_new_tokens", {"max_new_tokens": 0}),
                                          ("seed", {"seed": -1}), ("stop", {"stop": (-1,)})])
def test_bad_sampling_names_field(field, kwargs):
    with pytest.raises(BackboneError) as e:
        Sampling(**kwargs)
    assert e.value.field == field


def test_context_and_vocab_errors(model):
    bb, mlp, _ = model
    g = Generator(bb, mlp, Sampling(max_new_tokens=2))
    with pytest.raises(BackboneError, match="context"):
        g.prefill([np.zeros(bb.max_position, dtype=np.int64)])
    with pytest.raises(BackboneError, match="token ids"):
        g.prefill([np.array([bb.vocab_size])])


def test_yarn_rotary_follows_reference_formula():
    cfg = {"rope_theta": 10000.0, "rope_scaling": {"type": "yarn", "factor": 40.0, "mscale": 1.0,
                                                   "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                                   "beta_fast": 32, "beta_slow": 1}}
    r = Rotary(64, ModelConfig.from_hf(cfg).rope, 163840)
    base = 1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64)
    # high frequencies extrapolate (unchanged), low frequencies interpolate (divided by factor)
    assert np.isclose(r.inv_freq[0], base[0]) and np.isclose(r.inv_freq[-1], base[-1] / 40.0)
    assert r.attention_factor == pytest.approx(1.0)  # mscale == mscale_all_dim


def test_backbone_blobs_roundtrip():
    c = Checkpoint(DEEPSEEK)
    groups = backbone_groups(c)
    assert set(groups) == {"embed", "head", "layer.0", "layer.1", "layer.2"}
    assert not any(".mlp." in n for names in groups.values() for n in names)
    blobs = {g: group_blob(c, names) for g, names in groups.items()}
    tensors, _ = loads_safetensors(blobs["embed"])
    assert tensors["model.embed_tokens.weight"].dtype == "BF16"  # source dtype kept
    store = {str(i): b for i, b in enumerate(blobs.values())}
    bb = load_backbone(c.config, {"blobs": {g: str(i) for i, g in enumerate(blobs)}}, store.__getitem__)
    direct, _, _ = local_model(DEEPSEEK)
    for name, arr in direct.w.items():
        assert np.array_equal(bb.w[name], arr)


def test_unknown_family():
    with pytest.raises(BackboneError, match="no backbone"):
        build_backbone({"model_type": "llama"}, {})


def test_kv_cache_appends_in_place_and_stays_within_its_reservation():
    """KVCache writes each appended row into a buffer with spare rows (no copy of the whole
    cache per step), returns exactly the rows appended so far (same values as concatenating),
    and never allocates more rows than ``max_rows`` (the scheduler's reservation)."""
    rng = np.random.default_rng(7)
    rows = [rng.standard_normal((n, 2, 4)).astype(np.float32) for n in (5, 1, 1, 3, 1, 1, 1)]
    capped, free = KVCache(1, max_rows=13), KVCache(1)
    for i, r in enumerate(rows):
        want = np.concatenate(rows[:i + 1])
        for c in (capped, free):
            got = c.append(0, k=r)["k"]
            assert got.flags.c_contiguous and got.dtype == np.float32
            np.testing.assert_array_equal(got, want)
        assert capped._buffers[0]["k"].shape[0] <= 13
    before = free.layers[0]["k"]
    free.append(0, k=rows[1])
    assert before.shape[0] == 13  # a view handed out earlier does not grow
    with pytest.raises(ValueError, match="rows of shape"):
        free.append(0, k=np.zeros((1, 3, 4), np.float32))
