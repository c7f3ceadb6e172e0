"""The expert FFN (SwiGLU), its blob, the gate-weighted combine, and the monolithic MoE forward.

``Y = (silu(X·Wgᵀ) ⊙ (X·Wuᵀ))·Wdᵀ`` with weights in HF ``[out, in]`` layout, all float32
(HF ``transformers/models/qwen3_moe/modeling_qwen3_moe.py`` ``Qwen3MoeExperts`` /
``deepseek_v3/modeling_deepseek_v3.py`` ``DeepseekV3NaiveMoe``, ``DeepseekV3MLP``). The
combine adds, per token, ``weight × row`` slot by slot in ascending expert id with the
shared slot last, starting from zeros: the same order as HF's ``index_add_`` loop over
ascending experts followed by ``+ shared_experts(x)``. Every caller that feeds identical
expert rows therefore gets bit-identical output, sharded or monolithic.

Pure Python + numpy; imports nothing from Django.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np
from numba import njit

from moe.activations import silu
from moe.compute import matmul_xt, matmul_xt_many
from moe.gating import Gate, Routing, route
from moe.quant import QTYPES, QUANT_TYPES, QuantizedMatrix
from moe.codec import dumps_safetensors, encode_bf16, loads_safetensors

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
BIASES = ("gate_bias", "up_bias", "down_bias")
# "silu": SwiGLU of Qwen/DeepSeek/Mixtral; "swiglu_oss": gpt-oss's clamped SwiGLU with biases
# (HF gpt_oss/modular_gpt_oss.py GptOssExperts: gate ≤ limit, |up| ≤ limit, gate·σ(alpha·gate)·(up+1)).
ACTIVATIONS = ("silu", "swiglu_oss")
BLOB_DTYPES = {"f32": "F32", "bf16": "BF16", "f16": "F16"}
# Aliases the reference system accepts in `<name>.quant` (tenzro_reference_system.md §4.1).
_QUANT_ALIASES = {"q4_k_m": "q4_k", "q4_k_s": "q4_k"}


class MissingExpertRows(KeyError):
    """Routed (expert, tokens) pairs that ``combine`` received no rows for.

    ``missing`` maps expert id → int64 array of token indices (ascending).
    """

    def __init__(self, missing: dict[int, np.ndarray]):
        self.missing = missing
        parts = "; ".join(f"expert {e}: tokens {t.tolist()}" for e, t in sorted(missing.items()))
        super().__init__(f"no output rows for routed pairs: {parts}")

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(eq=False)
class ExpertWeights:
    """One expert's SwiGLU weights, HF ``[out, in]`` layout: ``gate_proj`` and ``up_proj``
    ``[F, H]``, ``down_proj`` ``[H, F]``. Each projection is a float32 array (made
    C-contiguous) or a ``moe.quant.QuantizedMatrix`` (GGUF blocks).

    Optional (gpt-oss): ``gate_bias``/``up_bias`` float32 ``[F]``, ``down_bias`` ``[H]``,
    ``activation`` ``"swiglu_oss"`` with ``swiglu_limit`` and ``swiglu_alpha``; the default
    ``"silu"`` without biases is the plain SwiGLU.

    Raises ``ValueError`` naming the projection for a non-2-D or mismatched shape or for
    non-finite dense values, and for a bias of the wrong shape or an unknown activation.
    """

    gate_proj: np.ndarray | QuantizedMatrix
    up_proj: np.ndarray | QuantizedMatrix
    down_proj: np.ndarray | QuantizedMatrix
    gate_bias: np.ndarray | None = None
    up_bias: np.ndarray | None = None
    down_bias: np.ndarray | None = None
    activation: str = "silu"
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702

    def __post_init__(self):
        for name in PROJECTIONS:
            a = getattr(self, name)
            if isinstance(a, QuantizedMatrix):
                continue  # validated on construction (shape, byte count, finite scales)
            a = np.ascontiguousarray(a, dtype=np.float32)
            if a.ndim != 2 or 0 in a.shape:
                raise ValueError(f"{name}.weight must be a non-empty 2-D matrix, got shape {a.shape}")
            if not np.isfinite(a).all():
                raise ValueError(f"{name}.weight holds NaN or infinity")
            setattr(self, name, a)
        f, h = self.gate_proj.shape
        if tuple(self.up_proj.shape) != (f, h):
            raise ValueError(f"up_proj.weight has shape {tuple(self.up_proj.shape)}; "
                             f"gate_proj.weight is {(f, h)}, they must match")
        if tuple(self.down_proj.shape) != (h, f):
            raise ValueError(f"down_proj.weight has shape {tuple(self.down_proj.shape)}; expected {(h, f)} "
                             f"([d_model, d_ff] for gate_proj {(f, h)})")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        for name, n in zip(BIASES, (f, f, h)):
            b = getattr(self, name)
            if b is None:
                continue
            b = np.ascontiguousarray(b, dtype=np.float32)
            if b.shape != (n,) or not np.isfinite(b).all():
                raise ValueError(f"{name.replace('_bias', '_proj')}.bias must be finite with shape ({n},), "
                                 f"got shape {b.shape}")
            setattr(self, name, b)

    @property
    def d_model(self) -> int:
        """H."""
        return int(self.gate_proj.shape[1])

    @property
    def d_ff(self) -> int:
        """F (the expert's intermediate width)."""
        return int(self.gate_proj.shape[0])

    @property
    def quant(self) -> str | None:
        """The coarsest quantization of the three projections (``q4_k`` < ``q6_k`` < ``q8_0``),
        or None when all are dense (reference §4.4, status ``quant``)."""
        kinds = [k for k in self.quant_kinds().values() if k in QTYPES]
        return min(kinds, key=lambda q: QUANT_TYPES[q].bits_per_weight) if kinds else None

    @property
    def nbytes(self) -> int:
        """Bytes held by the three projections (float32 arrays or quantized blocks) and biases."""
        return int(sum(a.nbytes for a in (self.gate_proj, self.up_proj, self.down_proj, self.gate_bias,
                                          self.up_bias, self.down_bias) if a is not None))

    def quant_kinds(self) -> dict[str, str]:
        """Per projection: its qtype (``"q4_k"`` ...) or ``"f32"`` for a dense array."""
        return {p: getattr(self, p).qtype if isinstance(getattr(self, p), QuantizedMatrix) else "f32"
                for p in PROJECTIONS}

    def dense(self) -> ExpertWeights:
        """This expert with every quantized projection decoded to float32 (itself if none is)."""
        if not any(isinstance(getattr(self, p), QuantizedMatrix) for p in PROJECTIONS):
            return self
        return replace(self, **{p: _as_dense(getattr(self, p)) for p in PROJECTIONS})

    def to_blob(self, dtype: str = "f32", metadata: Mapping[str, str] | None = None) -> bytes:
        """Serialize to canonical safetensors bytes (reference system §4.1): dense
        projections ``gate_proj.weight``, ``up_proj.weight``, ``down_proj.weight`` stored as
        ``dtype`` ("f32", "f16", or "bf16" rounded to nearest even: exact for weights that
        came from such a source); a ``QuantizedMatrix`` projection as a flat 1-D ``U8``
        tensor of its blocks plus ``__metadata__`` ``"<name>.quant"`` (qtype) and
        ``"<name>.shape"`` (``"rows,cols"``). ``metadata`` adds further string keys (e.g.
        ``"<name>.fallback"`` notes). Biases are ``gate_proj.bias``, ``up_proj.bias``,
        ``down_proj.bias`` in ``dtype``; a non-default activation is recorded as metadata
        ``activation``, ``swiglu_limit``, ``swiglu_alpha``. Same content → same bytes.

        Raises ``ValueError`` for another dtype, a non-string metadata entry, or a dense
        value out of range for ``dtype``.
        """
        if dtype not in BLOB_DTYPES:
            raise ValueError(f"expert blob dtype must be one of {sorted(BLOB_DTYPES)}, got {dtype!r}")
        tensors, meta = {}, dict(metadata or {})
        for name in PROJECTIONS:
            a = getattr(self, name)
            key = f"{name}.weight"
            if isinstance(a, QuantizedMatrix):
                tensors[key] = a.blocks.reshape(-1)
                meta[f"{key}.quant"] = a.qtype
                meta[f"{key}.shape"] = f"{a.shape[0]},{a.shape[1]}"
            elif dtype == "f32":
                tensors[key] = a
            elif dtype == "f16":
                with np.errstate(over="ignore"):
                    h = a.astype("<f2")
                if not np.isfinite(h).all():
                    raise ValueError(f"{key}: value beyond the f16 range")
                tensors[key] = h
            else:
                tensors[key] = ("BF16", a.shape, encode_bf16(a).tobytes())
        for name in BIASES:
            b = getattr(self, name)
            if b is not None:
                key = name.replace("_bias", "_proj.bias")
                tensors[key] = (b if dtype == "f32" else b.astype("<f2") if dtype == "f16"
                                else ("BF16", b.shape, encode_bf16(b).tobytes()))
        if self.activation != "silu":
            meta.update(activation=self.activation, swiglu_limit=repr(float(self.swiglu_limit)),
                        swiglu_alpha=repr(float(self.swiglu_alpha)))
        return dumps_safetensors(tensors, meta)

    @classmethod
    def from_blob(cls, data: bytes) -> ExpertWeights:
        """Load an expert blob: projections stored as F32, F16 or BF16 (decoded to float32)
        or as quantized ``U8`` with ``<name>.quant``/``<name>.shape`` metadata (kept as a
        ``QuantizedMatrix``; ``q4_k_m``/``q4_k_s`` tags read as ``q4_k``).

        Raises ``ValueError`` naming the tensor when one is missing, unexpected, of an
        undecodable dtype, of a bad shape, or has bad quant metadata or block bytes.
        """
        tensors, meta = loads_safetensors(data, source="expert blob")
        expected = {f"{p}.weight" for p in PROJECTIONS}
        biases = {f"{p}.bias" for p in PROJECTIONS}
        unknown = sorted(set(tensors) - expected - biases)
        if unknown:
            raise ValueError(f"expert blob has unsupported tensors {unknown} (expected {sorted(expected)})")
        extra = {}
        for p, name in zip(PROJECTIONS, BIASES):
            if f"{p}.bias" in tensors:
                extra[name] = tensors[f"{p}.bias"].to_f32(f"{p}.bias", "expert blob")
        if "activation" in meta:
            try:
                extra.update(activation=meta["activation"], swiglu_limit=float(meta.get("swiglu_limit", 7.0)),
                             swiglu_alpha=float(meta.get("swiglu_alpha", 1.702)))
            except ValueError:
                raise ValueError("expert blob: swiglu_limit / swiglu_alpha metadata must be numbers") from None
        return cls(**{p: _decode_projection(tensors, meta, f"{p}.weight") for p in PROJECTIONS}, **extra)


def _as_dense(a) -> np.ndarray:
    return a.dequantize() if isinstance(a, QuantizedMatrix) else a


def _decode_projection(tensors, meta: Mapping[str, str], name: str) -> np.ndarray | QuantizedMatrix:
    """One projection of a parsed expert blob: float32, or a ``QuantizedMatrix`` when the
    metadata tags it quantized."""
    if name not in tensors:
        raise ValueError(f"expert blob has no {name!r} tensor")
    t = tensors[name]
    tag = meta.get(f"{name}.quant")
    if tag is None:
        if t.dtype == "U8":
            raise ValueError(f"expert blob tensor {name!r} is U8 but has no '{name}.quant' metadata")
        return t.to_f32(name, "expert blob")
    q = _QUANT_ALIASES.get(tag.strip().lower(), tag.strip().lower())
    if q not in QTYPES:
        raise ValueError(f"expert blob {name!r}: unsupported quant {tag!r} (supported: {', '.join(QTYPES)})")
    if t.dtype != "U8":
        raise ValueError(f"expert blob {name!r}: quantized data must be U8, got {t.dtype}")
    shape_text = meta.get(f"{name}.shape", "")
    try:
        rows, cols = (int(v) for v in shape_text.split(","))
    except ValueError:
        raise ValueError(f"expert blob {name!r}: '{name}.shape' must be \"rows,cols\", got {shape_text!r}") from None
    try:
        return QuantizedMatrix(q, (rows, cols), np.frombuffer(t.data, dtype=np.uint8))
    except ValueError as exc:
        raise ValueError(f"expert blob {name!r}: {exc}") from None


def _check_rows(x, d_model: int, what: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] != d_model:
        raise ValueError(f"{what} must be [n, {d_model}] (d_model={d_model}), got shape {x.shape}")
    return np.ascontiguousarray(x, dtype=np.float32)


def expert_forward(w: ExpertWeights, x: np.ndarray) -> np.ndarray:
    """SwiGLU expert on rows ``x`` float32 ``[n, H]`` → float32 ``[n, H]``.

    ``(silu(x·Wgᵀ) ⊙ (x·Wuᵀ))·Wdᵀ``, three products through the compute seam
    (``moe.compute.matmul_xt``: for dense weights on the CPU exactly ``x @ w.T``);
    ``silu(g) = g / (1 + exp(-g))`` as torch's CPU kernel computes it (exp overflow gives
    ``-0.0``, the right limit, not NaN). Source: HF ``Qwen3MoeMLP`` / ``DeepseekV3MLP``.

    Quantized projections go to the backend as blocks: on the CPU the native integer kernels
    (``moe.kernels``: activations quantized to 8 bits as ggml does; on the x86 paths every batch
    size, so each row's result depends only on that row), else (portable / NEON above
    ``TENZRO_QUANT_NATIVE_BATCH`` rows, or without the extension above
    ``TENZRO_QUANT_SMALL_BATCH``) a decode bit-identical to gguf-py and the dense product; each
    row's result then depends only on that row and the batch-size class.
    Biases, when present, are added after each matmul; ``activation == "swiglu_oss"`` runs
    gpt-oss's clamped SwiGLU instead (``_swiglu_oss``).

    Raises ``ValueError`` when ``x`` is not ``[n, w.d_model]``.
    """
    x = _check_rows(x, w.d_model, "expert input rows")
    g, u = matmul_xt_many(x, (w.gate_proj, w.up_proj))  # one activation quantization for both
    if w.gate_bias is not None:
        g += w.gate_bias
    if w.up_bias is not None:
        u += w.up_bias
    if w.activation == "swiglu_oss":
        return _swiglu_oss(w, g, u)
    silu(g, out=g)
    g *= u
    out = matmul_xt(g, w.down_proj)
    if w.down_bias is not None:
        out += w.down_bias
    return out


def _swiglu_oss(w: ExpertWeights, g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """gpt-oss expert tail (HF ``GptOssExperts.forward``) on biased ``g``/``u``:
    ``gate = min(gate, limit)``, ``up = clip(up, -limit, limit)``, ``glu = gate · σ(alpha · gate)``,
    ``((up + 1) · glu)·Wdᵀ + bd``."""
    lim = np.float32(w.swiglu_limit)
    np.minimum(g, lim, out=g)
    np.clip(u, -lim, lim, out=u)
    glu = silu(g, alpha=w.swiglu_alpha)
    u += np.float32(1)
    out = matmul_xt(u * glu, w.down_proj)
    if w.down_bias is not None:
        out += w.down_bias
    return out


def combine(routing: Routing, expert_outputs: Mapping[int, tuple[np.ndarray, np.ndarray]],
            d_model: int) -> np.ndarray:
    """Gate-weighted sum of expert rows → float32 ``[T, d_model]``.

    ``expert_outputs[e] = (token_indices int [n], rows float32 [n, d_model])``: expert e's
    output for those tokens (any order, no repeats; rows for unrouted tokens are ignored).
    ``out[t] = Σ_s weights[t, s] · row(expert_ids[t, s], t)`` accumulated from zeros one slot
    position at a time (ascending expert id, shared slot last), each product rounded to
    float32 before its add, as HF's ``index_add_`` of ``rows * weight``.

    Raises ``MissingExpertRows`` (a ``KeyError``) naming each (expert, tokens) routed but
    absent, and ``ValueError`` for a bad row shape, token indices out of ``0..T-1`` or
    repeated, or a count mismatch between tokens and rows.
    """
    ids, weights = routing.expert_ids, routing.weights
    t, s = ids.shape
    out = np.zeros((t, d_model), dtype=np.float32)
    if t == 0 or s == 0:
        return out
    max_id = int(ids.max())
    compact = np.full(max_id + 1, -1, dtype=np.int64)  # expert id → row of `table`
    table_rows, blocks, offset = [], [], 0
    for e, value in expert_outputs.items():
        e = int(e)
        if e < 0 or e > max_id:
            continue
        tok, rows = value
        tok = np.asarray(tok)
        rows = _check_rows(rows, d_model, f"rows of expert {e}")
        if tok.ndim != 1 or tok.shape[0] != rows.shape[0]:
            raise ValueError(f"expert {e}: {np.shape(tok)} token indices for {rows.shape[0]} rows")
        if tok.size and (not np.issubdtype(tok.dtype, np.integer) or tok.min() < 0 or tok.max() >= t):
            raise ValueError(f"expert {e}: token indices must be integers in 0..{t - 1}")
        pos = np.full(t, -1, dtype=np.int64)
        pos[tok] = offset + np.arange(tok.size)
        if tok.size and np.count_nonzero(pos >= 0) != tok.size:
            raise ValueError(f"expert {e}: repeated token indices")
        compact[e] = len(table_rows)
        table_rows.append(pos)
        blocks.append(rows)
        offset += tok.size
    table = np.stack(table_rows) if table_rows else np.full((1, t), -1, dtype=np.int64)
    all_rows = np.concatenate(blocks) if blocks else np.zeros((0, d_model), dtype=np.float32)
    tokens = np.arange(t)
    gather = np.empty((t, s), dtype=np.int64)
    for j in range(s):
        c = compact[ids[:, j]]
        gather[:, j] = np.where(c >= 0, table[np.maximum(c, 0), tokens], -1)
    if (gather < 0).any():
        miss_t, miss_s = np.nonzero(gather < 0)
        miss_e = ids[miss_t, miss_s]
        missing = {int(e): np.sort(miss_t[miss_e == e]).astype(np.int64) for e in np.unique(miss_e)}
        raise MissingExpertRows(missing)
    return weighted_sum(weights, gather, all_rows)


def weighted_sum(weights: np.ndarray, gather: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``combine``'s arithmetic on rows already laid out: float32 ``[T, H]`` with
    ``out[t] = Σ_j weights[t, j] · rows[gather[t, j]]`` accumulated from zeros in slot order
    ``j``, each product rounded to float32 before its add. ``weights`` float32 ``[T, S]``,
    ``gather`` int64 ``[T, S]`` (every entry a row of ``rows``: unchecked, the caller built
    it), ``rows`` float32 ``[N, H]``."""
    out = np.zeros((gather.shape[0], rows.shape[1]), dtype=np.float32)
    _weighted_sum(out, np.ascontiguousarray(weights, dtype=np.float32), np.ascontiguousarray(gather, dtype=np.int64),
                  np.ascontiguousarray(rows, dtype=np.float32))
    return out


@njit(cache=True, nogil=True)
def _weighted_sum(out, weights, gather, rows):
    """``out[t] += weights[t, j] * rows[gather[t, j]]`` for j = 0, 1, … in order: each product
    rounded to float32, then added (no fused multiply-add: the bits of numpy's
    ``out += weights[:, j, None] * rows[gather[:, j]]``), one token row at a time in cache."""
    t, s = gather.shape
    h = out.shape[1]
    for i in range(t):
        for j in range(s):
            w = weights[i, j]
            r = gather[i, j]
            for c in range(h):
                out[i, c] += w * rows[r, c]


def moe_layer_forward(gate: Gate, experts: Callable[[int], ExpertWeights] | Mapping[int, ExpertWeights],
                      hidden_states: np.ndarray, top_k: int | None = None) -> tuple[np.ndarray, Routing]:
    """Monolithic in-process MoE layer: route, run each routed expert (ascending id) on its
    tokens' rows (ascending token index) with ``expert_forward``, then ``combine``.

    ``hidden_states`` float32 ``[T, H]``; ``experts`` maps or returns ``ExpertWeights`` by
    expert id (the shared expert is id ``gate.num_experts``). Returns (output float32
    ``[T, H]``, ``Routing``). Raises ``ValueError`` from ``route``/``expert_forward``
    (wrong shapes, non-finite input, bad top_k) and ``KeyError`` for an expert ``experts``
    does not hold.
    """
    routing = route(gate, hidden_states, top_k)
    x = np.ascontiguousarray(hidden_states, dtype=np.float32)
    outputs = {}
    for e, tok in routing.tokens_by_expert().items():
        if isinstance(experts, Mapping):
            if e not in experts:
                raise KeyError(f"no weights for expert {e}, routed to tokens {tok.tolist()}")
            w = experts[e]
        else:
            w = experts(e)
        outputs[e] = (tok, expert_forward(w, x[tok]))
    return combine(routing, outputs, gate.d_model), routing
