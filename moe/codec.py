"""The safetensors codec and float decoders shared by checkpoints, blobs and the wire.

``parse_header`` validates a safetensors header (``u64 LE N ‖ N bytes of JSON ‖ data``, see
``huggingface/safetensors`` README "Format" and ``safetensors/src/tensor.rs``) against the
size of what follows; ``decode_f32`` turns BF16/F16/F32 bytes into float32 and the FP8 /
MXFP4 decoders handle the quantized checkpoint formats. ``dumps_safetensors`` writes
canonical bytes (sorted JSON header, fixed tensor order), which ``safetensors.numpy.save``
cannot promise because its ``__metadata__`` is a Rust HashMap whose key order changes from
process to process; ``loads_safetensors`` parses bytes with the same validation as the
checkpoint reader (``prepare.checkpoint``). Expert, gate and dense blobs use this format.

Pure Python + numpy; imports nothing from Django.
"""
from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

MAX_HEADER_SIZE = 100_000_000  # safetensors/src/tensor.rs MAX_HEADER_SIZE

# Bits per element of every dtype the safetensors format defines (tensor.rs `enum Dtype`).
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "F64": 64, "I64": 64, "U64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
FLOAT_DTYPES = ("BF16", "F16", "F32")  # what decode_f32 turns into float32

_NUMPY_TO_ST = {  # keyed by little-endian numpy dtype.str
    "<f4": "F32", "<f2": "F16", "<f8": "F64", "|u1": "U8", "|i1": "I8", "<u2": "U16",
    "<i2": "I16", "<u4": "U32", "<i4": "I32", "<u8": "U64", "<i8": "I64", "|b1": "BOOL",
}


class CheckpointError(ValueError):
    """A checkpoint or safetensors buffer is unreadable: missing file or tensor, bad or
    truncated header, inconsistent index, or a dtype this reader cannot decode."""


class TensorInfo(NamedTuple):
    """What ``Checkpoint.info`` returns: safetensors dtype string, shape, shard file."""

    dtype: str
    shape: tuple[int, ...]
    shard: Path


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # relative to the start of the data buffer
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    """A validated safetensors header: ``tensors`` name → entry, ``metadata`` (str → str)
    and ``data_start`` (= 8 + N, the absolute offset of the data buffer)."""

    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int


def _reject_duplicates(pairs):
    seen = {}
    for k, v in pairs:
        if k in seen:
            raise CheckpointError(f"duplicate key {k!r}")
        seen[k] = v
    return seen


