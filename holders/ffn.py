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
from dataclasses import dataclass

import numpy as np

from holders.compute import matmul_xt
from holders.gating import Gate, Routing, route
from holders.quant import QuantizedMatrix
from prepare.checkpoint import dumps_safetensors, encode_bf16, loads_safetensors

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
BLOB_DTYPES = {"f32": "F32", "bf16": "BF16"}


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
    """One expert's SwiGLU weights, HF ``[out, in]`` layout: ``gate_proj`` and
    ``up_proj`` ``[F, H]``, ``down_proj`` ``[H, F]``. Each projection is a float32 array
    (made C-contiguous) or a ``holders.quant.QuantizedMatrix`` (GGUF blocks).

    Raises ``ValueError`` naming the projection for a non-2-D or mismatched shape or for
    non-finite values.
    """

    gate_proj: np.ndarray
    up_proj: np.ndarray
    down_proj: np.ndarray

    def __post_init__(self):
        for name in PROJECTIONS:
            if isinstance(getattr(self, name), QuantizedMatrix):
                continue
            a = np.ascontiguousarray(getattr(self, name), dtype=np.float32)
            if a.ndim != 2 or 0 in a.shape:
                raise ValueError(f"{name}.weight must be a non-empty 2-D matrix, got shape {a.shape}")
            if not np.isfinite(a).all():
                raise ValueError(f"{name}.weight holds NaN or infinity")
            setattr(self, name, a)
        f, h = self.gate_proj.shape
        if self.up_proj.shape != (f, h):
            raise ValueError(f"up_proj.weight has shape {self.up_proj.shape}; "
                             f"gate_proj.weight is {(f, h)}, they must match")
        if self.down_proj.shape != (h, f):
            raise ValueError(f"down_proj.weight has shape {self.down_proj.shape}; expected {(h, f)} "
                             f"([d_model, d_ff] for gate_proj {(f, h)})")

    @property
    def d_model(self) -> int:
        """H."""
        return int(self.gate_proj.shape[1])

    @property
    def d_ff(self) -> int:
        """F (the expert's intermediate width)."""
        return int(self.gate_proj.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes held by the three projections (float32 elements × 4, or quantized block bytes)."""
        return int(self.gate_proj.nbytes + self.up_proj.nbytes + self.down_proj.nbytes)

    @property
    def quant(self) -> str | None:
        """The coarsest quantization of the three projections (``q4_k`` < ``q6_k`` < ``q8_0``),
        or None when all are dense (reference §4.4)."""
        kinds = [getattr(self, p).qtype for p in PROJECTIONS if isinstance(getattr(self, p), QuantizedMatrix)]
        return min(kinds, key=("q4_k", "q6_k", "q8_0").index) if kinds else None

    def to_blob(self, dtype: str = "f32") -> bytes:
        """Serialize to canonical safetensors bytes with ``gate_proj.weight``,
        ``up_proj.weight``, ``down_proj.weight`` stored as ``dtype`` ("f32", or "bf16" rounded
        to nearest even, exact for bf16-sourced weights). Same content → same bytes.

        Raises ``ValueError`` for another dtype.
        """
        if dtype not in BLOB_DTYPES:
            raise ValueError(f"expert blob dtype must be one of {sorted(BLOB_DTYPES)}, got {dtype!r}")
        tensors = {}
        for name in PROJECTIONS:
            a = getattr(self, name)
            key = f"{name}.weight"
            tensors[key] = a if dtype == "f32" else ("BF16", a.shape, encode_bf16(a).tobytes())
        return dumps_safetensors(tensors)

    @classmethod
    def from_blob(cls, data: bytes) -> ExpertWeights:
        """Load an expert blob (projections stored as F32, F16 or BF16, decoded to float32).

        Raises ``ValueError`` naming the tensor when one is missing, unexpected, of an
        undecodable dtype, or of a bad shape.
        """
        tensors, _meta = loads_safetensors(data, source="expert blob")
        expected = {f"{p}.weight" for p in PROJECTIONS}
        unknown = sorted(set(tensors) - expected)
        if unknown:
            raise ValueError(f"expert blob has unsupported tensors {unknown} (expected {sorted(expected)})")
        return cls(**{p: _decode_projection(tensors, f"{p}.weight") for p in PROJECTIONS})


def _decode_projection(tensors, name: str) -> np.ndarray:
    """One projection of a parsed expert blob as float32; the place where stored encodings
    other than plain floats get decoded."""
    if name not in tensors:
        raise ValueError(f"expert blob has no {name!r} tensor")
    return tensors[name].to_f32(name, "expert blob")


def _check_rows(x, d_model: int, what: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] != d_model:
        raise ValueError(f"{what} must be [n, {d_model}] (d_model={d_model}), got shape {x.shape}")
    return np.ascontiguousarray(x, dtype=np.float32)


def expert_forward(w: ExpertWeights, x: np.ndarray) -> np.ndarray:
    """SwiGLU expert on rows ``x`` float32 ``[n, H]`` → float32 ``[n, H]``.

    ``(silu(x·Wgᵀ) ⊙ (x·Wuᵀ))·Wdᵀ``, three products through the compute seam
    (``holders.compute.matmul_xt``: BLAS on the CPU for dense weights, bit-identical to
    ``x @ w.T``; quantized kernels or a GPU backend otherwise);
    ``silu(g) = g / (1 + exp(-g))`` as torch's CPU kernel computes it (exp overflow gives
    ``-0.0``, the right limit, not NaN). Source: HF ``Qwen3MoeMLP`` / ``DeepseekV3MLP``.

    Raises ``ValueError`` when ``x`` is not ``[n, w.d_model]``.
    """
    x = _check_rows(x, w.d_model, "expert input rows")
    g = matmul_xt(x, w.gate_proj)
    u = matmul_xt(x, w.up_proj)
    t = np.negative(g)
    with np.errstate(over="ignore", under="ignore"):
        np.exp(t, out=t)
    t += np.float32(1)
    np.divide(g, t, out=g)
    g *= u
    return matmul_xt(g, w.down_proj)


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
    for j in range(s):
        out += weights[:, j, None] * all_rows[gather[:, j]]
    return out


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
