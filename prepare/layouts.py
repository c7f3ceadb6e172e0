"""Per-family MoE shape from ``config.json`` and checkpoint tensor names.

Families: ``qwen3_moe``, ``qwen2_moe``, ``mixtral``, ``deepseek_v3``, ``kimi_k2``, ``glm4_moe``,
``gpt_oss``; the config is read by ``moe.config.ModelConfig`` and the MoE-layer rules are
``moe.config.is_moe_layer`` (DeepSeek-style leading dense layers are refused for expert
extraction; multi-token-prediction layers past ``num_hidden_layers`` are never listed).

Tensor names (as on the Hub; reference ``gguf_quant_and_routing.md`` §4):

* router ``model.layers.{L}.mlp.gate.weight`` ``[E, H]`` (Mixtral:
  ``model.layers.{L}.block_sparse_moe.gate.weight``), DeepSeek-style correction bias
  ``model.layers.{L}.mlp.gate.e_score_correction_bias`` ``[E]`` (f32);
* per-expert ``model.layers.{L}.mlp.experts.{e}.{gate,up,down}_proj.weight`` (Mixtral:
  ``block_sparse_moe.experts.{e}.w1`` = gate, ``w3`` = up, ``w2`` = down);
* fused 3-D (transformers 5, Qwen3.5, Mixtral v5): ``model.layers.{L}.mlp.experts.gate_up_proj``
  ``[E, 2F, H]`` (gate = rows ``[:F]``, up = rows ``[F:]``) and ``...experts.down_proj``
  ``[E, H, F]``; the transposed orientation ``[E, H, 2F]`` / ``[E, F, H]`` (Qwen3-VL) is
  recognised from the shapes. Expert e is the contiguous slab ``[e]``: only it is read;
* shared expert, addressed as expert ``num_experts``: DeepSeek/Kimi/GLM
  ``mlp.shared_experts.{p}.weight`` (width ``n_shared_experts × moe_intermediate_size``),
  Qwen2 ``mlp.shared_expert.{p}.weight`` (width ``shared_expert_intermediate_size``) with its
  gate ``mlp.shared_expert_gate.weight`` ``[1, H]``.

* gpt-oss (every layer MoE): router ``mlp.router.weight`` + ``mlp.router.bias`` (added to
  the logits); experts fused MXFP4 ``mlp.experts.gate_up_proj_blocks`` ``[E, 2F, H/32, 16]`` +
  ``_scales`` ``[E, 2F, H/32]`` and ``down_proj_blocks``/``_scales`` (or the dequantized HF
  layout ``gate_up_proj`` ``[E, H, 2F]``, ``down_proj`` ``[E, F, H]``), biases
  ``gate_up_proj_bias`` ``[E, 2F]`` / ``down_proj_bias`` ``[E, H]``; gate/up rows are
  interleaved (even = gate, odd = up); the FFN is the clamped SwiGLU (``swiglu_limit``).

Source dtypes: BF16, F16, F32 and FP8 e4m3 with ``weight_scale_inv`` block scales (decoded
by ``Checkpoint.read``). Checkpoints whose ``quantization_config`` names another method
(e.g. compressed-tensors INT4) are refused.

Pure Python + numpy; imports nothing from Django.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe.codec import CheckpointError, decode_mxfp4
from moe.config import DEEPSEEK_LIKE, EXPERT_COUNT_KEYS, QWEN_LIKE, ModelConfig, is_moe_layer
from moe.families import SUPPORTED_FAMILIES
from moe.ffn import PROJECTIONS, ExpertWeights
from moe.gating import Gate
from prepare.checkpoint import Checkpoint

_MIXTRAL_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


@dataclass(frozen=True)
class MoeSpec:
    """MoE shape and routing parameters of one model, read from its ``config.json``.

    ``family`` is the config ``model_type``; ``num_experts`` routed experts E; ``top_k``
    (``num_experts_per_tok``); ``hidden_size`` H; ``moe_intermediate_size`` F per routed
    expert (Mixtral: ``intermediate_size``); ``n_shared_experts`` (DeepSeek-like: fused
    into one FFN of width ``n_shared × F``; qwen2_moe: 1 when it has a shared expert; 0
    otherwise); ``shared_expert_intermediate_size`` (qwen2_moe's shared width, else 0);
    ``norm_topk_prob``; ``routed_scaling_factor``; ``n_group``; ``topk_group``;
    ``first_k_dense_replace``, ``moe_layer_freq`` (DeepSeek-like); ``decoder_sparse_step``,
    ``mlp_only_layers`` (Qwen); ``num_hidden_layers``; ``fp8_block`` (rows, cols) of FP8
    ``weight_scale_inv`` blocks, from ``quantization_config.weight_block_size``.
    """

    family: str
    num_experts: int
    top_k: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    n_shared_experts: int = 0
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0
    fp8_block: tuple[int, int] = (128, 128)
    swiglu_limit: float = 7.0

    @property
    def shared_slot(self) -> int | None:
        """Expert id of the shared expert (``num_experts``), or None without one."""
        return self.num_experts if self.n_shared_experts > 0 else None

    @property
    def shared_intermediate_size(self) -> int:
        """Width of the shared expert: ``n_shared_experts × moe_intermediate_size``
        (DeepSeek-like) or ``shared_expert_intermediate_size`` (qwen2_moe)."""
        if self.family == "qwen2_moe":
            return self.shared_expert_intermediate_size
        return self.n_shared_experts * self.moe_intermediate_size

    @property
    def prefix(self) -> str:
        """Per-layer module path of the MoE block, with ``{layer}`` to fill."""
        return "model.layers.{layer}." + ("block_sparse_moe" if self.family == "mixtral" else "mlp")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based, < ``num_hidden_layers``) is MoE (``moe.config.is_moe_layer``)."""
        return is_moe_layer(self, layer)

    def moe_layers(self) -> list[int]:
        """The MoE layer indices, ascending."""
        return [layer for layer in range(self.num_hidden_layers) if self.is_moe_layer(layer)]

    def check_layer(self, layer: int) -> int:
        """Return ``layer`` if it is an MoE layer; raise ``ValueError`` saying why not (a
        leading dense layer of DeepSeek/Kimi/GLM is refused: it has no experts to extract)."""
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise ValueError(f"layer must be an integer, got {layer!r}")
        if not 0 <= layer < self.num_hidden_layers:
            raise ValueError(f"layer {layer} is out of range: the model has {self.num_hidden_layers} "
                             f"decoder layers (0..{self.num_hidden_layers - 1})")
        if not self.is_moe_layer(layer):
            if self.family in QWEN_LIKE:
                why = f"mlp_only_layers={list(self.mlp_only_layers)}, decoder_sparse_step={self.decoder_sparse_step}"
            else:
                why = f"first_k_dense_replace={self.first_k_dense_replace}"
                if self.moe_layer_freq != 1:
                    why += f", moe_layer_freq={self.moe_layer_freq}"
            raise ValueError(f"layer {layer} is a dense layer ({why}); MoE layers: {self.moe_layers()}")
        return layer

    def check_expert(self, layer: int, expert: int) -> int:
        """Return ``expert`` if it names a routed expert (0..E-1) or the shared slot (E);
        raise ``ValueError`` otherwise."""
        if isinstance(expert, bool) or not isinstance(expert, int):
            raise ValueError(f"expert must be an integer, got {expert!r}")
        top = self.num_experts if self.shared_slot is not None else self.num_experts - 1
        if not 0 <= expert <= top:
            shared = (f" and the shared expert {self.num_experts}" if self.shared_slot is not None
                      else " and no shared expert")
            raise ValueError(f"expert {expert} is out of range: layer {layer} has {self.num_experts} routed "
                             f"experts (0..{self.num_experts - 1}){shared}")
        return expert

    def slots(self) -> int:
        """Expert ids per layer: routed experts plus the shared slot when there is one."""
        return self.num_experts + (1 if self.shared_slot is not None else 0)

    def gate_tensor_names(self, layer: int) -> dict[str, str]:
        """Checkpoint names of layer ``layer``'s router: ``{"weight": ...}`` plus ``"bias"``
        (DeepSeek-like correction bias) or ``"shared_gate"`` (qwen2_moe). Raises
        ``ValueError`` for a non-MoE layer."""
        self.check_layer(layer)
        pre = self.prefix.format(layer=layer)
        if self.family == "gpt_oss":
            return {"weight": f"{pre}.router.weight", "logit_bias": f"{pre}.router.bias"}
        names = {"weight": f"{pre}.gate.weight"}
        if self.family in DEEPSEEK_LIKE:
            names["bias"] = f"{pre}.gate.e_score_correction_bias"
        if self.family == "qwen2_moe" and self.shared_slot is not None:
            names["shared_gate"] = f"{pre}.shared_expert_gate.weight"
        return names

    def fused_tensor_names(self, layer: int) -> dict[str, str]:
        """Names of the fused 3-D expert tensors of ``layer``: ``{"gate_up": ..., "down": ...}``
        (``model.layers.{L}.mlp.experts.gate_up_proj`` / ``.down_proj``)."""
        self.check_layer(layer)
        pre = f"model.layers.{layer}.mlp.experts"
        return {"gate_up": f"{pre}.gate_up_proj", "down": f"{pre}.down_proj"}

    def expert_tensor_names(self, layer: int, expert: int) -> dict[str, str]:
        """Checkpoint names ``{"gate_proj": ..., "up_proj": ..., "down_proj": ...}`` of
        expert ``expert`` (``num_experts`` = the shared expert) in layer ``layer``, for
        per-expert checkpoints. Raises ``ValueError`` for a non-MoE layer or an
        out-of-range expert."""
        self.check_layer(layer)
        self.check_expert(layer, expert)
        pre = self.prefix.format(layer=layer)
        if expert == self.shared_slot:
            shared = "shared_expert" if self.family == "qwen2_moe" else "shared_experts"
            return {p: f"{pre}.{shared}.{p}.weight" for p in PROJECTIONS}
        if self.family == "mixtral":
            return {p: f"{pre}.experts.{expert}.{_MIXTRAL_NAMES[p]}.weight" for p in PROJECTIONS}
        return {p: f"{pre}.experts.{expert}.{p}.weight" for p in PROJECTIONS}


def spec_from_config(config: dict) -> MoeSpec:
    """Build the ``MoeSpec`` of ``config`` (a parsed ``config.json``, read by ``moe.config.ModelConfig``).

    Defaults when absent: ``norm_topk_prob`` False for qwen3_moe/qwen2_moe (HF config
    classes), True for DeepSeek-like and always True for Mixtral; ``routed_scaling_factor``
    1.0; ``n_group``/``topk_group`` 1; ``first_k_dense_replace`` 0; ``moe_layer_freq`` 1;
    ``decoder_sparse_step`` 1; ``mlp_only_layers`` []; ``n_shared_experts`` 0.

    Raises ``ValueError`` naming ``model_type`` and the supported list for another family,
    and naming the field for a missing, mistyped or inconsistent value or an unsupported
    ``quantization_config``.
    """
    cfg = ModelConfig.from_hf(config)
    family = cfg.family
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(f"unsupported model_type {family!r}; supported: {', '.join(SUPPORTED_FAMILIES)}")
    if cfg.num_experts is None:
        raise ValueError(f"config.json ({family}) names no expert count ({', '.join(EXPERT_COUNT_KEYS)})")
    deepseek = family in DEEPSEEK_LIKE
    return MoeSpec(
        family=family,
        num_experts=cfg.num_experts,
        top_k=cfg.need("top_k"),
        hidden_size=cfg.need("hidden_size"),
        moe_intermediate_size=cfg.need("moe_intermediate_size"),
        num_hidden_layers=cfg.need("num_hidden_layers"),
        n_shared_experts=cfg.n_shared_experts or 0,
        norm_topk_prob=deepseek if cfg.norm_topk_prob is None else cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor or 1.0,
        n_group=cfg.n_group or 1,
        topk_group=cfg.topk_group or 1,
        first_k_dense_replace=cfg.first_k_dense_replace or 0,
        moe_layer_freq=cfg.moe_layer_freq,
        decoder_sparse_step=cfg.decoder_sparse_step,
        mlp_only_layers=cfg.mlp_only_layers,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
        fp8_block=cfg.fp8_block(),
        swiglu_limit=cfg.swiglu_limit,
    )


def _check(name: str, arr: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if arr.shape != shape:
        raise ValueError(f"tensor {name!r} has shape {arr.shape}; the config implies {shape}")
    if not np.isfinite(arr).all():
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(arr))[0])
        raise ValueError(f"tensor {name!r} holds NaN or infinity (first at index {bad})")
    return arr


