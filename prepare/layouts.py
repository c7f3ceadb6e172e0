"""Per-family MoE shape from ``config.json`` and checkpoint tensor names.

Families: ``qwen3_moe`` (HF ``transformers/models/qwen3_moe/configuration_qwen3_moe.py`` and
``modeling_qwen3_moe.py``: a layer is MoE iff it is not in ``mlp_only_layers`` and
``(layer + 1) % decoder_sparse_step == 0``), ``deepseek_v3`` and ``kimi_k2`` (HF
``deepseek_v3/configuration_deepseek_v3.py``; a layer is MoE iff
``layer >= first_k_dense_replace`` and ``layer % moe_layer_freq == 0``; layers at or beyond
``num_hidden_layers`` are multi-token-prediction layers and never listed).

Tensor names (as on the Hub): router ``model.layers.{L}.mlp.gate.weight`` ``[E, H]``,
DeepSeek correction bias ``model.layers.{L}.mlp.gate.e_score_correction_bias`` ``[E]``,
expert ``model.layers.{L}.mlp.experts.{e}.{gate,up,down}_proj.weight`` and the DeepSeek
shared expert ``model.layers.{L}.mlp.shared_experts.{gate,up,down}_proj.weight`` (width
``n_shared_experts × moe_intermediate_size``), addressed as expert ``num_experts``.

Pure Python + numpy; imports nothing from Django.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from holders.ffn import PROJECTIONS, ExpertWeights
from holders.gating import Gate
from prepare.checkpoint import Checkpoint

SUPPORTED_FAMILIES = ("qwen3_moe", "deepseek_v3", "kimi_k2")
_DEEPSEEK_LIKE = ("deepseek_v3", "kimi_k2")
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class MoeSpec:
    """MoE shape and routing parameters of one model, read from its ``config.json``.

    ``family`` is the config ``model_type``; ``num_experts`` routed experts E; ``top_k``
    (``num_experts_per_tok``); ``hidden_size`` H; ``moe_intermediate_size`` F per routed
    expert; ``n_shared_experts`` (fused into one FFN of width ``n_shared × F``; 0 for
    qwen3_moe); ``norm_topk_prob``; ``routed_scaling_factor``; ``n_group``; ``topk_group``;
    ``first_k_dense_replace``, ``moe_layer_freq`` (deepseek/kimi); ``decoder_sparse_step``,
    ``mlp_only_layers`` (qwen3_moe); ``num_hidden_layers``.
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

    @property
    def shared_slot(self) -> int | None:
        """Expert id of the fused shared expert (``num_experts``), or None without one."""
        return self.num_experts if self.n_shared_experts > 0 else None

    @property
    def shared_intermediate_size(self) -> int:
        """Width of the fused shared expert: ``n_shared_experts × moe_intermediate_size``."""
        return self.n_shared_experts * self.moe_intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based, < ``num_hidden_layers``) is MoE."""
        if not 0 <= layer < self.num_hidden_layers:
            return False
        if self.family == "qwen3_moe":
            return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    def moe_layers(self) -> list[int]:
        """The MoE layer indices, ascending."""
        return [layer for layer in range(self.num_hidden_layers) if self.is_moe_layer(layer)]

    def check_layer(self, layer: int) -> int:
        """Return ``layer`` if it is an MoE layer; raise ``ValueError`` saying why not."""
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise ValueError(f"layer must be an integer, got {layer!r}")
        if not 0 <= layer < self.num_hidden_layers:
            raise ValueError(f"layer {layer} is out of range: the model has {self.num_hidden_layers} "
                             f"decoder layers (0..{self.num_hidden_layers - 1})")
        if not self.is_moe_layer(layer):
            if self.family == "qwen3_moe":
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

    def gate_tensor_names(self, layer: int) -> dict[str, str]:
        """Checkpoint names of layer ``layer``'s router: ``{"weight": ..., "bias": ...}``
        (``bias`` only for deepseek/kimi). Raises ``ValueError`` for a non-MoE layer."""
        self.check_layer(layer)
        names = {"weight": f"model.layers.{layer}.mlp.gate.weight"}
        if self.family in _DEEPSEEK_LIKE:
            names["bias"] = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
        return names

    def expert_tensor_names(self, layer: int, expert: int) -> dict[str, str]:
        """Checkpoint names ``{"gate_proj": ..., "up_proj": ..., "down_proj": ...}`` of
        expert ``expert`` (``num_experts`` = the shared expert) in layer ``layer``.
        Raises ``ValueError`` for a non-MoE layer or an out-of-range expert."""
        self.check_layer(layer)
        self.check_expert(layer, expert)
        if expert == self.shared_slot:
            prefix = f"model.layers.{layer}.mlp.shared_experts"
        else:
            prefix = f"model.layers.{layer}.mlp.experts.{expert}"
        return {p: f"{prefix}.{p}.weight" for p in PROJECTIONS}


def _get_int(config: dict, key: str, default: int | None, lo: int) -> int:
    value = config.get(key, default)
    if value is None:
        raise ValueError(f"config.json ({config.get('model_type')}) lacks required field {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"config.json field {key!r} must be an integer >= {lo}, got {value!r}")
    return value


def spec_from_config(config: dict) -> MoeSpec:
    """Build the ``MoeSpec`` of ``config`` (a parsed ``config.json``).

    The routed-expert count comes from ``num_experts``, ``num_local_experts`` or
    ``n_routed_experts`` (transformers 5 writes ``num_local_experts`` where Hub Qwen3-MoE
    configs say ``num_experts``). Defaults when absent: ``norm_topk_prob`` False for
    qwen3_moe (``Qwen3MoeConfig``) and True for deepseek/kimi; ``routed_scaling_factor``
    1.0; ``n_group``/``topk_group`` 1; ``first_k_dense_replace`` 0; ``moe_layer_freq`` 1;
    ``decoder_sparse_step`` 1; ``mlp_only_layers`` []; ``n_shared_experts`` 0.

    Raises ``ValueError`` naming ``model_type`` and the supported list for another family,
    and naming the field for a missing, mistyped or inconsistent value.
    """
    if not isinstance(config, dict):
        raise ValueError("config must be a dict (the parsed config.json)")
    family = config.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(f"unsupported model_type {family!r}; supported: {', '.join(SUPPORTED_FAMILIES)}")
    counts = {k: config[k] for k in _EXPERT_COUNT_KEYS if config.get(k) is not None}
    if not counts:
        raise ValueError(f"config.json ({family}) names no expert count ({', '.join(_EXPERT_COUNT_KEYS)})")
    if len(set(map(str, counts.values()))) > 1:
        raise ValueError(f"config.json ({family}) has conflicting expert counts {counts}")
    key = next(iter(counts))
    num_experts = _get_int(config, key, None, 1)
    deepseek = family in _DEEPSEEK_LIKE
    norm = config.get("norm_topk_prob", deepseek)
    if not isinstance(norm, bool):
        raise ValueError(f"config.json field 'norm_topk_prob' must be true or false, got {norm!r}")
    rsf = config.get("routed_scaling_factor", 1.0)
    if isinstance(rsf, bool) or not isinstance(rsf, (int, float)) or not rsf > 0:
        raise ValueError(f"config.json field 'routed_scaling_factor' must be a positive number, got {rsf!r}")
    mlp_only = config.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in mlp_only):
        raise ValueError(f"config.json field 'mlp_only_layers' must be a list of integers, got {mlp_only!r}")
    spec = MoeSpec(
        family=family,
        num_experts=num_experts,
        top_k=_get_int(config, "num_experts_per_tok", None, 1),
        hidden_size=_get_int(config, "hidden_size", None, 1),
        moe_intermediate_size=_get_int(config, "moe_intermediate_size", None, 1),
        num_hidden_layers=_get_int(config, "num_hidden_layers", None, 1),
        n_shared_experts=_get_int(config, "n_shared_experts", 0, 0) if deepseek else 0,
        norm_topk_prob=norm,
        routed_scaling_factor=float(rsf),
        n_group=_get_int(config, "n_group", 1, 1) if deepseek else 1,
        topk_group=_get_int(config, "topk_group", 1, 1) if deepseek else 1,
        first_k_dense_replace=_get_int(config, "first_k_dense_replace", 0, 0) if deepseek else 0,
        moe_layer_freq=_get_int(config, "moe_layer_freq", 1, 1) if deepseek else 1,
        decoder_sparse_step=_get_int(config, "decoder_sparse_step", 1, 1) if not deepseek else 1,
        mlp_only_layers=tuple(sorted(set(mlp_only))) if not deepseek else (),
    )
    if spec.num_experts % spec.n_group:
        raise ValueError(f"config.json: {key}={spec.num_experts} is not divisible by n_group={spec.n_group}")
    if spec.topk_group > spec.n_group:
        raise ValueError(f"config.json: topk_group={spec.topk_group} exceeds n_group={spec.n_group}")
    if spec.top_k > spec.topk_group * (spec.num_experts // spec.n_group):
        raise ValueError(f"config.json: num_experts_per_tok={spec.top_k} exceeds the "
                         f"{spec.topk_group * (spec.num_experts // spec.n_group)} experts routing can reach")
    return spec


def _read(ckpt: Checkpoint, name: str, shape: tuple[int, ...]):
    arr = ckpt.read(name)
    if arr.shape != shape:
        raise ValueError(f"tensor {name!r} has shape {arr.shape}; the config implies {shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"tensor {name!r} holds NaN or infinity")
    return arr


def load_gate(ckpt: Checkpoint, spec: MoeSpec, layer: int) -> Gate:
    """Read layer ``layer``'s router from ``ckpt`` → ``Gate`` (weight ``[E, H]`` float32,
    plus the float32 correction bias ``[E]`` for deepseek/kimi) carrying the spec's routing
    parameters. Reads only those tensors' byte ranges.

    Raises ``ValueError`` for a dense or out-of-range layer or a shape that disagrees with
    the config, and ``CheckpointError`` for a missing or unreadable tensor.
    """
    names = spec.gate_tensor_names(layer)
    weight = _read(ckpt, names["weight"], (spec.num_experts, spec.hidden_size))
    bias = _read(ckpt, names["bias"], (spec.num_experts,)) if "bias" in names else None
    return Gate(family=spec.family, weight=weight, correction_bias=bias, top_k=spec.top_k,
                norm_topk_prob=spec.norm_topk_prob, routed_scaling_factor=spec.routed_scaling_factor,
                n_group=spec.n_group, topk_group=spec.topk_group,
                n_shared_experts=spec.n_shared_experts, num_experts=spec.num_experts)


def load_expert(ckpt: Checkpoint, spec: MoeSpec, layer: int, expert: int) -> ExpertWeights:
    """Read expert ``expert`` of layer ``layer`` (``spec.num_experts`` = the fused shared
    expert) → float32 ``ExpertWeights``; only those three tensors' byte ranges are read.

    Raises ``ValueError`` for a dense or out-of-range layer, an out-of-range expert, or a
    shape that disagrees with the config (naming the tensor), and ``CheckpointError`` for a
    missing or unreadable tensor.
    """
    names = spec.expert_tensor_names(layer, expert)
    f = spec.shared_intermediate_size if expert == spec.shared_slot else spec.moe_intermediate_size
    h = spec.hidden_size
    return ExpertWeights(
        gate_proj=_read(ckpt, names["gate_proj"], (f, h)),
        up_proj=_read(ckpt, names["up_proj"], (f, h)),
        down_proj=_read(ckpt, names["down_proj"], (h, f)),
    )
