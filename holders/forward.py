"""The router's MoE layer forward over remote holders (DESIGN §7), free of Django.

gate locally → per-token routings → planner over the live shard view → one batch per
(expert, holder) → ``send`` each batch (primary first, then its backups in order) → fold
the returned rows into the gate-weighted combine (``holders.ffn.combine``), which sums each
token's slots in ascending expert id with the shared slot last, exactly as the monolithic
forward does, so both agree bit for bit on the same backend.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import numpy as np

from holders.ffn import combine
from holders.gating import Gate, Routing, route
from registry.planner import DispatchPlan, PlanningError, TokenRouting, plan_dispatch
from registry.shardmap import ShardView

# send(provider, layer, expert, token_indices, rows f32 [n, H]) -> output rows f32 [n, H]
Send = Callable[[str, int, int, list[int], np.ndarray], Awaitable[np.ndarray]]


class ForwardError(Exception):
    """The forward cannot complete: ``kind`` is "planning" (nobody holds an expert) or
    "execution" (every holder of a batch failed); ``data`` names the (expert, tokens)."""

    def __init__(self, kind: str, message: str, data: dict | None = None):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.data = data or {}


@dataclass
class ForwardResult:
    """Output of a distributed forward: ``output`` f32 [T, H] plus what it took."""

    output: np.ndarray
    routing: Routing
    plan: DispatchPlan
    holders: list[str]
    failures: list[dict] = field(default_factory=list)
    timings_ms: dict = field(default_factory=dict)


def token_routings(routing: Routing, layer: int) -> list[TokenRouting]:
    """Planner input from a routing: per token its (layer, expert) slots, shared slot included."""
    return [TokenRouting(t, tuple((layer, int(e)) for e in routing.expert_ids[t]))
            for t in range(routing.expert_ids.shape[0])]


async def distributed_forward(*, gate: Gate, layer: int, hidden_states: np.ndarray, view: ShardView,
                              send: Send, top_k: int | None = None, allow_cold: bool = False) -> ForwardResult:
    """One MoE layer forward with experts executed by remote holders.

    ``hidden_states`` f32 [T, H] with H == gate.d_model. Raises ``ValueError`` for bad
    input (from ``route``) and ``ForwardError`` when an expert has no eligible holder
    (kind "planning", ``data["missing"]``) or every holder of a batch failed (kind
    "execution", ``data["missing"]`` and ``data["failures"]``).
    """
    t0 = time.perf_counter()
    routing = route(gate, hidden_states, top_k)
    t_gate = time.perf_counter()
    try:
        plan = plan_dispatch(view, token_routings(routing, layer), allow_cold=allow_cold)
    except PlanningError as exc:
        raise ForwardError("planning", str(exc)) from exc
    if plan.unplanned:
        first = plan.unplanned[0]
        raise ForwardError("planning", f"no live holder for expert l{first['layer']}/e{first['expert']} "
                           f"(tokens {first['tokens']}); {len(plan.unplanned)} expert(s) unplanned",
                           {"missing": plan.unplanned})
    failures: list[dict] = []
    used: set[str] = set()

    async def run_batch(batch):
        tokens = list(batch.token_indices)
        rows = hidden_states[np.asarray(tokens, dtype=np.int64)]
        for provider in [batch.provider] + [b.provider for b in batch.backups]:
            try:
                out = await send(provider, batch.layer, batch.expert, tokens, rows)
            except (ConnectionError, ValueError, asyncio.TimeoutError) as exc:
                failures.append({"provider": provider, "layer": batch.layer, "expert": batch.expert,
                                 "error": str(exc)})
                continue
            if out.shape != rows.shape:
                failures.append({"provider": provider, "layer": batch.layer, "expert": batch.expert,
                                 "error": f"returned shape {out.shape}, expected {rows.shape}"})
                continue
            used.add(provider)
            return batch.expert, np.asarray(tokens, dtype=np.int64), out
        return batch.expert, np.asarray(tokens, dtype=np.int64), None

    results = await asyncio.gather(*(run_batch(b) for b in plan.batches))
    t_exec = time.perf_counter()
    missing = [{"layer": layer, "expert": int(e), "tokens": [int(t) for t in toks]}
               for e, toks, out in results if out is None]
    if missing:
        m = missing[0]
        raise ForwardError("execution", f"every holder of expert l{m['layer']}/e{m['expert']} failed "
                           f"(tokens {m['tokens']}): {failures[-1]['error'] if failures else 'no holder'}",
                           {"missing": missing, "failures": failures})
    by_expert: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for e, toks, out in results:
        if e in by_expert:  # a split batch: join the parts, tokens ascending
            t_all = np.concatenate([by_expert[e][0], toks])
            r_all = np.concatenate([by_expert[e][1], out])
            order = np.argsort(t_all, kind="stable")
            by_expert[e] = (t_all[order], r_all[order])
        else:
            by_expert[e] = (toks, out)
    output = combine(routing, by_expert, gate.d_model)
    t_end = time.perf_counter()
    timings = {"gate": t_gate - t0, "execute": t_exec - t_gate, "combine": t_end - t_exec, "total": t_end - t0}
    return ForwardResult(output=output, routing=routing, plan=plan, holders=sorted(used), failures=failures,
                         timings_ms={k: round(v * 1e3, 3) for k, v in timings.items()})
