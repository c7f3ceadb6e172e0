"""GGUF files (llama.cpp) read as checkpoints: experts, gates, backbone, tokenizer, chat template.

``GgufCheckpoint(path_or_url)`` parses a GGUF v2/v3 header (metadata and tensor table) with
ranged reads only (a local file, or HTTP Range through ``prepare.remote``), then presents
the file under Hugging Face tensor names with HF shapes, so the extractor
(``prepare.layouts``), the backbone publisher and the in-process model read it like a
safetensors checkpoint. ``config`` is the ``config.json`` the metadata stands for
(``moe.config.hf_config_from_gguf``).

llama.cpp's layout conventions undone here (``convert_hf_to_gguf.py`` / ``conversion/``):

* the routed experts of a layer are one stack per projection, ``blk.{L}.ffn_{gate,up,down}_exps``
  of numpy shape ``[E, rows, cols]``: expert e is the contiguous slab ``[e]``, each row quantized
  on its own, so its GGUF blocks are exactly our ``QuantizedMatrix`` bytes;
* ``llama`` (Mixtral): ``attn_q``/``attn_k`` rows are permuted for llama.cpp's interleaved
  rope (``LlamaModel.permute``); read back with the inverse permutation;
* ``deepseek2``: ``kv_b_proj`` is split into ``attn_k_b`` ``[heads, kv_lora_rank, nope]``
  (transposed) and ``attn_v_b`` ``[heads, v, kv_lora_rank]``; rejoined per head (older files
  keep ``attn_kv_b`` whole);
* qwen2moe's shared-expert gate ``ffn_gate_inp_shexp`` may be 1-D ``[H]``: read as ``[1, H]``;
* older Mixtral files keep one tensor per expert, ``blk.{L}.ffn_{gate,up,down}.{e}.weight``: read as such;
* no ``output.weight``: the embeddings are tied.

Expert projections keep the file's bytes for the types the holders execute (Q8_0, Q4_K,
Q6_K as blocks; F16, BF16, F32 dense, exact); any other ggml type (Q4_0, Q5_0, Q5_K, …) is
decoded to float32 by gguf-py's reference dequantizer and that is reported per projection
(``load_expert_blocks``). Backbone tensors are decoded to float32 unless F16/BF16/F32.

Pure Python + numpy (+ gguf-py for its type table and fallback dequantizers); no Django.
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from moe.codec import CheckpointError, TensorInfo
from moe.config import ConfigError, hf_config_from_gguf
from moe.ffn import PROJECTIONS, ExpertWeights
from moe.quant import QuantizedMatrix, dequantize

GGUF_MAGIC = b"GGUF"
MAX_METADATA_BYTES = 1 << 30  # a string or array larger than this is a corrupt (or hostile) header
_CHUNK = 1 << 20

# ggml type ids (ggml.h) we name; everything else goes through gguf-py's tables.
GGML_F32, GGML_F16, GGML_Q8_0, GGML_Q4_K, GGML_Q6_K, GGML_BF16 = 0, 1, 8, 12, 14, 30
BLOCK_TYPES = {GGML_Q8_0: "q8_0", GGML_Q4_K: "q4_k", GGML_Q6_K: "q6_k"}  # executed as blocks
DENSE_TYPES = {GGML_F32: "F32", GGML_F16: "F16", GGML_BF16: "BF16"}

# GGUF value types -> struct format (scalars)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP_ARRAYS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
              12: "<f8"}
_STRING, _ARRAY = 8, 9


def ggml_type_name(t: int) -> str:
    """The ggml name of type id ``t`` (``"Q4_K"``), or ``"type <t>"`` when unknown."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(t).name
    except ValueError:
        return f"type {t}"


