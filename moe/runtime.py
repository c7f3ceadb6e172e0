"""The expert-host runtime: a byte-bounded LRU memory tier over a disk tier, gates,
execution, metering and the holdings a holder declares (reference §4.3–4.5, §10).

- Memory tier (Warm): decoded ``ExpertWeights`` in least-recently-used order. The budget
  (bytes) counts every resident expert as admitted (the backend's ``prepare`` first makes its host
  copies: the CPU's repacked kernel layout, which then replaces the GGUF bytes in memory; so
  ``ExpertWeights.nbytes`` is what is held: f32 elements × 4, quantized block bytes or their repacked copy) *and* every loaded gate (reference gap 28: gates were free).
  Gates are never evicted. After each admission or promotion the least recently used
  experts leave memory until the total fits; the last resident expert always stays, so
  an expert larger than the whole budget is still served (counted in
  ``admissions_over_budget``).
- Disk tier (Cold): with a ``disk_dir``, every loaded blob is written up front, atomically
  (temporary file, fsync, rename), under a name derived from a SHA-256 of the key (no
  sanitisation collisions, gap 18), with a JSON sidecar naming the key, the BLAKE3 hash and
  the source URI. An evicted expert stays held on disk and is decoded again on demand
  (``resolve``) or ahead of a forward (``readahead``), after re-checking its hash. The disk
  tier is re-indexed when a runtime starts on the same directory (gap 17). Without a
  disk tier an evicted expert is dropped and no longer declared.
- Every tier change (load, unload, eviction, promotion) calls the ``on_change`` listeners,
  so the agent re-advertises residency at once (gap 16) besides its periodic heartbeat.
- Metering: tokens served per expert and for the host over a rolling minute
  (``moe.metering``); each holding declares its own ``committed_tps``. Dispute
  re-execution and self-tests call ``execute(..., metered=False)``.

Pure Python + numpy; imports nothing from Django.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

from moe import compute
from moe.ffn import PROJECTIONS, ExpertWeights, expert_forward
from moe.gating import Gate, Routing, route
from moe.metering import Meter
from moe.blobs import blob_hash
from moe.content import BlobError, blob_uri, parse_blob_uri

log = logging.getLogger(__name__)

Key = tuple[str, int, int]
DEFAULT_MEMORY_BUDGET = 4 << 30  # bytes, when available memory cannot be read


class RuntimeFault(Exception):
    """Base of the runtime's request errors; ``field`` names the offending request field."""

    field = "request"

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        if field is not None:
            self.field = field


class ExpertNotLoaded(RuntimeFault, LookupError):
    """The requested (model_id, layer, expert) is held in neither tier."""

    field = "expert"


class GateNotLoaded(RuntimeFault, LookupError):
    """No gate is loaded for (model_id, layer)."""

    field = "layer"


class DimensionMismatch(RuntimeFault, ValueError):
    """Input rows do not fit (wrong d_model, row count ≠ token indices, no rows)."""

    field = "hidden_states"


class NonFiniteInput(RuntimeFault, ValueError):
    """Input rows hold NaN or infinity."""

    field = "hidden_states"


class BadBlob(RuntimeFault, ValueError):
    """A blob is corrupt (not a valid expert/gate) or its BLAKE3 hash differs from its URI."""

    field = "blob"


class DiskTierError(RuntimeFault, OSError):
    """The disk tier cannot write or read a blob (the message names the path)."""

    field = "disk"


def default_memory_budget() -> int:
    """``TENZRO_MEMORY_BUDGET`` (bytes) or 60 % of available memory (psutil), 4 GiB if unreadable.

    Raises ``ValueError`` when the variable is set but not a positive integer.
    """
    env = os.environ.get("TENZRO_MEMORY_BUDGET", "").strip()
    if env:
        try:
            value = int(env)
        except ValueError:
            value = 0
        if value <= 0:
            raise ValueError(f"TENZRO_MEMORY_BUDGET must be a positive number of bytes, got {env!r}")
        return value
    try:
        avail = int(psutil.virtual_memory().available)
    except Exception:  # psutil cannot read memory on this platform
        avail = 0
    return avail // 10 * 6 or DEFAULT_MEMORY_BUDGET


