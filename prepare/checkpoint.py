"""Reading Hugging Face safetensors checkpoints one tensor at a time.

A checkpoint is a directory with ``config.json`` and either ``model.safetensors`` or
``model.safetensors.index.json`` plus the shards it names (or a single ``.safetensors`` file).
Each shard's header is parsed by ``moe.codec.parse_header`` and validated against the
shard's size, and a tensor is read by seeking to its byte range: no shard is ever loaded
whole. All byte access goes through ``Checkpoint._shard_size`` and ``Checkpoint._read_range``
so that a remote (HTTP Range) source only has to replace those two.

Pure Python + numpy; imports nothing from Django.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np

from moe.codec import (DTYPE_BITS, MAX_HEADER_SIZE, CheckpointError, SafetensorsHeader, TensorInfo,
                           TensorEntry, apply_block_scale, decode_f32, decode_fp8_e4m3, parse_header,
                           require_float_dtype)

class Checkpoint:
    """A Hugging Face safetensors checkpoint read one tensor at a time.

    ``Checkpoint(path)`` accepts a directory holding ``config.json`` and either
    ``model.safetensors`` or ``model.safetensors.index.json`` (format in
    ``DeepSeek-V3:inference/fp8_cast_bf16.py``: ``{"metadata": ..., "weight_map": {name:
    shard}}``) plus its shards, or a single ``.safetensors`` file (its directory's
    ``config.json`` is read when present, else ``config`` is ``{}``).

    Shard headers are parsed lazily on first use and cached; reading a tensor costs one
    ranged read of exactly its bytes. Attributes: ``path``, ``config`` (dict), ``shards``
    (list of shard paths). Raises ``CheckpointError`` (a ``ValueError``) for a missing path,
    config, index or shard, and from the methods below.
    """

    def __init__(self, path: str | Path):
        p = Path(path)
        self.path = p
        self._headers: dict[Path, SafetensorsHeader] = {}
        self._weight_map: dict[str, Path] | None = None
        if p.is_file():
            if p.suffix != ".safetensors":
                raise CheckpointError(f"{p}: not a .safetensors file or a checkpoint directory")
            cfg = p.parent / "config.json"
            self.config = self._load_json(cfg) if cfg.is_file() else {}
            self.shards = [p]
        elif p.is_dir():
            cfg = p / "config.json"
            if not cfg.is_file():
                raise CheckpointError(f"{p}: checkpoint directory has no config.json")
            self.config = self._load_json(cfg)
            index, single = p / "model.safetensors.index.json", p / "model.safetensors"
            if index.is_file():
                self._weight_map = self._load_index(index)
                self.shards = sorted(set(self._weight_map.values()))
            elif single.is_file():
                self.shards = [single]
            else:
                raise CheckpointError(
                    f"{p}: checkpoint directory has neither model.safetensors nor model.safetensors.index.json"
                )
        else:
            raise CheckpointError(f"{p}: no such checkpoint file or directory")
        if not isinstance(self.config, dict):
            raise CheckpointError(f"{p}: config.json must hold a JSON object")
        for shard in self.shards:
            if not shard.is_file():
                raise CheckpointError(f"{shard}: shard named by the index is missing")

    @staticmethod
    def _load_json(path: Path):
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: cannot read JSON ({exc})") from None

    def _load_index(self, index: Path) -> dict[str, Path]:
        data = self._load_json(index)
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard file names")
        out = {}
        for name, shard in wm.items():
            if Path(shard).name != shard:
                raise CheckpointError(
                    f"{index}: tensor {name!r} names shard {shard!r} outside the checkpoint directory")
            out[name] = index.parent / shard
        return out

    # -- byte access seam: a remote source replaces these two ------------------------------
    def _shard_size(self, shard: Path) -> int:
        """Total size in bytes of ``shard``."""
        try:
            return shard.stat().st_size
        except OSError as exc:
            raise CheckpointError(f"{shard}: cannot stat shard ({exc})") from None

    def _open(self, shard: Path) -> BinaryIO:
        """Open ``shard`` for binary reading (a seam for tests that count bytes)."""
        return open(shard, "rb")

    def _read_range(self, shard: Path, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes of ``shard`` starting at ``offset`` (seek + read).

        Raises ``CheckpointError`` when the shard ends early (it shrank since its header
        was validated) or cannot be read.
        """
        try:
            with self._open(shard) as f:
                f.seek(offset)
                data = f.read(length)
        except OSError as exc:
            raise CheckpointError(f"{shard}: read of {length} bytes at {offset} failed ({exc})") from None
        if len(data) != length:
            raise CheckpointError(
                f"{shard}: file is truncated: wanted {length} bytes at offset {offset}, got {len(data)}"
            )
        return data

    # -- headers ------------------------------------------------------------------------
    def header(self, shard: Path) -> SafetensorsHeader:
        """The validated header of ``shard`` (parsed on first use, then cached).

        Raises ``CheckpointError`` for a short file, a header length beyond
        ``MAX_HEADER_SIZE`` or the file, and anything ``parse_header`` rejects.
        """
        hdr = self._headers.get(shard)
        if hdr is None:
            size = self._shard_size(shard)
            if size < 8:
                raise CheckpointError(f"{shard}: bad safetensors header: file is {size} bytes, shorter than 8")
            (n,) = struct.unpack("<Q", self._read_range(shard, 0, 8))
            if n > MAX_HEADER_SIZE:
                raise CheckpointError(f"{shard}: bad safetensors header: length {n} exceeds {MAX_HEADER_SIZE}")
            if 8 + n > size:
                raise CheckpointError(
                    f"{shard}: bad safetensors header: header length {n} runs past the end of the {size}-byte file"
                )
            hdr = parse_header(self._read_range(shard, 8, n), size, str(shard))
            self._headers[shard] = hdr
        return hdr

    def _locate(self, name: str) -> tuple[Path, TensorEntry, int]:
        if self._weight_map is not None:
            shard = self._weight_map.get(name)
            if shard is None:
                raise CheckpointError(f"{self.path}: tensor {name!r} is not in the checkpoint")
            hdr = self.header(shard)
            entry = hdr.tensors.get(name)
            if entry is None:
                raise CheckpointError(
                    f"{shard}: the index maps tensor {name!r} to this shard but its header has no such tensor"
                )
            return shard, entry, hdr.data_start
        shard = self.shards[0]
        hdr = self.header(shard)
        entry = hdr.tensors.get(name)
        if entry is None:
            raise CheckpointError(f"{shard}: tensor {name!r} is not in the checkpoint")
        return shard, entry, hdr.data_start

    # -- public API ---------------------------------------------------------------------
    def names(self) -> list[str]:
        """All tensor names, sorted (from the index when there is one, else the header)."""
        if self._weight_map is not None:
            return sorted(self._weight_map)
        return sorted(self.header(self.shards[0]).tensors)

    def has(self, name: str) -> bool:
        """Whether the checkpoint lists tensor ``name`` (reads no tensor data)."""
        if self._weight_map is not None:
            return name in self._weight_map
        return name in self.header(self.shards[0]).tensors

    def info(self, name: str) -> TensorInfo:
        """``(dtype, shape, shard)`` of tensor ``name``; raises ``CheckpointError`` if absent."""
        shard, e, _ = self._locate(name)
        return TensorInfo(e.dtype, e.shape, shard)

    def location(self, name: str) -> tuple[Path, int, int]:
        """``(shard, absolute byte offset, byte length)`` of tensor ``name``."""
        shard, e, base = self._locate(name)
        return shard, base + e.begin, e.end - e.begin

    def read_bytes(self, name: str) -> bytes:
        """The raw little-endian bytes of tensor ``name`` (one ranged read)."""
        shard, offset, length = self.location(name)
        return self._read_range(shard, offset, length) if length else b""

    def read(self, name: str, fp8_block: tuple[int, int] = (128, 128)) -> np.ndarray:
        """Tensor ``name`` decoded to a float32 array of its shape (BF16 exactly, F16, F32,
        and F8_E4M3 times its ``<name>_scale_inv`` block scales of ``fp8_block`` — the scale
        may live in another shard).

        Reads only the tensor's byte range (and its scale's). Raises ``CheckpointError``
        naming the tensor for a missing tensor or scale, an unsupported dtype (checked
        before any data is read), FP8 NaN codes, or a truncated shard.
        """
        shard, e, base = self._locate(name)
        if e.dtype == "F8_E4M3":
            scale_name = f"{name}_scale_inv"
            if not self.has(scale_name):
                raise CheckpointError(f"{shard}: FP8 tensor {name!r} has no {scale_name!r} block-scale tensor")
            if len(e.shape) != 2:
                raise CheckpointError(f"{shard}: FP8 tensor {name!r} must be 2-D, got {list(e.shape)}")
            raw = self._read_range(shard, base + e.begin, e.end - e.begin) if e.end > e.begin else b""
            w = decode_fp8_e4m3(raw, e.shape, name)
            return apply_block_scale(w, self.read(scale_name), fp8_block, name)
        require_float_dtype(e.dtype, name, str(shard))
        raw = self._read_range(shard, base + e.begin, e.end - e.begin) if e.end > e.begin else b""
        return decode_f32(raw, e.dtype, e.shape, name=name, source=str(shard))

    def read_slab_u8(self, name: str, index: int) -> np.ndarray:
        """Slab ``[index]`` of a ``U8`` tensor (MXFP4 blocks or scales) as uint8 ``shape[1:]``;
        reads only that range. Raises ``CheckpointError`` for another dtype or index."""
        shard, e, base = self._locate(name)
        if e.dtype != "U8" or len(e.shape) < 2 or not 0 <= index < e.shape[0]:
            raise CheckpointError(f"{shard}: tensor {name!r} ({e.dtype} {list(e.shape)}) has no U8 slab [{index}]")
        inner = tuple(e.shape[1:])
        size = math.prod(inner)
        raw = self._read_range(shard, base + e.begin + index * size, size) if size else b""
        return np.frombuffer(raw, dtype=np.uint8).reshape(inner)

    def read_slab(self, name: str, index: int) -> np.ndarray:
        """Slab ``[index]`` of a tensor of 2 or more dimensions (expert ``index`` of a fused
        ``[E, R, C]`` tensor) as float32 ``shape[1:]``; reads only that contiguous range.

        Raises ``CheckpointError`` for an index out of range, a 0/1-D tensor or a dtype
        other than BF16/F16/F32 (fused FP8 tensors have per-tensor scales this reader does
        not slice).
        """
        shard, e, base = self._locate(name)
        require_float_dtype(e.dtype, name, str(shard))
        if len(e.shape) < 2 or not 0 <= index < e.shape[0]:
            raise CheckpointError(f"{shard}: tensor {name!r} of shape {list(e.shape)} has no slab [{index}]")
        inner = tuple(e.shape[1:])
        size = math.prod(inner) * DTYPE_BITS[e.dtype] // 8
        raw = self._read_range(shard, base + e.begin + index * size, size) if size else b""
        return decode_f32(raw, e.dtype, inner, name=f"{name}[{index}]", source=str(shard))

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, shards={len(self.shards)})"