def _type_sizes(t: int, name: str, source: str) -> tuple[int, int]:
    """(block size in values, bytes per block) of ggml type ``t``; ``CheckpointError`` when unknown."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(t)]
    except (ValueError, KeyError):
        raise CheckpointError(f"{source}: tensor {name!r} has unknown ggml type {t}") from None


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of the table: ``name``, ggml ``type`` id, ``shape`` in numpy order (ggml
    ``ne`` reversed: rows last-but-one, the block-quantized row last), absolute ``offset``
    and ``nbytes`` in the file."""

    name: str
    type: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class _Reader:
    """Sequential reads over ``read_range`` in 1 MiB chunks (the header is parsed in order)."""

    def __init__(self, read_range: Callable[[int, int], bytes], size: int, source: str):
        self.read_range, self.size, self.source = read_range, size, source
        self.pos, self.buf, self.buf_at = 0, b"", 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise CheckpointError(f"{self.source}: bad GGUF header: it runs past the end of the {self.size}-byte file")
        end = self.pos + n
        if not (self.buf_at <= self.pos and end <= self.buf_at + len(self.buf)):
            self.buf_at = self.pos
            self.buf = self.read_range(self.pos, min(self.size - self.pos, max(n, _CHUNK)))
        out = self.buf[self.pos - self.buf_at:end - self.buf_at]
        self.pos = end
        return out

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        if n > MAX_METADATA_BYTES:
            raise CheckpointError(f"{self.source}: bad GGUF header: string length {n}")
        raw = self.take(n)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")  # a vocabulary may hold partial UTF-8 pieces

    def value(self, vtype: int, key: str, depth: int = 0):
        if vtype == 6:  # f32: the shortest decimal that round-trips (1e-06, not 9.99999997e-07)
            return float(str(np.float32(self.scalar("<f"))))
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY and depth == 0:
            etype, n = self.scalar("<I"), self.scalar("<Q")
            if n > MAX_METADATA_BYTES:
                raise CheckpointError(f"{self.source}: bad GGUF header: array {key!r} of {n} items")
            if etype in _NP_ARRAYS:
                dt = np.dtype(_NP_ARRAYS[etype])
                a = np.frombuffer(self.take(n * dt.itemsize), dtype=dt)
                return [bool(x) for x in a] if etype == 7 else a.tolist()
            return [self.value(etype, key, depth + 1) for _ in range(n)]
        raise CheckpointError(f"{self.source}: bad GGUF header: metadata {key!r} has value type {vtype}")


