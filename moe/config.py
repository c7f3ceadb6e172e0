"""One reading of a model's Hugging Face ``config.json``: MoE shape, routing, attention, rope.

The catalog (``registry.catalog.ModelShape.from_hf_config``), the expert extractor
(``prepare.layouts.spec_from_config``) and the whole-model backbones (``moe.backbone``) all
read a config through :meth:`ModelConfig.from_hf`, so every key name, alias and type check
lives here once. A field is ``None`` when ``config.json`` does not say and the family fixes
no value; each reader then applies its own default, or requires the value with
:meth:`ModelConfig.need`. The dataclass is plain keyword data, so other metadata (GGUF) can
fill it too. Pure Python; imports nothing from Django.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

DEEPSEEK_LIKE = ("deepseek_v3", "kimi_k2", "glm4_moe")  # sigmoid routers, DeepSeek-style names
QWEN_LIKE = ("qwen3_moe", "qwen2_moe")
_DENSE_WIDTH = ("mixtral", "gpt_oss")  # experts are as wide as ``intermediate_size``
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "experts_per_token")
_KEY_OF = {"family": "model_type", "architecture": "architectures", "top_k": "num_experts_per_tok"}


class ConfigError(ValueError):
    """``config.json`` lacks a needed key or holds a bad value; ``key`` names the key."""

    def __init__(self, message: str, key: str):
        super().__init__(message)
        self.key = key


def _int(c: Mapping, key: str, lo: int = 1) -> int | None:
    """``c[key]`` as an int ``>= lo``, or None when absent (``ConfigError`` when mistyped)."""
    v = c.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < lo):
        raise ConfigError(f"config.json field {key!r} must be an integer >= {lo}, got {v!r}", key)
    return v


def _num(c: Mapping, key: str) -> float | None:
    """``c[key]`` as a positive float, or None when absent."""
    v = c.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
        raise ConfigError(f"config.json field {key!r} must be a positive number, got {v!r}", key)
    return None if v is None else float(v)


def _bool(c: Mapping, key: str) -> bool | None:
    v = c.get(key)
    if v is not None and not isinstance(v, bool):
        raise ConfigError(f"config.json field {key!r} must be true or false, got {v!r}", key)
    return v


def _rope(c: Mapping) -> dict:
    """Rotary parameters: transformers 5 ``rope_parameters`` or the older ``rope_theta`` +
    ``rope_scaling``; always with ``rope_type`` and ``rope_theta``."""
    p = dict(c.get("rope_parameters") or {})
    for k, v in (c.get("rope_scaling") or {}).items():
        p.setdefault(k, v)
    if "type" in p and "rope_type" not in p:
        p["rope_type"] = p["type"]
    p.setdefault("rope_type", "default")
    p.setdefault("rope_theta", float(c.get("rope_theta", 10000.0)))
    return p


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The shape of one decoder-only MoE model, as its ``config.json`` gives it.

    MoE: ``family`` (``model_type``), ``architecture`` (``architectures[0]``), ``num_experts``
    routed experts (``num_experts`` / ``num_local_experts`` / ``n_routed_experts``), ``top_k``
    per token (:data:`TOP_K_KEYS`), ``hidden_size`` H and ``num_hidden_layers``,
    ``moe_intermediate_size`` (one routed expert's d_ff; ``intermediate_size`` for mixtral and
    gpt_oss), ``n_shared_experts`` (DeepSeek-like: the config's; qwen2_moe: 1 when
    ``shared_expert_intermediate_size`` > 0; else 0), ``shared_expert_intermediate_size``
    (qwen2_moe's shared width, else 0). Layer map: ``first_k_dense_replace`` and
    ``moe_layer_freq`` (DeepSeek-like), ``decoder_sparse_step`` and ``mlp_only_layers`` (Qwen);
    see :func:`is_moe_layer`. Routing: ``scoring_func``, ``norm_topk_prob``,
    ``routed_scaling_factor``, ``n_group``, ``topk_group`` (fixed by the architecture for
    softmax families: no groups, no scaling; mixtral and gpt_oss always renormalise; Qwen's
    ``norm_topk_prob`` defaults to False as in transformers), ``swiglu_limit`` (gpt_oss).

    Backbone: ``vocab_size``, ``rms_norm_eps``, ``max_position_embeddings``,
    ``tie_word_embeddings``, ``num_attention_heads``, ``num_key_value_heads`` (default: the
    head count), ``head_dim`` (default H / heads), ``rope`` (rotary parameters with
    ``rope_type`` and ``rope_theta``), ``sliding_window`` (None unless used); MLA (DeepSeek):
    ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
    ``v_head_dim``, ``rope_interleave``. ``quantization_config`` is kept as given (see
    :meth:`fp8_block`).
    """

    family: str | None
    architecture: str | None = None
    num_experts: int | None = None
    top_k: int | None = None
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    moe_intermediate_size: int | None = None
    n_shared_experts: int | None = 0
    shared_expert_intermediate_size: int = 0
    first_k_dense_replace: int | None = 0
    moe_layer_freq: int = 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    scoring_func: str | None = "softmax"
    norm_topk_prob: bool | None = None
    routed_scaling_factor: float | None = 1.0
    n_group: int | None = 1
    topk_group: int | None = 1
    swiglu_limit: float = 7.0
    vocab_size: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rope: dict = field(default_factory=lambda: _rope({}), hash=False)
    sliding_window: int | None = None
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    rope_interleave: bool = True
    quantization_config: Any = field(default=None, hash=False)

    @classmethod
    def from_hf(cls, config: Mapping, *, unwrap: bool = False) -> "ModelConfig":
        """Read a parsed ``config.json``. With ``unwrap``, a multimodal wrapper that names no
        expert count is read from its ``text_config`` (``architectures`` from either level).

        Raises ``ConfigError`` (a ``ValueError`` naming the key) for a non-mapping config, a
        mistyped value, conflicting expert counts, or routing that cannot work: experts not
        divisible by ``n_group``, ``topk_group > n_group``, or more experts per token than
        the groups reach. Absent keys are not errors (see :meth:`need`).
        """
        if not isinstance(config, Mapping):
            raise ConfigError(f"config must be a mapping (the parsed config.json), got {type(config).__name__}",
                              "config")
        c, text = config, config.get("text_config")
        if unwrap and isinstance(text, Mapping) and all(config.get(k) is None for k in EXPERT_COUNT_KEYS):
            c = text
        family = c.get("model_type")
        deepseek, qwen = family in DEEPSEEK_LIKE, family in QWEN_LIKE
        counts = {k: c[k] for k in EXPERT_COUNT_KEYS if c.get(k) is not None}
        if len(set(map(str, counts.values()))) > 1:
            raise ConfigError(f"config.json ({family}) has conflicting expert counts {counts}", next(iter(counts)))
        count_key = next(iter(counts), "num_experts")
        top_key = next((k for k in TOP_K_KEYS if c.get(k) is not None), "num_experts_per_tok")
        archs = config.get("architectures") or c.get("architectures")
        mlp_only = (c.get("mlp_only_layers") or []) if qwen else []
        if not isinstance(mlp_only, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in mlp_only):
            raise ConfigError(f"config.json field 'mlp_only_layers' must be a list of integers, got {mlp_only!r}",
                              "mlp_only_layers")
        shared_width = (_int(c, "shared_expert_intermediate_size", 0) or 0) if family == "qwen2_moe" else 0
        hidden, heads = _int(c, "hidden_size"), _int(c, "num_attention_heads")
        window = c.get("sliding_window")
        norm = True if family in _DENSE_WIDTH else _bool(c, "norm_topk_prob")
        cfg = cls(
            family=family,
            architecture=archs[0] if isinstance(archs, list) and archs else None,
            num_experts=_int(c, count_key),
            top_k=_int(c, top_key),
            hidden_size=hidden,
            num_hidden_layers=_int(c, "num_hidden_layers"),
            moe_intermediate_size=_int(c, "intermediate_size" if family in _DENSE_WIDTH else "moe_intermediate_size"),
            n_shared_experts=_int(c, "n_shared_experts", 0) if deepseek else int(shared_width > 0),
            shared_expert_intermediate_size=shared_width,
            first_k_dense_replace=_int(c, "first_k_dense_replace", 0) if deepseek else 0,
            moe_layer_freq=(_int(c, "moe_layer_freq") or 1) if deepseek else 1,
            decoder_sparse_step=(_int(c, "decoder_sparse_step") or 1) if qwen else 1,
            mlp_only_layers=tuple(sorted(set(mlp_only))),
            scoring_func=c.get("scoring_func", "sigmoid") if deepseek else "softmax",
            norm_topk_prob=False if qwen and norm is None else norm,
            routed_scaling_factor=_num(c, "routed_scaling_factor") if deepseek else 1.0,
            n_group=_int(c, "n_group") if deepseek else 1,
            topk_group=_int(c, "topk_group") if deepseek else 1,
            swiglu_limit=(_num(c, "swiglu_limit") or 7.0) if family == "gpt_oss" else 7.0,
            vocab_size=_int(c, "vocab_size"),
            rms_norm_eps=_num(c, "rms_norm_eps") or 1e-6,
            max_position_embeddings=_int(c, "max_position_embeddings") or 2048,
            tie_word_embeddings=bool(c.get("tie_word_embeddings")),
            num_attention_heads=heads,
            num_key_value_heads=_int(c, "num_key_value_heads") or heads,
            head_dim=_int(c, "head_dim") or (hidden // heads if hidden and heads else None),
            rope=_rope(c),
            sliding_window=int(window) if window and c.get("use_sliding_window", True) else None,
            q_lora_rank=_int(c, "q_lora_rank"),
            kv_lora_rank=_int(c, "kv_lora_rank"),
            qk_nope_head_dim=_int(c, "qk_nope_head_dim", 0),
            qk_rope_head_dim=_int(c, "qk_rope_head_dim"),
            v_head_dim=_int(c, "v_head_dim"),
            rope_interleave=bool(c.get("rope_interleave", True)),
            quantization_config=c.get("quantization_config"),
        )
        cfg._check_groups(count_key)
        return cfg

    @classmethod
    def from_gguf(cls, metadata: Mapping, *, vocab_size: int | None = None,
                  tied: bool = False) -> "ModelConfig":
        """Read the metadata of a llama.cpp GGUF file (``{key: value}``, arrays as lists).

        The metadata is first translated to the ``config.json`` it stands for
        (:func:`hf_config_from_gguf`, architectures in :data:`GGUF_ARCHITECTURES`), then read
        by :meth:`from_hf`. ``vocab_size`` (the embedding's rows) is used when the file names
        none; ``tied`` says the file has no ``output.weight`` (tied embeddings). Raises
        ``ConfigError`` whose ``key`` is the GGUF key (e.g. ``general.architecture``).
        """
        hf = hf_config_from_gguf(metadata, vocab_size=vocab_size, tied=tied)
        try:
            return cls.from_hf(hf)
        except ConfigError as exc:
            key = gguf_key_of(str(metadata.get("general.architecture")), exc.key)
            raise ConfigError(f"GGUF metadata {key!r}: {exc}", key) from None

    def _check_groups(self, count_key: str) -> None:
        """Refuse group-limited routing that cannot work (values known only)."""
        e, k, ng, tg = self.num_experts, self.top_k, self.n_group, self.topk_group
        if e and ng and e % ng:
            raise ConfigError(f"config.json: {count_key}={e} is not divisible by n_group={ng}", "n_group")
        if ng and tg and tg > ng:
            raise ConfigError(f"config.json: topk_group={tg} exceeds n_group={ng}", "topk_group")
        if e and k and ng and tg and k > tg * (e // ng):
            raise ConfigError(f"config.json: num_experts_per_tok={k} exceeds the {tg * (e // ng)} experts "
                              "routing can reach", "num_experts_per_tok")

    def key_of(self, name: str) -> str:
        """The ``config.json`` key that field ``name`` is read from."""
        if name == "moe_intermediate_size" and self.family in _DENSE_WIDTH:
            return "intermediate_size"
        return _KEY_OF.get(name, name)

    def need(self, name: str) -> Any:
        """Field ``name``'s value; raises ``ConfigError`` naming its key when ``config.json`` lacks it."""
        value = getattr(self, name)
        if value is None:
            key = self.key_of(name)
            raise ConfigError(f"config.json ({self.family}) lacks required field {key!r}", key)
        return value

    def moe_layers(self) -> tuple[int, ...] | None:
        """The MoE layer ids ascending, or None when the layer count or dense prefix is unknown."""
        if self.num_hidden_layers is None or self.first_k_dense_replace is None:
            return None
        return tuple(i for i in range(self.num_hidden_layers) if is_moe_layer(self, i))

    def fp8_block(self) -> tuple[int, int]:
        """``(rows, cols)`` of FP8 ``weight_scale_inv`` blocks (128×128 when unquantized).

        Raises ``ConfigError`` for a ``quantization_config`` the extractor cannot decode
        (anything but FP8 e4m3, or gpt-oss MXFP4 experts).
        """
        qc = self.quantization_config
        if qc is None:
            return (128, 128)
        if not isinstance(qc, dict):
            raise ConfigError("config.json field 'quantization_config' must be an object", "quantization_config")
        method = qc.get("quant_method")
        if method == "mxfp4" and self.family == "gpt_oss":
            return (128, 128)  # MXFP4 expert blocks are decoded by the gpt-oss layout
        if method != "fp8":
            raise ConfigError(f"config.json quantization_config.quant_method={method!r} is not supported; "
                              "supported: unquantized (bf16/f16/f32) or 'fp8' (e4m3 with weight_scale_inv)",
                              "quantization_config")
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ConfigError(f"config.json quantization_config.fmt={fmt!r} is not supported (only e4m3)",
                              "quantization_config")
        block = qc.get("weight_block_size", [128, 128])
        if (not isinstance(block, list) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ConfigError("config.json quantization_config.weight_block_size must be [rows, cols], "
                              f"got {block!r}", "quantization_config")
        return (block[0], block[1])


def is_moe_layer(c, layer: int) -> bool:
    """Whether decoder layer ``layer`` (0-based) of ``c`` has experts.

    ``c`` is a :class:`ModelConfig` or anything with its ``family``, ``num_hidden_layers`` and
    layer-map fields (``prepare.layouts.MoeSpec``). Qwen (HF ``configuration_qwen3_moe.py``):
    not in ``mlp_only_layers`` and ``(layer + 1) % decoder_sparse_step == 0``; mixtral and
    gpt_oss: every layer; DeepSeek-like: ``layer >= first_k_dense_replace`` and ``layer %
    moe_layer_freq == 0``. Layers at or past ``num_hidden_layers`` (MTP) never are.
    """
    if not 0 <= layer < c.num_hidden_layers:
        return False
    if c.family in QWEN_LIKE:
        return layer not in c.mlp_only_layers and (layer + 1) % c.decoder_sparse_step == 0
    if c.family in _DENSE_WIDTH:
        return True
    return layer >= c.first_k_dense_replace and layer % c.moe_layer_freq == 0


# --------------------------------------------------------------------------------------
# GGUF metadata (llama.cpp ``convert_hf_to_gguf.py`` / ``gguf-py`` ``Keys.LLM``)

GGUF_ARCHITECTURES = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "deepseek2": "deepseek_v3",
                      "llama": "mixtral"}
_GGUF_HF_ARCH = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM", "mixtral": "MixtralForCausalLM"}
# config.json key -> GGUF key (``{arch}`` filled in), for error messages and the translation.
_GGUF_KEYS = {
    "hidden_size": "{arch}.embedding_length", "num_hidden_layers": "{arch}.block_count",
    "num_attention_heads": "{arch}.attention.head_count", "num_key_value_heads": "{arch}.attention.head_count_kv",
    "rms_norm_eps": "{arch}.attention.layer_norm_rms_epsilon", "max_position_embeddings": "{arch}.context_length",
    "rope_theta": "{arch}.rope.freq_base", "intermediate_size": "{arch}.feed_forward_length",
    "num_experts_per_tok": "{arch}.expert_used_count", "num_experts": "{arch}.expert_count",
    "num_local_experts": "{arch}.expert_count", "n_routed_experts": "{arch}.expert_count",
    "moe_intermediate_size": "{arch}.expert_feed_forward_length",
    "shared_expert_intermediate_size": "{arch}.expert_shared_feed_forward_length",
    "head_dim": "{arch}.attention.key_length", "n_shared_experts": "{arch}.expert_shared_count",
    "first_k_dense_replace": "{arch}.leading_dense_block_count",
    "routed_scaling_factor": "{arch}.expert_weights_scale", "norm_topk_prob": "{arch}.expert_weights_norm",
    "n_group": "{arch}.expert_group_count", "topk_group": "{arch}.expert_group_used_count",
    "q_lora_rank": "{arch}.attention.q_lora_rank", "kv_lora_rank": "{arch}.attention.kv_lora_rank",
    "qk_rope_head_dim": "{arch}.rope.dimension_count", "qk_nope_head_dim": "{arch}.attention.key_length_mla",
    "v_head_dim": "{arch}.attention.value_length_mla", "vocab_size": "{arch}.vocab_size",
    "scoring_func": "{arch}.expert_gating_func", "rope_scaling": "{arch}.rope.scaling.type",
}


def gguf_key_of(arch: str, hf_key: str) -> str:
    """The GGUF metadata key that ``config.json`` key ``hf_key`` is translated from (itself
    when there is none, e.g. ``general.architecture``)."""
    return _GGUF_KEYS.get(hf_key, hf_key).format(arch=arch)


def hf_config_from_gguf(metadata: Mapping, *, vocab_size: int | None = None, tied: bool = False) -> dict:
    """The ``config.json`` (a dict) that GGUF ``metadata`` describes, for ``ModelConfig.from_hf``.

    Architectures (``general.architecture``): ``qwen3moe`` → ``qwen3_moe`` (llama.cpp always
    renormalises the top-k: ``norm_topk_prob`` true), ``qwen2moe`` → ``qwen2_moe`` (never
    renormalises), ``deepseek2`` → ``deepseek_v3`` (sigmoid gating only: MLA sizes from
    ``key_length_mla``/``value_length_mla`` when present, else the pre-MLA
    ``key_length``/``value_length``; ``head_count_kv`` of llama.cpp's MQA view is ignored),
    ``llama`` with ``llama.expert_count`` > 0 → ``mixtral``. Rope scaling: none, ``linear``
    or ``yarn`` (DeepSeek's ``yarn_log_multiplier`` = 0.1 × ``mscale_all_dim``).

    Raises ``ConfigError`` naming the GGUF key for an unknown architecture, a dense ``llama``,
    a per-layer (array) value where one number is needed, a gating function or rope scaling
    we do not reproduce.
    """
    if not isinstance(metadata, Mapping):
        raise ConfigError("GGUF metadata must be a mapping of keys to values", "metadata")
    arch = metadata.get("general.architecture")
    if arch == "gpt-oss":  # its safetensors experts are read (MXFP4); a GGUF of it needs what we lack
        raise ConfigError("GGUF general.architecture='gpt-oss' is not supported: there is no gpt-oss backbone "
                          "here (attention sinks, alternating sliding-window layers) and no reader for GGUF's "
                          "MXFP4 expert stacks with their biases; publish its safetensors checkpoint instead",
                          "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError(f"GGUF general.architecture={arch!r} is not supported; supported: "
                          f"{', '.join(GGUF_ARCHITECTURES)} (llama only with experts)", "general.architecture")
    family = GGUF_ARCHITECTURES[arch]

    def get(hf_key: str, default=None):
        key = gguf_key_of(arch, hf_key)
        v = metadata.get(key, default)
        if isinstance(v, (list, tuple)):
            raise ConfigError(f"GGUF metadata {key!r} is a per-layer array {list(v)[:8]}...; only one value "
                              "for every layer is supported", key)
        return v

    c: dict = {"model_type": family, "architectures": [_GGUF_HF_ARCH[family]]}
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
              "max_position_embeddings", "rope_theta", "intermediate_size", "num_experts_per_tok", "vocab_size"):
        if (v := get(k)) is not None:
            c[k] = v
    if "vocab_size" not in c and vocab_size is not None:
        c["vocab_size"] = vocab_size
    c["tie_word_embeddings"] = bool(tied)
    experts = get("num_experts")
    if family == "mixtral":
        if not experts:
            raise ConfigError("GGUF llama.expert_count is absent or 0: a dense llama model has no experts to serve",
                              "llama.expert_count")
        c["num_local_experts"] = experts
    elif family == "deepseek_v3":
        c["n_routed_experts"] = experts
    else:
        c["num_experts"] = experts
    if family != "mixtral":
        c["moe_intermediate_size"] = get("moe_intermediate_size")
    if family in ("qwen3_moe", "mixtral") and get("head_dim") is not None:
        c["head_dim"] = get("head_dim")
    if family == "qwen3_moe":
        c["norm_topk_prob"] = True  # llama.cpp's qwen3moe graph always renormalises
    if family == "qwen2_moe":
        c["norm_topk_prob"] = False  # and qwen2moe's never does
        c["shared_expert_intermediate_size"] = get("shared_expert_intermediate_size") or 0
    if family == "deepseek_v3":
        gating = get("scoring_func", 1)
        if gating != 2:
            raise ConfigError(f"GGUF {arch}.expert_gating_func={gating!r}: only 2 (sigmoid, DeepSeek V3 / Kimi K2) "
                              "is supported; softmax-gated DeepSeek V2 is not", f"{arch}.expert_gating_func")
        c["scoring_func"] = "sigmoid"
        c["num_key_value_heads"] = c.get("num_attention_heads")  # MLA: the MQA head count is llama.cpp's view
        for k in ("n_shared_experts", "first_k_dense_replace", "routed_scaling_factor", "n_group", "topk_group",
                  "q_lora_rank", "kv_lora_rank"):
            if (v := get(k)) is not None:
                c[k] = v
        c["norm_topk_prob"] = bool(get("norm_topk_prob", False))
        rope = get("qk_rope_head_dim")
        c["qk_rope_head_dim"] = rope
        key_mla = metadata.get(f"{arch}.attention.key_length_mla")
        if key_mla is not None:
            c["qk_nope_head_dim"] = key_mla - (rope or 0)
            c["v_head_dim"] = metadata.get(f"{arch}.attention.value_length_mla")
        else:  # files from before llama.cpp's MLA split
            key_len = metadata.get(f"{arch}.attention.key_length")
            c["qk_nope_head_dim"] = None if key_len is None else key_len - (rope or 0)
            c["v_head_dim"] = metadata.get(f"{arch}.attention.value_length")
        c["rope_interleave"] = True
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        factor = metadata.get(f"{arch}.rope.scaling.factor")
        if scaling == "linear":
            c["rope_scaling"] = {"rope_type": "linear", "factor": factor}
        elif scaling == "yarn":
            rs = {"rope_type": "yarn", "factor": factor,
                  "original_max_position_embeddings": metadata.get(f"{arch}.rope.scaling.original_context_length")}
            for hk, gk in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
                if (v := metadata.get(f"{arch}.rope.scaling.{gk}")) is not None:
                    rs[hk] = v
            log_mul = metadata.get(f"{arch}.rope.scaling.yarn_log_multiplier")
            if family == "deepseek_v3" and log_mul:
                rs["mscale_all_dim"] = rs["mscale"] = log_mul / 0.1
            c["rope_scaling"] = rs
        else:
            raise ConfigError(f"GGUF {arch}.rope.scaling.type={scaling!r} is not supported (none, linear, yarn)",
                              f"{arch}.rope.scaling.type")
    return c
