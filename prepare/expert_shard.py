"""Expert-shard downloads for Kvasir workers (``kvasir_market_contract.md`` §1.10).

``GET /api/proxy/models/{model}/expert-shard`` hands a volunteer the slice it was assigned: a
mini-GGUF of one MoE layer's routed experts ``[begin, end)`` cut from this site's published
expert blobs (``prepare.gguf_export.write_expert_shard``: the blobs' quantized blocks byte for
byte). Both query dialects in the wild are accepted (``parse_query``): the desktop's
``layer=L&expert_begin=a&expert_end=b`` and the phones' / Python agent's ``layers=A:B&experts=a:b``.
Ranges are refused rather than clamped (400), wider than ``MAX_SHARD_EXPERTS`` → 413, an unknown
model → 404. Every refusal raises ``registry.market.MarketError``; the view answers ``{"error"}``.

``source_digest`` (metadata) is the SHA-256 of the range's published blob hashes, newline-joined
in expert order: it names exactly which publication the slice was cut from and changes when
any of those experts is republished. The ``x-kvasir-shard-digest`` header is the SHA-256 (hex)
of the response body.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from moe.blobs import BlobStore
from prepare.gguf_export import ExportError, ShardSpec, expert_from_blob, write_expert_shard
from registry.market import MAX_SHARD_EXPERTS, MarketError, basename
from registry.models import ExpertBlob, MarketModel, MoeModel


@dataclass(frozen=True)
class ShardRange:
    """One requested slice: MoE ``layer``, routed experts ``[begin, end)`` (global ids)."""

    layer: int
    begin: int
    end: int


@dataclass
class BuiltShard:
    """A written shard: ``path`` (a temporary file the caller owns), ``size`` in bytes, ``digest``
    (SHA-256 hex of the file), ``manifest_bytes`` (bytes before the tensor data) and its ``spec``."""

    path: Path
    size: int
    digest: str
    manifest_bytes: int
    spec: ShardSpec


def _int(query, key: str) -> int:
    raw = query.get(key)
    if raw is None or not str(raw).strip():
        raise MarketError(400, f"{key} is required")
    try:
        return int(str(raw).strip())
    except ValueError:
        raise MarketError(400, f"{key} must be an integer, got {str(raw)[:40]!r}") from None


def _pair(text: str, what: str) -> tuple[int, int]:
    a, sep, b = text.partition(":")
    if not sep:
        raise ValueError(what)
    return int(a.strip()), int(b.strip())


def parse_query(query) -> ShardRange:
    """The slice a query names, in either dialect (``query``: a mapping of strings, e.g. ``request.GET``).

    Desktop: ``layer``, ``expert_begin``, ``expert_end`` (each required: 400 "<key> is required").
    Phones / agent (used when none of those keys is present and ``layers`` or ``experts`` is):
    ``layers=A:B`` (end-exclusive; ``L:L`` also reads as layer L) or a comma list, ``experts=a:b``
    (end-exclusive). A shard holds one layer, so a request naming several is refused. Raises
    ``MarketError`` 400 with the contract's messages."""
    if not any(k in query for k in ("layer", "expert_begin", "expert_end")) and (
            "layers" in query or "experts" in query):
        text = (query.get("layers") or "").strip()
        if not text:
            raise MarketError(400, "no layers requested")
        try:
            if ":" in text:
                a, b = _pair(text, "layers")
                layers = [a] if a == b else list(range(a, b))
            else:
                layers = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise MarketError(400, "layers must be A:B or a comma list") from None
        layers = sorted(set(layers))
        if not layers:
            raise MarketError(400, "no layers requested")
        if len(layers) > 1:
            raise MarketError(400, f"a shard holds one layer; layers names {len(layers)} ({text[:40]}): "
                                   "download one shard per layer")
        try:
            begin, end = _pair((query.get("experts") or "").strip(), "experts")
        except ValueError:
            raise MarketError(400, "experts must be A:B") from None
        if begin < 0 or end <= begin:
            raise MarketError(400, f"invalid expert range [{begin}, {end})")
        return ShardRange(layers[0], begin, end)
    layer, begin, end = (_int(query, k) for k in ("layer", "expert_begin", "expert_end"))
    if begin < 0 or end <= begin:
        raise MarketError(400, f"invalid expert range [{begin}, {end}): empty or inverted ranges are refused "
                               "rather than clamped")
    return ShardRange(layer, begin, end)