def _gate_bytes(gate: Gate) -> int:
    return int(sum(v.nbytes for v in vars(gate).values() if isinstance(v, np.ndarray)))


@dataclass
class Held:
    """What the runtime knows of one held expert, whichever tier it is in."""

    model_id: str
    layer: int
    expert: int
    d_model: int
    d_ff: int
    bytes: int
    quant: str | None
    blob_uri: str
    blob_hash: str
    on_disk: bool = False


@dataclass
class LoadedGate:
    """A loaded gate with its accounting."""

    model_id: str
    layer: int
    gate: Gate
    bytes: int
    blob_uri: str
    blob_hash: str

    def row(self) -> dict:
        """The reference's ``MoeLoadedGate`` row."""
        return {"model_id": self.model_id, "layer": self.layer, "num_experts": int(self.gate.weight.shape[0]),
                "d_model": self.gate.d_model, "approx_bytes": self.bytes, "source_uri": self.blob_uri}


class DiskTier:
    """Raw blobs on disk with JSON sidecars, written atomically; ``scan()`` re-indexes them.

    File names: ``<kind>-<sha256(model_id NUL layer NUL expert)[:40]>.blob`` and ``.json``.
    """

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DiskTierError(f"cannot create the disk tier {self.root}: {exc}") from exc

    def path(self, kind: str, model_id: str, layer: int, expert: int = -1) -> Path:
        """Blob path of a key (the sidecar is the same path with ``.json``)."""
        digest = hashlib.sha256(f"{model_id}\0{layer}\0{expert}".encode()).hexdigest()[:40]
        return self.root / f"{kind}-{digest}.blob"

    @staticmethod
    def _write_atomic(path: Path, data: bytes) -> None:
        tmp = path.with_name(path.name + f".{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)

    def write(self, path: Path, blob: bytes, meta: dict) -> None:
        """Store ``blob`` then its sidecar ``meta``; raises ``DiskTierError``."""
        try:
            self._write_atomic(path, blob)
            self._write_atomic(path.with_suffix(".json"), json.dumps(meta, sort_keys=True).encode())
        except OSError as exc:
            raise DiskTierError(f"cannot write {path}: {exc}") from exc

    def read(self, path: Path) -> bytes:
        """The blob bytes at ``path``; raises ``DiskTierError``."""
        try:
            return path.read_bytes()
        except OSError as exc:
            raise DiskTierError(f"cannot read {path}: {exc}") from exc

    def remove(self, path: Path) -> None:
        """Delete a blob and its sidecar (missing files are fine)."""
        for p in (path.with_suffix(".json"), path):
            try:
                p.unlink()
            except FileNotFoundError:
                pass

    def scan(self) -> list[tuple[Path, dict]]:
        """Every (blob path, sidecar) whose blob exists with the recorded size; leftovers of
        interrupted writes (``*.tmp``, blobs without sidecars, sidecars without blobs) are removed."""
        found = []
        for tmp in self.root.glob("*.tmp"):
            tmp.unlink(missing_ok=True)
        for side in sorted(self.root.glob("*.json")):
            blob = side.with_suffix(".blob")
            try:
                meta = json.loads(side.read_text())
                ok = blob.stat().st_size == meta["size"] and meta["kind"] in ("expert", "gate")
            except (OSError, ValueError, KeyError, TypeError):
                ok = False
            if ok:
                found.append((blob, meta))
            else:
                log.warning("disk tier: dropping incomplete entry %s", side.name)
                self.remove(blob)
        indexed = {b for b, _ in found}
        for blob in self.root.glob("*.blob"):
            if blob not in indexed:
                blob.unlink(missing_ok=True)
        return found


class ExpertRuntime:
    """Thread-safe expert host: memory tier (LRU, byte budget) over an optional disk tier.

    ``memory_budget``: bytes (None → ``default_memory_budget()``; at least 1).
    ``disk_dir``: the disk tier's directory (None → memory only). ``backend``: the compute
    backend reported in status (None → ``moe.compute.backend()``). ``clock``: seconds,
    for the meter. Raises ``DiskTierError`` when the disk tier cannot be created.
    """

    def __init__(self, memory_budget: int | None = None, disk_dir: str | os.PathLike | None = None,
                 backend: compute.ComputeBackend | None = None, clock: Callable[[], float] | None = None):
        self.budget = max(int(memory_budget), 1) if memory_budget is not None else default_memory_budget()
        self.disk = DiskTier(disk_dir) if disk_dir is not None else None
        self._backend = backend
        self.meter = Meter(clock) if clock is not None else Meter()
        self._mem: OrderedDict[Key, ExpertWeights] = OrderedDict()  # oldest first
        self._mem_sizes: dict[Key, int] = {}  # bytes counted at admission (backend copies included)
        self._held: dict[Key, Held] = {}
        self._gates: dict[tuple[str, int], LoadedGate] = {}
        self._mem_bytes = 0
        self._gate_bytes = 0
        self.evicted_to_disk = 0
        self.evicted_dropped = 0
        self.admissions_over_budget = 0
        self.promotions = 0
        self._lock = threading.RLock()
        self._listeners: list[Callable[[], None]] = []
        if self.disk is not None:
            self._reindex()

    # ---- bookkeeping -------------------------------------------------------------

    @property
    def backend(self) -> compute.ComputeBackend:
        """The compute backend in use."""
        return self._backend or compute.backend()

    def add_listener(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` after every tier change (from whichever thread made it)."""
        self._listeners.append(fn)

    def _changed(self) -> None:
        for fn in list(self._listeners):
            try:
                fn()
            except Exception:  # a listener must not break the runtime
                log.exception("tier-change listener failed")

    @property
    def memory_bytes(self) -> int:
        """Bytes of resident experts plus loaded gates."""
        return self._mem_bytes + self._gate_bytes

    def _reindex(self) -> None:
        for path, meta in self.disk.scan():
            try:
                if meta["kind"] == "gate":
                    data = self.disk.read(path)
                    self._admit_gate(meta["model_id"], int(meta["layer"]), self._decode_gate(data, meta["blob_hash"]),
                                     meta["blob_uri"], meta["blob_hash"])
                else:
                    key = (meta["model_id"], int(meta["layer"]), int(meta["expert"]))
                    self._held[key] = Held(*key, d_model=int(meta["d_model"]), d_ff=int(meta["d_ff"]),
                                           bytes=int(meta["bytes"]), quant=meta.get("quant"),
                                           blob_uri=meta["blob_uri"], blob_hash=meta["blob_hash"], on_disk=True)
            except (RuntimeFault, KeyError, TypeError, ValueError) as exc:
                log.warning("disk tier: dropping %s: %s", path.name, exc)
                self.disk.remove(path)

    @staticmethod
    def _check_uri(data: bytes, uri: str | None) -> tuple[str, str]:
        h = blob_hash(data)
        if uri:
            try:
                want = parse_blob_uri(uri)
            except BlobError as exc:
                raise BadBlob(str(exc), "uri") from exc
            if want != h:
                raise BadBlob(f"blob hash mismatch: the bytes hash to {h}, the URI names {want}", "uri")
        return h, blob_uri(h)

    @staticmethod
    def _decode_expert(data: bytes, h: str) -> ExpertWeights:
        if blob_hash(data) != h:
            raise BadBlob(f"stored blob no longer hashes to {h} (disk corruption)", "blob")
        try:
            return ExpertWeights.from_blob(data)
        except (ValueError, KeyError, TypeError) as exc:
            raise BadBlob(f"corrupt expert blob: {exc}") from exc

    @staticmethod
    def _decode_gate(data: bytes, h: str) -> Gate:
        if blob_hash(data) != h:
            raise BadBlob(f"stored gate blob no longer hashes to {h} (disk corruption)", "blob")
        try:
            return Gate.from_blob(data)
        except (ValueError, KeyError, TypeError) as exc:
            raise BadBlob(f"corrupt gate blob: {exc}") from exc

    def _prepare(self, w: ExpertWeights) -> None:
        """Let the backend make its host copies (the CPU's repacked kernel layout) before the
        expert's bytes are counted."""
        prepare = getattr(self.backend, "prepare", None)
        if prepare is not None:
            for p in PROJECTIONS:
                prepare(getattr(w, p))

    def _release(self, w: ExpertWeights) -> None:
        for p in PROJECTIONS:
            self.backend.release(getattr(w, p))

    def _evict_to_budget(self) -> None:
        """Evict LRU experts until memory fits (never the last one). Caller holds the lock."""
        while self._mem_bytes + self._gate_bytes > self.budget and len(self._mem) > 1:
            key, w = self._mem.popitem(last=False)
            held = self._held[key]
            self._mem_bytes -= self._mem_sizes.pop(key)
            self._release(w)
            if held.on_disk:
                self.evicted_to_disk += 1
            else:
                self.evicted_dropped += 1
                del self._held[key]
                self.meter.forget(key)

    def _insert(self, key: Key, w: ExpertWeights) -> None:
        """Put ``w`` in memory as most recently used, then evict. Caller holds the lock."""
        old = self._mem.pop(key, None)
        if old is not None:
            self._mem_bytes -= self._mem_sizes.pop(key)
            self._release(old)
        self._mem[key] = w
        self._mem_sizes[key] = w.nbytes
        self._mem_bytes += w.nbytes
        if w.nbytes + self._gate_bytes > self.budget:
            self.admissions_over_budget += 1
        self._evict_to_budget()

    # ---- experts -----------------------------------------------------------------

    def load_expert(self, model_id: str, layer: int, expert: int, blob: bytes, uri: str | None = None) -> dict:
        """Admit an expert blob (safetensors, ``ExpertWeights.from_blob``) to memory, and to disk.

        ``uri`` (``tenzro://blob/<hash>``) must match the blob's BLAKE3 hash; without one the
        holding declares the blob's own URI. Replaces an expert already held under the key.
        Returns the ``MoeLoadedExpert`` row. Raises ``BadBlob`` (corrupt, hash mismatch) or
        ``DiskTierError``; nothing changes on error.
        """
        key = (str(model_id), int(layer), int(expert))
        h, uri = self._check_uri(blob, uri)
        w = self._decode_expert(blob, h)
        self._prepare(w)
        held = Held(*key, d_model=w.d_model, d_ff=w.d_ff, bytes=w.nbytes, quant=w.quant, blob_uri=uri,
                    blob_hash=h, on_disk=self.disk is not None)
        if self.disk is not None:
            meta = {"kind": "expert", "model_id": key[0], "layer": key[1], "expert": key[2], "d_model": w.d_model,
                    "d_ff": w.d_ff, "bytes": w.nbytes, "quant": w.quant, "blob_uri": uri, "blob_hash": h,
                    "size": len(blob)}
            self.disk.write(self.disk.path("expert", *key), blob, meta)
        with self._lock:
            self._held[key] = held
            self._insert(key, w)
        self._changed()
        return self._row(key)

    def unload_expert(self, model_id: str, layer: int, expert: int) -> bool:
        """Forget an expert in both tiers (its disk file deleted); returns whether it was held."""
        key = (str(model_id), int(layer), int(expert))
        with self._lock:
            held = self._held.pop(key, None)
            w = self._mem.pop(key, None)
            if w is not None:
                self._mem_bytes -= self._mem_sizes.pop(key)
                self._release(w)
            self.meter.forget(key)
        if held is not None and self.disk is not None:
            self.disk.remove(self.disk.path("expert", *key))
        if held is not None:
            self._changed()
        return held is not None

    def has(self, model_id: str, layer: int, expert: int) -> bool:
        """Whether the expert is held in either tier."""
        return (model_id, layer, expert) in self._held

    def tier(self, model_id: str, layer: int, expert: int) -> str | None:
        """``"memory"``, ``"disk"`` or None."""
        key = (model_id, layer, expert)
        with self._lock:
            if key in self._mem:
                return "memory"
            return "disk" if key in self._held else None

    def resolve(self, model_id: str, layer: int, expert: int) -> ExpertWeights:
        """The expert's weights, promoting it from disk to memory when needed (most recently used).

        Raises ``ExpertNotLoaded``; ``BadBlob`` when the disk copy no longer matches its
        hash (the entry is then dropped) or ``DiskTierError``.
        """
        key = (model_id, layer, expert)
        with self._lock:
            w = self._mem.get(key)
            if w is not None:
                self._mem.move_to_end(key)
                return w
            held = self._held.get(key)
        if held is None:
            raise ExpertNotLoaded(f"expert {model_id} l{layer}/e{expert} is not loaded on this holder")
        path = self.disk.path("expert", *key)
        try:
            w = self._decode_expert(self.disk.read(path), held.blob_hash)
        except BadBlob:
            self.unload_expert(*key)
            raise
        self._prepare(w)
        with self._lock:
            if key not in self._held:  # unloaded meanwhile
                raise ExpertNotLoaded(f"expert {model_id} l{layer}/e{expert} was unloaded")
            if key in self._mem:
                self._mem.move_to_end(key)
                return self._mem[key]
            self.promotions += 1
            self._insert(key, w)
        self._changed()
        return w

    def readahead(self, model_id: str, keys: Iterable[tuple[int, int]]) -> int:
        """Promote the disk-tier members of ``keys`` ((layer, expert) pairs) before a forward.

        Returns how many were promoted; memory-resident and unknown keys are no-ops. A
        disk copy that fails its hash is dropped and skipped (logged).
        """
        n = 0
        for layer, expert in keys:
            if self.tier(model_id, int(layer), int(expert)) == "disk":
                try:
                    self.resolve(model_id, int(layer), int(expert))
                    n += 1
                except RuntimeFault as exc:
                    log.warning("readahead of %s l%s/e%s failed: %s", model_id, layer, expert, exc)
        return n

    def execute(self, model_id: str, layer: int, expert: int, rows: np.ndarray, n_tokens: int,
                d_model: int | None = None, metered: bool = True) -> np.ndarray:
        """Run the expert FFN on ``rows`` f32 ``[n, H]`` → f32 ``[n, H]``.

        ``n_tokens``: the request's token-index count (must equal n, > 0); ``d_model``: the
        request's declared width (must equal the expert's). ``metered=False`` for dispute
        re-execution and self-tests. Raises ``ExpertNotLoaded``, ``DimensionMismatch``
        (field ``d_model`` / ``token_indices`` / ``hidden_states``), ``NonFiniteInput``,
        and the promotion errors of ``resolve``.
        """
        w = self.resolve(model_id, layer, expert)
        rows = np.asarray(rows)
        if d_model is not None and int(d_model) != w.d_model:
            raise DimensionMismatch(f"d_model is {d_model} but expert {model_id} l{layer}/e{expert} has "
                                    f"d_model {w.d_model}", "d_model")
        if rows.ndim != 2 or rows.shape[1] != w.d_model:
            raise DimensionMismatch(f"rows must be [n, {w.d_model}], got shape {rows.shape}", "hidden_states")
        if n_tokens == 0 or rows.shape[0] == 0:
            raise DimensionMismatch("the batch holds no rows", "token_indices")
        if rows.shape[0] != n_tokens:
            raise DimensionMismatch(f"{rows.shape[0]} rows for {n_tokens} token indices", "token_indices")
        if not np.isfinite(rows).all():
            raise NonFiniteInput("hidden_states holds non-finite values (NaN or Inf)", "hidden_states")
        out = expert_forward(w, rows)
        if metered:
            self.meter.record((model_id, layer, expert), n_tokens)
        return out

    # ---- gates -------------------------------------------------------------------

    def _admit_gate(self, model_id: str, layer: int, gate: Gate, uri: str, h: str) -> None:
        with self._lock:
            old = self._gates.pop((model_id, layer), None)
            if old is not None:
                self._gate_bytes -= old.bytes
            g = LoadedGate(model_id, layer, gate, _gate_bytes(gate), uri, h)
            self._gates[(model_id, layer)] = g
            self._gate_bytes += g.bytes
            self._evict_to_budget()

    def load_gate(self, model_id: str, layer: int, blob: bytes, uri: str | None = None) -> dict:
        """Load a layer's gate blob (``Gate.from_blob``); counted in the budget, never evicted.

        Returns the ``MoeLoadedGate`` row. Raises ``BadBlob`` or ``DiskTierError``.
        """
        h, uri = self._check_uri(blob, uri)
        gate = self._decode_gate(blob, h)
        if self.disk is not None:
            self.disk.write(self.disk.path("gate", model_id, int(layer)), blob,
                            {"kind": "gate", "model_id": model_id, "layer": int(layer), "blob_uri": uri,
                             "blob_hash": h, "size": len(blob)})
        self._admit_gate(model_id, int(layer), gate, uri, h)
        self._changed()
        return self._gates[(model_id, int(layer))].row()

    def unload_gate(self, model_id: str, layer: int) -> bool:
        """Drop a gate (and its disk copy); returns whether it was loaded."""
        with self._lock:
            g = self._gates.pop((model_id, int(layer)), None)
            if g is not None:
                self._gate_bytes -= g.bytes
        if g is not None and self.disk is not None:
            self.disk.remove(self.disk.path("gate", model_id, int(layer)))
        if g is not None:
            self._changed()
        return g is not None

    def gate(self, model_id: str, layer: int) -> Gate:
        """The loaded gate; raises ``GateNotLoaded``."""
        g = self._gates.get((model_id, int(layer)))
        if g is None:
            raise GateNotLoaded(f"no gate is loaded for model {model_id!r} layer {layer}")
        return g.gate

    def route(self, model_id: str, layer: int, hidden_states: np.ndarray, top_k: int | None = None) -> Routing:
        """Route rows f32 ``[T, H]`` through the loaded gate (``moe.gating.route``).

        Raises ``GateNotLoaded``, ``DimensionMismatch`` (field ``d_model``), ``NonFiniteInput``,
        or ``ValueError`` for a bad ``top_k``.
        """
        gate = self.gate(model_id, layer)
        x = np.asarray(hidden_states)
        if x.ndim != 2 or x.shape[1] != gate.d_model:
            raise DimensionMismatch(f"hidden_states must be [T, {gate.d_model}] for this gate, got {x.shape}",
                                    "d_model")
        if not np.isfinite(x).all():
            raise NonFiniteInput("hidden_states holds non-finite values (NaN or Inf)", "hidden_states")
        return route(gate, x, top_k)

    # ---- declarations ------------------------------------------------------------

    def _row(self, key: Key) -> dict:
        h = self._held[key]
        row = {"model_id": h.model_id, "layer": h.layer, "expert": h.expert, "d_model": h.d_model, "d_ff": h.d_ff,
               "approx_bytes": h.bytes, "tier": "memory" if key in self._mem else "disk",
               "source_uri": h.blob_uri, "committed_tps": self.meter.tps(key)}
        if h.quant:
            row["quant"] = h.quant
        return row

    def holdings(self) -> list[dict]:
        """Heartbeat holdings, sorted: every held expert, ``Warm`` in memory, ``Cold`` on disk,
        with its own rolling-minute ``committed_tps`` and blob URI."""
        with self._lock:
            keys = sorted(self._held)
            mem = set(self._mem)
            uris = {k: self._held[k].blob_uri for k in keys}
        return [{"model_id": m, "layer": layer, "expert": e, "residency": "Warm" if (m, layer, e) in mem else "Cold",
                 "committed_tps": self.meter.tps((m, layer, e)), "blob_uri": uris[(m, layer, e)]}
                for m, layer, e in keys]

    def status(self) -> dict:
        """``tenzro_moeExpertStatus``: per-expert tier, bytes, quant, source URI; gates; budget,
        counts, evictions, backend, gpu flag, measured tps (host, tokens/s over the last minute)."""
        b = self.backend
        with self._lock:
            experts = [self._row(k) for k in sorted(self._held)]
            gates = [self._gates[k].row() for k in sorted(self._gates)]
            return {
                "experts": experts, "gates": gates,
                "total_bytes": self.memory_bytes, "memory_bytes": self._mem_bytes, "gate_bytes": self._gate_bytes,
                "memory_budget_bytes": self.budget, "memory_experts": len(self._mem),
                "disk_experts": sum(1 for k in self._held if k not in self._mem),
                "disk_tier": str(self.disk.root) if self.disk is not None else None,
                "compute_backend": b.tag, "gpu": bool(b.gpu),
                "evicted_to_disk": self.evicted_to_disk, "evicted_dropped": self.evicted_dropped,
                "admissions_over_budget": self.admissions_over_budget, "promotions": self.promotions,
                "measured_tps": self.meter.tps(), "tokens_last_minute": self.meter.tokens(),
            }
