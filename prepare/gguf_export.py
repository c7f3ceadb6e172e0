"""Writing a published model as a GGUF file llama.cpp loads (``manage.py export_gguf``).

The inverse of ``prepare.gguf``: metadata in llama.cpp's keys for the architecture
(``qwen3_moe`` → ``qwen3moe``, ``qwen2_moe`` → ``qwen2moe``, ``deepseek_v3`` → ``deepseek2``,
``mixtral`` → ``llama``), the backbone under GGUF names (llama Q/K rows permuted for
llama.cpp's rope, DeepSeek's ``kv_b_proj`` split into ``attn_k_b``/``attn_v_b``), each MoE
layer's router (``ffn_gate_inp``, ``exp_probs_b``, ``ffn_gate_inp_shexp``, F32), its routed
experts stacked per projection as ``ffn_{gate,up,down}_exps`` in their blob types (Q8_0 /
Q4_K / Q6_K blocks as they are; dense ones as BF16/F16 when every blob of the stack is that
dtype, else F32), the shared expert as ``ffn_*_shexp``, DeepSeek's leading dense MLPs as
``ffn_{gate,up,down}``, and the vocabulary (byte-level BPE tokenizers as ``gpt2``) and chat
template when the model has them. A stack whose experts have different block types is
written F32 (decoded) and reported.

The writer is gguf-py's ``GGUFWriter``, fed tensor by tensor (``add_tensor_info`` on a first
pass, ``write_tensor_data`` on a second): the routed experts of one layer at most are in memory,
not the model. This module is Django-free (the command gathers the blobs).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from moe.config import GGUF_ARCHITECTURES, ModelConfig, is_moe_layer
from moe.codec import loads_safetensors
from moe.ffn import BIASES, PROJECTIONS, ExpertWeights
from moe.gating import Gate
from moe.quant import QuantizedMatrix
from prepare.gguf import BLOCK_TENSORS

ARCH_OF = {family: arch for arch, family in GGUF_ARCHITECTURES.items()}
# The backbone's per-block tensors: the reader's table inverted, less what the export writes
# itself (dense MLPs, routers and DeepSeek's kv_b, which llama.cpp splits into k_b / v_b).
_WRITTEN_ELSEWHERE = {"ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "attn_kv_b.weight",
                      "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "exp_probs_b.bias"}
_SUFFIX = {hf: g for g, hf in BLOCK_TENSORS.items() if g not in _WRITTEN_ELSEWHERE}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_GGML = {"q8_0": "Q8_0", "q4_k": "Q4_K", "q6_k": "Q6_K"}


class ExportError(ValueError):
    """The model cannot be written as GGUF; the message names what is missing or unsupported."""


@dataclass
class ExportModel:
    """What a GGUF export needs, gathered by the caller.

    ``config``: the model's ``config.json`` dict; ``backbone``: HF name → (dtype ``"BF16"`` /
    ``"F16"`` / ``"F32"``, float32 array); ``gates``: MoE layer → ``Gate``; ``expert``:
    ``(layer, expert) -> (ExpertWeights, blob dense dtype)`` (expert ``num_experts`` = the
    shared one); ``dense``: layer → ``ExpertWeights`` of a dense MLP; ``tokenizer_json`` and
    ``chat_template`` (text) or None; ``gguf_vocab``: the ``tokenizer.ggml.*`` keys of the GGUF
    file the model came from (written back verbatim, any vocabulary kind) or None.
    """

    config: dict
    backbone: dict[str, tuple[str, np.ndarray]]
    gates: dict[int, Gate]
    expert: Callable[[int, int], tuple[ExpertWeights, str]]
    dense: dict[int, ExpertWeights] = field(default_factory=dict)
    tokenizer_json: str | None = None
    chat_template: str | None = None
    gguf_vocab: dict | None = None


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 → bf16 bit patterns (round to nearest even; exact for bf16-sourced values)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _add(name: str, a: np.ndarray, dtype: str = "F32"):
    """``(name, array, raw ggml type or None)`` of a dense tensor written as ``dtype``."""
    from gguf import GGMLQuantizationType

    if dtype == "BF16" and a.ndim >= 2:
        return name, _bf16_bits(a), GGMLQuantizationType.BF16
    if dtype == "F16" and a.ndim >= 2:
        return name, np.ascontiguousarray(a, dtype=np.float16), None
    return name, np.ascontiguousarray(a, dtype=np.float32), None  # norms and vectors F32, as llama.cpp's converter


def _permute(a: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf ``LlamaModel.permute`` (HF rotate-half rows → llama.cpp's interleaved rope)."""
    return a.reshape(n_head, 2, a.shape[0] // n_head // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def add_metadata(w, cfg: ModelConfig, hf: dict) -> None:
    """Write ``cfg``'s shape in llama.cpp's keys for its architecture (as its converter does)."""
    fam = cfg.family
    w.add_block_count(cfg.need("num_hidden_layers"))
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.need("hidden_size"))
    if hf.get("intermediate_size"):
        w.add_feed_forward_length(int(hf["intermediate_size"]))
    w.add_head_count(cfg.need("num_attention_heads"))
    w.add_head_count_kv(1 if fam == "deepseek_v3" else cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.need("num_experts"))
    w.add_expert_used_count(cfg.need("top_k"))
    if cfg.vocab_size:
        w.add_vocab_size(cfg.vocab_size)
    rt = cfg.rope.get("rope_type", "default")
    if rt == "linear":
        from gguf import RopeScalingType

        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(cfg.rope["factor"]))
    elif rt == "yarn":
        from gguf import RopeScalingType

        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(cfg.rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(cfg.rope["original_max_position_embeddings"]))
        if fam == "deepseek_v3" and cfg.rope.get("mscale_all_dim"):
            w.add_rope_scaling_yarn_log_mul(0.1 * float(cfg.rope["mscale_all_dim"]))
    elif rt != "default":
        raise ExportError(f"rope_type {rt!r} has no GGUF equivalent here (default, linear, yarn)")
    if fam == "qwen3_moe":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if fam in ("qwen3_moe", "qwen2_moe", "deepseek_v3"):
        w.add_expert_feed_forward_length(cfg.need("moe_intermediate_size"))
    if fam == "qwen2_moe" and cfg.shared_expert_intermediate_size:
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if fam == "mixtral":
        w.add_rope_dimension_count(cfg.head_dim)
    if fam == "deepseek_v3":
        from gguf import ExpertGatingFuncType

        rank, rope = cfg.need("kv_lora_rank"), cfg.need("qk_rope_head_dim")
        w.add_leading_dense_block_count(cfg.first_k_dense_replace or 0)
        if cfg.q_lora_rank:
            w.add_q_lora_rank(cfg.q_lora_rank)
        w.add_kv_lora_rank(rank)
        w.add_key_length(rank + rope)
        w.add_value_length(rank)
        w.add_key_length_mla(cfg.need("qk_nope_head_dim") + rope)
        w.add_value_length_mla(cfg.need("v_head_dim"))
        w.add_expert_shared_count(cfg.n_shared_experts or 0)
        w.add_expert_weights_scale(float(cfg.routed_scaling_factor or 1.0))
        if cfg.norm_topk_prob:
            w.add_expert_weights_norm(True)
        w.add_expert_group_count(cfg.n_group or 1)
        w.add_expert_group_used_count(cfg.topk_group or 1)
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        w.add_rope_dimension_count(rope)


