"""Seed catalog of Mixture-of-Experts model shapes, as data (``seed_catalog.json`` beside this module).

Pure Python (no Django, no numpy). Every catalog entry is a frozen :class:`ModelShape`:
how many routed experts a model has, how many are picked per token, whether a layer has a
shared expert, the widths an expert FFN works with, which layers are MoE layers, and the
router math parameters. The registry, the planner, the repair pass and the prepare jobs
read expert sets from here (:meth:`ModelShape.expert_keys`), and the JSON-RPC method
``tenzro_moeCatalogShape`` answers with :meth:`ModelShape.catalog_shape` (:func:`shape_json`
for catalog ids; a model published on a site from a checkpoint gets its shape from its stored
``config.json`` through ``registry.selectors.catalog_shape``).

Where the numbers come from (each entry's ``source`` says which applies to it):

* Routed experts, experts per token and shared experts of every seed entry are the values
  of the reference system's catalog (``reference/tenzro_reference_system.md`` §12, the
  table of ``docs/AI.md`` §3.6), because this project reproduces that catalog. Where a
  public Hugging Face ``config.json`` / model card disagrees, the public value is recorded
  in ``public_disagreements`` (and explained in ``notes``) instead of being silently mixed
  in.
* Widths, layer counts, dense prefixes, routing parameters and parameter counts come from
  public configs or model cards (quoted through third-party copies where the Hub itself was
  not reachable; ``source`` names them). A value that could not be confirmed is ``None``
  and its field name is listed in ``unknown``; nothing is guessed.

Conventions (``docs/DESIGN.md`` §1): an expert key is ``(layer, expert)``; the shared expert(s)
of a layer are fused into one extra slot with index ``num_experts`` (width
``n_shared_experts × moe_intermediate_size``, combine weight 1.0).

Local checkpoints are added at runtime with :func:`register_local`, usually from
:meth:`ModelShape.from_hf_config`.
"""

from __future__ import annotations

import difflib
import json
import threading
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator, Mapping

from moe.config import EXPERT_COUNT_KEYS, TOP_K_KEYS, ConfigError, ModelConfig
from moe.families import SUPPORTED_FAMILIES

__all__ = [
    "ROUTING_KEYS",
    "SCORING_FUNCS",
    "EXPERT_FFNS",
    "NULLABLE_FIELDS",
    "HF_CONFIG_FAMILIES",
    "FrozenDict",
    "UnknownModelError",
    "UnknownShapeError",
    "ModelShape",
    "CATALOG",
    "get",
    "all_models",
    "shape_json",
    "register_local",
    "unregister_local",
]

# ---------------------------------------------------------------------------------------
# Schema constants
# ---------------------------------------------------------------------------------------

#: Keys of :attr:`ModelShape.routing`, always all present, in this order.
#:
#: * ``scoring``: how router logits become scores: ``"softmax"`` (over all experts),
#:   ``"sigmoid"`` (DeepSeek-V3 family) or ``"sqrtsoftplus"`` (DeepSeek-V4).
#: * ``norm_topk_prob``: selected weights are renormalised to sum to 1.
#: * ``routed_scaling_factor``: multiplier on the routed weights (1.0 = none).
#: * ``n_group`` / ``topk_group``: group-limited selection (1 / 1 = no groups).
#: * ``correction_bias``: an ``e_score_correction_bias`` is added for selection only.
#: * ``topk_before_softmax``: softmax runs over the k selected logits only (gpt-oss).
#: * ``router_bias``: the router linear layer has a bias added to the logits (gpt-oss).
#: * ``shared_expert_gate``: the shared expert output is scaled by a sigmoid gate
#:   (Qwen2-MoE / Qwen3-Next / Qwen3.5 style).
#: * ``per_expert_scale``: a learned per-expert multiplier on the weights (Gemma 4).
#: * ``hash_layers``: number of leading MoE layers routed by a static token hash instead of
#:   the learned router (DeepSeek-V4); 0 = none.
ROUTING_KEYS: tuple[str, ...] = (
    "scoring",
    "norm_topk_prob",
    "routed_scaling_factor",
    "n_group",
    "topk_group",
    "correction_bias",
    "topk_before_softmax",
    "router_bias",
    "shared_expert_gate",
    "per_expert_scale",
    "hash_layers",
)

