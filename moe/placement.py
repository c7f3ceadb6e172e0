"""Rendezvous (HRW) placement and the repair plan (docs/DESIGN.md §8, reference §9).

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

from moe.shardmap import (HoldingInfo, ProviderInfo, ReplicationPolicy, ShardView, check_provider_id,
                               expert_key, is_int)

__all__ = ["PLACEMENT_DOMAIN", "ReleaseRow", "RepairRow", "placement_score", "rank_providers", "plan_release",
           "plan_repair", "rows_for", "place", "view_from_map"]

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


def plan_repair(
    view: ShardView,
    policy: ReplicationPolicy | None = None,
    expected: Iterable[tuple[int, int]] | None = None,
    candidates: Iterable[str] | None = None,
    exclude: Iterable[tuple[int, int, str]] = (),
) -> list[RepairRow]:
    """Rows that bring every expected expert up to its replication target (docs/DESIGN.md §8).

    Target: ``policy.max_replication`` for hot experts (any holder ``committed_tps >=
    policy.hot_threshold_tps``), else ``policy.min_replication``; replication counts
    distinct Warm/Cold providers (see :class:`ShardView`). For each expert under target,
    candidates not already holding it (in any residency) and not in ``exclude`` ((layer,
    expert, provider) triples, e.g. recent declines, so the next candidate is asked) are
    ranked by HRW and the top ``missing`` become rows. ``policy`` defaults to
    ``view.policy``; ``expected`` to the view's catalog, else its covered experts;
    ``candidates`` to ``view.distinct_providers()`` (providers already declaring holdings
    for the model: no node is conscripted into a model it does not serve).

    Order, most urgent first: rows that lift an expert towards ``min_replication`` (current
    replication ascending, then (layer, expert), then HRW rank); then the hot-expert rows
    above the minimum in DeepSeek EPLB order (``eplb/eplb.py`` ``replicate_experts``: each
    next replica goes to the expert with the largest load per replica, load = the sum of its
    holders' ``committed_tps``; ties by (layer, expert)). An agent taking the first
    ``max_repairs_per_pass`` rows naming it therefore fixes coverage before adding hot
    replicas. Raises ``ValueError`` for malformed ids or expert keys.
    """
    policy = view.policy if policy is None else policy
    if not isinstance(policy, ReplicationPolicy):
        raise ValueError(f"policy must be a ReplicationPolicy, got {type(policy).__name__}")
    if expected is None:
        keys = sorted(view.expected) if view.expected is not None else view.covered_experts()
    else:
        keys = sorted({expert_key(item, "expected") for item in expected})
    pool = _pool(view.distinct_providers() if candidates is None else candidates, "candidates")
    skip: dict[tuple[int, int], set[str]] = {}
    for layer, expert, p in exclude:
        skip.setdefault((layer, expert), set()).add(p)
    threshold = policy.hot_threshold_tps
    lo, hi = policy.min_replication, policy.max_replication
    model_id = view.model_id
    # Read the view's index directly: materializing HolderInfo objects for every expert
    # dominated the plan at Kimi-K2 size (23k experts).
    entries, evicting, plist = view._entries, view._evicting, view._plist

    urgent: list[tuple[int, RepairRow]] = []
    hot: list[tuple[tuple[int, int], list[str], str | None, int, int, int]] = []
    for key in keys:
        lst = entries.get(key)
        have = len(lst) - evicting.get(key, 0) if lst else 0
        if have >= hi:
            continue
        is_hot = bool(lst) and any(-e[1] >= threshold for e in lst)
        target = hi if is_hot else lo
        missing = target - have
        if missing <= 0:
            continue
        holding = {plist[e[2]].provider for e in lst} if lst else set()
        holding |= skip.get(key, set())
        free = [pb for pb in pool if pb[0] not in holding] if holding else pool
        if not free:
            continue
        uri = _first_uri(lst)
        ranked = _ranked(_prefix(model_id, *key), free, missing)
        n_urgent = max(0, min(lo - have, len(ranked)))
        for p in ranked[:n_urgent]:
            urgent.append((have, RepairRow(model_id, key[0], key[1], p, uri, missing)))
        if len(ranked) > n_urgent:
            load = sum(-e[1] for e in lst)
            hot.append((key, ranked[n_urgent:], uri, missing, load, have + n_urgent))
    # Stable sort keeps (layer, expert, rank) order inside each replication level.
    urgent.sort(key=lambda hr: hr[0])
    out = [r for _, r in urgent]
    # EPLB greedy over the hot experts' remaining replicas: largest load per replica first.
    heap = [(-load / max(reps, 1), key, 0, i) for i, (key, _, _, _, load, reps) in enumerate(hot)]
    heapq.heapify(heap)
    while heap:
        _, key, k, i = heapq.heappop(heap)
        _, ranked, uri, missing, load, reps = hot[i]
        out.append(RepairRow(model_id, key[0], key[1], ranked[k], uri, missing))
        if k + 1 < len(ranked):
            heapq.heappush(heap, (-load / (reps + k + 1), key, k + 1, i))
    return out


def _first_uri(lst: list | None) -> str | None:
    """Most-declared ``blob_uri`` among an expert's holder entries (ties: holder order)."""
    if not lst:
        return None
    uris = [e[3] for e in lst if e[3] is not None]
    if not uris:
        return None
    if len(set(uris)) == 1:
        return uris[0]
    counts = Counter(uris)
    top = max(counts.values())
    return next(u for u in uris if counts[u] == top)


@dataclass(frozen=True)
class ReleaseRow:
    """``provider`` holds a replica of ``(model_id, layer, expert)`` above its target.

    ``target`` is the replication the expert should keep (``min_replication`` when cool,
    ``max_replication`` when hot); ``replication`` what it has now.
    """

    model_id: str
    layer: int
    expert: int
    provider: str
    replication: int
    target: int

    def to_json(self) -> dict:
        """``{model_id, layer, expert, provider, replication, target}``."""
        return {"model_id": self.model_id, "layer": self.layer, "expert": self.expert,
                "provider": self.provider, "replication": self.replication, "target": self.target}


def plan_release(view: ShardView, policy: ReplicationPolicy | None = None) -> list[ReleaseRow]:
    """Replicas above target, to drop once the expert has stayed cool for a grace period.

    For each expert with more Warm/Cold holders than its target (``max_replication`` when
    hot, else ``min_replication``) the holders are ranked by the same HRW score as
    placement; the top ``target`` keep their copy, every other holder gets a row. Every node
    computes the same rows from the same view, so the replicas that stay are exactly those
    placement and repair would pick. Evicting holders are already leaving and get no row.
    """
    policy = view.policy if policy is None else policy
    threshold = policy.hot_threshold_tps
    out: list[ReleaseRow] = []
    entries, evicting, plist = view._entries, view._evicting, view._plist
    for key, lst in entries.items():
        have = len(lst) - evicting.get(key, 0)
        if have <= policy.min_replication:
            continue
        target = policy.max_replication if any(-e[1] >= threshold for e in lst) else policy.min_replication
        if have <= target:
            continue
        live = [plist[e[2]].provider for e in lst if e[0] != 2]
        ranked = rank_providers(view.model_id, key[0], key[1], live)
        out.extend(ReleaseRow(view.model_id, key[0], key[1], p, have, target) for p in ranked[target:])
    return out


def view_from_map(shard_map: dict, expected: Iterable[tuple[int, int]] | None = None) -> ShardView:
    """Rebuild a :class:`ShardView` from a ``tenzro_moeShardMap`` result (what an agent fetches).

    Holders become providers with their declared residency, ``committed_tps``, ``blob_uri``,
    ``http_endpoint`` and gpu flag; ``expected`` defaults to the map's covered experts plus
    its under-replicated ones (which include catalog experts nobody holds). Reputation is not
    in the map, so holder order may differ from the site's, but HRW rankings and replication
    counts, all that planning reads, are the same. Raises ``ValueError`` for a malformed map.
    """
    if not isinstance(shard_map, dict) or not isinstance(shard_map.get("holders"), list):
        raise ValueError("shard map must be an object with a holders list")
    model_id = shard_map.get("model_id")
    policy = ReplicationPolicy.from_mapping(shard_map.get("policy") or {})
    per: dict[str, list[HoldingInfo]] = {}
    meta: dict[str, tuple[str | None, bool]] = {}
    for row in shard_map["holders"]:
        layer, expert = expert_key((row.get("layer"), row.get("expert")), "holders")
        for h in row.get("holders") or ():
            pid = h.get("provider")
            check_provider_id(pid, "holders.provider")
            per.setdefault(pid, []).append(HoldingInfo(model_id, layer, expert, h.get("residency", "Warm"),
                                                       int(h.get("committed_tps") or 0), h.get("blob_uri")))
            meta[pid] = (h.get("http_endpoint") or None, bool(h.get("gpu")))
    if expected is None:
        keys = {(c["layer"], c["expert"]) for c in shard_map.get("covered") or ()}
        keys |= {(c["layer"], c["expert"]) for c in shard_map.get("under_replicated_experts") or ()}
        expected = sorted(keys)
    infos = [ProviderInfo(provider=p, roles=("ExpertHolder",), http_endpoint=meta[p][0], gpu=meta[p][1],
                          holdings=tuple(hs)) for p, hs in per.items()]
    return ShardView.build(model_id, infos, policy=policy, expected=expected)


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
