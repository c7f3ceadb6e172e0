"""Dispatch planner: routed (token, expert) pairs → per-holder expert batches.

Plain Python (no Django). Input is a :class:`moe.shardmap.ShardView` and the gate's
routings; output is a :class:`DispatchPlan` that the forward (router role) executes.

Source: reference §2 (``moe_router.rs``), with its gaps fixed (reference §14 items 12, 20,
25): an expert without an eligible holder is reported in ``unplanned`` instead of failing
the whole plan, holder order is total (deterministic on every node), duplicate tokens and
duplicate slots are rejected, and large batches can be split across warm replicas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from moe.shardmap import HolderInfo, ShardView, is_int

__all__ = ["PlanningError", "TokenRouting", "ExpertBatch", "DispatchPlan", "plan_dispatch"]


class PlanningError(ValueError):
    """Routings the planner cannot accept (JSON-RPC −32000 in the API layer)."""


@dataclass(frozen=True)
class TokenRouting:
    """One token's routed experts: ``experts`` is a tuple of ``(layer, expert)`` pairs.

    Lists (and ``{"layer", "expert"}`` dicts) are normalized to tuples. Raises
    :class:`PlanningError` for a negative or non-integer index, layer or expert.
    """

    token_index: int
    experts: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if not is_int(self.token_index) or self.token_index < 0:
            raise PlanningError(f"token_index must be a non-negative integer, got {self.token_index!r}")
        try:
            items = list(self.experts)
        except TypeError:
            raise PlanningError(f"token {self.token_index}: experts must be a list of (layer, expert) pairs") from None
        out = []
        for item in items:
            if isinstance(item, dict):
                item = (item.get("layer"), item.get("expert"))
            try:
                layer, expert = item
            except (TypeError, ValueError):
                raise PlanningError(
                    f"token {self.token_index}: expected (layer, expert) pairs, got {item!r}"
                ) from None
            if not (is_int(layer) and is_int(expert)) or layer < 0 or expert < 0:
                raise PlanningError(
                    f"token {self.token_index}: layer and expert must be non-negative integers, got {item!r}"
                )
            out.append((layer, expert))
        object.__setattr__(self, "experts", tuple(out))


@dataclass
class ExpertBatch:
    """Tokens of one expert sent to one provider; ``backups`` are the other eligible holders in order."""

    layer: int
    expert: int
    provider: str
    iroh_endpoint_id: str | None
    http_endpoint: str | None
    token_indices: list[int]
    backups: list[HolderInfo] = field(default_factory=list)

    def to_json(self) -> dict:
        """``{layer, expert, provider, iroh_endpoint_id, http_endpoint, token_indices, backups}``."""
        return {
            "layer": self.layer,
            "expert": self.expert,
            "provider": self.provider,
            "iroh_endpoint_id": self.iroh_endpoint_id,
            "http_endpoint": self.http_endpoint,
            "token_indices": list(self.token_indices),
            "backups": [
                {"provider": b.provider, "iroh_endpoint_id": b.iroh_endpoint_id, "http_endpoint": b.http_endpoint}
                for b in self.backups
            ],
        }


@dataclass
class DispatchPlan:
    """Result of :func:`plan_dispatch`.

    ``batches``: sorted by (layer, expert, first token, provider). ``token_assignments``:
    ``[{token_index, slots: [{layer, expert, provider | None}]}]`` in ascending token index,
    slots in the token's routing order (``provider`` None when unplanned). ``unplanned``:
    ``[{layer, expert, tokens}]`` for experts without an eligible holder, sorted.
    """

    model_id: str
    batches: list[ExpertBatch]
    token_assignments: list[dict]
    unplanned: list[dict]

    def to_json(self) -> dict:
        """The ``tenzro_moePlanDispatch`` result (reference §2 shape plus ``backups`` and ``unplanned``)."""
        return {
            "model_id": self.model_id,
            "batch_count": len(self.batches),
            "batches": [b.to_json() for b in self.batches],
            "token_assignments": [
                {"token_index": a["token_index"], "slots": [dict(s) for s in a["slots"]]}
                for a in self.token_assignments
            ],
            "unplanned": [
                {"layer": u["layer"], "expert": u["expert"], "tokens": list(u["tokens"])} for u in self.unplanned
            ],
        }


def plan_dispatch(
    view: ShardView,
    routings: Iterable[TokenRouting],
    allow_cold: bool = False,
    split_threshold: int | None = None,
    rank: Callable[[Sequence[HolderInfo]], tuple[Sequence[HolderInfo], int]] | None = None,
    avoid: Callable[[str], bool] | None = None,
) -> DispatchPlan:
    """Assign every routed (token, expert) pair to exactly one holder.

    Algorithm (docs/DESIGN.md §7; reference §2 with fixes): group tokens by expert (ascending token
    index); the eligible holders are ``view.holders(layer, expert, allow_cold)`` (Warm only
    unless ``allow_cold``); the primary is the first, the backups the rest in order. With
    ``split_threshold`` set, an expert's tokens are cut into contiguous ascending chunks of
    at most ``split_threshold`` tokens, dealt round-robin over its Warm holders in order
    (over the primary alone when it has none), so every batch holds at most
    ``split_threshold`` tokens; each chunk's backups are the other eligible holders. An
    expert with no eligible holder goes to ``unplanned`` (the forward decides whether that
    is fatal). The result depends only on the view's contents and the routings' contents,
    not on provider or routing input order. ``rank``: reorders each expert's eligible
    holders (the router's observations, ``router.scoreboard.Scoreboard.rank``) and says how
    many leading ones are *peers* (interchangeable); it must keep Warm holders before Cold
    ones and return the same holders. An unsplit batch goes to the peer with the least work
    planned so far in this call (its rows plus one per batch, the experts taken in ascending
    order; ties to the first), the other candidates following in order as backups: with 2
    replicas on 3 equal holders, the first in a fixed order would otherwise get every batch of
    the experts it holds and the third none, and the forward waits on the busiest. ``avoid(provider)``:
    True for a holder that split chunks are dealt to only when no other Warm holder exists
    (a holder the router recently saw fail); it stays a backup.

    Raises :class:`PlanningError` for empty routings, a non-:class:`TokenRouting` entry, a
    duplicate ``token_index``, a token listing the same expert twice, a non-bool
    ``allow_cold``, or a ``split_threshold`` that is not a positive integer.
    """
    if not isinstance(view, ShardView):
        raise PlanningError(f"view must be a ShardView, got {type(view).__name__}")
    if not isinstance(allow_cold, bool):
        raise PlanningError(f"allow_cold must be a bool, got {allow_cold!r}")
    if split_threshold is not None and (not is_int(split_threshold) or split_threshold < 1):
        raise PlanningError(f"split_threshold must be a positive integer or None, got {split_threshold!r}")
    routings = list(routings)
    if not routings:
        raise PlanningError("routings is empty: nothing to plan")
    for r in routings:
        if not isinstance(r, TokenRouting):
            raise PlanningError(f"routings must contain TokenRouting, got {type(r).__name__}")
    routings.sort(key=lambda r: r.token_index)

    by_expert: dict[tuple[int, int], list[int]] = {}
    prev = None
    for r in routings:
        t = r.token_index
        if t == prev:
            raise PlanningError(f"duplicate token_index {t}: each token must appear once")
        prev = t
        experts = r.experts
        if len(set(experts)) != len(experts):
            dup = next(k for i, k in enumerate(experts) if k in experts[:i])
            raise PlanningError(f"token {t} lists expert l{dup[0]}/e{dup[1]} twice")
        for key in experts:
            lst = by_expert.get(key)
            if lst is None:
                by_expert[key] = [t]
            else:
                lst.append(t)

    batches, unplanned, chosen = plan_expert_batches(view, by_expert, allow_cold, split_threshold, rank, avoid)
    assignments = []
    for r in routings:
        t = r.token_index
        slots = []
        for key in r.experts:
            c = chosen[key]
            slots.append({"layer": key[0], "expert": key[1], "provider": c[t] if type(c) is dict else c})
        assignments.append({"token_index": t, "slots": slots})
    return DispatchPlan(view.model_id, batches, assignments, unplanned)


def plan_expert_batches(
    view: ShardView,
    by_expert: dict[tuple[int, int], list[int]],
    allow_cold: bool = False,
    split_threshold: int | None = None,
    rank: Callable[[Sequence[HolderInfo]], tuple[Sequence[HolderInfo], int]] | None = None,
    avoid: Callable[[str], bool] | None = None,
) -> tuple[list["ExpertBatch"], list[dict], dict]:
    """The batch step of :func:`plan_dispatch` on pairs already grouped: ``by_expert`` maps
    ``(layer, expert)`` to its tokens, ascending and distinct (not checked: callers hold them
    so, as a forward's outstanding pairs are). Returns (batches sorted by layer, expert, first
    token and provider; ``unplanned`` experts ``{layer, expert, tokens}``; per expert the
    provider chosen, a per-token dict when split, None when unplanned). Same parameters and
    algorithm as :func:`plan_dispatch`, which validates its routings and calls this."""
    batches: list[ExpertBatch] = []
    planned: dict[str, int] = {}  # provider -> rows + batches dealt to it in this call (with peers)
    unplanned: list[dict] = []
    # key -> provider for the whole expert, or a per-token dict when split.
    chosen: dict[tuple[int, int], object] = {}
    for key in sorted(by_expert):
        tokens = by_expert[key]
        cands = view.eligible(key, allow_cold)
        lead = 1
        if rank is not None and len(cands) > 1:
            ordered, lead = rank(cands)
            cands = tuple(ordered)
        layer, expert = key
        if not cands:
            unplanned.append({"layer": layer, "expert": expert, "tokens": tokens})
            chosen[key] = None
            continue
        if split_threshold is None or len(tokens) <= split_threshold:
            j = 0
            if lead > 1:
                j = min(range(min(lead, len(cands))), key=lambda i: planned.get(cands[i].provider, 0))
                planned[cands[j].provider] = planned.get(cands[j].provider, 0) + len(tokens) + 1
            p = cands[j]
            batches.append(
                ExpertBatch(layer, expert, p.provider, p.iroh_endpoint_id, p.http_endpoint, tokens,
                            list(cands[:j] + cands[j + 1:]))
            )
            chosen[key] = p.provider
            continue
        targets = cands[: view.warm_count(layer, expert)] or cands[:1]
        if avoid is not None:
            targets = [h for h in targets if not avoid(h.provider)] or targets[:1]
        per_token: dict[int, str] = {}
        n = len(targets)
        for j, start in enumerate(range(0, len(tokens), split_threshold)):
            p = targets[j % n]
            chunk = tokens[start : start + split_threshold]
            backups = [h for h in cands if h.provider != p.provider]
            batches.append(ExpertBatch(layer, expert, p.provider, p.iroh_endpoint_id, p.http_endpoint, chunk, backups))
            for t in chunk:
                per_token[t] = p.provider
        chosen[key] = per_token
    # Already grouped by (layer, expert) with ascending first tokens; sort anyway for the contract.
    batches.sort(key=lambda b: (b.layer, b.expert, b.token_indices[0], b.provider))
    return batches, unplanned, chosen