def add_tokenizer(w, tokenizer_json: str, n_vocab: int = 0) -> str | None:
    """Write a byte-level BPE ``tokenizers`` JSON as a ``gpt2`` vocabulary. Returns a note
    when the tokenizer is of another kind (then no vocabulary is written: llama.cpp needs one
    of its own kinds, and a wrong one would tokenize differently). Ids up to ``n_vocab`` that
    the tokenizer does not use are written as unused ``[PADi]`` tokens."""
    data = json.loads(tokenizer_json)
    model = data.get("model") or {}
    pre = json.dumps(data.get("pre_tokenizer"))
    if model.get("type") != "BPE" or "ByteLevel" not in pre:
        return f"tokenizer of kind {model.get('type')!r} without a byte-level pre-tokenizer is not exported"
    vocab = dict(model["vocab"])
    for a in data.get("added_tokens") or []:
        vocab[a["content"]] = a["id"]
    n = max(max(vocab.values()) + 1, n_vocab)  # llama.cpp wants one token per embedding row
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [5] * n  # unused until named
    for t, i in vocab.items():
        tokens[i], types[i] = t, 1
    for a in data.get("added_tokens") or []:
        types[a["id"]] = 3 if a.get("special") else 4
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if "\\p{N}|" in pre else "default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    if merges:
        w.add_token_merges(merges)
    else:  # llama.cpp refuses a gpt2 vocabulary without the key; gguf-py drops an empty array (``_Writer``)
        from gguf import GGUFValueType, Keys

        w.add_key_value(Keys.Tokenizer.MERGES, [], GGUFValueType.ARRAY, sub_type=GGUFValueType.STRING)
    for a in data.get("added_tokens") or []:
        if a.get("special") and a["content"] in ("<|endoftext|>", "</s>", "<|im_end|>", "<｜end▁of▁sentence｜>"):
            w.add_eos_token_id(a["id"])
            break
    w.add_add_bos_token(False)
    return None


