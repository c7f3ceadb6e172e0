"""Tests of the seed MoE catalog (``registry.catalog``): data, invariants, JSON, lookups.

Pure Python; uses the shipped tiny checkpoints' ``config.json`` files for
``ModelShape.from_hf_config``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
from pathlib import Path

import pytest

from registry import catalog
from registry.catalog import (
    CATALOG,
    NULLABLE_FIELDS,
    ROUTING_KEYS,
    FrozenDict,
    ModelShape,
    UnknownModelError,
    UnknownShapeError,
    all_models,
    get,
    register_local,
    shape_json,
    unregister_local,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures"

# (model_id, experts, top_k, shared) exactly as the reference catalog (§12) lists them.
REFERENCE_TABLE = [
    ("qwen3-30b-a3b", 128, 8, 0),
    ("qwen3-coder-30b-a3b", 128, 8, 0),
    ("qwen3.5-35b-a3b", 128, 8, 0),
    ("qwen3.5-122b-a10b", 128, 8, 0),
    ("qwen3.5-397b-a17b", 128, 8, 0),
    ("qwen3.5-35b-a3b-mtp", 128, 8, 0),
    ("qwen3.5-122b-a10b-mtp", 128, 8, 0),
    ("qwen3.5-397b-a17b-mtp", 128, 8, 0),
    ("qwen3.6-35b-a3b", 128, 8, 0),
    ("qwen3.6-35b-a3b-mtp", 128, 8, 0),
    ("gemma4-26b-a4b", 128, 4, 1),
    ("gemma4-26b-a4b-qat", 128, 4, 1),
    ("gemma4-26b-a4b-mtp-draft", 128, 4, 1),
    ("diffusiongemma-26b-a4b", 128, 4, 1),
    ("kimi-k2-instruct", 384, 8, 1),
    ("kimi-k2.5", 384, 8, 1),
    ("kimi-k2.6", 384, 8, 1),
    ("kimi-k2.7-code", 384, 8, 1),
    ("kimi-k3", 896, 16, 2),
    ("minimax-m1-40b", 32, 2, 0),
    ("minimax-m3", 32, 2, 0),
    ("deepseek-v3-0324", 256, 8, 1),
    ("deepseek-v4-flash", 256, 8, 1),
    ("deepseek-v4-pro", 512, 8, 1),
    ("glm-5", 160, 8, 1),
    ("glm-5.1", 160, 8, 1),
    ("glm-5.2", 160, 8, 1),
    ("nemotron-nano-30b-a3b", 16, 4, 0),
    ("gpt-oss-120b", 128, 4, 0),
]
SEED_IDS = [row[0] for row in REFERENCE_TABLE]

SHAPE_KEYS = {"model_id", "is_moe", "moe", "architecture", "unknown"}
MOE_KEYS = {
    "num_experts",
    "experts_per_token",
    "shared_experts",
    "params_per_expert_x10",
    "params_per_expert",
    "hidden_size",
    "expert_d_ff",
    "layers",
    "first_dense_layers",
    "moe_layers_count",
    "routing",
}


def _load_config(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


@pytest.fixture
def local_cleanup():
    """Remove every model a test registered locally."""
    before = set(CATALOG)
    yield
    for model_id in set(CATALOG) - before:
        unregister_local(model_id)


# --------------------------------------------------------------------------- contents


def test_every_seed_model_is_present_in_catalog_order():
    seed = [m.model_id for m in all_models() if m.model_id in set(SEED_IDS)]
    assert sorted(seed) == sorted(SEED_IDS)
    assert len(seed) == len(SEED_IDS)
    assert [m.model_id for m in all_models()][: len(SEED_IDS)] == [
        i for i in CATALOG if i in set(SEED_IDS)
    ]


def test_seed_file_lists_each_model_once_in_catalog_order():
    """``seed_catalog.json`` is the seed: a duplicated id would silently collapse in CATALOG."""
    data = json.loads((Path(catalog.__file__).with_name("seed_catalog.json")).read_text(encoding="utf-8"))
    ids = [m["model_id"] for m in data["models"]]
    assert sorted(ids) == sorted(SEED_IDS) and len(set(ids)) == len(ids)
    assert list(CATALOG)[: len(ids)] == ids


@pytest.mark.parametrize("model_id,experts,top_k,shared", REFERENCE_TABLE)
def test_reference_counts(model_id, experts, top_k, shared):
    shape = get(model_id)
    assert (shape.num_experts, shape.top_k, shape.n_shared_experts) == (experts, top_k, shared)
    assert "reference catalog" in shape.source


def test_fully_known_public_entries():
    qwen = get("qwen3-30b-a3b")
    assert qwen.unknown == ()
    assert (qwen.hidden_size, qwen.moe_intermediate_size, qwen.num_layers) == (2048, 768, 48)
    assert qwen.moe_layers() == list(range(48))
    assert qwen.routing["scoring"] == "softmax" and qwen.routing["norm_topk_prob"] is True
    ds = get("deepseek-v3-0324")
    assert ds.unknown == ()
    assert ds.moe_layers() == list(range(3, 61))
    r = ds.routing
    assert (r["scoring"], r["n_group"], r["topk_group"]) == ("sigmoid", 8, 4)
    assert r["routed_scaling_factor"] == 2.5 and r["correction_bias"] is True
    kimi = get("kimi-k2-instruct")
    assert kimi.routing["routed_scaling_factor"] == pytest.approx(2.827)
    assert kimi.moe_layers()[0] == 1 and len(kimi.moe_layers()) == 60
    oss = get("gpt-oss-120b")
    assert oss.routing["topk_before_softmax"] is True and oss.routing["router_bias"] is True


def test_public_disagreements_are_recorded_not_mixed_in():
    nemo = get("nemotron-nano-30b-a3b")
    assert nemo.num_experts == 16 and nemo.top_k == 4
    assert nemo.public_disagreements == {"num_experts": 128, "top_k": 6, "n_shared_experts": 1}
    assert get("gemma4-26b-a4b").public_disagreements == {"top_k": 8}
    assert get("kimi-k3").public_disagreements == {}
    for shape in all_models():
        for name, value in shape.public_disagreements.items():
            assert getattr(shape, name) != value, (shape.model_id, name)


def test_known_unknowns():
    assert "hidden_size" in get("gemma4-26b-a4b").unknown
    assert get("gemma4-26b-a4b").hidden_size is None
    k3 = get("kimi-k3")
    assert "expert_input_size" in k3.unknown and k3.params_per_expert is None
    assert "routing.routed_scaling_factor" in k3.unknown
    nemo = get("nemotron-nano-30b-a3b")
    assert not nemo.moe_layers_known
    with pytest.raises(UnknownShapeError, match="nemotron-nano-30b-a3b"):
        nemo.moe_layers()
    with pytest.raises(UnknownShapeError):
        list(nemo.expert_keys())


# --------------------------------------------------------------------------- invariants


@pytest.mark.parametrize("shape", all_models(), ids=lambda s: s.model_id)
def test_invariants(shape: ModelShape):
    assert 1 <= shape.top_k <= shape.num_experts
    assert shape.n_shared_experts >= 0
    assert shape.expert_slots == shape.num_experts + (1 if shape.n_shared_experts else 0)
    assert shape.shared_slot == (shape.num_experts if shape.n_shared_experts else None)
    assert shape.is_moe
    assert shape.source and shape.display_name and shape.family
    # unknown fields are None, and every None nullable field is unknown
    unknown = set(shape.unknown)
    assert len(unknown) == len(shape.unknown)
    for name in NULLABLE_FIELDS:
        assert (getattr(shape, name) is None) == (name in unknown), name
    assert list(shape.routing) == list(ROUTING_KEYS)
    for key in ROUTING_KEYS:
        assert (shape.routing[key] is None) == (f"routing.{key}" in unknown), key
    for name in unknown:
        if name.startswith("routing."):
            assert shape.routing[name.split(".", 1)[1]] is None
        else:
            assert getattr(shape, name) is None
    if shape.routing["scoring"] is not None:
        assert shape.routing["scoring"] in catalog.SCORING_FUNCS
    # expert keys
    if shape.moe_layers_known:
        layers = shape.moe_layers()
        assert layers == sorted(set(layers))
        if shape.num_layers is not None:
            assert all(0 <= layer < shape.num_layers for layer in layers)
        keys = list(shape.expert_keys())
        assert len(keys) == len(layers) * shape.expert_slots
        assert len(set(keys)) == len(keys)
        if shape.n_shared_experts:
            assert (layers[0], shape.num_experts) in keys
        assert (layers[0], shape.num_experts + (1 if shape.n_shared_experts else 0)) not in keys
    # params
    if shape.params_per_expert is not None:
        assert shape.params_per_expert_x10 == round(shape.params_per_expert / 1e8)
    else:
        assert shape.params_per_expert_x10 is None


def test_params_per_expert_values():
    assert get("qwen3-30b-a3b").params_per_expert == 3 * 2048 * 768
    assert get("qwen3-30b-a3b").params_per_expert_x10 == 0
    assert get("minimax-m1-40b").params_per_expert == 3 * 6144 * 9216
    assert get("minimax-m1-40b").params_per_expert_x10 == 2  # 0.17B -> 1.7 -> 2
    # ReLU² experts have no gate projection
    assert get("nemotron-nano-30b-a3b").params_per_expert == 2 * 2688 * 1856
    assert get("qwen3.5-122b-a10b").params_per_expert is None


def test_shapes_are_frozen_hashable_and_picklable():
    shape = get("deepseek-v3-0324")
    with pytest.raises(dataclasses.FrozenInstanceError):
        shape.top_k = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        shape.routing["n_group"] = 1  # type: ignore[index]
    with pytest.raises(TypeError):
        shape.routing.update({"n_group": 1})  # type: ignore[attr-defined]
    assert isinstance(shape.routing, dict) and isinstance(shape.routing, FrozenDict)
    assert hash(shape) == hash(copy.deepcopy(shape))
    clone = pickle.loads(pickle.dumps(shape))
    assert clone == shape and isinstance(clone.routing, FrozenDict)


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"top_k": 129}, "top_k"),
        ({"top_k": 0}, "top_k"),
        ({"n_shared_experts": -1}, "n_shared_experts"),
        ({"hidden_size": None}, "hidden_size is None but not listed in unknown"),
        ({"unknown": ("hidden_size",)}, "hidden_size is listed in unknown"),
        ({"unknown": ("bogus",)}, "unrecognised"),
        ({"first_dense_layers": 99}, "first_dense_layers"),
        ({"expert_ffn": "tanh"}, "expert_ffn"),
        ({"moe_layer_indices": (2, 1)}, "moe_layer_indices"),
        ({"public_disagreements": {"nope": 1}}, "public_disagreements"),
    ],
)
def test_validation_rejects_bad_shapes(changes, message):
    base = get("qwen3-30b-a3b")
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(base, **changes)


def test_validation_rejects_bad_routing():
    base = get("deepseek-v3-0324")
    with pytest.raises(ValueError, match="routing"):
        dataclasses.replace(base, routing={**base.routing, "n_group": None})
    with pytest.raises(ValueError, match="scoring"):
        dataclasses.replace(base, routing={**base.routing, "scoring": "relu"})
    with pytest.raises(ValueError, match="unrecognised keys"):
        dataclasses.replace(base, routing={**base.routing, "extra": 1})
    with pytest.raises(ValueError, match="topk_group"):
        dataclasses.replace(base, routing={**base.routing, "topk_group": 9})
    with pytest.raises(ValueError, match="divisible"):
        dataclasses.replace(base, routing={**base.routing, "n_group": 3, "topk_group": 1})


# --------------------------------------------------------------------------- from_hf_config


def test_from_hf_config_qwen3_moe_fixture():
    shape = ModelShape.from_hf_config("qwen3-moe-tiny", _load_config("qwen3_moe_tiny"))
    assert shape.family == "qwen3_moe"
    assert (shape.num_experts, shape.top_k, shape.n_shared_experts) == (16, 4, 0)
    assert (shape.hidden_size, shape.moe_intermediate_size, shape.num_layers) == (256, 256, 2)
    assert shape.moe_layers() == [0, 1]
    assert shape.expert_slots == 16
    assert len(list(shape.expert_keys())) == 2 * 16
    assert shape.routing["scoring"] == "softmax" and shape.routing["norm_topk_prob"] is True
    assert shape.routing["correction_bias"] is False
    assert shape.architecture == "Qwen3MoeForCausalLM"
    assert set(shape.unknown) == {"hf_repo", "total_params_b", "active_params_b"}
    assert shape.params_per_expert == 3 * 256 * 256


def test_from_hf_config_accepts_num_local_experts():
    ref = json.loads((FIXTURES / "qwen3_moe_tiny" / "reference.json").read_text())["config"]
    assert "num_local_experts" in ref and "num_experts" not in ref
    shape = ModelShape.from_hf_config("qwen3-moe-tiny-v5", ref)
    assert shape.num_experts == 16 and shape.moe_layers() == [0, 1]
    assert "architecture" in shape.unknown  # architectures: null in that dump


def test_from_hf_config_deepseek_v3_fixture():
    shape = ModelShape.from_hf_config("deepseek-v3-tiny", _load_config("deepseek_v3_tiny"))
    assert shape.family == "deepseek_v3"
    assert (shape.num_experts, shape.top_k, shape.n_shared_experts) == (16, 4, 1)
    assert shape.first_dense_layers == 1
    assert shape.moe_layers() == [1, 2]
    r = shape.routing
    assert (r["n_group"], r["topk_group"]) == (4, 2)
    assert r["routed_scaling_factor"] == 2.5
    assert r["scoring"] == "sigmoid" and r["correction_bias"] is True
    assert r["norm_topk_prob"] is True
    assert shape.expert_slots == 17 and shape.shared_slot == 16
    keys = list(shape.expert_keys())
    assert len(keys) == 2 * 17
    assert keys[0] == (1, 0) and keys[16] == (1, 16) and keys[-1] == (2, 16)
    assert shape.shared_d_ff == 256


def test_from_hf_config_deepseek_missing_keys_are_unknown_not_defaulted():
    cfg = _load_config("deepseek_v3_tiny")
    for key in ("routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace"):
        cfg.pop(key)
    shape = ModelShape.from_hf_config("ds-partial", cfg)
    assert shape.routing["routed_scaling_factor"] is None
    assert {"routing.routed_scaling_factor", "routing.n_group", "routing.topk_group"} <= set(
        shape.unknown
    )
    assert "first_dense_layers" in shape.unknown
    with pytest.raises(UnknownShapeError):
        shape.moe_layers()


def test_from_hf_config_other_families():
    mixtral = ModelShape.from_hf_config(
        "mix",
        {
            "model_type": "mixtral",
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 3,
        },
    )
    assert mixtral.moe_intermediate_size == 96 and mixtral.moe_layers() == [0, 1, 2]
    assert mixtral.routing["norm_topk_prob"] is True
    oss = ModelShape.from_hf_config(
        "oss",
        {
            "model_type": "gpt_oss",
            "architectures": ["GptOssForCausalLM"],
            "num_local_experts": 32,
            "experts_per_token": 4,
            "hidden_size": 64,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
        },
    )
    assert oss.top_k == 4 and oss.routing["topk_before_softmax"] is True
    assert oss.expert_ffn == "swiglu_oai"
    qwen2 = ModelShape.from_hf_config(
        "q2",
        {
            "model_type": "qwen2_moe",
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "hidden_size": 32,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 64,
            "num_hidden_layers": 4,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [3],
        },
    )
    assert qwen2.n_shared_experts == 1 and qwen2.routing["shared_expert_gate"] is True
    assert qwen2.routing["norm_topk_prob"] is False  # transformers' default when absent
    assert qwen2.moe_layers() == [1]  # (i+1) % 2 == 0 -> 1, 3; 3 is mlp_only
    assert "64" in qwen2.notes
    glm = _load_config("deepseek_v3_tiny")
    glm.update({"model_type": "glm4_moe", "moe_layer_freq": 2, "first_k_dense_replace": 0})
    glm_shape = ModelShape.from_hf_config("glm-tiny", glm)
    assert glm_shape.moe_layers() == [0, 2]


def test_from_hf_config_reads_text_config_of_a_wrapper():
    inner = _load_config("deepseek_v3_tiny")
    inner["model_type"] = "kimi_k2"
    wrapper = {
        "model_type": "kimi_k25",
        "architectures": ["KimiK25ForConditionalGeneration"],
        "text_config": inner,
    }
    shape = ModelShape.from_hf_config("kimi-tiny", wrapper, hf_repo="local/kimi-tiny")
    assert shape.family == "kimi_k2" and shape.architecture == "KimiK25ForConditionalGeneration"
    assert shape.hf_repo == "local/kimi-tiny" and "hf_repo" not in shape.unknown
    assert shape.moe_layers() == [1, 2]


@pytest.mark.parametrize(
    "config,message",
    [
        ({"num_experts": 4}, "model_type"),
        ({"model_type": "llama"}, "unsupported model_type"),
        ({"model_type": "qwen3_moe", "num_experts": 4}, "experts per token"),
        (
            {"model_type": "deepseek_v3", "n_routed_experts": 4, "num_experts_per_tok": 2},
            "n_shared_experts",
        ),
        ([1, 2], "mapping"),
    ],
)
def test_from_hf_config_errors(config, message):
    with pytest.raises(ValueError, match=message):
        ModelShape.from_hf_config("bad", config)


def test_model_config_reads_once_and_names_the_bad_key():
    from moe.config import ConfigError, ModelConfig

    cfg = _load_config("deepseek_v3_tiny")
    mc = ModelConfig.from_hf(cfg)
    assert (mc.num_experts, mc.n_shared_experts, mc.kv_lora_rank) == (16, 1, cfg["kv_lora_rank"])
    assert mc.moe_layers() == (1, 2) and mc.rope["rope_type"]
    with pytest.raises(ConfigError, match="'n_group' must be an integer >= 1") as err:
        ModelConfig.from_hf(dict(cfg, n_group="4"))
    assert err.value.key == "n_group"
    with pytest.raises(ConfigError, match="lacks required field 'intermediate_size'"):
        ModelConfig.from_hf({"model_type": "mixtral"}).need("moe_intermediate_size")
    with pytest.raises(ValueError, match="bad: config.json .* conflicting expert counts"):
        ModelShape.from_hf_config("bad", dict(cfg, num_experts=8))


# --------------------------------------------------------------------------- JSON


@pytest.mark.parametrize("model_id", SEED_IDS)
def test_shape_json_golden_keys(model_id):
    out = shape_json(model_id)
    assert set(out) == SHAPE_KEYS
    assert out["model_id"] == model_id and out["is_moe"] is True
    assert set(out["moe"]) == MOE_KEYS
    assert set(out["moe"]["routing"]) == set(ROUTING_KEYS)
    assert isinstance(out["unknown"], list)
    assert isinstance(out["architecture"], str) and out["architecture"]
    json.dumps(out)  # serialisable


def test_shape_json_values():
    out = shape_json("deepseek-v3-0324")
    assert out == {
        "model_id": "deepseek-v3-0324",
        "is_moe": True,
        "moe": {
            "num_experts": 256,
            "experts_per_token": 8,
            "shared_experts": 1,
            "params_per_expert_x10": 0,
            "params_per_expert": 3 * 7168 * 2048,
            "hidden_size": 7168,
            "expert_d_ff": 2048,
            "layers": 61,
            "first_dense_layers": 3,
            "moe_layers_count": 58,
            "routing": {
                "scoring": "sigmoid",
                "norm_topk_prob": True,
                "routed_scaling_factor": 2.5,
                "n_group": 8,
                "topk_group": 4,
                "correction_bias": True,
                "topk_before_softmax": False,
                "router_bias": False,
                "shared_expert_gate": False,
                "per_expert_scale": False,
                "hash_layers": 0,
            },
        },
        "architecture": "DeepseekV3ForCausalLM",
        "unknown": [],
    }
    nemo = shape_json("nemotron-nano-30b-a3b")
    assert nemo["moe"]["moe_layers_count"] is None
    assert nemo["architecture"] == "nemotron_h"  # class name unconfirmed -> family
    assert "first_dense_layers" in nemo["unknown"]


# --------------------------------------------------------------------------- lookups


def test_get_is_case_insensitive_and_returns_same_object():
    assert get("Qwen3-30B-A3B") is get("qwen3-30b-a3b")


def test_get_unknown_lists_close_matches():
    with pytest.raises(KeyError) as info:
        get("qwen3-30b")
    err = info.value
    assert isinstance(err, UnknownModelError)
    text = str(err)
    assert text.startswith("unknown model id 'qwen3-30b'")
    assert "close matches:" in text and "qwen3-30b-a3b" in text
    assert "qwen3-30b-a3b" in err.suggestions and len(err.suggestions) <= 5
    with pytest.raises(KeyError, match="kimi-k2.6"):
        get("kimi-k2.66")
    with pytest.raises(KeyError) as none:
        get("zzzzzzzz-unrelated")
    assert "no close match" in str(none.value) and none.value.suggestions == []
    # what an HTTP client can follow, not a Python function of the site
    assert "GET /api/v1/catalog" in str(none.value) and "registry.catalog" not in str(none.value)


def test_shape_json_unknown_model_raises_keyerror():
    with pytest.raises(KeyError, match="close matches"):
        shape_json("deepseek-v3")


def test_register_local_roundtrip(local_cleanup):
    shape = ModelShape.from_hf_config("local/qwen3-moe-tiny", _load_config("qwen3_moe_tiny"))
    assert register_local(shape) is shape
    assert get("local/qwen3-moe-tiny") is shape
    assert all_models()[-1] is shape
    assert shape_json("local/qwen3-moe-tiny")["moe"]["moe_layers_count"] == 2
    again = dataclasses.replace(shape, display_name="re-read")
    register_local(again)  # a re-read checkpoint replaces the local entry
    assert get("local/qwen3-moe-tiny").display_name == "re-read"
    assert unregister_local("local/qwen3-moe-tiny") is True
    assert unregister_local("local/qwen3-moe-tiny") is False
    with pytest.raises(KeyError):
        get("local/qwen3-moe-tiny")


def test_register_local_refuses_seed_ids_and_non_shapes(local_cleanup):
    clash = dataclasses.replace(get("qwen3-30b-a3b"), model_id="QWEN3-30B-A3B")
    with pytest.raises(ValueError, match="seed"):
        register_local(clash)
    with pytest.raises(TypeError):
        register_local({"model_id": "x"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seed"):
        unregister_local("qwen3-30b-a3b")
    assert get("qwen3-30b-a3b").model_id == "qwen3-30b-a3b"