#: Routing keys that a caller may omit when building a shape; they default to "absent".
_ROUTING_DEFAULTS: dict[str, Any] = {
    "topk_before_softmax": False,
    "router_bias": False,
    "shared_expert_gate": False,
    "per_expert_scale": False,
    "hash_layers": 0,
}

#: Accepted values of ``routing["scoring"]`` (when known).
SCORING_FUNCS: tuple[str, ...] = ("softmax", "sigmoid", "sqrtsoftplus")

#: Accepted values of :attr:`ModelShape.expert_ffn` (when known). ``relu2`` experts are
#: not gated (up and down projections only); all others have gate, up and down.
EXPERT_FFNS: tuple[str, ...] = ("swiglu", "geglu", "relu2", "swiglu_oai")

#: Optional fields for which ``None`` means "public value not confirmed": for these a value
#: is ``None`` exactly when the field name is listed in ``unknown``.
NULLABLE_FIELDS: tuple[str, ...] = (
    "hf_repo",
    "architecture",
    "hidden_size",
    "moe_intermediate_size",
    "num_layers",
    "first_dense_layers",
    "total_params_b",
    "active_params_b",
    "expert_ffn",
)

#: ``unknown`` may also name ``expert_input_size`` (latent-MoE experts whose input width is
#: not public) and ``routing.<key>`` for every routing key.
_UNKNOWN_TOKENS: frozenset[str] = frozenset(
    NULLABLE_FIELDS + ("expert_input_size",) + tuple(f"routing.{k}" for k in ROUTING_KEYS)
)

#: ``config.json`` ``model_type`` values :meth:`ModelShape.from_hf_config` understands.
HF_CONFIG_FAMILIES: tuple[str, ...] = SUPPORTED_FAMILIES


class FrozenDict(dict):
    """A ``dict`` that refuses mutation, so a frozen :class:`ModelShape` stays frozen.

    It is still a real ``dict`` (``isinstance(x, dict)``, ``json.dumps`` and pickling work).
    Every mutating method raises ``TypeError``. Values must be hashable for ``hash()``.
    """

    __slots__ = ()

    def _readonly(self, *args: Any, **kwargs: Any) -> None:
        """Raise ``TypeError``: the mapping is read-only."""
        raise TypeError("FrozenDict is read-only")

    __setitem__ = _readonly
    __delitem__ = _readonly
    __ior__ = _readonly  # type: ignore[assignment]
    clear = _readonly  # type: ignore[assignment]
    pop = _readonly  # type: ignore[assignment]
    popitem = _readonly  # type: ignore[assignment]
    setdefault = _readonly  # type: ignore[assignment]
    update = _readonly  # type: ignore[assignment]

    def __hash__(self) -> int:  # type: ignore[override]
        """Hash of the (key, value) pairs, order-independent."""
        return hash(frozenset(self.items()))

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle as ``FrozenDict(dict_copy)`` (the default would call ``__setitem__``)."""
        return (FrozenDict, (dict(self),))

    def __copy__(self) -> "FrozenDict":
        """Return ``self``: the mapping is immutable."""
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> "FrozenDict":
        """Return ``self``: the mapping is immutable and holds only immutable values."""
        return self


class UnknownModelError(KeyError):
    """Raised by :func:`get` for a model id that is not in the catalog.

    ``str(err)`` is the plain message (``KeyError`` would wrap it in quotes); it names the
    requested id and up to five close matches. ``err.model_id`` is the requested id and
    ``err.suggestions`` the close matches.
    """

    def __init__(self, model_id: str, suggestions: list[str]):
        """Build the error for ``model_id`` with the ``suggestions`` found for it."""
        self.model_id = model_id
        self.suggestions = list(suggestions)
        if suggestions:
            msg = f"unknown model id {model_id!r}; close matches: {', '.join(suggestions)}"
        else:
            msg = (
                f"unknown model id {model_id!r}; no close match among "
                f"{len(CATALOG)} catalog models (GET /api/v1/catalog lists the models this site knows)"
            )
        super().__init__(msg)
        self.message = msg

    def __str__(self) -> str:
        """The plain message, without ``KeyError``'s quoting."""
        return self.message


class UnknownShapeError(ValueError):
    """Raised when a derived value needs a field whose public value is unknown.

    For example :meth:`ModelShape.moe_layers` of a model whose layer count or dense prefix
    could not be confirmed. The message names the model and the missing fields.
    """