def resolve_model(ref: str) -> MoeModel:
    """The published MoE model a path names: its id, else a market listing's id, name or basename
    whose model is published here. Raises ``MarketError`` 404."""
    pub = MoeModel.objects.filter(model_id=ref).exclude(family="dense").first()
    if pub is None:
        for m in MarketModel.objects.all():
            if ref in (m.model_id, m.name, basename(m.model_id)) or (m.name and ref == basename(m.name)):
                pub = MoeModel.objects.filter(model_id=m.model_id).exclude(family="dense").first()
                if pub is not None:
                    break
    if pub is None:
        raise MarketError(404, f"unknown model {ref[:200]!r}: no such model is published on this site")
    return pub


def build_shard(ref: str, rng: ShardRange, store: BlobStore, tmp_dir: str | None = None) -> BuiltShard:
    """Check ``rng`` against the published model ``ref`` and write its shard to a temporary file.

    Raises ``MarketError``: 404 unknown model or an expert of the range never published; 400 a
    layer outside the model, a dense layer ("layer L holds no routed experts"), a range past the
    expert count; 413 more than ``MAX_SHARD_EXPERTS`` experts; 400 experts the worker protocol
    cannot compute (biases, non-SiLU)."""
    pub = resolve_model(ref)
    n_layer = int((pub.config or {}).get("num_hidden_layers") or 0) or max(pub.moe_layers, default=-1) + 1
    if not 0 <= rng.layer < n_layer:
        raise MarketError(400, f"layer {rng.layer} is outside [0, {n_layer}) of model {pub.model_id!r}")
    if rng.layer not in pub.moe_layers:
        raise MarketError(400, f"layer {rng.layer} holds no routed experts")
    if rng.end > pub.num_experts:
        raise MarketError(400, f"expert range [{rng.begin}, {rng.end}) is outside [0, {pub.num_experts}) "
                               "(refused rather than clamped)")
    if rng.end - rng.begin > MAX_SHARD_EXPERTS:
        raise MarketError(413, f"at most {MAX_SHARD_EXPERTS} experts per request")
    rows = {r.expert: r.blob_hash for r in ExpertBlob.objects.filter(
        model_id=pub.model_id, layer=rng.layer, expert__gte=rng.begin, expert__lt=rng.end)}
    missing = [e for e in range(rng.begin, rng.end) if e not in rows]
    if missing:
        raise MarketError(404, f"layer {rng.layer} experts {missing[:8]} of model {pub.model_id!r} are not published")
    hashes = [rows[e] for e in range(rng.begin, rng.end)]
    experts, dtypes = [], set()
    for e, h in zip(range(rng.begin, rng.end), hashes):
        ew, dt = expert_from_blob(store.get(h), f"expert blob {rng.layer}/{e}")
        experts.append(ew)
        dtypes.add(dt.upper())
    spec = ShardSpec(model=pub.model_id, family=pub.family, layer=rng.layer, expert_begin=rng.begin,
                     expert_end=rng.end, n_expert_total=pub.num_experts, n_embd=pub.hidden_size, n_layer=n_layer,
                     expert_d_ff=pub.expert_d_ff,
                     source_digest=hashlib.sha256("\n".join(hashes).encode()).hexdigest())
    fd, name = tempfile.mkstemp(prefix="expert-shard-", suffix=".gguf", dir=tmp_dir)
    os.close(fd)
    path = Path(name)
    try:
        report = write_expert_shard(spec, experts, dtypes, path)
        with open(path, "rb") as fh:
            digest = hashlib.file_digest(fh, "sha256").hexdigest()
    except ExportError as exc:
        path.unlink(missing_ok=True)
        raise MarketError(400, str(exc)) from None
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return BuiltShard(path, path.stat().st_size, digest, report["manifest_bytes"], spec)