def _read(ckpt: Checkpoint, spec: MoeSpec, name: str, shape: tuple[int, ...]) -> np.ndarray:
    return _check(name, ckpt.read(name, fp8_block=spec.fp8_block), shape)


def load_gate(ckpt: Checkpoint, spec: MoeSpec, layer: int) -> Gate:
    """Read layer ``layer``'s router from ``ckpt`` → ``Gate`` (weight ``[E, H]`` float32,
    plus the float32 correction bias ``[E]`` for DeepSeek-like families, or the qwen2_moe
    shared-expert gate ``[1, H]``) carrying the spec's routing parameters. Reads only those
    tensors' byte ranges.

    Raises ``ValueError`` for a dense or out-of-range layer, a shape that disagrees with
    the config or non-finite values (naming the tensor), and ``CheckpointError`` for a
    missing or unreadable tensor.
    """
    names = spec.gate_tensor_names(layer)
    if spec.family == "mixtral" and not ckpt.has(names["weight"]):
        names["weight"] = f"model.layers.{layer}.mlp.gate.weight"  # transformers 5 renames block_sparse_moe
    weight = _read(ckpt, spec, names["weight"], (spec.num_experts, spec.hidden_size))
    bias = _read(ckpt, spec, names["bias"], (spec.num_experts,)) if "bias" in names else None
    sgate = _read(ckpt, spec, names["shared_gate"], (1, spec.hidden_size)) if "shared_gate" in names else None
    lbias = _read(ckpt, spec, names["logit_bias"], (spec.num_experts,)) if "logit_bias" in names else None
    return Gate(family=spec.family, weight=weight, correction_bias=bias, top_k=spec.top_k,
                norm_topk_prob=spec.norm_topk_prob, routed_scaling_factor=spec.routed_scaling_factor,
                n_group=spec.n_group, topk_group=spec.topk_group,
                n_shared_experts=spec.n_shared_experts, num_experts=spec.num_experts, shared_gate=sgate,
                logit_bias=lbias)