def parse_header(header: bytes, file_size: int, source: str) -> SafetensorsHeader:
    """Validate the JSON header ``header`` (the N bytes after the u64 length) of a
    safetensors file of ``file_size`` bytes.

    Checks (as ``safetensors/src/tensor.rs`` does): UTF-8 JSON object starting with ``{``,
    no duplicate keys, known dtypes, ``end - begin == prod(shape) * bits / 8``, every tensor
    inside the file, and the tensors tiling the data buffer with no hole, overlap or
    trailing bytes. ``source`` names the file in error messages.

    Raises ``CheckpointError`` naming ``source`` and the offending tensor.
    """
    data_start = 8 + len(header)
    data_size = file_size - data_start
    if not header.startswith(b"{"):
        raise CheckpointError(f"{source}: bad safetensors header: it must be a JSON object starting with '{{'")
    try:
        raw = json.loads(header.decode("utf-8"), object_pairs_hook=_reject_duplicates)
    except CheckpointError as exc:
        raise CheckpointError(f"{source}: bad safetensors header: {exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{source}: bad safetensors header: not UTF-8 JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{source}: bad safetensors header: not a JSON object")
    metadata = raw.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CheckpointError(f"{source}: bad safetensors header: __metadata__ must map strings to strings")
    tensors: dict[str, TensorEntry] = {}
    for name, info in raw.items():
        where = f"{source}: tensor {name!r}"
        if not isinstance(info, dict):
            raise CheckpointError(f"{where}: header entry is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in DTYPE_BITS:
            raise CheckpointError(f"{where}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise CheckpointError(f"{where}: bad shape {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and o >= 0 for o in offsets) or offsets[0] > offsets[1]):
            raise CheckpointError(f"{where}: bad data_offsets {offsets!r}")
        bits = math.prod(shape) * DTYPE_BITS[dtype]
        if bits % 8 or offsets[1] - offsets[0] != bits // 8:
            raise CheckpointError(
                f"{where}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes but "
                f"{dtype} {shape} needs {bits / 8:g}"
            )
        if offsets[1] > data_size:
            raise CheckpointError(
                f"{where}: file is truncated: the tensor needs bytes up to {data_start + offsets[1]} "
                f"but the file has {file_size} bytes"
            )
        tensors[name] = TensorEntry(dtype, tuple(shape), offsets[0], offsets[1])
    # Sorted by offset the tensors must tile the buffer exactly (tensor.rs `validate`).
    expected = 0
    for name, e in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if e.begin != expected:
            kind = ("overlaps the previous tensor" if e.begin < expected
                    else f"leaves a hole of {e.begin - expected} bytes")
            raise CheckpointError(f"{source}: tensor {name!r} at data offset {e.begin} {kind}")
        expected = e.end
    if expected != data_size:
        raise CheckpointError(
            f"{source}: bad safetensors file: {data_size - expected} bytes after the last tensor "
            f"(data buffer is {data_size} bytes, tensors cover {expected})"
        )
    return SafetensorsHeader(tensors, metadata, data_start)


def _fp8_e4m3_table() -> np.ndarray:
    """float32 value of each of the 256 e4m3fn codes (sign bit 7, exponent bits 6..3 with
    bias 7, mantissa bits 2..0; exponent 0 is subnormal ``m/8 · 2^-6``; 0x7F/0xFF are NaN;
    no infinity). Reference ``gguf_quant_and_routing.md`` §4.1; equals ``ml_dtypes.float8_e4m3fn``."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp, man = (codes >> 3) & 0xF, codes & 0x7
    mag = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp - 7.0))
    table = (sign * mag).astype(np.float32)
    table[[0x7F, 0xFF]] = np.nan
    return table


FP8_E4M3_TABLE = _fp8_e4m3_table()


def decode_fp8_e4m3(raw: bytes | memoryview, shape: tuple[int, ...], name: str = "tensor") -> np.ndarray:
    """Decode F8_E4M3 bytes to float32 ``shape`` (unscaled). Raises ``CheckpointError``
    naming the tensor when a NaN code (0x7F, 0xFF) is present or the size is wrong."""
    codes = np.frombuffer(raw, dtype=np.uint8)
    if codes.size != math.prod(shape):
        raise CheckpointError(f"tensor {name!r}: {codes.size} bytes for F8_E4M3 {list(shape)}")
    if ((codes & 0x7F) == 0x7F).any():
        raise CheckpointError(f"tensor {name!r} holds FP8 NaN codes (0x7F/0xFF): non-finite weights are refused")
    return FP8_E4M3_TABLE[codes].reshape(shape)


def apply_block_scale(w: np.ndarray, scale: np.ndarray, block: tuple[int, int], name: str = "tensor") -> np.ndarray:
    """``W[i, j] · scale[i // bi, j // bj]`` in float32 (DeepSeek-V3 ``inference/kernel.py``
    ``weight_dequant``: the ``_scale_inv`` tensor is multiplied in). ``w`` float32 ``[R, C]``,
    ``scale`` float32 ``[ceil(R/bi), ceil(C/bj)]``. Raises ``CheckpointError`` for a scale of
    the wrong shape or with non-finite values."""
    bi, bj = block
    r, c = w.shape
    want = (-(-r // bi), -(-c // bj))
    if scale.shape != want:
        raise CheckpointError(f"tensor {name!r}: weight_scale_inv has shape {scale.shape}; "
                              f"{list(w.shape)} with {bi}x{bj} blocks needs {want}")
    if not np.isfinite(scale).all():
        raise CheckpointError(f"tensor {name!r}: weight_scale_inv holds NaN or infinity")
    full = np.repeat(np.repeat(scale.astype(np.float32), bi, axis=0), bj, axis=1)[:r, :c]
    return np.multiply(w, full, dtype=np.float32)


# E2M1 values of the 16 FP4 codes (transformers integrations/mxfp4.py FP4_VALUES).
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      dtype=np.float32)


def decode_mxfp4(blocks: np.ndarray, scales: np.ndarray, name: str = "tensor") -> np.ndarray:
    """HF/OpenAI MXFP4 → float32 (reference ``gguf_quant_and_routing.md`` §4.2,
    ``transformers`` ``convert_moe_packed_tensors``): ``blocks`` uint8 ``[R, G, 16]`` (byte j
    holds element 2j in its low nibble, 2j+1 in its high nibble), ``scales`` uint8 ``[R, G]``
    (E8M0: value × 2^(s − 127)) → ``[R, 32·G]``, group g covering columns 32g..32g+31.
    Raises ``CheckpointError`` naming the tensor for mismatched shapes or the NaN scale 255."""
    if blocks.ndim != 3 or blocks.shape[2] != 16 or scales.shape != blocks.shape[:2]:
        raise CheckpointError(f"tensor {name!r}: MXFP4 blocks {list(blocks.shape)} and scales "
                              f"{list(scales.shape)} do not fit ([R, G, 16] and [R, G])")
    if (scales == 255).any():
        raise CheckpointError(f"tensor {name!r}: MXFP4 scale 255 is NaN: non-finite weights are refused")
    r, g, _ = blocks.shape
    vals = np.empty((r, g, 16, 2), dtype=np.float32)
    vals[..., 0] = FP4_VALUES[blocks & 0x0F]
    vals[..., 1] = FP4_VALUES[blocks >> 4]
    exp = scales.astype(np.int32) - 127
    return np.ldexp(vals.reshape(r, g, 32), exp[:, :, None]).astype(np.float32).reshape(r, g * 32)


def require_float_dtype(dtype: str, name: str = "tensor", source: str = "") -> None:
    """Raise ``CheckpointError`` unless ``dtype`` is one ``decode_f32`` handles (BF16, F16,
    F32); FP8 other than e4m3-with-scales gets its own message. The message names the tensor."""
    if dtype in FLOAT_DTYPES:
        return
    where = f"{source}: tensor {name!r}" if source else f"tensor {name!r}"
    supported = ", ".join(FLOAT_DTYPES)
    if dtype.startswith("F8_"):
        raise CheckpointError(f"{where} has dtype {dtype}: only F8_E4M3 with a weight_scale_inv tensor is "
                              f"supported among FP8 formats (other supported dtypes: {supported})")
    raise CheckpointError(f"{where} has dtype {dtype}, which cannot be decoded to float32 "
                          f"(supported dtypes: {supported})")


def decode_f32(raw: bytes | memoryview, dtype: str, shape: tuple[int, ...], *, name: str = "tensor",
               source: str = "") -> np.ndarray:
    """Decode little-endian ``raw`` bytes of a BF16, F16 or F32 tensor into a new float32
    array of ``shape`` (BF16: the 16 bits become the high half of a u32, exact).

    Raises ``CheckpointError`` for FP8 ("not supported yet") or any other dtype, and when the
    byte count does not match ``shape``.
    """
    require_float_dtype(dtype, name, source)
    count = math.prod(shape)
    need = count * DTYPE_BITS[dtype] // 8
    if len(raw) != need:
        where = f"{source}: tensor {name!r}" if source else f"tensor {name!r}"
        raise CheckpointError(f"{where}: {len(raw)} bytes for {dtype} {list(shape)} (needs {need})")
    if dtype == "BF16":
        u = np.frombuffer(raw, dtype="<u2", count=count).astype(np.uint32)
        u <<= 16
        return u.view(np.float32).reshape(shape)
    src = np.frombuffer(raw, dtype="<f2" if dtype == "F16" else "<f4", count=count)
    return src.astype(np.float32).reshape(shape)  # astype copies: independent of `raw`


def encode_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 ``x`` to bfloat16 (round to nearest, ties to even), returned as the raw
    ``uint16`` bit patterns, same shape. Exact for values that are already bf16.

    Raises ``ValueError`` when ``x`` holds NaN or infinity, or a value beyond the bf16 range.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    if not np.isfinite(x).all():
        raise ValueError("cannot encode non-finite values as bf16")
    u = x.view(np.uint32).copy()
    u += np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))  # finite inputs cannot wrap a u32
    out = (u >> 16).astype(np.uint16)
    if ((out & 0x7F80) == 0x7F80).any():
        raise ValueError("value beyond the bf16 range (rounds to infinity)")
    return out


class RawTensor(NamedTuple):
    """One tensor of a parsed safetensors buffer: dtype string, shape, and its bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: memoryview

    def to_f32(self, name: str = "tensor", source: str = "") -> np.ndarray:
        """This tensor as a new float32 array (see ``decode_f32``)."""
        return decode_f32(self.data, self.dtype, self.shape, name=name, source=source)


def loads_safetensors(data: bytes, source: str = "blob") -> tuple[dict[str, RawTensor], dict[str, str]]:
    """Parse an in-memory safetensors buffer into (tensors name → ``RawTensor``, metadata).

    Raises ``CheckpointError`` (a ``ValueError``) for a short buffer, an oversized or bad
    header, or tensors that do not fit; ``source`` names the buffer in messages.
    """
    mv = memoryview(data).cast("B")
    if len(mv) < 8:
        raise CheckpointError(f"{source}: {len(mv)} bytes is too short for a safetensors header")
    (n,) = struct.unpack_from("<Q", mv, 0)
    if n > MAX_HEADER_SIZE or 8 + n > len(mv):
        raise CheckpointError(f"{source}: bad safetensors header length {n} for a {len(mv)}-byte buffer")
    hdr = parse_header(bytes(mv[8:8 + n]), len(mv), source)
    base = hdr.data_start
    tensors = {name: RawTensor(e.dtype, e.shape, mv[base + e.begin:base + e.end])
               for name, e in hdr.tensors.items()}
    return tensors, hdr.metadata


def dumps_safetensors(tensors: Mapping[str, np.ndarray | tuple[str, tuple[int, ...], bytes]],
                      metadata: Mapping[str, str] | None = None) -> bytes:
    """Serialize ``tensors`` to canonical safetensors bytes: identical content gives
    identical bytes in every process.

    Each value is a numpy array (dtype mapped to F32, F16, U8, I64, ...) or a
    ``(dtype string, shape, raw little-endian bytes)`` triple (how BF16 is passed). The data
    buffer holds tensors ordered by element size descending then name (the library's order,
    which keeps wider types aligned); the JSON header has sorted keys, no spaces, and is
    padded with spaces to a multiple of 8 bytes (tensor.rs). Output loads with
    ``safetensors.safe_open``.

    Raises ``ValueError`` for a non-string metadata value, an unsupported numpy dtype, or a
    triple whose byte count does not match its shape.
    """
    items = []
    for name, value in tensors.items():
        if isinstance(value, np.ndarray):
            arr = np.ascontiguousarray(value)
            arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
            dtype = _NUMPY_TO_ST.get(arr.dtype.str)
            if dtype is None:
                raise ValueError(f"tensor {name!r}: numpy dtype {arr.dtype} has no safetensors equivalent")
            shape, raw = tuple(arr.shape), arr.tobytes()
        else:
            dtype, shape, raw = value[0], tuple(int(d) for d in value[1]), bytes(value[2])
            if dtype not in DTYPE_BITS:
                raise ValueError(f"tensor {name!r}: unknown safetensors dtype {dtype!r}")
            if len(raw) * 8 != math.prod(shape) * DTYPE_BITS[dtype]:
                raise ValueError(f"tensor {name!r}: {len(raw)} bytes do not match {dtype} {list(shape)}")
        items.append((name, dtype, shape, raw))
    items.sort(key=lambda t: (-DTYPE_BITS[t[1]], t[0]))
    header: dict[str, object] = {}
    if metadata:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise ValueError(f"metadata {k!r}: keys and values must be strings")
        header["__metadata__"] = dict(sorted(metadata.items()))
    offset = 0
    for name, dtype, shape, raw in items:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return b"".join([struct.pack("<Q", len(text)), text] + [raw for *_, raw in items])
