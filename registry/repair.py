"""Rendezvous (HRW) placement and the repair plan (DESIGN §8, reference §9).

Plain Python (no Django). Every node computes the same ranking from the same shard view,
so a node acts only on rows naming itself and no node can make a peer allocate memory.

Score byte layout (all ids are lowercase hex / ASCII; no separators are needed because the
provider id has a fixed length of 64 characters, so the split point is unambiguous)::

    SHA-256( b"tenzro/moe/placement"
             ‖ f"{model_id}/{layer}/{expert}".encode("utf-8")   # decimal layer/expert
             ‖ provider.encode("ascii") )                       # 64 lowercase hex chars

Layer and expert are decimal and the last two ``/`` fields, so a model id containing ``/``
(``org/name``) cannot collide with another key. Scores compare as raw big-endian bytes, highest first;
ties (never seen in practice) go to
the lower provider id. Unlike the reference (§14 item 9) the provider id is the same hex
string the JSON carries, not a base58 re-encoding.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

from registry.shardmap import ReplicationPolicy, ShardView, check_provider_id, expert_key, is_int

__all__ = ["PLACEMENT_DOMAIN", "RepairRow", "placement_score", "rank_providers", "plan_repair", "rows_for", "place"]

PLACEMENT_DOMAIN = b"tenzro/moe/placement"


def _prefix(model_id: str, layer: int, expert: int) -> bytes:
    if not isinstance(model_id, str) or not model_id:
        raise ValueError(f"model_id must be a non-empty string, got {model_id!r}")
    if not (is_int(layer) and is_int(expert)) or layer < 0 or expert < 0:
        raise ValueError(f"layer and expert must be non-negative integers, got {(layer, expert)!r}")
    return PLACEMENT_DOMAIN + f"{model_id}/{layer}/{expert}".encode("utf-8")


def placement_score(model_id: str, layer: int, expert: int, provider: str) -> bytes:
    """32-byte HRW score of ``provider`` for expert ``(model_id, layer, expert)`` (layout above).

    Raises ``ValueError`` for a provider that is not 64 lowercase hex or a bad expert key.
    """
    check_provider_id(provider)
    return hashlib.sha256(_prefix(model_id, layer, expert) + provider.encode("ascii")).digest()


def _ranked(prefix: bytes, pool: list[tuple[str, bytes]], top: int | None) -> list[str]:
    """Ids of ``pool`` ((id, id bytes), sorted by id) by descending score, ties by id.

    Entries are ``(score, -position)``: on equal scores the lower position (lower id) wins.
    """
    sha = hashlib.sha256
    scored = [(sha(prefix + b).digest(), -i) for i, (_, b) in enumerate(pool)]
    if top is not None and top < len(scored):
        best = heapq.nlargest(top, scored)
    else:
        best = sorted(scored, reverse=True)
    return [pool[-i][0] for _, i in best]


def _pool(ids: Iterable[str], field: str) -> list[tuple[str, bytes]]:
    """Validated, de-duplicated ids sorted ascending, with their ASCII bytes."""
    return [(p, p.encode("ascii")) for p in sorted(_unique_ids(ids, field))]


def _unique_ids(providers: Iterable[str], field: str) -> list[str]:
    if isinstance(providers, str):
        raise ValueError(f"{field} must be an iterable of provider ids, not a single string")
    out = list(dict.fromkeys(providers))
    for p in out:
        check_provider_id(p, field)
    return out


def rank_providers(model_id: str, layer: int, expert: int, providers: Iterable[str]) -> list[str]:
    """``providers`` (duplicates collapsed) by descending :func:`placement_score`, ties by id.

    Raises ``ValueError`` for a malformed provider id or expert key.
    """
    return _ranked(_prefix(model_id, layer, expert), _pool(providers, "providers"), None)


@dataclass(frozen=True)
class RepairRow:
    """One repair assignment: ``provider`` should pull ``(model_id, layer, expert)``.

    ``blob_uri`` is the content address to fetch (verify BLAKE3), None when no live holder
    declares one (the source must then come from the site's blob store / a prepare job).
    ``missing`` is how many replicas the expert lacks in total (shared by its rows).
    """

    model_id: str
    layer: int
    expert: int
    provider: str
    blob_uri: str | None
    missing: int

    def to_json(self) -> dict:
        """``{model_id, layer, expert, provider, blob_uri, missing}`` (what the site offers an agent)."""
        return {
            "model_id": self.model_id,
            "layer": self.layer,
            "expert": self.expert,
            "provider": self.provider,
            "blob_uri": self.blob_uri,
            "missing": self.missing,
        }


def _blob_source(view: ShardView, layer: int, expert: int) -> str | None:
    # Most-declared blob_uri among holders; ties by holder order. Deterministic on all nodes.
    uris = [h.blob_uri for h in view.holders(layer, expert) if h.blob_uri is not None]
    if not uris:
        return None
    counts = Counter(uris)
    top = max(counts.values())
    return next(u for u in uris if counts[u] == top)


def plan_repair(
    view: ShardView,
    policy: ReplicationPolicy | None = None,
    expected: Iterable[tuple[int, int]] | None = None,
    candidates: Iterable[str] | None = None,
) -> list[RepairRow]:
    """Rows that bring every expected expert up to its replication target (DESIGN §8).

    Target: ``policy.max_replication`` for hot experts (any holder ``committed_tps >=
    policy.hot_threshold_tps``), else ``policy.min_replication``; replication counts
    distinct Warm/Cold providers (see :class:`ShardView`). For each expert under target,
    candidates not already holding it (in any residency) are ranked by HRW and the top
    ``missing`` become rows. ``policy`` defaults to ``view.policy``; ``expected`` to the
    view's catalog, else its covered experts; ``candidates`` to
    ``view.distinct_providers()`` (providers already declaring holdings for the model: no
    node is conscripted into a model it does not serve).

    Rows are ordered most urgent first: current replication ascending, then (layer,
    expert), then HRW rank. Raises ``ValueError`` for malformed ids or expert keys.
    """
    policy = view.policy if policy is None else policy
    if not isinstance(policy, ReplicationPolicy):
        raise ValueError(f"policy must be a ReplicationPolicy, got {type(policy).__name__}")
    if expected is None:
        keys = sorted(view.expected) if view.expected is not None else view.covered_experts()
    else:
        keys = sorted({expert_key(item, "expected") for item in expected})
    pool = _pool(view.distinct_providers() if candidates is None else candidates, "candidates")
    threshold = policy.hot_threshold_tps
    model_id = view.model_id

    rows: list[tuple[int, RepairRow]] = []
    for layer, expert in keys:
        holders = view.holders(layer, expert)
        hot = any(h.committed_tps >= threshold for h in holders)
        target = policy.max_replication if hot else policy.min_replication
        have = view.replication(layer, expert)
        missing = target - have
        if missing <= 0:
            continue
        holding = {h.provider for h in holders}
        free = [pb for pb in pool if pb[0] not in holding]
        if not free:
            continue
        uri = _blob_source(view, layer, expert)
        for p in _ranked(_prefix(model_id, layer, expert), free, missing):
            rows.append((have, RepairRow(model_id, layer, expert, p, uri, missing)))
    # Stable sort keeps (layer, expert, rank) order inside each replication level.
    rows.sort(key=lambda hr: hr[0])
    return [r for _, r in rows]


def rows_for(rows: Iterable[RepairRow], provider: str,
             max_repairs: int = ReplicationPolicy().max_repairs_per_pass) -> list[RepairRow]:
    """The first ``max_repairs`` rows naming ``provider`` (the pull-only rule: ignore the rest).

    Raises ``ValueError`` for a malformed provider id or a negative ``max_repairs``.
    """
    check_provider_id(provider)
    if not is_int(max_repairs) or max_repairs < 0:
        raise ValueError(f"max_repairs must be a non-negative integer, got {max_repairs!r}")
    out: list[RepairRow] = []
    for r in rows:
        if len(out) >= max_repairs:
            break
        if r.provider == provider:
            out.append(r)
    return out


def place(
    model_id: str,
    experts: Iterable[tuple[int, int]],
    providers: Iterable[str],
    replication: int,
) -> dict[str, list[tuple[int, int]]]:
    """Initial placement: each expert on its top-``replication`` providers by HRW.

    ``replication`` is capped at the number of distinct providers. Returns every provider
    as a key (possibly with ``[]``), values sorted by (layer, expert). Cost: one SHA-256 per
    (expert, provider). Raises ``ValueError`` for ``replication < 1``, no providers while
    experts are given, or malformed ids/keys.
    """
    if not is_int(replication) or replication < 1:
        raise ValueError(f"replication must be a positive integer, got {replication!r}")
    keys = sorted({expert_key(item, "experts") for item in experts})
    pool = _pool(providers, "providers")
    out: dict[str, list[tuple[int, int]]] = {p: [] for p, _ in pool}
    if keys and not pool:
        raise ValueError("providers: cannot place experts on an empty provider set")
    r = min(replication, len(pool))
    for layer, expert in keys:
        for p in _ranked(_prefix(model_id, layer, expert), pool, r):
            out[p].append((layer, expert))
    return out
