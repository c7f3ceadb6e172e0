"""Pieces every backbone family shares: RMSNorm, rotary tables (default, linear, YaRN),
rotation, causal attention over a per-sequence KV cache, and the decoder-layer loop.

All arithmetic is float32, the way the Hugging Face modeling files run an f32 model
(RMSNorm and softmax computed in f32). Pure numpy; imports nothing from Django.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
import math
from dataclasses import dataclass, field
from typing import Callable, Generator

import numpy as np

from moe import rowwise
from moe.config import ModelConfig

F32 = np.float32

# mlp(layer, rows float32 [N, H]) -> float32 [N, H]: the MoE or dense MLP of one decoder layer.
MlpFn = Callable[[int, np.ndarray], np.ndarray]


class BackboneError(ValueError):
    """A backbone cannot be built or run (bad config, missing tensor, context exceeded)."""

    def __init__(self, message: str, field: str = "model_id"):
        super().__init__(message)
        self.field = field


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x², -1) + eps) * weight`` in float32 (HF ``*RMSNorm``).

    ``x`` float32 ``[..., D]``, ``weight`` float32 ``[D]`` → float32 ``[..., D]``.
    """
    var = np.mean(np.square(x, dtype=F32), axis=-1, keepdims=True, dtype=F32)
    return (x * (F32(1.0) / np.sqrt(var + F32(eps)))).astype(F32) * weight


def silu(x: np.ndarray) -> np.ndarray:
    """``x · sigmoid(x)`` in float32."""
    return (x / (F32(1.0) + np.exp(-x))).astype(F32)


def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    """``x · wᵀ (+ b)``: ``x`` float32 ``[N, in]``, ``w`` ``[out, in]`` → float32 ``[N, out]``,
    row-invariant (``moe.rowwise.matmul_xt``: a row's result does not depend on ``N``)."""
    y = rowwise.matmul_xt(x, w)
    return y + b if b is not None else y


def _yarn_inv_freq(dim: int, base: float, p: dict, max_pos: int) -> tuple[np.ndarray, float]:
    """YaRN inverse frequencies and attention factor (Peng et al. 2023, "YaRN: Efficient
    Context Window Extension"; HF ``modeling_rope_utils._compute_yarn_parameters``)."""
    factor = float(p["factor"])
    orig = int(p.get("original_max_position_embeddings") or max_pos)

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        ms, ms_all = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = (get_mscale(factor, ms) / get_mscale(factor, ms_all) if ms and ms_all
                            else get_mscale(factor))
    beta_fast, beta_slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)

    def correction_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    extra = 1.0 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv, float(attention_factor)


@dataclass
class Rotary:
    """Rotary position tables for one head width ``dim`` (HF ``*RotaryEmbedding``).

    ``rope_type`` ``default``, ``linear`` (positions divided by ``factor``) or ``yarn``
    (``_yarn_inv_freq``; cos/sin scaled by its attention factor). ``cos_sin(positions)``
    → float32 ``([N, dim], [N, dim])`` with the frequencies repeated twice (``cat(f, f)``).
    Raises ``BackboneError`` for another rope type.
    """

    dim: int
    params: dict
    max_position: int
    inv_freq: np.ndarray = field(init=False)
    attention_factor: float = field(init=False, default=1.0)

    def __post_init__(self):
        kind, base = self.params["rope_type"], float(self.params["rope_theta"])
        if kind in ("default", "linear"):
            self.inv_freq = 1.0 / base ** (np.arange(0, self.dim, 2, dtype=np.int64).astype(np.float32) / self.dim)
            if kind == "linear":
                self.inv_freq = self.inv_freq / float(self.params["factor"])
        elif kind == "yarn":
            self.inv_freq, self.attention_factor = _yarn_inv_freq(self.dim, base, self.params, self.max_position)
        else:
            raise BackboneError(f"rope type {kind!r} is not supported (default, linear, yarn)", "config")
        self.inv_freq = np.asarray(self.inv_freq, dtype=F32)

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        freqs = positions.astype(F32)[:, None] * self.inv_freq[None, :]
        emb = np.concatenate([freqs, freqs], axis=-1)
        return (np.cos(emb) * F32(self.attention_factor)).astype(F32), \
            (np.sin(emb) * F32(self.attention_factor)).astype(F32)