def add_vocab_metadata(w, vocab: dict) -> None:
    """Write ``tokenizer.ggml.*`` keys as a GGUF file had them: strings, bools, token ids as
    u32, and the arrays (``tokens``/``merges`` strings, ``scores`` f32, ``token_type`` i32)."""
    from gguf import GGUFValueType

    for key, v in sorted(vocab.items()):
        if isinstance(v, bool):
            w.add_bool(key, v)
        elif isinstance(v, int):
            w.add_uint32(key, v)
        elif isinstance(v, float):
            w.add_float32(key, v)
        elif isinstance(v, str):
            w.add_string(key, v)
        elif isinstance(v, list) and key.endswith(".scores"):
            w.add_key_value(key, [float(x) for x in v], GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT32)
        elif isinstance(v, list) and key.endswith(".token_type"):
            w.add_key_value(key, [int(x) for x in v], GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
        elif isinstance(v, list):
            w.add_array(key, v)


def _stack(mats: list, what: str, notes: dict, dtypes: set[str]):
    """(array, raw ggml dtype name or None) of one projection over every routed expert."""
    kinds = {m.qtype if isinstance(m, QuantizedMatrix) else "dense" for m in mats}
    if len(kinds) == 1 and kinds != {"dense"}:
        q = kinds.pop()
        return np.stack([m.blocks for m in mats]), _GGML[q]
    if kinds != {"dense"}:
        notes[what] = f"experts have different types {sorted(kinds)}: written F32 (decoded)"
    arr = np.stack([m.dequantize() if isinstance(m, QuantizedMatrix) else m for m in mats])
    return arr, (dtypes.pop() if len(dtypes) == 1 and kinds == {"dense"} else "F32")


def _writer(gguf):
    """gguf-py's ``GGUFWriter`` that also writes an empty typed array (``n = 0``: the format
    allows it, gguf-py refuses it); a byte-level BPE without merges needs one."""

    class Writer(gguf.GGUFWriter):
        def _pack_val(self, val, vtype, add_vtype, sub_type=None):
            if vtype == gguf.GGUFValueType.ARRAY and sub_type is not None and len(val) == 0:
                return (self._pack("I", vtype) if add_vtype else b"") + self._pack("I", sub_type) + self._pack("Q", 0)
            return super()._pack_val(val, vtype, add_vtype, sub_type)

    return Writer


def write_gguf(model: ExportModel, out: str | Path, progress: bool = False) -> dict:
    """Write ``model`` to ``out`` (module docstring), streaming: tensors are produced one at a
    time (a layer's experts at most in memory) twice, once for the tensor table and once for
    the data, and written as they come; ``progress`` shows a tqdm bar of the data pass.
    Returns a report ``{"tensors": n, "notes": {what: note}}``. Raises ``ExportError`` for an
    architecture llama.cpp has no MoE graph of here, a missing gate, expert or backbone tensor."""
    import gguf
    from tqdm import tqdm

    cfg = ModelConfig.from_hf(model.config)
    fam = cfg.family
    if fam not in ARCH_OF:
        raise ExportError(f"model family {fam!r} has no GGUF architecture here; supported: {', '.join(ARCH_OF)}")
    if "model.embed_tokens.weight" not in model.backbone:
        raise ExportError("the published backbone has no model.embed_tokens.weight")
    w = _writer(gguf)(str(out), ARCH_OF[fam])
    add_metadata(w, cfg, model.config)
    notes: dict[str, str] = {}
    if model.gguf_vocab:
        add_vocab_metadata(w, model.gguf_vocab)
    elif model.tokenizer_json:
        note = add_tokenizer(w, model.tokenizer_json, cfg.vocab_size or 0)
        if note:
            notes["tokenizer"] = note
    else:  # no vocabulary: the model takes token ids (llama.cpp's "none" kind)
        w.add_tokenizer_model("none")
    if model.chat_template:
        w.add_chat_template(model.chat_template)
    names = []
    for name, arr, raw in _tensors(model, cfg, notes):  # pass 1: the tensor table only
        w.add_tensor_info(name, arr.shape, arr.dtype, arr.nbytes, raw_dtype=raw)
        names.append(name)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    with tqdm(total=len(names), desc=f"export {Path(out).name}", unit="tensor", disable=not progress) as bar:
        for i, (name, arr, _) in enumerate(_tensors(model, cfg, {})):  # pass 2: the same tensors, in order
            if i >= len(names) or name != names[i]:
                raise ExportError(f"tensor {name!r} came in a different order on the data pass")
            w.write_tensor_data(arr)
            bar.update(1)
    w.close()
    return {"tensors": len(names), "notes": notes}


def _tensors(model: ExportModel, cfg: ModelConfig, notes: dict):
    """Every tensor of the file in order as ``(GGUF name, array, raw ggml type or None)``,
    produced lazily: one layer's routed experts are read when that layer is reached."""
    import gguf

    fam = cfg.family
    bb = model.backbone
    for hf_name, gname in _GLOBAL.items():
        if hf_name in bb:
            dt, a = bb[hf_name]
            yield _add(gname, a, dt)
    heads, kv_heads = cfg.need("num_attention_heads"), cfg.num_key_value_heads
    e_count = cfg.need("num_experts")
    for layer in range(cfg.need("num_hidden_layers")):
        pre = f"model.layers.{layer}."
        for hf_name in sorted(n for n in bb if n.startswith(pre)):
            leaf, (dt, a) = hf_name[len(pre):], bb[hf_name]
            if leaf == "self_attn.kv_b_proj.weight":
                nope, v = cfg.need("qk_nope_head_dim"), cfg.need("v_head_dim")
                kvb = a.reshape(heads, nope + v, a.shape[-1])
                yield _add(f"blk.{layer}.attn_k_b.weight", np.ascontiguousarray(kvb[:, :nope].transpose(0, 2, 1)), dt)
                yield _add(f"blk.{layer}.attn_v_b.weight", np.ascontiguousarray(kvb[:, nope:]), dt)
                continue
            if leaf not in _SUFFIX:
                raise ExportError(f"backbone tensor {hf_name!r} has no GGUF name here")
            if fam == "mixtral" and leaf in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
                a = _permute(a, heads if "q_proj" in leaf else kv_heads)
            yield _add(f"blk.{layer}.{_SUFFIX[leaf]}", a, dt)
        if not is_moe_layer(cfg, layer):
            d = model.dense.get(layer)
            if d is None:
                raise ExportError(f"layer {layer} is a dense MLP layer and no dense weights were published for it")
            for proj in PROJECTIONS:
                yield _add(f"blk.{layer}.ffn_{_PROJ[proj]}.weight", _dense(getattr(d, proj)), "F32")
            continue
        gate = model.gates.get(layer)
        if gate is None:
            raise ExportError(f"layer {layer}: no published gate")
        yield _add(f"blk.{layer}.ffn_gate_inp.weight", gate.weight)
        if gate.correction_bias is not None:
            yield _add(f"blk.{layer}.exp_probs_b.bias", gate.correction_bias)
        if gate.shared_gate is not None:
            yield _add(f"blk.{layer}.ffn_gate_inp_shexp.weight", gate.shared_gate)
        experts, dtypes = [], set()
        for e in range(e_count):
            ew, dt = model.expert(layer, e)
            experts.append(ew)
            dtypes.add(dt.upper())
        for proj in PROJECTIONS:
            name = f"blk.{layer}.ffn_{_PROJ[proj]}_exps.weight"
            arr, raw = _stack([getattr(x, proj) for x in experts], name, notes, set(dtypes))
            yield (name, arr, gguf.GGMLQuantizationType[raw]) if raw in _GGML.values() else _add(name, arr, raw)
            del arr
        del experts
        if (cfg.n_shared_experts or 0) > 0:
            sw, dt = model.expert(layer, e_count)
            for proj in PROJECTIONS:
                m = getattr(sw, proj)
                name = f"blk.{layer}.ffn_{_PROJ[proj]}_shexp.weight"
                if isinstance(m, QuantizedMatrix):
                    yield name, m.blocks, gguf.GGMLQuantizationType[_GGML[m.qtype]]
                else:
                    yield _add(name, m, dt.upper())


def expert_from_blob(blob: bytes, what: str = "expert blob") -> tuple[ExpertWeights, str]:
    """An expert blob as ``(ExpertWeights, dense dtype)``: the dtype (``"F32"``/``"F16"``/``"BF16"``)
    its dense projections were stored in, ``"F32"`` when mixed or all quantized (``U8`` blocks).
    Raises ``ValueError`` (``CheckpointError``) for a malformed blob; ``what`` names it."""
    tensors, _ = loads_safetensors(blob, what)
    dense = {t.dtype for n, t in tensors.items() if n.endswith(".weight") and t.dtype != "U8"}
    return ExpertWeights.from_blob(blob), (dense.pop() if len(dense) == 1 else "F32")


@dataclass
class ShardSpec:
    """One expert shard (Kvasir contract §1.10): routed experts ``[expert_begin, expert_end)`` of MoE
    layer ``layer`` of ``model`` (``family`` its HF ``model_type``), with the model's ``n_embd``
    (hidden size), ``n_layer`` (block count), ``n_expert_total`` (routed experts per layer),
    ``expert_d_ff`` and ``source_digest`` (what the slice was cut from)."""

    model: str
    family: str
    layer: int
    expert_begin: int
    expert_end: int
    n_expert_total: int
    n_embd: int
    n_layer: int
    expert_d_ff: int
    source_digest: str


def write_expert_shard(spec: ShardSpec, experts: list[ExpertWeights], dtypes: set[str], out: str | Path) -> dict:
    """Write a mini-GGUF of one expert range, as ``linkcpp-expert-worker`` loads it:
    ``blk.L.ffn_{gate,up,down}_exps.weight`` stacked over the range's experts (local expert i =
    global ``expert_begin + i``) in the blobs' types (Q8_0 / Q4_K / Q6_K blocks byte for byte;
    dense as their common dtype, else F32; ``_stack``), the arch's ``block_count`` /
    ``embedding_length`` / ``expert_count`` / ``expert_feed_forward_length``, and the shard keys
    ``kvasir.expert_shard.{model, layer, expert_begin, expert_end, n_expert_total, source_digest}``
    (plus the older ``linkcpp.expert_shard.*`` set). ``experts`` are the range's in order, each a
    SiLU-gated FFN without biases (the worker computes ``W_down·(silu(W_gate·h) ⊙ W_up·h)``).
    Returns ``{"tensors": 3, "notes": {...}, "manifest_bytes": bytes before the tensor data}``.
    Raises ``ExportError`` for an empty range or experts the worker cannot compute."""
    import gguf

    n = spec.expert_end - spec.expert_begin
    if n < 1 or len(experts) != n:
        raise ExportError(f"expert range [{spec.expert_begin}, {spec.expert_end}) needs {max(n, 0)} experts, "
                          f"got {len(experts)}")
    for i, ew in enumerate(experts):
        if ew.activation != "silu" or any(getattr(ew, b) is not None for b in BIASES):
            raise ExportError(f"layer {spec.layer} expert {spec.expert_begin + i} has biases or a non-SiLU "
                              "activation, which the expert worker does not compute")
    arch = ARCH_OF.get(spec.family, spec.family)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(spec.n_layer)
    w.add_embedding_length(spec.n_embd)
    w.add_expert_count(spec.n_expert_total)
    w.add_expert_feed_forward_length(spec.expert_d_ff)
    k = "kvasir.expert_shard."
    w.add_string(k + "model", spec.model)
    w.add_string(k + "source_digest", spec.source_digest)
    for key, v in (("layer", spec.layer), ("expert_begin", spec.expert_begin), ("expert_end", spec.expert_end),
                   ("n_expert_total", spec.n_expert_total)):
        w.add_uint32(k + key, v)
    for key, v in (("expert_begin", spec.expert_begin), ("expert_end", spec.expert_end),
                   ("n_expert_global", spec.n_expert_total), ("n_embd", spec.n_embd), ("n_layer", spec.n_layer)):
        w.add_uint32("linkcpp.expert_shard." + key, v)
    notes: dict[str, str] = {}
    for proj in PROJECTIONS:
        name = f"blk.{spec.layer}.ffn_{_PROJ[proj]}_exps.weight"
        arr, raw = _stack([getattr(x, proj) for x in experts], name, notes, set(dtypes))
        name, arr, raw = (name, arr, gguf.GGMLQuantizationType[raw]) if raw in _GGML.values() else _add(name, arr, raw)
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()  # the tensor table, then the data
    w.close()
    return {"tensors": 3, "notes": notes, "manifest_bytes": int(gguf.GGUFReader(str(out)).data_offset)}


def _dense(m) -> np.ndarray:
    return m.dequantize() if isinstance(m, QuantizedMatrix) else m