def is_fused(ckpt: Checkpoint, spec: MoeSpec, layer: int) -> bool:
    """Whether ``layer``'s routed experts are stored as fused 3-D tensors."""
    return ckpt.has(spec.fused_tensor_names(layer)["gate_up"])


def _oss_names(ckpt: Checkpoint, layer: int) -> dict[str, str]:
    pre = f"model.layers.{layer}.mlp.experts"
    if ckpt.has(f"{pre}.gate_up_proj_blocks"):
        return {k: f"{pre}.{k}" for k in ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias",
                                          "down_proj_blocks", "down_proj_scales", "down_proj_bias")}
    return {k: f"{pre}.{k}" for k in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")}


def _load_gpt_oss(ckpt: Checkpoint, spec: MoeSpec, layer: int, expert: int) -> ExpertWeights:
    """gpt-oss expert ``expert``: MXFP4 blocks (``[E, 2F, H/32, 16]`` + scales) or the
    dequantized HF layout (``gate_up_proj`` ``[E, H, 2F]``, ``down_proj`` ``[E, F, H]``);
    gate = rows 0::2, up = rows 1::2 of the ``[2F, H]`` matrix (interleaved), with biases."""
    n = _oss_names(ckpt, layer)
    f, h = spec.moe_intermediate_size, spec.hidden_size
    if "gate_up_proj_blocks" in n:
        gu = decode_mxfp4(ckpt.read_slab_u8(n["gate_up_proj_blocks"], expert),
                          ckpt.read_slab_u8(n["gate_up_proj_scales"], expert), n["gate_up_proj_blocks"])
        down = decode_mxfp4(ckpt.read_slab_u8(n["down_proj_blocks"], expert),
                            ckpt.read_slab_u8(n["down_proj_scales"], expert), n["down_proj_blocks"])
    else:
        gu = ckpt.read_slab(n["gate_up_proj"], expert).T
        down = ckpt.read_slab(n["down_proj"], expert).T
    _check(f"{n.get('gate_up_proj_blocks', n.get('gate_up_proj'))}[{expert}]", gu, (2 * f, h))
    _check(f"{n.get('down_proj_blocks', n.get('down_proj'))}[{expert}]", down, (h, f))
    gub = _check(f"{n['gate_up_proj_bias']}[{expert}]", ckpt.read_slab(n["gate_up_proj_bias"], expert), (2 * f,))
    db = _check(f"{n['down_proj_bias']}[{expert}]", ckpt.read_slab(n["down_proj_bias"], expert), (h,))
    return ExpertWeights(gate_proj=gu[0::2], up_proj=gu[1::2], down_proj=down, gate_bias=gub[0::2],
                         up_bias=gub[1::2], down_bias=db, activation="swiglu_oss", swiglu_limit=spec.swiglu_limit)


def expert_sources(ckpt: Checkpoint, spec: MoeSpec, layer: int, expert: int) -> list[str]:
    """The checkpoint tensors expert ``expert`` of ``layer`` is read from (for progress)."""
    if spec.family == "gpt_oss":
        spec.check_expert(layer, expert)
        return list(_oss_names(ckpt, layer).values())
    if expert != spec.shared_slot and is_fused(ckpt, spec, layer):
        spec.check_expert(layer, expert)
        return list(spec.fused_tensor_names(layer).values())
    return list(spec.expert_tensor_names(layer, expert).values())


def source_dtype(ckpt: Checkpoint, spec: MoeSpec, layer: int, expert: int) -> str:
    """The blob dtype that keeps expert ``expert``'s dense projections exact and no larger
    than the source: ``"bf16"`` for BF16, ``"f16"`` for F16, else ``"f32"`` (F32, and FP8
    whose scaled values need f32)."""
    dtypes = {ckpt.info(n).dtype for n in expert_sources(ckpt, spec, layer, expert)}
    if dtypes == {"BF16"}:
        return "bf16"
    if dtypes == {"F16"}:
        return "f16"
    return "f32"


def _load_fused(ckpt: Checkpoint, spec: MoeSpec, layer: int, expert: int) -> ExpertWeights:
    names = spec.fused_tensor_names(layer)
    e, f, h = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
    gu_shape, d_shape = ckpt.info(names["gate_up"]).shape, ckpt.info(names["down"]).shape
    if gu_shape == (e, 2 * f, h):
        gate_up = ckpt.read_slab(names["gate_up"], expert)
    elif gu_shape == (e, h, 2 * f):  # Qwen3-VL orientation: [E, in, out]
        gate_up = ckpt.read_slab(names["gate_up"], expert).T
    else:
        raise ValueError(f"tensor {names['gate_up']!r} has shape {gu_shape}; the config implies "
                         f"{(e, 2 * f, h)} (or {(e, h, 2 * f)})")
    if d_shape == (e, h, f):
        down = ckpt.read_slab(names["down"], expert)
    elif d_shape == (e, f, h):
        down = ckpt.read_slab(names["down"], expert).T
    else:
        raise ValueError(f"tensor {names['down']!r} has shape {d_shape}; the config implies {(e, h, f)} "
                         f"(or {(e, f, h)})")
    where = f"{names['gate_up']}[{expert}]"
    _check(where, gate_up, (2 * f, h))
    _check(f"{names['down']}[{expert}]", down, (h, f))
    return ExpertWeights(gate_proj=gate_up[:f], up_proj=gate_up[f:], down_proj=down)


def load_expert(ckpt: Checkpoint, spec: MoeSpec, layer: int, expert: int) -> ExpertWeights:
    """Read expert ``expert`` of layer ``layer`` (``spec.num_experts`` = the shared
    expert) → float32 ``ExpertWeights``. Only the needed byte ranges are read: the three
    per-expert tensors (plus FP8 scales), or expert e's slab of fused 3-D tensors.

    Raises ``ValueError`` for a dense or out-of-range layer, an out-of-range expert, or a
    shape that disagrees with the config or non-finite values (naming the tensor), and
    ``CheckpointError`` for a missing or unreadable tensor.
    """
    spec.check_layer(layer)
    spec.check_expert(layer, expert)
    if spec.family == "gpt_oss":
        return _load_gpt_oss(ckpt, spec, layer, expert)
    if expert != spec.shared_slot and is_fused(ckpt, spec, layer):
        return _load_fused(ckpt, spec, layer, expert)
    names = spec.expert_tensor_names(layer, expert)
    f = spec.shared_intermediate_size if expert == spec.shared_slot else spec.moe_intermediate_size
    h = spec.hidden_size
    return ExpertWeights(
        gate_proj=_read(ckpt, spec, names["gate_proj"], (f, h)),
        up_proj=_read(ckpt, spec, names["up_proj"], (f, h)),
        down_proj=_read(ckpt, spec, names["down_proj"], (h, f)),
    )


__all__ = ["CheckpointError", "MoeSpec", "SUPPORTED_FAMILIES", "expert_sources", "is_fused", "load_expert",
           "load_gate", "source_dtype", "spec_from_config"]