def rotate_half(x: np.ndarray) -> np.ndarray:
    """``cat(-x[..., d/2:], x[..., :d/2])`` (HF ``rotate_half``)."""
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def apply_rotary(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleave: bool = False) -> np.ndarray:
    """Rotate ``x`` float32 ``[N, heads, d]`` by position tables ``[N, d]``.

    ``interleave`` (DeepSeek ``rope_interleave``): pairs are adjacent, so the last axis is
    first de-interleaved to ``[even…, odd…]`` (HF ``apply_rotary_pos_emb_interleave``).
    """
    if interleave:
        n, h, d = x.shape
        x = x.reshape(n, h, d // 2, 2).transpose(0, 1, 3, 2).reshape(n, h, d)
    return (x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]).astype(F32)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax in float32 (masked ``-inf`` entries give 0). The reductions are
    the ufuncs ``np.max``/``np.sum`` run on an array, called directly (same bits, a third less
    time on a decode step's ``[heads, keys]`` scores, where call overhead is most of it)."""
    e = np.exp(x - np.maximum.reduce(x, axis=axis, keepdims=True))
    return (e / np.add.reduce(e, axis=axis, keepdims=True)).astype(F32, copy=False)


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_positions: np.ndarray, scaling: float,
                     sliding_window: int | None = None) -> np.ndarray:
    """Scaled dot-product attention of new queries against a sequence's whole cache.

    ``q`` float32 ``[Tq, Hq, Dk]`` at absolute ``q_positions`` ``[Tq]``; ``k`` ``[Tk, Hkv, Dk]``
    and ``v`` ``[Tk, Hkv, Dv]`` for positions ``0..Tk-1`` (grouped-query: each KV head
    serves ``Hq / Hkv`` query heads). Key ``j`` is visible to query at position ``p`` when
    ``j ≤ p`` (and ``j > p - sliding_window`` when given). Returns float32 ``[Tq, Hq, Dv]``.

    Each query runs on its own against exactly its visible keys (no mask over a longer
    key range): its result depends on its position and the cache alone, not on how many
    queries share the call, so a prompt prefilled in chunks or whole, alone or beside
    other sequences, gives the same bits (batch invariance).
    """
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv:
        k = k.repeat(hq // hkv, axis=1)
        v = v.repeat(hq // hkv, axis=1)
    out = np.empty((q.shape[0], hq, v.shape[2]), dtype=F32)
    for i, p in enumerate(q_positions.tolist()):
        lo = max(0, p - sliding_window + 1) if sliding_window else 0
        scores = np.einsum("hd,khd->hk", q[i], k[lo:p + 1]).astype(F32, copy=False) * F32(scaling)
        out[i] = np.einsum("hk,khd->hd", softmax(scores), v[lo:p + 1])
    return out


class KVCache:
    """The attention cache of one sequence: per decoder layer, named float32 arrays grown
    along axis 0 (one row per position), plus ``length`` (positions cached).

    GQA families keep ``k`` ``[T, Hkv, D]`` (rotated) and ``v``; MLA keeps the compressed
    latent ``ckv`` ``[T, kv_lora_rank]`` and rotated ``k_pe`` ``[T, rope_dim]`` (DeepSeek-V2
    §2.1: the cache is the latent, not the per-head keys). ``to_bytes``/``from_bytes``
    serialize it as safetensors for the Prefill → Decode handoff.

    ``layers[i][name]`` is the cached rows only: a C-contiguous view of the first rows of a
    buffer with spare rows (``GROW``), so a decode step writes its row in place instead of
    copying the whole cache (the views hold the same values in the same layout as a
    concatenated array: attention over them gives the same bits). ``max_rows`` (the positions
    the scheduler reserved: prompt + max new tokens) caps the spare rows, so a cache never holds
    more memory than its reservation.
    """

    # Spare rows when a buffer is (re)allocated: at least GROW, and an eighth of the rows held, so
    # the copies stay O(1) per row while the memory beyond what the scheduler reserves per
    # position (Backbone.kv_bytes_per_token) stays within GROW rows and 12.5 %.
    GROW = 16

    def __init__(self, num_layers: int, max_rows: int | None = None):
        self.max_rows = max_rows
        self.layers: list[dict[str, np.ndarray]] = [{} for _ in range(num_layers)]
        self._buffers: list[dict[str, np.ndarray]] = [{} for _ in range(num_layers)]
        self.length = 0

    def append(self, layer: int, **arrays: np.ndarray) -> dict[str, np.ndarray]:
        """Append rows to ``layer``'s arrays (cast to float32); returns the whole (updated)
        arrays (views: rows appended later do not change them)."""
        slot, bufs = self.layers[layer], self._buffers[layer]
        for name, a in arrays.items():
            held = slot.get(name)
            n, m = (0 if held is None else held.shape[0]), a.shape[0]
            if held is not None and held.shape[1:] != a.shape[1:]:
                raise ValueError(f"kv cache {name}: rows of shape {a.shape[1:]} appended to {held.shape[1:]}")
            buf = bufs.get(name)
            if buf is None or buf.shape[0] < n + m or (held is not None and held.base is not buf):
                rows = n + m + max(self.GROW, n // 8)
                if self.max_rows is not None and n + m <= self.max_rows:
                    rows = min(rows, self.max_rows)
                buf = np.empty((rows,) + a.shape[1:], dtype=F32)
                if n:
                    buf[:n] = held
                bufs[name] = buf
            buf[n:n + m] = a
            slot[name] = buf[:n + m]
        return slot

    @property
    def nbytes(self) -> int:
        """Bytes of cached float32 data."""
        return sum(a.nbytes for slot in self.layers for a in slot.values())

    def to_bytes(self) -> bytes:
        """Safetensors bytes: tensors ``{layer}.{name}``, metadata ``length`` and ``layers``."""
        from moe.codec import dumps_safetensors

        tensors = {f"{i}.{n}": a for i, slot in enumerate(self.layers) for n, a in slot.items()}
        return dumps_safetensors(tensors, {"length": str(self.length), "layers": str(len(self.layers))})

    @classmethod
    def from_bytes(cls, data: bytes) -> "KVCache":
        """Inverse of ``to_bytes``. Raises ``moe.codec.CheckpointError`` (a ``ValueError``)
        for a malformed buffer."""
        from moe.codec import CheckpointError, loads_safetensors

        tensors, meta = loads_safetensors(data, "kv cache")
        try:
            cache = cls(int(meta["layers"]))
            cache.length = int(meta["length"])
        except (KeyError, ValueError) as exc:
            raise CheckpointError(f"kv cache: metadata lacks layers/length ({exc})") from None
        for key, raw in tensors.items():
            layer, name = key.split(".", 1)
            cache.layers[int(layer)][name] = raw.to_f32(key, "kv cache")
        return cache


class Backbone(ABC):
    """A decoder-only transformer whose MLP of each layer is supplied by the caller.

    Subclasses set ``num_layers``, ``eps`` and implement ``attention(layer, h, positions,
    cache)``; weights are float32 arrays in ``self.w`` under their checkpoint names.
    ``forward(seqs, caches, mlp)`` runs new tokens of several sequences together: rows of
    all sequences are concatenated for norms, projections and each layer's ``mlp`` call
    (so a distributed MoE layer sends one batch per holder for the whole step), attention
    runs per sequence against its own cache. Pre-norm residual layout of the HF decoder
    layer: ``h += attn(norm1(h)); h += mlp(norm2(h))``; final norm; LM head.
    """

    family = ""
    num_layers: int
    eps: float
    max_position: int

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray]):
        self.config = config
        self.w = weights
        self.num_layers = config.need("num_hidden_layers")
        self.eps = config.rms_norm_eps
        self.hidden_size = config.need("hidden_size")
        self.vocab_size = config.need("vocab_size")
        self.max_position = config.max_position_embeddings
        for name in ("model.embed_tokens.weight", "model.norm.weight"):
            self.weight(name)
        self.lm_head = (self.w["model.embed_tokens.weight"] if config.tie_word_embeddings
                        and "lm_head.weight" not in self.w else self.weight("lm_head.weight"))

    def weight(self, name: str) -> np.ndarray:
        """Weight ``name``; raises ``BackboneError`` when the published backbone lacks it."""
        try:
            return self.w[name]
        except KeyError:
            raise BackboneError(f"backbone weight {name!r} is missing") from None

    def new_cache(self, max_rows: int | None = None) -> KVCache:
        """An empty cache for one sequence (``max_rows``: positions reserved for it, if known)."""
        return KVCache(self.num_layers, max_rows)

    def kv_bytes_per_token(self) -> int:
        """Bytes one position adds to a sequence's ``KVCache`` (all layers, float32): what the
        scheduler reserves against ``TENZRO_KV_BUDGET_BYTES``. Families override it; this
        default assumes a key and a value of ``hidden_size`` per layer."""
        return self.num_layers * 2 * self.hidden_size * 4

    @abstractmethod
    def attention(self, layer: int, h: np.ndarray, positions: np.ndarray, cache: KVCache) -> np.ndarray:
        """Self-attention of ``layer`` for one sequence's new rows ``h`` float32 ``[T, H]`` at
        ``positions`` ``[T]``; appends to ``cache`` and returns float32 ``[T, H]``."""

    def attention_rows(self, layer: int, h: np.ndarray, bounds: np.ndarray, positions: list[np.ndarray],
                       caches: list[KVCache]) -> np.ndarray:
        """Self-attention of ``layer`` for the new rows of several sequences stacked in ``h``
        float32 ``[N, H]`` (sequence ``i``'s rows ``bounds[i]:bounds[i + 1]`` at
        ``positions[i]``, cache ``caches[i]``); float32 ``[N, H]``. This default runs
        ``attention`` per sequence; a family whose projections are row-invariant overrides it
        to run each over every row at once (same bits, one call instead of one per sequence)."""
        return np.concatenate([self.attention(layer, h[bounds[i]:bounds[i + 1]], positions[i], caches[i])
                               for i in range(len(caches))])

    def forward(self, seqs: list[np.ndarray], caches: list[KVCache], mlp: MlpFn,
                all_logits: bool = False, select: list[str] | None = None) -> list[np.ndarray | None]:
        """Run new token ids of each sequence (``seqs[i]`` int ``[T_i]``) through the model.

        ``caches[i]`` holds sequence ``i``'s earlier positions and is extended. Returns per
        sequence float32 logits ``[T_i, vocab]`` when ``all_logits`` else ``[1, vocab]``
        (the last position); ``select[i]`` (``"all"``, ``"last"`` or ``"none"``: None, no LM
        head; a prompt chunk before the last) overrides that per sequence. Every row's math
        is row-invariant (``linear``, ``causal_attention``, per-row norms): a sequence's
        logits do not depend on the other sequences of the call. Raises ``BackboneError``
        (field ``input_ids``) for an id out of the vocabulary or a sequence past
        ``max_position_embeddings``. ``forward_steps`` driven with ``mlp``.
        """
        steps = self.forward_steps(seqs, caches, all_logits, select)
        try:
            layer, x = next(steps)
            while True:
                layer, x = steps.send(mlp(layer, x))
        except StopIteration as done:
            return done.value

    def forward_steps(self, seqs: list[np.ndarray], caches: list[KVCache], all_logits: bool = False,
                      select: list[str] | None = None) -> Generator[tuple[int, np.ndarray], np.ndarray,
                                                                    list[np.ndarray | None]]:
        """``forward`` as a generator, for a caller that runs each layer's MLP elsewhere (the
        scheduler awaits it on its event loop): yields ``(layer, x)`` with ``x`` float32
        ``[N, H]`` C-contiguous (every sequence's rows after the layer's post-attention norm),
        takes the MLP's output float32 ``[N, H]`` by ``send``, and returns ``forward``'s
        logits list (``StopIteration.value``). Same arguments, math and errors as
        ``forward`` (raised by the first ``next``); the caches are extended as it runs."""
        for ids, cache in zip(seqs, caches):
            if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
                raise BackboneError(f"token ids must be in 0..{self.vocab_size - 1}", "input_ids")
            if cache.length + ids.size > self.max_position:
                raise BackboneError(f"{cache.length + ids.size} positions exceed the context of "
                                    f"{self.max_position} (max_position_embeddings)", "max_new_tokens")
        lens = [int(s.size) for s in seqs]
        bounds = np.cumsum([0] + lens)
        positions = [np.arange(c.length, c.length + n) for c, n in zip(caches, lens)]
        h = self.w["model.embed_tokens.weight"][np.concatenate(seqs).astype(np.int64)].astype(F32)
        for layer in range(self.num_layers):
            x = rms_norm(h, self.weight(f"model.layers.{layer}.input_layernorm.weight"), self.eps)
            h = h + self.attention_rows(layer, x, bounds, positions, caches)
            x = rms_norm(h, self.weight(f"model.layers.{layer}.post_attention_layernorm.weight"), self.eps)
            out = yield layer, np.ascontiguousarray(x, dtype=F32)
            h = h + np.asarray(out, dtype=F32)
        for c, n in zip(caches, lens):
            c.length += n
        h = rms_norm(h, self.w["model.norm.weight"], self.eps)
        # One LM-head product over every sequence's wanted rows (row-invariant, so sharing it
        # changes no bits), split back per sequence.
        spans, picks = [], []
        for i in range(len(seqs)):
            want = select[i] if select is not None else ("all" if all_logits else "last")
            lo = bounds[i] if want == "all" else bounds[i + 1] - 1
            spans.append(None if want == "none" else (sum(len(p) for p in picks), bounds[i + 1] - lo))
            if want != "none":
                picks.append(np.arange(lo, bounds[i + 1]))
        logits = linear(h[np.concatenate(picks)], self.lm_head) if picks else None
        return [None if sp is None else logits[sp[0]:sp[0] + sp[1]] for sp in spans]