# ---------------------------------------------------------------------------------------
# ModelShape
# ---------------------------------------------------------------------------------------


def _routing(scoring: str | None, **kwargs: Any) -> dict[str, Any]:
    """Return a routing dict with every key of :data:`ROUTING_KEYS`.

    ``scoring`` plus keyword values; keys not given take :data:`_ROUTING_DEFAULTS`
    (booleans False, ``hash_layers`` 0). The core keys (``norm_topk_prob``,
    ``routed_scaling_factor``, ``n_group``, ``topk_group``, ``correction_bias``) must be
    given (``None`` for unknown). Raises ``ValueError`` for an unknown key.
    """
    out: dict[str, Any] = {"scoring": scoring}
    for key, value in kwargs.items():
        if key not in ROUTING_KEYS:
            raise ValueError(f"unknown routing key {key!r}; expected one of {ROUTING_KEYS}")
        out[key] = value
    for key, default in _ROUTING_DEFAULTS.items():
        out.setdefault(key, default)
    missing = [k for k in ROUTING_KEYS if k not in out]
    if missing:
        raise ValueError(f"routing is missing keys {missing}")
    return {k: out[k] for k in ROUTING_KEYS}


def _softmax_routing(norm_topk_prob: bool | None, **extra: Any) -> dict[str, Any]:
    """Routing of softmax families (Qwen, Mixtral/MiniMax-M1, Gemma 4, gpt-oss).

    These routers have no groups, no scaling and no correction bias (architectural facts,
    not config values), so those keys hold their neutral values (1 / 1 / 1.0 / False).
    """
    return _routing(
        "softmax",
        norm_topk_prob=norm_topk_prob,
        routed_scaling_factor=1.0,
        n_group=1,
        topk_group=1,
        correction_bias=False,
        **extra,
    )


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The MoE topology and router parameters of one model.

    Fields (all keyword-only; ``None`` in a :data:`NULLABLE_FIELDS` field means "not
    confirmed from a public source" and requires the field name in ``unknown``):

    * ``model_id``: catalog id (e.g. ``"qwen3-30b-a3b"``); ``display_name``: human name.
    * ``hf_repo``: public Hugging Face repo id of the weights, when known.
    * ``family``: the config ``model_type`` whose router math and tensor layout apply
      (``qwen3_moe``, ``qwen3_5_moe``, ``gemma4``, ``deepseek_v3``, ``kimi_k2``, ...).
    * ``architecture``: the config ``architectures[0]`` class name, when confirmed.
    * ``num_experts``: routed experts per MoE layer; ``top_k``: routed experts per token;
      ``n_shared_experts``: always-on experts per MoE layer (fused into one slot).
    * ``hidden_size``: model width H (elements); ``moe_intermediate_size``: one routed
      expert's FFN width d_ff (elements).
    * ``expert_input_size``: input width of a routed expert when it differs from
      ``hidden_size`` (latent MoE); ``None`` means "equals ``hidden_size``" unless
      ``"expert_input_size"`` is in ``unknown``.
    * ``num_layers``: decoder layers (MTP / next-token-prediction layers excluded);
      ``first_dense_layers``: leading layers with a dense FFN instead of MoE.
    * ``moe_layer_indices``: explicit MoE layer ids when they are not "every layer from
      ``first_dense_layers`` on" (e.g. Qwen ``decoder_sparse_step``); ``None`` = derive.
    * ``routing``: router parameters, a read-only dict with every key of
      :data:`ROUTING_KEYS`; a ``None`` value requires ``"routing.<key>"`` in ``unknown``.
    * ``expert_ffn``: expert FFN kind, one of :data:`EXPERT_FFNS`.
    * ``total_params_b`` / ``active_params_b``: whole-model parameters, billions.
    * ``unknown``: names of fields whose public value could not be confirmed.
    * ``public_disagreements``: field → public value, for fields where this entry keeps the
      reference catalog's value although a public config says otherwise.
    * ``source``: where the numbers come from; ``notes``: caveats.

    Construction validates the invariants and raises ``ValueError`` when one fails:
    ``1 <= top_k <= num_experts``, ``n_shared_experts >= 0``, positive widths,
    ``first_dense_layers <= num_layers``, the None/unknown correspondence, known routing
    keys and values.
    """

    model_id: str
    display_name: str
    family: str
    num_experts: int
    top_k: int
    n_shared_experts: int
    routing: Mapping[str, Any] = field(hash=False)
    source: str
    hf_repo: str | None = None
    architecture: str | None = None
    hidden_size: int | None = None
    moe_intermediate_size: int | None = None
    expert_input_size: int | None = None
    num_layers: int | None = None
    first_dense_layers: int | None = None
    moe_layer_indices: tuple[int, ...] | None = None
    expert_ffn: str | None = None
    total_params_b: float | None = None
    active_params_b: float | None = None
    unknown: tuple[str, ...] = ()
    public_disagreements: Mapping[str, Any] = field(default_factory=dict, hash=False)
    notes: str = ""

    # ----------------------------------------------------------------- validation
    def __post_init__(self) -> None:
        """Freeze the mappings and check every invariant (``ValueError`` on failure)."""
        routing = dict(self.routing)
        for key, default in _ROUTING_DEFAULTS.items():
            routing.setdefault(key, default)
        object.__setattr__(self, "routing", FrozenDict({k: routing.get(k) for k in ROUTING_KEYS}))
        object.__setattr__(self, "public_disagreements", FrozenDict(self.public_disagreements))
        object.__setattr__(self, "unknown", tuple(self.unknown))
        if self.moe_layer_indices is not None:
            object.__setattr__(self, "moe_layer_indices", tuple(self.moe_layer_indices))
        errors = self._invariant_errors(set(routing) - set(ROUTING_KEYS))
        if errors:
            raise ValueError(f"invalid ModelShape {self.model_id!r}: " + "; ".join(errors))

    def _invariant_errors(self, extra_routing_keys: set[str]) -> list[str]:
        """Return the list of violated invariants (empty when the shape is valid)."""
        errs: list[str] = []
        if not isinstance(self.model_id, str) or not self.model_id.strip():
            errs.append("model_id must be a non-empty string")
        if not isinstance(self.family, str) or not self.family:
            errs.append("family must be a non-empty string")
        for name in ("num_experts", "top_k", "n_shared_experts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                errs.append(f"{name} must be an int, got {value!r}")
        if errs:
            return errs
        if self.num_experts < 1:
            errs.append("num_experts must be >= 1")
        if not 1 <= self.top_k <= self.num_experts:
            errs.append(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.n_shared_experts < 0:
            errs.append("n_shared_experts must be >= 0")
        for name in ("hidden_size", "moe_intermediate_size", "expert_input_size", "num_layers"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                errs.append(f"{name} must be a positive int or None, got {value!r}")
        fdl = self.first_dense_layers
        if fdl is not None and (not isinstance(fdl, int) or fdl < 0):
            errs.append(f"first_dense_layers must be an int >= 0 or None, got {fdl!r}")
        elif fdl is not None and self.num_layers is not None and fdl > self.num_layers:
            errs.append(f"first_dense_layers={fdl} exceeds num_layers={self.num_layers}")
        if self.moe_layer_indices is not None:
            idx = self.moe_layer_indices
            if list(idx) != sorted(set(idx)) or any(not isinstance(i, int) or i < 0 for i in idx):
                errs.append("moe_layer_indices must be sorted, unique, non-negative ints")
            elif self.num_layers is not None and idx and idx[-1] >= self.num_layers:
                errs.append(f"moe_layer_indices reach {idx[-1]} >= num_layers={self.num_layers}")
        if self.expert_ffn is not None and self.expert_ffn not in EXPERT_FFNS:
            errs.append(f"expert_ffn {self.expert_ffn!r} not in {EXPERT_FFNS}")
        # unknown <-> None
        bad = [u for u in self.unknown if u not in _UNKNOWN_TOKENS]
        if bad:
            errs.append(f"unknown lists unrecognised names {bad}")
        if len(set(self.unknown)) != len(self.unknown):
            errs.append("unknown lists a name twice")
        unknown = set(self.unknown)
        for name in NULLABLE_FIELDS:
            is_none = getattr(self, name) is None
            if is_none and name not in unknown:
                errs.append(f"{name} is None but not listed in unknown")
            if not is_none and name in unknown:
                errs.append(f"{name} is listed in unknown but holds {getattr(self, name)!r}")
        if "expert_input_size" in unknown and self.expert_input_size is not None:
            errs.append("expert_input_size is listed in unknown but holds a value")
        # routing
        if extra_routing_keys:
            errs.append(f"routing has unrecognised keys {sorted(extra_routing_keys)}")
        for key in ROUTING_KEYS:
            value = self.routing.get(key)
            token = f"routing.{key}"
            if value is None and token not in unknown:
                errs.append(f"routing[{key!r}] is None but {token!r} is not in unknown")
            if value is not None and token in unknown:
                errs.append(f"{token!r} is listed in unknown but holds {value!r}")
        scoring = self.routing.get("scoring")
        if scoring is not None and scoring not in SCORING_FUNCS:
            errs.append(f"routing scoring {scoring!r} not in {SCORING_FUNCS}")
        for key in ("n_group", "topk_group"):
            value = self.routing.get(key)
            if value is not None and (not isinstance(value, int) or value < 1):
                errs.append(f"routing[{key!r}] must be a positive int, got {value!r}")
        ng, tg = self.routing.get("n_group"), self.routing.get("topk_group")
        if isinstance(ng, int) and isinstance(tg, int) and tg > ng:
            errs.append(f"routing topk_group={tg} exceeds n_group={ng}")
        if isinstance(ng, int) and ng >= 1 and self.num_experts % ng:
            errs.append(f"num_experts={self.num_experts} is not divisible by n_group={ng}")
        names = {f.name for f in fields(self)}
        bad_dis = [k for k in self.public_disagreements if k not in names]
        if bad_dis:
            errs.append(f"public_disagreements names unknown fields {bad_dis}")
        return errs

    # ----------------------------------------------------------------- derived values
    @property
    def is_moe(self) -> bool:
        """True: every catalog shape is a Mixture-of-Experts model (``num_experts >= 1``)."""
        return self.num_experts >= 1

    @property
    def has_shared_expert(self) -> bool:
        """True when MoE layers carry shared expert(s), fused into slot ``num_experts``."""
        return self.n_shared_experts > 0

    @property
    def expert_slots(self) -> int:
        """Expert slots per MoE layer: ``num_experts`` plus 1 when a shared expert exists."""
        return self.num_experts + (1 if self.has_shared_expert else 0)

    @property
    def shared_slot(self) -> int | None:
        """Index of the fused shared-expert slot (``num_experts``), or ``None`` if none."""
        return self.num_experts if self.has_shared_expert else None

    @property
    def shared_d_ff(self) -> int | None:
        """Width of the fused shared slot: ``n_shared_experts × moe_intermediate_size``.

        ``None`` without a shared expert or when the expert width is unknown. (Families
        whose shared expert has its own width, e.g. Qwen2-MoE, also store it that way when
        built by :meth:`from_hf_config`; the seed catalog follows the DeepSeek convention.)
        """
        if not self.has_shared_expert or self.moe_intermediate_size is None:
            return None
        return self.n_shared_experts * self.moe_intermediate_size

    @property
    def moe_layers_known(self) -> bool:
        """True when :meth:`moe_layers` can be computed (layer map confirmed)."""
        if self.moe_layer_indices is not None:
            return True
        return self.num_layers is not None and self.first_dense_layers is not None

    def moe_layers(self) -> list[int]:
        """Ids of the MoE layers, ascending (0-based decoder layer index).

        ``moe_layer_indices`` when set, else ``range(first_dense_layers, num_layers)``.
        Raises :class:`UnknownShapeError` when the layer count or the dense prefix is not
        known.
        """
        if self.moe_layer_indices is not None:
            return list(self.moe_layer_indices)
        missing = [n for n in ("num_layers", "first_dense_layers") if getattr(self, n) is None]
        if missing:
            raise UnknownShapeError(
                f"{self.model_id}: MoE layer map unknown (missing {', '.join(missing)})"
            )
        assert self.num_layers is not None and self.first_dense_layers is not None
        return list(range(self.first_dense_layers, self.num_layers))

    def expert_keys(self) -> Iterator[tuple[int, int]]:
        """Yield every ``(layer, expert)`` key: MoE layers ascending, experts ascending.

        Per layer the experts are ``0 .. num_experts-1`` plus the shared slot
        ``num_experts`` when the model has shared experts, so the count is
        ``len(moe_layers()) × expert_slots``. Raises :class:`UnknownShapeError` (when the
        iterator starts) if the layer map is unknown.
        """
        layers = self.moe_layers()
        slots = self.expert_slots
        for layer in layers:
            for expert in range(slots):
                yield (layer, expert)

    @property
    def params_per_expert(self) -> int | None:
        """Weight parameters of one routed expert (biases excluded), or ``None``.

        Gated FFNs (SwiGLU / GeGLU, three matrices): ``3 × in × d_ff``; ``relu2`` experts
        (up and down only): ``2 × in × d_ff``; ``in`` is ``expert_input_size`` or
        ``hidden_size``. ``None`` when a needed width or the FFN kind is unknown.
        """
        if "expert_input_size" in self.unknown:
            return None
        width_in = self.expert_input_size or self.hidden_size
        if width_in is None or self.moe_intermediate_size is None or self.expert_ffn is None:
            return None
        matrices = 2 if self.expert_ffn == "relu2" else 3
        return matrices * width_in * self.moe_intermediate_size

    @property
    def params_per_expert_x10(self) -> int | None:
        """Parameters per routed expert in billions scaled ×10, as the reference defines it.

        The reference's ``MoeShape.params_per_expert_x10`` (``catalog.rs``): "parameters per
        routed expert, in billions scaled x10 (e.g. 5 = 0.5B)". Computed as
        ``round(params_per_expert / 1e8)``; fine-grained experts (a few million parameters)
        therefore report 0, which is why :func:`shape_json` also gives the exact
        ``params_per_expert``. ``None`` when ``params_per_expert`` is unknown.
        """
        ppe = self.params_per_expert
        if ppe is None:
            return None
        return int(round(ppe / 1e8))

    # ----------------------------------------------------------------- JSON
    def catalog_shape(self) -> dict[str, Any]:
        """The ``tenzro_moeCatalogShape`` result for this model (JSON-serialisable).

        ``{model_id, is_moe, moe: {...} | null, architecture, unknown: [...]}``; see
        :func:`shape_json` for the keys of ``moe``. ``architecture`` is the config class
        name when confirmed, otherwise the ``family`` (config ``model_type``).
        """
        moe: dict[str, Any] | None = None
        if self.is_moe:
            moe = {
                "num_experts": self.num_experts,
                "experts_per_token": self.top_k,
                "shared_experts": self.n_shared_experts,
                "params_per_expert_x10": self.params_per_expert_x10,
                "params_per_expert": self.params_per_expert,
                "hidden_size": self.hidden_size,
                "expert_d_ff": self.moe_intermediate_size,
                "layers": self.num_layers,
                "first_dense_layers": self.first_dense_layers,
                "moe_layers_count": len(self.moe_layers()) if self.moe_layers_known else None,
                "routing": dict(self.routing),
            }
        return {
            "model_id": self.model_id,
            "is_moe": self.is_moe,
            "moe": moe,
            "architecture": self.architecture if self.architecture is not None else self.family,
            "unknown": list(self.unknown),
        }

    # ----------------------------------------------------------------- from config.json
    @classmethod
    def from_hf_config(
        cls,
        model_id: str,
        config: Mapping[str, Any],
        *,
        display_name: str | None = None,
        hf_repo: str | None = None,
        source: str | None = None,
    ) -> "ModelShape":
        """Build a shape from a Hugging Face ``config.json`` dict (a local checkpoint).

        Families (``model_type``): see :data:`HF_CONFIG_FAMILIES`. A multimodal wrapper
        whose language model sits under ``text_config`` is read from there. Field names
        accepted: experts ``num_experts`` / ``num_local_experts`` / ``n_routed_experts``;
        top-k ``num_experts_per_tok`` / ``num_experts_per_token`` / ``experts_per_token``;
        expert width ``moe_intermediate_size`` (``intermediate_size`` for mixtral and
        gpt_oss, whose experts use it).

        Layer map: Qwen MoE layers are those not in ``mlp_only_layers`` with
        ``(i + 1) % decoder_sparse_step == 0`` (transformers' defaults ``[]`` and 1 when
        absent); DeepSeek-style layers ``i >= first_k_dense_replace`` with
        ``i % moe_layer_freq == 0``; mixtral and gpt_oss every layer.

        Routing follows ``reference/gguf_quant_and_routing.md`` §3: Qwen softmax with
        ``norm_topk_prob`` (transformers' default False when absent), Qwen2-MoE shared
        expert (one slot of width ``shared_expert_intermediate_size``, sigmoid-gated) when
        that width is > 0; mixtral softmax renormalised; DeepSeek-V3 / Kimi-K2 / GLM-4.5
        sigmoid with correction bias, and ``norm_topk_prob`` / ``routed_scaling_factor`` /
        ``n_group`` / ``topk_group`` / ``first_k_dense_replace`` read from the config (absent
        → ``None`` and listed in ``unknown``, never defaulted); gpt-oss top-k on biased
        logits then softmax over the k. Parameter counts are unknown.

        The config is read by ``moe.config.ModelConfig`` (shared with the extractor and the
        backbones). Raises ``ValueError`` for a non-mapping config, a mistyped value or
        conflicting expert counts (naming the key), a missing or unsupported ``model_type``,
        missing expert count / top-k, a DeepSeek-style config without ``n_shared_experts``,
        or a shape that fails validation.
        """
        try:
            cfg = ModelConfig.from_hf(config, unwrap=True)
        except ConfigError as exc:
            raise ValueError(f"{model_id}: {exc}") from None
        family = cfg.family
        if not family:
            raise ValueError(f"{model_id}: config has no model_type")
        if family not in HF_CONFIG_FAMILIES:
            raise ValueError(
                f"{model_id}: unsupported model_type {family!r}; "
                f"supported: {', '.join(HF_CONFIG_FAMILIES)}"
            )
        if cfg.num_experts is None or cfg.top_k is None:
            raise ValueError(
                f"{model_id}: config lacks the expert count ({'/'.join(EXPERT_COUNT_KEYS)}) or "
                f"the experts per token ({'/'.join(TOP_K_KEYS)})"
            )
        layers, d_ff = cfg.num_hidden_layers, cfg.moe_intermediate_size
        n_shared = cfg.n_shared_experts
        moe_indices: tuple[int, ...] | None = None
        first_dense = cfg.first_k_dense_replace
        expert_ffn = "swiglu"
        if family in ("qwen3_moe", "qwen2_moe"):
            moe_indices = cfg.moe_layers()  # None when the layer count is unknown
            first_dense = None if moe_indices is None else (moe_indices[0] if moe_indices else layers)
            routing = _softmax_routing(cfg.norm_topk_prob, shared_expert_gate=n_shared > 0)
        elif family == "mixtral":
            routing = _softmax_routing(True)
        elif family == "gpt_oss":
            expert_ffn = "swiglu_oai"
            routing = _softmax_routing(True, topk_before_softmax=True, router_bias=True)
        else:  # deepseek_v3, kimi_k2, glm4_moe
            if n_shared is None:
                raise ValueError(
                    f"{model_id}: {family} config lacks n_shared_experts (needed to "
                    "enumerate the shared slot)"
                )
            if cfg.moe_layer_freq != 1:
                moe_indices = cfg.moe_layers()
            routing = _routing(
                cfg.scoring_func,
                norm_topk_prob=cfg.norm_topk_prob,
                routed_scaling_factor=cfg.routed_scaling_factor,
                n_group=cfg.n_group,
                topk_group=cfg.topk_group,
                correction_bias=True,
            )
        values: dict[str, Any] = {
            "hf_repo": hf_repo,
            "architecture": cfg.architecture,
            "hidden_size": cfg.hidden_size,
            "moe_intermediate_size": d_ff,
            "num_layers": layers,
            "first_dense_layers": first_dense,
            "total_params_b": None,
            "active_params_b": None,
            "expert_ffn": expert_ffn,
        }
        unknown = [n for n in NULLABLE_FIELDS if values[n] is None]
        unknown += [f"routing.{k}" for k in ROUTING_KEYS if routing[k] is None]
        notes = ""
        shared_d_ff = cfg.shared_expert_intermediate_size
        if shared_d_ff and d_ff and shared_d_ff != n_shared * d_ff:
            notes = (
                f"shared expert width {shared_d_ff} (shared_expert_intermediate_size) "
                f"differs from the routed expert width {d_ff}"
            )
        return cls(
            model_id=model_id,
            display_name=display_name or model_id,
            family=family,
            num_experts=cfg.num_experts,
            top_k=cfg.top_k,
            n_shared_experts=n_shared,
            routing=routing,
            source=source or "HF config.json of a local checkpoint (ModelShape.from_hf_config)",
            moe_layer_indices=moe_indices,
            unknown=tuple(unknown),
            notes=notes,
            **values,
        )


def _seed() -> list[ModelShape]:
    """The seed entries of ``seed_catalog.json`` (shipped beside this module), in catalog order.

    Each entry holds :class:`ModelShape` fields (left-out ones take the defaults); a bad entry
    raises ``ValueError`` (``TypeError`` for an unknown field) at import.
    """
    data = json.loads(Path(__file__).with_name("seed_catalog.json").read_text(encoding="utf-8"))
    return [ModelShape(**entry) for entry in data["models"]]


_LOCK = threading.RLock()

#: The catalog: model id → shape. Seed entries first (catalog order), then local ones.
#: Mutate only through :func:`register_local` / :func:`unregister_local`.
CATALOG: dict[str, ModelShape] = {s.model_id: s for s in _seed()}

_SEED_IDS: frozenset[str] = frozenset(CATALOG)


# ---------------------------------------------------------------------------------------
# API
# ---------------------------------------------------------------------------------------


def _suggestions(model_id: str, limit: int = 5) -> list[str]:
    """Catalog ids close to ``model_id`` (fuzzy, then substring), at most ``limit``."""
    ids = list(CATALOG)
    lowered = {i.lower(): i for i in ids}
    query = str(model_id).lower().strip()
    found = [lowered[m] for m in difflib.get_close_matches(query, list(lowered), n=limit, cutoff=0.6)]
    if len(query) >= 3:
        for low, orig in lowered.items():
            if (query in low or low in query) and orig not in found:
                found.append(orig)
    return found[:limit]


def get(model_id: str) -> ModelShape:
    """Return the shape of ``model_id`` (exact id, else a case-insensitive match).

    Raises :class:`UnknownModelError` (a ``KeyError``) whose message lists up to five close
    matches, e.g. ``unknown model id 'qwen3-30b'; close matches: qwen3-30b-a3b, ...``.
    """
    with _LOCK:
        shape = CATALOG.get(model_id)
        if shape is not None:
            return shape
        if isinstance(model_id, str):
            low = model_id.strip().lower()
            for key, value in CATALOG.items():
                if key.lower() == low:
                    return value
        raise UnknownModelError(str(model_id), _suggestions(str(model_id)))


def all_models() -> list[ModelShape]:
    """Every catalog shape: seed entries in catalog order, then locally registered ones."""
    with _LOCK:
        return list(CATALOG.values())


def shape_json(model_id: str) -> dict[str, Any]:
    """The ``tenzro_moeCatalogShape`` result for ``model_id``.

    ``{model_id, is_moe, moe: {num_experts, experts_per_token, shared_experts,
    params_per_expert_x10, params_per_expert, hidden_size, expert_d_ff, layers,
    first_dense_layers, moe_layers_count, routing: {...}} | null, architecture,
    unknown: [...]}``. ``params_per_expert_x10`` follows the reference (billions ×10,
    rounded); ``params_per_expert`` is the exact count; unknown values are ``null`` and
    named in ``unknown``. Raises :class:`UnknownModelError` for an unknown id.
    """
    return get(model_id).catalog_shape()


def register_local(shape: ModelShape) -> ModelShape:
    """Add (or replace) a locally prepared model in :data:`CATALOG` and return it.

    Seed ids cannot be overridden: registering a shape whose ``model_id`` equals a seed
    entry's (case-insensitively) raises ``ValueError``. Registering a local id again
    replaces the previous local shape (a re-read checkpoint). Raises ``TypeError`` for a
    non-:class:`ModelShape` argument. Thread-safe.
    """
    if not isinstance(shape, ModelShape):
        raise TypeError(f"register_local expects a ModelShape, got {type(shape).__name__}")
    with _LOCK:
        low = shape.model_id.lower()
        clash = [s for s in _SEED_IDS if s.lower() == low]
        if clash:
            raise ValueError(
                f"model id {shape.model_id!r} is a seed catalog entry ({clash[0]}); "
                "choose another id for a local checkpoint"
            )
        for key in [k for k in CATALOG if k.lower() == low and k != shape.model_id]:
            del CATALOG[key]
        CATALOG[shape.model_id] = shape
        return shape


def unregister_local(model_id: str) -> bool:
    """Remove a locally registered model; return True if one was removed.

    Seed entries cannot be removed (``ValueError``). Unknown ids return False.
    """
    with _LOCK:
        if model_id in _SEED_IDS:
            raise ValueError(f"{model_id!r} is a seed catalog entry and cannot be removed")
        return CATALOG.pop(model_id, None) is not None
