"""Write the HF fixtures as GGUF files with gguf-py's ``GGUFWriter`` (an independent writer),
following llama.cpp's ``convert_hf_to_gguf.py`` conventions: expert stacks
``ffn_{gate,up,down}_exps``, Q/K rows permuted for ``llama`` (Mixtral), DeepSeek's ``kv_b``
split into ``attn_k_b`` (transposed) and ``attn_v_b``, the metadata keys it writes."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from prepare.checkpoint import Checkpoint

ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "deepseek_v3": "deepseek2", "mixtral": "llama"}
_ATTN = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
         "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
         "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
         "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
         "self_attn.k_norm.weight": "attn_k_norm.weight", "self_attn.q_a_proj.weight": "attn_q_a.weight",
         "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight", "self_attn.q_b_proj.weight": "attn_q_b.weight",
         "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
         "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
         "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
         "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
         "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
         "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight"}
_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf ``LlamaModel.permute``."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _raw(c: Checkpoint, name: str, f32: bool = False):
    """(array, ggml raw dtype or None): BF16 kept as bf16 bits (unless ``f32``), else float32."""
    from gguf import GGMLQuantizationType

    info = c.info(name)
    if info.dtype == "BF16" and not f32:
        return np.frombuffer(c.read_bytes(name), "<u2").reshape(info.shape).copy(), GGMLQuantizationType.BF16
    return c.read(name).astype(np.float32), None


def write_fixture_gguf(src: Path, out: Path, *, tokenizer=None, chat_template: str | None = None,
                       kv_b_split: bool = True, expert_quant: dict[str, str] | None = None,
                       f32: bool = False, stacked: bool = True) -> Path:
    """Write checkpoint ``src`` as the GGUF ``out`` (source dtypes kept; permutations as llama.cpp).

    ``tokenizer``: an optional ``tokenizers.Tokenizer`` (byte-level BPE) written as a ``gpt2``
    vocabulary; ``chat_template`` as ``tokenizer.chat_template``; ``expert_quant`` maps
    ``gate``/``up``/``down`` to a ggml type name for the routed expert stacks (Q8_0, Q4_K, Q6_K
    by ``moe.quant``, the reference bytes; other types by gguf-py); ``f32`` writes every
    tensor as F32 (bf16 values widened exactly); ``stacked`` False writes one tensor per expert
    (``blk.{L}.ffn_{gate,up,down}.{e}.weight``, llama.cpp's older Mixtral layout).
    """
    import gguf

    c = Checkpoint(src)
    cfg = c.config
    family = cfg["model_type"]
    arch = ARCH[family]
    w = gguf.GGUFWriter(str(out), arch)
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(1 if family == "deepseek_v3" else kv)
    w.add_rope_freq_base(cfg.get("rope_parameters", {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts"))
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    if family == "qwen3_moe":
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if family in ("qwen3_moe", "qwen2_moe"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if family == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if family == "mixtral":
        w.add_rope_dimension_count(cfg["hidden_size"] // heads)
    if family == "deepseek_v3":
        rank, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        w.add_q_lora_rank(cfg["q_lora_rank"])
        w.add_kv_lora_rank(rank)
        if kv_b_split:
            w.add_key_length(rank + rope)
            w.add_value_length(rank)
            w.add_key_length_mla(cfg["qk_nope_head_dim"] + rope)
            w.add_value_length_mla(cfg["v_head_dim"])
        else:  # a file from before llama.cpp's MLA split
            w.add_key_length(cfg["qk_nope_head_dim"] + rope)
            w.add_value_length(cfg["v_head_dim"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_rope_dimension_count(rope)
    if tokenizer is not None:
        add_tokenizer(w, tokenizer, cfg["vocab_size"])
    if chat_template is not None:
        w.add_chat_template(chat_template)

    w.add_tensor("token_embd.weight", *_pair(c, f32, "model.embed_tokens.weight"))
    w.add_tensor("output_norm.weight", *_pair(c, f32, "model.norm.weight"))
    if c.has("lm_head.weight"):
        w.add_tensor("output.weight", *_pair(c, f32, "lm_head.weight"))
    n_exp = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    for layer in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{layer}."
        names = [n for n in c.names() if n.startswith(pre)]
        stacks: dict[str, list] = {}
        for name in names:
            leaf = name[len(pre):]
            if ".experts." in leaf:
                parts = leaf.split(".")
                stacks.setdefault(_PROJ[parts[-2]], []).append((int(parts[-3]), name))
                continue
            if ".shared_expert." in leaf or ".shared_experts." in leaf:
                proj = _PROJ[leaf.split(".")[-2]]
                w.add_tensor(f"blk.{layer}.ffn_{proj}_shexp.weight", *_pair(c, f32, name))
                continue
            if leaf == "self_attn.kv_b_proj.weight":
                a = c.read(name)
                if not kv_b_split:
                    w.add_tensor(f"blk.{layer}.attn_kv_b.weight", a)
                    continue
                nope, v = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
                kvb = a.reshape(heads, nope + v, a.shape[-1])
                w.add_tensor(f"blk.{layer}.attn_k_b.weight", np.ascontiguousarray(kvb[:, :nope].transpose(0, 2, 1)))
                w.add_tensor(f"blk.{layer}.attn_v_b.weight", np.ascontiguousarray(kvb[:, nope:]))
                continue
            if family == "mixtral" and leaf in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
                a = c.read(name)
                w.add_tensor(f"blk.{layer}.{_ATTN[leaf]}", _permute(a, heads if "q_proj" in leaf else kv))
                continue
            w.add_tensor(f"blk.{layer}.{_ATTN[leaf]}", *_pair(c, f32, name))
        for proj, items in stacks.items():
            items.sort()
            assert [e for e, _ in items] == list(range(n_exp))
            qname = (expert_quant or {}).get(proj)
            if qname:
                from gguf import GGMLQuantizationType
                from gguf.quants import quantize as gguf_quantize

                from moe.quant import quantize

                qt = GGMLQuantizationType[qname.upper()]
                mats = [c.read(n) for _, n in items]
                q = [quantize(m, qname.lower()) if qname.upper() in ("Q8_0", "Q4_K", "Q6_K")
                     else gguf_quantize(m, qt) for m in mats]
                w.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", np.stack(q), raw_dtype=qt)
                continue
            if not stacked:
                for e, n in items:
                    w.add_tensor(f"blk.{layer}.ffn_{proj}.{e}.weight", *_pair(c, f32, n))
                continue
            arrays = [_raw(c, n, f32) for _, n in items]
            w.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", np.stack([a for a, _ in arrays]),
                         raw_dtype=arrays[0][1])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _pair(c: Checkpoint, f32: bool, name: str):
    """add_tensor args: norms, vectors and routers F32 (as llama.cpp's converter), else the source dtype."""
    if len(c.info(name).shape) == 1 or name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight",
                                                          "shared_expert_gate.weight")):
        return (c.read(name).astype(np.float32),)
    a, dt = _raw(c, name, f32)
    return (a,) if dt is None else (a, None, dt)


