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
