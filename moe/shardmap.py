"""Shard view of one MoE model: which live provider holds which expert, in what order.

Plain Python (no Django): the registry converts database rows into the dataclasses below,
builds a :class:`ShardView`, and hands it to the planner (:mod:`registry.planner`) and the
repair pass (:mod:`moe.placement`). Agents can build the same view from the same data and
get the same answers, because every ordering here is total (no dependence on input order).

Source: ``docs/DESIGN.md`` §7-§8 and ``reference/tenzro_reference_system.md`` §1.2, with the
reference's gaps fixed (§14 items 12, 19, 20): replication counts distinct providers, ties
are broken by reputation and provider id, zero-holder experts are visible when the catalog
is supplied, and a provider declaring an expert twice counts once.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, fields
from typing import Iterable, Mapping

__all__ = [
    "RESIDENCIES",
    "ROLES",
    "ReplicationPolicy",
    "HoldingInfo",
    "ProviderInfo",
    "HolderInfo",
    "ShardView",
    "check_provider_id",
    "expert_key",
]

RESIDENCIES = ("Warm", "Cold", "Evicting")
ROLES = ("Replica", "Router", "ExpertHolder", "PrefillDecode", "Prefill", "Decode")

_RANK = {name: i for i, name in enumerate(RESIDENCIES)}
_HEX64 = re.compile(r"[0-9a-f]{64}")
# A relay-wired Kvasir market worker (``moe.transports.kvasir.provider_id``): ``kvasir:<worker_id>``,
# the id up to 200 printable characters (the market's worker_id column).
_KVASIR = re.compile(r"kvasir:[^\x00-\x1f\x7f]{1,200}")


def is_int(value: object) -> bool:
    """True for a Python ``int`` that is not a ``bool`` (JSON integers; ``True`` is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_provider_id(value: object, field: str = "provider") -> None:
    """Raise ``ValueError`` naming ``field`` unless ``value`` is a 64-char lowercase hex key or a
    Kvasir worker's ``kvasir:<worker_id>`` (1–200 printable characters)."""
    if not isinstance(value, str) or (_HEX64.fullmatch(value) is None and _KVASIR.fullmatch(value) is None):
        raise ValueError(f"{field} must be a 64-character lowercase hex ed25519 key or kvasir:<worker_id>, "
                         f"got {value!r}")


def expert_key(item: object, field: str = "expert") -> tuple[int, int]:
    """Normalize ``(layer, expert)`` (pair of non-negative ints, or a dict) or raise ValueError."""
    if type(item) is tuple and len(item) == 2:
        layer, expert = item
        if type(layer) is int and type(expert) is int and layer >= 0 and expert >= 0:
            return item  # type: ignore[return-value]
    if isinstance(item, Mapping):
        item = (item.get("layer"), item.get("expert"))
    try:
        layer, expert = item  # type: ignore[misc]
    except (TypeError, ValueError):
        raise ValueError(f"{field}: expected a (layer, expert) pair, got {item!r}") from None
    if not (is_int(layer) and is_int(expert)) or layer < 0 or expert < 0:
        raise ValueError(f"{field}: layer and expert must be non-negative integers, got {item!r}")
    return (layer, expert)


@dataclass(frozen=True)
class ReplicationPolicy:
    """Replication and repair policy (docs/DESIGN.md §8; governance-editable through proposals).

    Fields: ``min_replication`` (distinct live providers every expert should have),
    ``max_replication`` (target for hot experts, and the upper bound), ``hot_threshold_tps``
    (an expert is hot when any holder commits at least this many tokens/s),
    ``repair_interval_s`` (seconds between repair passes), ``max_repairs_per_pass`` (experts a
    node may pull per pass). Construction validates; :meth:`validate` raises ``ValueError``
    naming the offending field.
    """

    min_replication: int = 2
    max_replication: int = 8
    hot_threshold_tps: int = 1000
    repair_interval_s: int = 120
    max_repairs_per_pass: int = 2

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field; raise ``ValueError("<field> ...")`` on the first bad one."""
        for f in fields(self):
            if not is_int(getattr(self, f.name)):
                raise ValueError(f"{f.name} must be an integer, got {getattr(self, f.name)!r}")
        if self.min_replication < 1:
            raise ValueError(f"min_replication must be >= 1, got {self.min_replication}")
        if self.max_replication < self.min_replication:
            raise ValueError(
                f"max_replication must be >= min_replication ({self.min_replication}), "
                f"got {self.max_replication}"
            )
        if self.hot_threshold_tps < 1:
            raise ValueError(f"hot_threshold_tps must be >= 1, got {self.hot_threshold_tps}")
        if self.repair_interval_s < 1:
            raise ValueError(f"repair_interval_s must be >= 1, got {self.repair_interval_s}")
        if self.max_repairs_per_pass < 0:
            raise ValueError(f"max_repairs_per_pass must be >= 0, got {self.max_repairs_per_pass}")

    def to_json(self) -> dict:
        """All policy fields as a JSON object (the ``tenzro_moeReplicationPolicy`` result)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_mapping(cls, data: Mapping[str, object], base: "ReplicationPolicy | None" = None) -> "ReplicationPolicy":
        """Policy from a (partial) mapping over ``base`` (defaults when None).

        Raises ``ValueError`` for an unknown key or an invalid value, naming the field.
        """
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                raise ValueError(f"{key}: unknown replication policy field (known: {sorted(known)})")
        merged = (base or cls()).to_json()
        merged.update(data)
        return cls(**merged)  # type: ignore[arg-type]


@dataclass(frozen=True)
class HoldingInfo:
    """One provider's declaration that it holds one expert (reference §1.1 ``MoeExpertHolding``).

    ``residency`` is one of :data:`RESIDENCIES`; ``committed_tps`` is tokens/s (0 = best
    effort); ``blob_uri`` is the content-addressed ``tenzro://blob/<blake3>`` it loaded.
    Raises ``ValueError`` naming the field on bad values.
    """

    model_id: str
    layer: int
    expert: int
    residency: str
    committed_tps: int = 0
    blob_uri: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ValueError(f"model_id must be a non-empty string, got {self.model_id!r}")
        for name in ("layer", "expert", "committed_tps"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.residency not in _RANK:
            raise ValueError(f"residency must be one of {RESIDENCIES}, got {self.residency!r}")
        if self.blob_uri is not None and not isinstance(self.blob_uri, str):
            raise ValueError(f"blob_uri must be a string or None, got {self.blob_uri!r}")

    @classmethod
    def unchecked(cls, model_id: str, layer: int, expert: int, residency: str, committed_tps: int = 0,
                  blob_uri: str | None = None) -> "HoldingInfo":
        """Build without the checks of ``__post_init__``, for rows already validated when they were
        stored (the registry's database read of 70k holdings spends most of its time in them)."""
        obj = object.__new__(cls)
        obj.__dict__.update(model_id=model_id, layer=layer, expert=expert, residency=residency,
                            committed_tps=committed_tps, blob_uri=blob_uri)
        return obj


@dataclass(frozen=True)
class ProviderInfo:
    """A registered provider as the shard view needs it (reference §1.1 ``InferenceProvider``).

    ``provider`` is the 64-lowercase-hex ed25519 public key; ``roles`` a subset of
    :data:`ROLES` (lists are normalized to tuples, duplicates dropped); only ``status ==
    "Active"`` providers enter a view. ``reputation`` is 0..1000 (higher first in holder
    order). Raises ``ValueError`` naming the field on bad values.
    """

    provider: str
    roles: tuple[str, ...] = ()
    status: str = "Active"
    gpu: bool = False
    iroh_endpoint_id: str | None = None
    http_endpoint: str | None = None
    reputation: int = 500
    holdings: tuple[HoldingInfo, ...] = ()

    def __post_init__(self) -> None:
        check_provider_id(self.provider)
        roles = tuple(dict.fromkeys(self.roles))
        for role in roles:
            if role not in ROLES:
                raise ValueError(f"roles: unknown role {role!r} (known: {ROLES})")
        object.__setattr__(self, "roles", roles)
        if not isinstance(self.status, str):
            raise ValueError(f"status must be a string, got {self.status!r}")
        if not isinstance(self.gpu, bool):
            raise ValueError(f"gpu must be a bool, got {self.gpu!r}")
        for name in ("iroh_endpoint_id", "http_endpoint"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string or None, got {value!r}")
        if not is_int(self.reputation) or self.reputation < 0:
            raise ValueError(f"reputation must be a non-negative integer, got {self.reputation!r}")
        holdings = tuple(self.holdings)
        for h in holdings:
            if not isinstance(h, HoldingInfo):
                raise ValueError(f"holdings must contain HoldingInfo, got {type(h).__name__}")
        object.__setattr__(self, "holdings", holdings)


@dataclass(frozen=True)
class HolderInfo:
    """One holder of one expert inside a view (reference ``ExpertHolder`` plus reputation)."""

    provider: str
    residency: str
    committed_tps: int
    reputation: int
    gpu: bool
    iroh_endpoint_id: str | None
    http_endpoint: str | None
    blob_uri: str | None

    def to_json(self) -> dict:
        """The ``tenzro_moeShardMap`` inner holder object."""
        return {
            "provider": self.provider,
            "residency": self.residency,
            "committed_tps": self.committed_tps,
            "iroh_endpoint_id": self.iroh_endpoint_id,
            "http_endpoint": self.http_endpoint,
            "blob_uri": self.blob_uri,
            "gpu": self.gpu,
        }


def _holding_pref(h: HoldingInfo) -> tuple:
    # Which of a provider's duplicate declarations wins: best residency, most tps, has a blob.
    return (_RANK[h.residency], -h.committed_tps, h.blob_uri is None, h.blob_uri or "")


def _dedupe(holdings: list[HoldingInfo]) -> list[HoldingInfo]:
    """One holding per (layer, expert): the best by :func:`_holding_pref` (order-independent)."""
    best: dict[tuple[int, int], HoldingInfo] = {}
    for h in holdings:
        key = (h.layer, h.expert)
        prev = best.get(key)
        if prev is None or _holding_pref(h) < _holding_pref(prev):
            best[key] = h
    return list(best.values())


# A holder inside a view is stored as a compact entry tuple
#   (residency rank, -committed_tps, provider position, blob_uri)
# where "provider position" indexes the view's providers sorted by (-reputation, id). Plain
# tuple order is then exactly the docs/DESIGN.md §7 order for non-hot experts; hot experts sort with
# the GPU flag inserted after the rank. HolderInfo objects are made on demand and cached.
_R, _NT, _P = 0, 1, 2


class ShardView:
    """Immutable index of one model's experts over the live (``Active``) providers.

    Build with :meth:`build`. Holder lists are ordered once at build time (docs/DESIGN.md §7):
    Warm < Cold < Evicting; for hot experts GPU holders first; then ``committed_tps``
    descending, ``reputation`` descending, provider id ascending. The order is total, so
    every node computes the same view from the same declarations in any input order.

    Counting rules (fixing reference §14 item 19): ``replication`` counts distinct providers
    whose holding is ``Warm`` or ``Cold``; an ``Evicting`` holder is still listed (last, as a
    final fallback) but does not count, since its copy is on the way out. A provider
    declaring the same expert twice counts once (its best declaration is kept: better
    residency, then higher ``committed_tps``, then one with a ``blob_uri``).

    Attributes: ``model_id``, ``policy`` (:class:`ReplicationPolicy`), ``expected``
    (frozenset of (layer, expert) from the catalog, or None).
    """

    __slots__ = (
        "model_id",
        "policy",
        "expected",
        "_plist",
        "_active",
        "_entries",
        "_evicting",
        "_hot",
        "_held_by",
        "_role_count",
        "_cache",
    )

    def __init__(self) -> None:
        raise TypeError("use ShardView.build(model_id, providers, policy, expected)")

    @classmethod
    def build(
        cls,
        model_id: str,
        providers: Iterable[ProviderInfo],
        policy: ReplicationPolicy = ReplicationPolicy(),
        expected: Iterable[tuple[int, int]] | None = None,
    ) -> "ShardView":
        """Index ``providers``' holdings of ``model_id``.

        Only ``status == "Active"`` providers count (for roles and holdings); holdings of
        other models are ignored. ``expected`` is the catalog's expert set (layer, expert),
        including shared-expert slots; when given, :meth:`under_replicated` and
        :meth:`covers` see experts nobody holds. Raises ``ValueError`` for an empty or
        non-string ``model_id``, a provider listed twice, a non-:class:`ProviderInfo` entry,
        or a bad expected pair. Cost: O(holdings + experts·r log r).
        """
        if not isinstance(model_id, str) or not model_id:
            raise ValueError(f"model_id must be a non-empty string, got {model_id!r}")
        if not isinstance(policy, ReplicationPolicy):
            raise ValueError(f"policy must be a ReplicationPolicy, got {type(policy).__name__}")
        seen: set[str] = set()
        active: list[ProviderInfo] = []
        for p in providers:
            if not isinstance(p, ProviderInfo):
                raise ValueError(f"providers must contain ProviderInfo, got {type(p).__name__}")
            if p.provider in seen:
                raise ValueError(f"provider {p.provider} is listed twice")
            seen.add(p.provider)
            if p.status == "Active":
                active.append(p)
        active.sort(key=lambda p: (-p.reputation, p.provider))

        exp: frozenset | None = None
        if expected is not None:
            exp = frozenset([expert_key(item, "expected") for item in expected])

        threshold = policy.hot_threshold_tps
        rank = _RANK
        raw: defaultdict[tuple[int, int], list[tuple]] = defaultdict(list)
        held_by: dict[str, list[tuple[int, int]]] = {}
        evicting: dict[tuple[int, int], int] = {}
        hot: set[tuple[int, int]] = set()
        role_count = {role: 0 for role in ROLES}
        for pos, p in enumerate(active):
            for role in p.roles:
                role_count[role] += 1
            hs = [h for h in p.holdings if h.model_id == model_id]
            if not hs:
                continue
            keys = [(h.layer, h.expert) for h in hs]
            if len(set(keys)) != len(keys):
                hs = _dedupe(hs)
                keys = [(h.layer, h.expert) for h in hs]
            held_by[p.provider] = sorted(keys)
            for key, h in zip(keys, hs):
                tps = h.committed_tps
                r = rank[h.residency]
                raw[key].append((r, -tps, pos, h.blob_uri))
                if tps >= threshold:
                    hot.add(key)
                if r == 2:
                    evicting[key] = evicting.get(key, 0) + 1

        view = object.__new__(cls)
        view.model_id = model_id
        view.policy = policy
        view.expected = exp
        view._plist = active
        view._active = {p.provider: p for p in active}
        view._held_by = held_by
        view._role_count = role_count
        view._evicting = evicting
        view._hot = hot
        gpu = [p.gpu for p in active]
        entries: dict[tuple[int, int], list[tuple]] = {}
        for key in sorted(raw):
            lst = raw[key]
            if len(lst) > 1:
                if key in hot:
                    lst.sort(key=lambda e: (e[0], not gpu[e[2]], e[1], e[2]))
                else:
                    lst.sort()
            entries[key] = lst
        view._entries = entries
        view._cache = {}
        return view

    # -- internal ---------------------------------------------------------------------

    def _materialize(self, key: tuple[int, int]) -> tuple[tuple[HolderInfo, ...], int]:
        """Cached (holders in order, number of Warm holders) for one expert."""
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        plist = self._plist
        out = []
        warm = 0
        new = object.__new__
        for r, nt, pos, blob in self._entries.get(key, ()):
            p = plist[pos]
            # Fast path around the frozen __init__ (same fields, values already validated).
            h = new(HolderInfo)
            h.__dict__.update(
                provider=p.provider,
                residency=RESIDENCIES[r],
                committed_tps=-nt,
                reputation=p.reputation,
                gpu=p.gpu,
                iroh_endpoint_id=p.iroh_endpoint_id,
                http_endpoint=p.http_endpoint,
                blob_uri=blob,
            )
            out.append(h)
            if r == 0:
                warm += 1
        hit = (tuple(out), warm)
        self._cache[key] = hit
        return hit

    # -- queries ---------------------------------------------------------------------

    def holders(self, layer: int, expert: int, allow_cold: bool = True) -> list[HolderInfo]:
        """Holders of ``(layer, expert)`` in docs/DESIGN.md §7 order; ``allow_cold=False`` keeps Warm only.

        Unknown experts give ``[]``.
        """
        return list(self.eligible((layer, expert), allow_cold))

    def eligible(self, key: tuple[int, int], allow_cold: bool) -> tuple[HolderInfo, ...]:
        """Like :meth:`holders` for a ``(layer, expert)`` key, returning the cached tuple (no copy)."""
        ordered, warm = self._materialize(key)
        return ordered if allow_cold else ordered[:warm]

    def warm_count(self, layer: int, expert: int) -> int:
        """Number of Warm holders of ``(layer, expert)``."""
        return self._materialize((layer, expert))[1]

    def replication(self, layer: int, expert: int) -> int:
        """Distinct providers holding ``(layer, expert)`` Warm or Cold (Evicting excluded)."""
        key = (layer, expert)
        lst = self._entries.get(key)
        return len(lst) - self._evicting.get(key, 0) if lst else 0

    def is_hot(self, layer: int, expert: int) -> bool:
        """True when any holder's ``committed_tps`` reaches ``policy.hot_threshold_tps``."""
        return (layer, expert) in self._hot

    def covered_experts(self) -> list[tuple[int, int]]:
        """Experts with at least one holder (any residency), sorted by (layer, expert)."""
        return list(self._entries)

    def distinct_providers(self) -> list[str]:
        """Active providers holding at least one expert of this model, sorted by id."""
        return sorted(self._held_by)

    def held_by(self, provider: str) -> list[tuple[int, int]]:
        """Experts of this model that ``provider`` declares (sorted; ``[]`` when none)."""
        return list(self._held_by.get(provider, ()))

    def provider(self, provider: str) -> ProviderInfo | None:
        """The active provider's info, or None when it is not active in this view."""
        return self._active.get(provider)

    @property
    def role_count(self) -> dict[str, int]:
        """Active providers declaring each role (every name in :data:`ROLES` present).

        As in the reference, roles are counted over all active providers, not only those
        holding experts of this model (roles are not declared per model).
        """
        return dict(self._role_count)

    def under_replicated(self) -> list[tuple[int, int]]:
        """Experts with fewer than ``policy.min_replication`` distinct providers, sorted.

        With a catalog (``expected``) this is every expected expert under the minimum,
        including those nobody holds; without one, the covered experts under it.
        """
        need = self.policy.min_replication
        entries, evicting = self._entries, self._evicting
        keys = sorted(self.expected) if self.expected is not None else entries
        out = []
        for k in keys:
            lst = entries.get(k)
            if lst is None or len(lst) - evicting.get(k, 0) < need:
                out.append(k)
        return out

    def hot_experts(self) -> list[tuple[int, int]]:
        """Hot experts (any holder ``committed_tps >= hot_threshold_tps``), sorted."""
        return sorted(self._hot)

    def covers(self, expected: Iterable[tuple[int, int]] | None = None, min_replication: int | None = None) -> bool:
        """True when every expected expert has ``>= min_replication`` distinct providers.

        ``expected`` defaults to the view's catalog, ``min_replication`` to the policy's.
        Raises ``ValueError`` when no expected set is available or ``min_replication < 1``.
        """
        if expected is None:
            if self.expected is None:
                raise ValueError("expected: covers() needs an expected expert set (none given, none in the view)")
            keys: Iterable[tuple[int, int]] = self.expected
        else:
            keys = [expert_key(item, "expected") for item in expected]
        need = self.policy.min_replication if min_replication is None else min_replication
        if not is_int(need) or need < 1:
            raise ValueError(f"min_replication must be a positive integer, got {need!r}")
        return all(self.replication(*k) >= need for k in keys)

    def without(self, providers: Iterable[str]) -> "ShardView":
        """A new view without ``providers`` (e.g. those that failed during a forward).

        Unknown ids are ignored; a single id string is accepted. Only the affected experts
        are re-indexed (hot status and order recomputed), so this is cheap for replans.
        """
        if isinstance(providers, str):
            providers = [providers]
        drop = {p for p in providers if p in self._active}
        new = object.__new__(ShardView)
        new.model_id = self.model_id
        new.policy = self.policy
        new.expected = self.expected
        new._plist = self._plist  # positions stay valid; dropped ones are no longer referenced
        new._cache = {}
        if not drop:
            for slot in ("_active", "_entries", "_evicting", "_hot", "_held_by", "_role_count"):
                setattr(new, slot, getattr(self, slot))
            return new
        new._active = {k: v for k, v in self._active.items() if k not in drop}
        new._held_by = {k: v for k, v in self._held_by.items() if k not in drop}
        role_count = {role: 0 for role in ROLES}
        for p in new._active.values():
            for role in p.roles:
                role_count[role] += 1
        new._role_count = role_count
        plist = self._plist
        gone = {i for i, p in enumerate(plist) if p.provider in drop}
        touched = {key for pid in drop for key in self._held_by.get(pid, ())}
        threshold = self.policy.hot_threshold_tps
        entries = dict(self._entries)  # insertion order stays (layer, expert)-sorted
        evicting = dict(self._evicting)
        hot = set(self._hot)
        for key in touched:
            lst = [e for e in entries[key] if e[_P] not in gone]
            hot.discard(key)
            evicting.pop(key, None)
            if not lst:
                del entries[key]
                continue
            if any(-e[_NT] >= threshold for e in lst):
                hot.add(key)
                lst.sort(key=lambda e: (e[0], not plist[e[2]].gpu, e[1], e[2]))
            else:
                lst.sort()
            n_ev = sum(1 for e in lst if e[_R] == 2)
            if n_ev:
                evicting[key] = n_ev
            entries[key] = lst
        new._entries = entries
        new._evicting = evicting
        new._hot = hot
        return new

    def to_json(self) -> dict:
        """The ``tenzro_moeShardMap`` result.

        Keys: ``model_id``; ``covered_experts`` (count, as the reference returns it) and
        ``covered`` (the list ``[{layer, expert}]``); ``distinct_providers`` (count) and
        ``providers`` (the sorted id list); ``expert_holders_role_count``,
        ``router_role_count``, ``prefill_role_count``, ``decode_role_count``,
        ``replica_role_count``; ``policy`` (all policy fields); ``under_replicated_experts``
        and ``hot_experts`` (``[{layer, expert}]``); ``holders`` (``[{layer, expert,
        replication, holders: [{provider, residency, committed_tps, iroh_endpoint_id,
        http_endpoint, blob_uri, gpu}]}]`` sorted by (layer, expert), inner lists in holder
        order).
        """
        rc = self._role_count
        evicting = self._evicting
        pinfo = [(p.provider, p.iroh_endpoint_id, p.http_endpoint, p.gpu) for p in self._plist]
        res = RESIDENCIES
        rows = []
        append = rows.append
        for key, lst in self._entries.items():
            hs = []
            for r, nt, pos, blob in lst:
                pid, iroh, http, gpu = pinfo[pos]
                hs.append(
                    {
                        "provider": pid,
                        "residency": res[r],
                        "committed_tps": -nt,
                        "iroh_endpoint_id": iroh,
                        "http_endpoint": http,
                        "blob_uri": blob,
                        "gpu": gpu,
                    }
                )
            append({"layer": key[0], "expert": key[1], "replication": len(lst) - evicting.get(key, 0), "holders": hs})
        return {
            "model_id": self.model_id,
            "covered_experts": len(self._entries),
            "covered": [{"layer": l, "expert": e} for l, e in self._entries],
            "distinct_providers": len(self._held_by),
            "providers": sorted(self._held_by),
            "expert_holders_role_count": rc["ExpertHolder"],
            "router_role_count": rc["Router"],
            "prefill_role_count": rc["Prefill"],
            "decode_role_count": rc["Decode"],
            "replica_role_count": rc["Replica"],
            "policy": self.policy.to_json(),
            "under_replicated_experts": [{"layer": l, "expert": e} for l, e in self.under_replicated()],
            "hot_experts": [{"layer": l, "expert": e} for l, e in sorted(self._hot)],
            "holders": rows,
        }