def add_tokenizer(w, tok, n_vocab: int | None = None) -> None:
    """Write a byte-level BPE ``tokenizers.Tokenizer`` as a ``gpt2`` GGUF vocabulary, padded
    with unused ``[PADi]`` tokens to ``n_vocab`` (llama.cpp wants one token per embedding row)."""
    import json

    data = json.loads(tok.to_str())
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [None] * max(len(vocab), n_vocab or 0)
    for i in range(len(vocab), len(tokens)):
        tokens[i] = f"[PAD{i}]"
    for t, i in vocab.items():
        tokens[i] = t
    types = [1] * len(vocab) + [5] * (len(tokens) - len(vocab))
    for a in data.get("added_tokens", []):
        types[a["id"]] = 3 if a["special"] else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for a in data.get("added_tokens", []):
        if a["content"] == "<|endoftext|>":
            w.add_eos_token_id(a["id"])
    w.add_add_bos_token(False)


CORPUS = ("the quick brown fox jumps over the lazy dog. experts hold the weights and the router "
          "gates every token to the experts it needs; holders run the feed forward layers. "
          "Hello, world! A mixture of experts model routes each token to a few experts. ") * 20


def train_tokenizer(vocab_size: int = 256):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``CORPUS`` (deterministic): the
    characters of the corpus, merges up to ``vocab_size - 1`` and ``<|endoftext|>`` last, so
    it fits the fixtures' 256-row embeddings."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, show_progress=False, special_tokens=[])
    tok.train_from_iterator([CORPUS], trainer)
    tok.add_special_tokens(["<|endoftext|>"])
    assert tok.get_vocab_size() <= vocab_size
    return tok