def parse_gguf_header(read_range: Callable[[int, int], bytes], size: int, source: str
                      ) -> tuple[dict[str, Any], dict[str, GgufTensor]]:
    """Parse a GGUF v2/v3 header: ``(metadata, tensors by name)``.

    ``read_range(offset, length)`` returns bytes of the file of ``size`` bytes. Arrays come
    back as lists. Raises ``CheckpointError`` (naming ``source``) for a bad magic, an
    unsupported version (1, or big-endian files), a truncated header, a duplicate tensor, a
    tensor whose bytes lie outside the file, or a row length that is not whole blocks.
    """
    r = _Reader(read_range, size, source)
    if size < 24 or r.take(4) != GGUF_MAGIC:
        raise CheckpointError(f"{source}: not a GGUF file (bad magic)")
    version = r.scalar("<I")
    if version not in (2, 3):
        raise CheckpointError(f"{source}: GGUF version {version} is not supported (2 or 3, little-endian)")
    n_tensors, n_kv = r.scalar("<Q"), r.scalar("<Q")
    if n_tensors > 10_000_000 or n_kv > 10_000_000:
        raise CheckpointError(f"{source}: bad GGUF header: {n_tensors} tensors, {n_kv} metadata entries")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string()
        meta[key] = r.value(r.scalar("<I"), key)
    raw = []
    for _ in range(n_tensors):
        name = r.string()
        n_dims = r.scalar("<I")
        if not 1 <= n_dims <= 4:
            raise CheckpointError(f"{source}: tensor {name!r} has {n_dims} dimensions")
        ne = [r.scalar("<Q") for _ in range(n_dims)]
        raw.append((name, ne, r.scalar("<I"), r.scalar("<Q")))
    align = meta.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise CheckpointError(f"{source}: GGUF general.alignment={align!r} is not a power of two")
    data_start = -(-r.pos // align) * align
    tensors: dict[str, GgufTensor] = {}
    for name, ne, t, off in raw:
        block, tsize = _type_sizes(t, name, source)
        if ne[0] % block:
            raise CheckpointError(f"{source}: tensor {name!r} ({ggml_type_name(t)}) has rows of {ne[0]} values, "
                                  f"not a multiple of its block size {block}")
        nbytes = int(np.prod(ne[1:], dtype=np.int64)) * (ne[0] // block) * tsize
        start = data_start + off
        if name in tensors:
            raise CheckpointError(f"{source}: tensor {name!r} appears twice in the GGUF table")
        if start + nbytes > size:
            raise CheckpointError(f"{source}: tensor {name!r} runs past the end of the file")
        tensors[name] = GgufTensor(name, t, tuple(int(x) for x in reversed(ne)), start, nbytes)
    return meta, tensors


def decode_tensor(raw: bytes, t: int, shape: tuple[int, ...], name: str) -> np.ndarray:
    """Tensor bytes of ggml type ``t`` → float32 array of numpy ``shape``: F32/F16/BF16
    exactly, Q8_0/Q4_K/Q6_K by ``moe.quant`` (bit-identical to gguf-py), any other type by
    gguf-py's reference dequantizer. Raises ``CheckpointError`` for a type neither knows."""
    if t == GGML_F32:
        return np.frombuffer(raw, "<f4").reshape(shape).astype(np.float32)
    if t == GGML_F16:
        return np.frombuffer(raw, "<f2").reshape(shape).astype(np.float32)
    if t == GGML_BF16:
        return (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
    if t in BLOCK_TYPES:
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        return dequantize(np.frombuffer(raw, np.uint8), BLOCK_TYPES[t], (rows, shape[-1])).reshape(shape)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    try:
        out = gguf_dequantize(np.frombuffer(raw, np.uint8), GGMLQuantizationType(t))
    except (ValueError, NotImplementedError) as exc:  # gguf-py has no decoder for this type
        raise CheckpointError(f"tensor {name!r}: ggml type {ggml_type_name(t)} cannot be decoded ({exc})") from None
    return np.asarray(out, dtype=np.float32).reshape(shape)


# blk.{L}.<suffix> -> HF name under model.layers.{L}. (the MLP ones are per family below)
BLOCK_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight", "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight", "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight", "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_EXPS = {"gate_proj": "ffn_gate_exps.weight", "up_proj": "ffn_up_exps.weight", "down_proj": "ffn_down_exps.weight"}
_SHEXP = {"gate_proj": "ffn_gate_shexp.weight", "up_proj": "ffn_up_shexp.weight",
          "down_proj": "ffn_down_shexp.weight"}
_MIXTRAL = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
_OLD_EXPERT = re.compile(r"^ffn_(gate|up|down)\.(\d+)\.weight$")
_OLD_PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


@dataclass(frozen=True)
class _Source:
    """How one HF tensor is read: ``kind`` ``plain`` | ``slab`` (index ``arg`` of a stack) |
    ``permute`` (llama rope permutation undone with ``arg`` heads) | ``kv_b`` (rejoined from
    ``tensor`` = k_b and ``other`` = v_b) | ``row`` (1-D read as ``[1, n]``)."""

    kind: str
    tensor: GgufTensor
    shape: tuple[int, ...]
    arg: int = 0
    other: GgufTensor | None = None


class GgufCheckpoint:
    """A GGUF file read as a checkpoint under Hugging Face tensor names (module docstring).

    ``GgufCheckpoint(source)``: a local ``.gguf`` path or an http(s) URL (HTTP Range reads
    through ``prepare.remote.HttpFile``). Attributes: ``path``, ``metadata`` (dict),
    ``tensors`` (GGUF table by GGUF name), ``config`` (the ``config.json`` it stands for),
    ``arch`` (``general.architecture``). Methods as ``prepare.checkpoint.Checkpoint``
    (``names``, ``has``, ``info``, ``read``, ``read_bytes``, ``read_slab``) plus
    ``load_expert_blocks``, ``tokenizer_json`` and ``chat_template``.

    Raises ``CheckpointError`` for an unreadable or malformed file, an unsupported
    architecture or metadata (the message names the GGUF key), and a stack whose shape
    disagrees with the metadata.
    """

    def __init__(self, source: str | Path, *, http_file=None):
        self.path = source
        self._http = http_file
        if http_file is None:
            p = Path(source)
            if not p.is_file():
                raise CheckpointError(f"{p}: no such GGUF file")
            size = p.stat().st_size
        else:
            size = http_file.size()
        self.size = size
        self.metadata, self.tensors = parse_gguf_header(self._read_range, size, str(source))
        self.arch = self.metadata.get("general.architecture")
        embd = self.tensors.get("token_embd.weight")
        try:
            self.config = hf_config_from_gguf(self.metadata, vocab_size=embd.shape[0] if embd else None,
                                              tied="output.weight" not in self.tensors)
        except ConfigError as exc:
            raise CheckpointError(f"{source}: {exc}") from None
        self._names = self._map()

    # -- bytes -------------------------------------------------------------------------
    def _read_range(self, offset: int, length: int) -> bytes:
        if self._http is not None:
            return self._http.read(offset, length)
        try:
            with open(self.path, "rb") as f:
                f.seek(offset)
                data = f.read(length)
        except OSError as exc:
            raise CheckpointError(f"{self.path}: read of {length} bytes at {offset} failed ({exc})") from None
        if len(data) != length:
            raise CheckpointError(f"{self.path}: file is truncated: wanted {length} bytes at {offset}")
        return data

    def close(self) -> None:
        """Close the HTTP connection pool (remote files)."""
        if self._http is not None:
            self._http.close()

    # -- the name map ------------------------------------------------------------------
    def _map(self) -> dict[str, _Source]:
        cfg, t = self.config, self.tensors
        family = cfg["model_type"]
        heads, kv_heads = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
        out: dict[str, _Source] = {}
        for gname, g in t.items():
            if gname in _GLOBAL:
                out[_GLOBAL[gname]] = _Source("plain", g, g.shape)
                continue
            m = _BLK.match(gname)
            if not m:
                continue  # e.g. rope_freqs: llama.cpp's own precomputation
            layer, suffix = int(m.group(1)), m.group(2)
            pre = f"model.layers.{layer}."
            moe = pre + ("block_sparse_moe." if family == "mixtral" else "mlp.")
            if suffix in ("attn_q.weight", "attn_k.weight") and family == "mixtral":
                n = heads if suffix == "attn_q.weight" else kv_heads
                out[pre + BLOCK_TENSORS[suffix]] = _Source("permute", g, g.shape, n)
            elif suffix == "ffn_gate_inp.weight":
                out[moe + "gate.weight"] = _Source("plain", g, g.shape)
            elif suffix == "ffn_gate_inp_shexp.weight":
                out[pre + BLOCK_TENSORS[suffix]] = _Source("row", g, (1, g.shape[-1]))
            elif suffix in BLOCK_TENSORS:
                out[pre + BLOCK_TENSORS[suffix]] = _Source("plain", g, g.shape)
            elif suffix == "attn_k_b.weight":
                v = t.get(f"blk.{layer}.attn_v_b.weight")
                if v is None or len(g.shape) != 3 or len(v.shape) != 3:
                    raise CheckpointError(f"{self.path}: {gname} needs a 3-D blk.{layer}.attn_v_b.weight beside it")
                h, rank, nope = g.shape
                out[pre + "self_attn.kv_b_proj.weight"] = _Source("kv_b", g, (h * (nope + v.shape[1]), rank),
                                                                  other=v)
            elif suffix in _EXPS.values():
                proj = next(p for p, s in _EXPS.items() if s == suffix)
                if len(g.shape) != 3:
                    raise CheckpointError(f"{self.path}: expert stack {gname!r} must be 3-D, got {list(g.shape)}")
                for e in range(g.shape[0]):
                    leaf = (f"experts.{e}.{_MIXTRAL[proj]}.weight" if family == "mixtral"
                            else f"experts.{e}.{proj}.weight")
                    out[moe + leaf] = _Source("slab", g, g.shape[1:], e)
            elif (old := _OLD_EXPERT.match(suffix)) is not None:  # llama.cpp's pre-stack Mixtral layout
                proj, e = _OLD_PROJ[old.group(1)], int(old.group(2))
                leaf = f"experts.{e}.{_MIXTRAL[proj]}.weight" if family == "mixtral" else f"experts.{e}.{proj}.weight"
                out[moe + leaf] = _Source("plain", g, g.shape)
            elif suffix in _SHEXP.values():
                proj = next(p for p, s in _SHEXP.items() if s == suffix)
                shared = "shared_expert" if family == "qwen2_moe" else "shared_experts"
                out[f"{pre}mlp.{shared}.{proj}.weight"] = _Source("plain", g, g.shape)
        return out

    # -- Checkpoint API ------------------------------------------------------------------
    def names(self) -> list[str]:
        """All HF tensor names the file provides, sorted."""
        return sorted(self._names)

    def has(self, name: str) -> bool:
        """Whether HF tensor ``name`` is in the file (reads no tensor data)."""
        return name in self._names

    def _src(self, name: str) -> _Source:
        src = self._names.get(name)
        if src is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in the GGUF file")
        return src

    def info(self, name: str) -> TensorInfo:
        """``(dtype, shape, path)`` of HF tensor ``name``: dtype ``F32``/``F16``/``BF16`` when
        its bytes are kept as they are, else the ggml type name (``Q4_K``, …) or ``F32`` for
        a rearranged tensor (llama Q/K, DeepSeek kv_b)."""
        src = self._src(name)
        if src.kind in ("permute", "kv_b"):
            dtype = "F32" if src.tensor.type not in DENSE_TYPES else DENSE_TYPES[src.tensor.type]
            if src.kind == "kv_b" and src.tensor.type != (src.other.type if src.other else None):
                dtype = "F32"
        else:
            dtype = DENSE_TYPES.get(src.tensor.type) or ggml_type_name(src.tensor.type)
        return TensorInfo(dtype, tuple(src.shape), self.path)

    def _raw(self, g: GgufTensor, index: int | None = None) -> tuple[bytes, tuple[int, ...]]:
        if index is None:
            return self._read_range(g.offset, g.nbytes), g.shape
        if not 0 <= index < g.shape[0]:
            raise CheckpointError(f"{self.path}: tensor {g.name!r} of shape {list(g.shape)} has no slab [{index}]")
        size = g.nbytes // g.shape[0]
        return self._read_range(g.offset + index * size, size), g.shape[1:]

    def _decode(self, g: GgufTensor, index: int | None = None) -> np.ndarray:
        raw, shape = self._raw(g, index)
        return decode_tensor(raw, g.type, shape, g.name if index is None else f"{g.name}[{index}]")

    def read(self, name: str, fp8_block=None) -> np.ndarray:
        """HF tensor ``name`` as float32 of its HF shape (reads only its bytes; a stack's slab
        only). Raises ``CheckpointError`` for an absent tensor or an undecodable type."""
        src = self._src(name)
        if src.kind == "slab":
            return self._decode(src.tensor, src.arg)
        a = self._decode(src.tensor)
        if src.kind == "row":
            return a.reshape(src.shape)
        if src.kind == "permute":  # inverse of convert_hf_to_gguf LlamaModel.permute
            n = src.arg
            rows = a.shape[0]
            return a.reshape(n, rows // n // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        if src.kind == "kv_b":
            k_b = a.transpose(0, 2, 1)  # [heads, nope, rank]
            v_b = self._decode(src.other)  # [heads, v, rank]
            return np.concatenate([k_b, v_b], axis=1).reshape(src.shape)
        return a

    def read_bytes(self, name: str) -> bytes:
        """The little-endian bytes of HF tensor ``name`` in the dtype ``info`` reports
        (float32 bytes of ``read`` for a decoded or rearranged tensor)."""
        src = self._src(name)
        if src.kind in ("plain", "row") and src.tensor.type in DENSE_TYPES:
            return self._raw(src.tensor)[0]
        if src.kind == "slab" and src.tensor.type in DENSE_TYPES:
            return self._raw(src.tensor, src.arg)[0]
        a = np.ascontiguousarray(self.read(name), dtype="<f4")
        dtype = self.info(name).dtype  # a rearranged BF16/F16 tensor keeps its dtype: its values convert back exactly
        if dtype == "BF16":
            return (a.view("<u4") >> 16).astype("<u2").tobytes()
        if dtype == "F16":
            return a.astype("<f2").tobytes()
        return a.tobytes()

    def read_slab(self, name: str, index: int) -> np.ndarray:
        """Slab ``[index]`` of a 3-D HF tensor; GGUF files expose experts per name, so this
        is only for plain 3-D tensors. Raises ``CheckpointError`` otherwise."""
        src = self._src(name)
        if src.kind != "plain" or len(src.shape) < 2:
            raise CheckpointError(f"{self.path}: tensor {name!r} has no slab [{index}]")
        return self._decode(src.tensor, index)

    # -- experts as blocks ---------------------------------------------------------------
    def load_expert_blocks(self, names: dict[str, str], what: str) -> tuple[ExpertWeights, dict[str, str]]:
        """An expert from its HF projection ``names`` (``{"gate_proj": ..., ...}``), keeping
        the file's bytes: Q8_0/Q4_K/Q6_K as ``QuantizedMatrix`` blocks, F16/BF16/F32 dense
        (exact in a blob of that dtype). Any other type is decoded to float32 and reported.

        Returns ``(weights, notes)``, ``notes`` mapping ``"<proj>.weight"`` to what was done
        (e.g. ``"q5_0 decoded to f32 (no q5_0 kernel)"``). Raises ``CheckpointError`` for a
        missing tensor and ``ValueError`` (naming ``what`` and the tensor) for non-finite
        values or block scales.
        """
        out, notes = {}, {}
        for proj in PROJECTIONS:
            name = names[proj]
            src = self._src(name)
            t = src.tensor.type
            try:
                if src.kind in ("slab", "plain") and t in BLOCK_TYPES:
                    raw, shape = self._raw(src.tensor, src.arg if src.kind == "slab" else None)
                    out[proj] = QuantizedMatrix(BLOCK_TYPES[t], tuple(shape),
                                                np.frombuffer(raw, np.uint8).copy())
                else:
                    a = self.read(name)
                    if not np.isfinite(a).all():
                        raise ValueError("holds NaN or infinity")
                    out[proj] = a
                    if t not in DENSE_TYPES:
                        q = ggml_type_name(t).lower()
                        notes[f"{proj}.weight"] = f"{q} decoded to f32 (no {q} kernel; tensor {src.tensor.name})"
            except ValueError as exc:
                raise ValueError(f"{what} {name} ({src.tensor.name}): {exc}") from None
        return ExpertWeights(**out), notes

    def blob_dtype(self, names: dict[str, str]) -> str:
        """The dense blob dtype that keeps these projections' dense bytes exactly:
        ``bf16``/``f16`` when every dense one is of that type, else ``f32``."""
        types = {self._src(n).tensor.type for n in names.values()} - set(BLOCK_TYPES)
        if types == {GGML_BF16}:
            return "bf16"
        if types == {GGML_F16}:
            return "f16"
        return "f32"

    # -- tokenizer and chat template -------------------------------------------------------
    def tokenizer_json(self) -> str | None:
        """The file's vocabulary as a ``tokenizers`` JSON document (``prepare.gguf_tokenizer``),
        or None when it has none (``tokenizer.ggml.model`` absent or ``none``)."""
        from prepare.gguf_tokenizer import tokenizer_from_gguf

        tok = tokenizer_from_gguf(self.metadata)
        return None if tok is None else tok.to_str()

    def vocab_metadata(self) -> dict:
        """The file's ``tokenizer.ggml.*`` keys as they are (for a verbatim export), or {}
        without a vocabulary."""
        if self.metadata.get("tokenizer.ggml.model") in (None, "none"):
            return {}
        return {k: v for k, v in self.metadata.items() if k.startswith("tokenizer.ggml.")}

    def chat_template(self) -> dict | None:
        """``{"template", "special_tokens"}`` from ``tokenizer.chat_template`` (special tokens
        ``bos_token``/``eos_token``/… named by their ids), or None without one."""
        from prepare.chat import compile_template

        template = self.metadata.get("tokenizer.chat_template")
        if not isinstance(template, str):
            return None
        compile_template(template)
        tokens = self.metadata.get("tokenizer.ggml.tokens") or []
        specials = {}
        for name in ("bos", "eos", "unknown", "padding", "seperator"):
            i = self.metadata.get(f"tokenizer.ggml.{name}_token_id")
            if isinstance(i, int) and 0 <= i < len(tokens):
                key = {"unknown": "unk", "padding": "pad", "seperator": "sep"}.get(name, name)
                specials[f"{key}_token"] = tokens[i]
        return {"template": template, "special_tokens": specials}

    def __repr__(self) -> str:
        return f"GgufCheckpoint({str(self.path)!r}, arch={self.arch!r}, tensors={len(self.tensors)})"


def is_gguf(source) -> bool:
    """Whether ``source`` (path or URL) names a GGUF file (by its ``.gguf`` suffix, query ignored)."""
    return str(source).split("?", 1)[0].lower().endswith(".gguf")
