"""The MoE router (gate), exact in float32, and its self-describing blob (docs/DESIGN.md §5).

Families (config ``model_type``):

* ``qwen3_moe``: ``softmax`` over all experts in float32, top-k, renormalize over the
  selected iff ``norm_topk_prob`` (HF ``transformers/models/qwen3_moe/modeling_qwen3_moe.py``,
  ``Qwen3MoeTopKRouter``).
* ``qwen2_moe``: the same softmax router plus a shared expert scaled per token by
  ``sigmoid(shared_expert_gate · x)`` (HF ``qwen2_moe/modular_qwen2_moe.py``); ``mixtral``:
  softmax over all, top-k, always renormalized (HF ``mixtral/modular_mixtral.py``);
  ``gpt_oss``: ``logits = x·Wᵀ + b``, top-k of the logits, softmax over those k (HF
  ``gpt_oss/modular_gpt_oss.py`` ``GptOssTopKRouter``).
* ``deepseek_v3``, ``kimi_k2`` and ``glm4_moe`` (HF ``glm4_moe``: the DeepSeek-V3 router):
  sigmoid scores; selection on score + correction bias,
  group-limited (keep ``topk_group`` of ``n_group`` groups ranked by the sum of each
  group's top-2 biased scores, the rest masked with -inf as the official DeepSeek code does,
  not HF's 0.0); weights are the unbiased sigmoid of the selected, divided by
  ``sum + 1e-20`` when ``norm_topk_prob``, times ``routed_scaling_factor``
  (HF ``transformers/models/deepseek_v3/modeling_deepseek_v3.py``,
  ``DeepseekV3MoE.route_tokens_to_experts``; ``deepseek-ai/DeepSeek-V3:inference/model.py``
  ``Gate.forward``).

Top-k ties go to the lower expert id (stable sort on the negated score). A routing lists,
per token, its routed experts in ascending id and then the shared slot (id
``num_experts``, weight 1.0) when the layer has shared experts.

Pure Python + numpy; imports nothing from Django.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe import rowwise
from moe.activations import sigmoid
from moe.codec import dumps_safetensors, loads_safetensors
from moe.families import FAMILIES, SUPPORTED_FAMILIES, families_scored
from moe.jsonrpc import ParamError

SOFTMAX_FAMILIES = families_scored("softmax")
SIGMOID_FAMILIES = families_scored("sigmoid")
TOPK_SOFTMAX_FAMILIES = families_scored("topk_softmax")  # top-k of the (biased) logits, softmax over those k
_GATE_TENSORS = ("router.weight", "router.bias", "router.logit_bias", "shared_gate.weight")


def _check_int(value, field: str, lo: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < lo:
        raise ValueError(f"gate {field} must be an integer >= {lo}, got {value!r}")
    return int(value)


@dataclass(eq=False)
class Gate:
    """One layer's router.

    Fields: ``family`` (one of ``SUPPORTED_FAMILIES``); ``weight`` float32 ``[E, H]`` (HF
    ``[out, in]``); ``correction_bias`` float32 ``[E]`` or None (sigmoid families only, used
    for selection only); ``top_k`` (int, or None for a legacy blob that records none: then
    ``route`` needs ``top_k``); ``norm_topk_prob`` (None → the family's HF default: qwen3
    False, deepseek/kimi True); ``routed_scaling_factor``; ``n_group``; ``topk_group``;
    ``n_shared_experts`` (> 0 adds the shared slot); ``num_experts`` (None → ``E``);
    ``shared_gate`` float32 ``[1, H]`` or None (qwen2_moe: the shared slot's weight is
    ``sigmoid(shared_gate · x)`` per token instead of 1.0); ``logit_bias`` float32 ``[E]`` or
    None (gpt_oss: the router's bias, added to the logits).

    Arrays are converted to C-contiguous float32. Raises ``ValueError`` for an unsupported
    family, bad shapes, non-finite values, or inconsistent routing parameters.
    """

    family: str
    weight: np.ndarray
    correction_bias: np.ndarray | None = None
    top_k: int | None = None
    norm_topk_prob: bool | None = None
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    n_shared_experts: int = 0
    num_experts: int | None = None
    shared_gate: np.ndarray | None = None
    logit_bias: np.ndarray | None = None

    def __post_init__(self):
        if self.family not in SUPPORTED_FAMILIES:
            raise ValueError(f"unsupported gate family {self.family!r}; supported: {', '.join(SUPPORTED_FAMILIES)}")
        w = np.ascontiguousarray(self.weight, dtype=np.float32)
        if w.ndim != 2 or w.shape[0] < 1 or w.shape[1] < 1:
            raise ValueError(f"gate weight must be a non-empty [num_experts, d_model] matrix, got shape {w.shape}")
        if not np.isfinite(w).all():
            raise ValueError("gate weight holds NaN or infinity")
        self.weight = w
        e = w.shape[0]
        if self.num_experts is None:
            self.num_experts = e
        elif _check_int(self.num_experts, "num_experts", 1) != e:
            raise ValueError(f"gate num_experts={self.num_experts} but the weight has {e} rows")
        self.num_experts = int(self.num_experts)
        if self.correction_bias is not None:
            if self.family not in SIGMOID_FAMILIES:
                raise ValueError(f"family {self.family} has no correction bias (only {', '.join(SIGMOID_FAMILIES)})")
            b = np.ascontiguousarray(self.correction_bias, dtype=np.float32)
            if b.shape != (e,):
                raise ValueError(f"gate correction bias must have shape ({e},), got {b.shape}")
            if not np.isfinite(b).all():
                raise ValueError("gate correction bias holds NaN or infinity")
            self.correction_bias = b
        if self.norm_topk_prob is None:
            self.norm_topk_prob = FAMILIES[self.family].norm_topk_prob
        self.norm_topk_prob = bool(self.norm_topk_prob)
        rsf = float(self.routed_scaling_factor)
        if not np.isfinite(rsf) or rsf <= 0:
            raise ValueError(
                f"gate routed_scaling_factor must be a positive number, got {self.routed_scaling_factor!r}")
        self.routed_scaling_factor = rsf
        self.n_group = _check_int(self.n_group, "n_group", 1)
        self.topk_group = _check_int(self.topk_group, "topk_group", 1)
        self.n_shared_experts = _check_int(self.n_shared_experts, "n_shared_experts", 0)
        if self.family in SOFTMAX_FAMILIES and self.n_group != 1:
            raise ValueError(f"family {self.family} has no group-limited routing (n_group={self.n_group})")
        if e % self.n_group:
            raise ValueError(f"num_experts={e} is not divisible by n_group={self.n_group}")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group={self.topk_group} exceeds n_group={self.n_group}")
        if self.n_group > 1 and e // self.n_group < 2:
            raise ValueError(f"group-limited routing needs at least 2 experts per group "
                             f"(num_experts={e}, n_group={self.n_group})")
        if self.top_k is not None:
            self.top_k = self.check_top_k(self.top_k)
        if self.logit_bias is not None:
            if self.family not in TOPK_SOFTMAX_FAMILIES:
                raise ValueError(f"family {self.family} has no router.logit_bias (only gpt_oss)")
            lb = np.ascontiguousarray(self.logit_bias, dtype=np.float32)
            if lb.shape != (e,) or not np.isfinite(lb).all():
                raise ValueError(f"gate logit_bias must be finite with shape ({e},), got {lb.shape}")
            self.logit_bias = lb
        if self.shared_gate is not None:
            g = np.ascontiguousarray(self.shared_gate, dtype=np.float32)
            if g.shape != (1, w.shape[1]):
                raise ValueError(f"gate shared_gate must have shape (1, {w.shape[1]}), got {g.shape}")
            if not np.isfinite(g).all():
                raise ValueError("gate shared_gate holds NaN or infinity")
            if self.n_shared_experts < 1:
                raise ValueError("gate shared_gate needs a shared expert (n_shared_experts >= 1)")
            self.shared_gate = g

    @property
    def d_model(self) -> int:
        """Hidden size H (columns of ``weight``)."""
        return int(self.weight.shape[1])

    @property
    def shared_slot(self) -> int | None:
        """Expert id of the fused shared expert (``num_experts``), or None without one."""
        return self.num_experts if self.n_shared_experts > 0 else None

    @property
    def max_top_k(self) -> int:
        """Largest valid k: ``E``, or ``topk_group * E / n_group`` with group-limited routing."""
        return self.topk_group * (self.num_experts // self.n_group)

    def check_top_k(self, top_k) -> int:
        """Return ``top_k`` as int if it lies in ``1..max_top_k``; raise ``ValueError`` otherwise."""
        if isinstance(top_k, (bool, np.bool_)) or not isinstance(top_k, (int, np.integer)):
            raise ParamError(f"top_k must be an integer, got {top_k!r}", "top_k")
        if not 1 <= top_k <= self.max_top_k:
            extra = (f" (n_group={self.n_group}, topk_group={self.topk_group})"
                     if self.max_top_k != self.num_experts else "")
            raise ParamError(f"top_k={top_k} is out of range 1..{self.max_top_k} for a gate with "
                             f"{self.num_experts} experts{extra}", "top_k")
        return int(top_k)

    def to_blob(self) -> bytes:
        """Serialize to a canonical safetensors gate blob (docs/DESIGN.md §5): ``router.weight`` F32
        ``[E, H]``, ``router.bias`` F32 ``[E]`` when present, and ``__metadata__`` strings
        ``family``, ``top_k`` (omitted when None), ``norm_topk_prob`` ("true"/"false"),
        ``routed_scaling_factor`` (shortest round-trip repr), ``n_group``, ``topk_group``,
        ``n_shared_experts``, ``num_experts``. Same content → same bytes in every process.
        """
        tensors = {"router.weight": self.weight}
        if self.correction_bias is not None:
            tensors["router.bias"] = self.correction_bias
        if self.shared_gate is not None:
            tensors["shared_gate.weight"] = self.shared_gate
        if self.logit_bias is not None:
            tensors["router.logit_bias"] = self.logit_bias
        meta = {
            "family": self.family,
            "norm_topk_prob": "true" if self.norm_topk_prob else "false",
            "routed_scaling_factor": repr(self.routed_scaling_factor),
            "n_group": str(self.n_group),
            "topk_group": str(self.topk_group),
            "n_shared_experts": str(self.n_shared_experts),
            "num_experts": str(self.num_experts),
        }
        if self.top_k is not None:
            meta["top_k"] = str(self.top_k)
        return dumps_safetensors(tensors, meta)

    @classmethod
    def from_blob(cls, data: bytes) -> Gate:
        """Load a gate blob written by ``to_blob`` (weights may be F32, F16 or BF16).

        A blob without ``family`` metadata is read as the reference system does (docs/DESIGN.md §5):
        ``router.bias`` present → sigmoid mode (``deepseek_v3``, no groups, always
        renormalized, ``routed_scaling_factor`` from metadata, default 1.0); absent →
        softmax over the selected logits (``qwen3_moe`` with ``norm_topk_prob`` true, which is
        the same function). Its ``shared_experts`` key (or ``n_shared_experts``) gives the
        shared-expert count, default 0; ``top_k`` is None unless recorded.

        Raises ``ValueError`` naming the tensor or key for a missing ``router.weight``, an
        unexpected tensor, a bad shape, or unparsable or inconsistent metadata.
        """
        tensors, meta = loads_safetensors(data, source="gate blob")
        unknown = sorted(set(tensors) - set(_GATE_TENSORS))
        if unknown:
            raise ValueError(f"gate blob has unsupported tensors {unknown} (expected {list(_GATE_TENSORS)})")
        if "router.weight" not in tensors:
            raise ValueError("gate blob has no 'router.weight' tensor")
        weight = tensors["router.weight"].to_f32("router.weight", "gate blob")
        if weight.ndim != 2:
            raise ValueError(f"gate blob 'router.weight' must be 2-D [num_experts, d_model], got shape {weight.shape}")
        bias = tensors["router.bias"].to_f32("router.bias", "gate blob") if "router.bias" in tensors else None
        sgate = (tensors["shared_gate.weight"].to_f32("shared_gate.weight", "gate blob")
                 if "shared_gate.weight" in tensors else None)
        lbias = (tensors["router.logit_bias"].to_f32("router.logit_bias", "gate blob")
                 if "router.logit_bias" in tensors else None)
        if bias is not None and bias.shape != (weight.shape[0],):
            raise ValueError(f"gate blob 'router.bias' has shape {bias.shape}; expected ({weight.shape[0]},)")

        def num(key, conv, default, kind):
            if key not in meta:
                return default
            try:
                return conv(meta[key])
            except ValueError:
                raise ValueError(f"gate blob metadata {key}={meta[key]!r} is not a valid {kind}") from None

        def flag(text: str) -> bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")

        top_k = num("top_k", int, None, "integer")
        if "family" in meta:
            return cls(
                family=meta["family"], weight=weight, correction_bias=bias, top_k=top_k,
                norm_topk_prob=num("norm_topk_prob", flag, None, "boolean"),
                routed_scaling_factor=num("routed_scaling_factor", float, 1.0, "number"),
                n_group=num("n_group", int, 1, "integer"), topk_group=num("topk_group", int, 1, "integer"),
                n_shared_experts=num("n_shared_experts", int, 0, "integer"),
                num_experts=num("num_experts", int, None, "integer"), shared_gate=sgate, logit_bias=lbias,
            )
        for name, t in (("router.logit_bias", lbias), ("shared_gate.weight", sgate)):
            if t is not None:
                raise ValueError(f"gate blob has {name!r} but no 'family' metadata saying how to use it")
        shared = num("shared_experts", int, num("n_shared_experts", int, 0, "integer"), "integer")
        if bias is not None:
            return cls(family="deepseek_v3", weight=weight, correction_bias=bias, top_k=top_k,
                       norm_topk_prob=True, routed_scaling_factor=num("routed_scaling_factor", float, 1.0, "number"),
                       n_shared_experts=shared)
        return cls(family="qwen3_moe", weight=weight, top_k=top_k, norm_topk_prob=True, n_shared_experts=shared)


@dataclass(eq=False)
class Routing:
    """Result of ``route`` for T tokens.

    ``expert_ids`` int64 ``[T, S]`` and ``weights`` float32 ``[T, S]``, S = k (+1 with a
    shared expert): per token the routed experts in ascending id, then the shared slot
    (id ``num_experts``, weight 1.0). ``router_logits`` float32 ``[T, E]`` (pre-activation),
    ``top_k`` the k used, ``shared_slot`` the shared expert id or None.
    """

    expert_ids: np.ndarray
    weights: np.ndarray
    router_logits: np.ndarray
    top_k: int
    shared_slot: int | None = None

    @property
    def num_tokens(self) -> int:
        """T."""
        return int(self.expert_ids.shape[0])

    def _pair_order(self) -> np.ndarray:
        """The flat (token, slot) pairs sorted by expert id; the sort is stable, so the row-major
        flat order keeps tokens ascending within each expert."""
        return np.argsort(self.expert_ids.ravel(), kind="stable")

    def tokens_by_expert(self) -> dict[int, np.ndarray]:
        """Expert id → int64 array of the token indices routed to it, ascending; keys
        ascending (the shared slot, when present, is the last key)."""
        t, s = self.expert_ids.shape
        flat = self.expert_ids.ravel()
        order = self._pair_order()
        experts, starts = np.unique(flat[order], return_index=True)
        tokens = (order // s).astype(np.int64)
        bounds = list(starts[1:]) + [len(order)]
        return {int(e): tokens[a:b] for e, a, b in zip(experts, starts, bounds)}

    def pair_rows(self) -> np.ndarray:
        """int64 ``[T, S]``: where each (token, slot) pair falls when the pairs are listed as
        ``tokens_by_expert`` lists them (experts ascending, each expert's tokens ascending), i.e.
        its row once every expert's output rows are stacked in that order."""
        order = self._pair_order()
        out = np.empty(order.size, dtype=np.int64)
        out[order] = np.arange(order.size)
        return out.reshape(self.expert_ids.shape)

    def routed(self, layer: int) -> list[dict]:
        """The ``routed`` JSON of route and forward results: per token ascending
        ``{token_index, slots: [{layer, expert, weight}]}`` in slot order (weights as float)."""
        return [{"token_index": t, "slots": [{"layer": layer, "expert": int(e), "weight": float(w)}
                                             for e, w in zip(self.expert_ids[t], self.weights[t])]}
                for t in range(self.expert_ids.shape[0])]


def _topk_desc(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries of each row, largest first, ties to the lower index."""
    return np.argsort(-scores, axis=-1, kind="stable")[..., :k]


def _route_topk_softmax(gate: Gate, logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """gpt_oss: top-k of the (biased) logits, softmax over those k (largest first)."""
    sel = _topk_desc(logits, k)
    w = np.take_along_axis(logits, sel, axis=1)
    w = w - w[:, :1]  # the largest selected logit comes first
    np.exp(w, out=w)
    w *= np.float32(1) / w.sum(axis=1, keepdims=True)
    return sel, w


def _route_softmax(gate: Gate, logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """qwen3_moe / qwen2_moe / mixtral: softmax over all E, top-k of p, renormalized iff
    ``norm_topk_prob``."""
    probs = logits - logits.max(axis=1, keepdims=True)
    np.exp(probs, out=probs)
    probs *= np.float32(1) / probs.sum(axis=1, keepdims=True)  # torch's CPU softmax scales by 1/sum
    sel = _topk_desc(probs, k)
    w = np.take_along_axis(probs, sel, axis=1)
    if gate.norm_topk_prob:
        w = w / w.sum(axis=1, keepdims=True)
    return sel, w


def _route_sigmoid(gate: Gate, logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """deepseek_v3 / kimi_k2 / glm4_moe: sigmoid scores, selection on score + correction bias
    (group-limited when ``n_group > 1``), weights the unbiased selected scores."""
    t, e = logits.shape
    scores = sigmoid(logits.copy())
    choice = scores + gate.correction_bias if gate.correction_bias is not None else scores.copy()
    if gate.n_group > 1:
        grouped = choice.reshape(t, gate.n_group, e // gate.n_group)
        top2 = np.sort(grouped, axis=2)[:, :, -2:]
        group_scores = top2[:, :, 1] + top2[:, :, 0]
        keep = _topk_desc(group_scores, gate.topk_group)
        masked = np.ones((t, gate.n_group), dtype=bool)
        np.put_along_axis(masked, keep, False, axis=1)
        grouped[masked] = -np.inf  # grouped is a view of choice
    sel = _topk_desc(choice, k)
    w = np.take_along_axis(scores, sel, axis=1)
    if gate.norm_topk_prob:
        w = w / (w.sum(axis=1, keepdims=True) + np.float32(1e-20))
    return sel, w * np.float32(gate.routed_scaling_factor)


# Router per scoring rule (``moe.families``): (gate, logits f32 [T, E], k) → (selected
# expert ids [T, k] largest first, their weights f32 [T, k]).
ROUTERS = {"softmax": _route_softmax, "sigmoid": _route_sigmoid, "topk_softmax": _route_topk_softmax}


def route(gate: Gate, hidden_states: np.ndarray, top_k: int | None = None) -> Routing:
    """Route ``hidden_states`` (float32 ``[T, H]``) through ``gate`` → ``Routing``.

    ``logits = x · Wᵀ`` in float32. qwen3_moe: ``p = softmax(logits)`` (max-subtracted,
    float32) over all E, top-k of p, ``w = p_sel / Σ p_sel`` iff ``norm_topk_prob``.
    deepseek_v3 / kimi_k2: ``s = 1 / (1 + exp(-logits))``, ``s_b = s + bias``; with
    ``n_group > 1`` each group's score is the sum of its top-2 ``s_b`` and all but the best
    ``topk_group`` groups are masked with -inf; top-k of ``s_b``; ``w = s_sel``, divided by
    ``Σ w + 1e-20`` iff ``norm_topk_prob``, times ``routed_scaling_factor``. Sums run over
    the selected in descending-score order (what torch.topk returns when sorted). Sources: HF
    ``modeling_qwen3_moe.py`` ``Qwen3MoeTopKRouter.forward``, ``modeling_deepseek_v3.py``
    ``DeepseekV3MoE.route_tokens_to_experts``.

    The shared slot gets weight 1.0, or ``sigmoid(x · shared_gateᵀ)`` (float32) when the
    gate has a ``shared_gate`` (qwen2_moe). ``top_k`` defaults to ``gate.top_k``. Raises
    ``ValueError`` when ``hidden_states`` is not 2-D, its width differs from
    ``gate.d_model``, it holds NaN/inf (or the logits overflow), or k is missing or outside
    ``1..gate.max_top_k``.
    """
    x = np.asarray(hidden_states)
    if x.ndim != 2:
        raise ParamError(f"hidden_states must be 2-D [tokens, d_model], got shape {x.shape}", "hidden_states")
    if x.shape[1] != gate.d_model:
        raise ParamError(f"hidden_states have d_model={x.shape[1]} but the gate expects d_model={gate.d_model}",
                         "d_model")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if not np.isfinite(x).all():
        raise ParamError("hidden_states hold NaN or infinity", "hidden_states")
    if top_k is None:
        if gate.top_k is None:
            raise ParamError("top_k is required: the gate records no top_k", "top_k")
        top_k = gate.top_k
    k = gate.check_top_k(top_k)
    t = x.shape[0]
    with np.errstate(over="ignore", invalid="ignore"):  # reported just below
        logits = rowwise.matmul_xt(x, gate.weight)  # batch-invariant rows
        if gate.logit_bias is not None:
            logits += gate.logit_bias
    if not np.isfinite(logits).all():
        raise ParamError("router logits overflow float32: hidden_states are too large for this gate",
                         "hidden_states")
    if t == 0:
        sel, w = np.zeros((0, k), dtype=np.int64), np.zeros((0, k), dtype=np.float32)
    else:
        with np.errstate(over="ignore", under="ignore"):
            sel, w = ROUTERS[FAMILIES[gate.family].scoring](gate, logits, k)
    order = np.argsort(sel, axis=1)  # present slots in ascending expert id
    ids = np.take_along_axis(sel, order, axis=1).astype(np.int64)
    w = np.take_along_axis(w, order, axis=1).astype(np.float32, copy=False)
    if gate.shared_slot is not None:
        ids = np.concatenate([ids, np.full((t, 1), gate.shared_slot, dtype=np.int64)], axis=1)
        if gate.shared_gate is None:
            sw = np.ones((t, 1), dtype=np.float32)
        else:  # qwen2_moe: shared expert scaled by sigmoid(shared_expert_gate · x)
            sw = sigmoid(rowwise.matmul_xt(x, gate.shared_gate))
        w = np.concatenate([w, sw.astype(np.float32, copy=False)], axis=1)
    return Routing(np.ascontiguousarray(ids), np.ascontiguousarray(w), logits, k, gate.shared_slot)
