"""The agent's half of the repair pass (docs/DESIGN.md §8, reference §9): decide for itself.

On an offer from the site (``{"type": "repair"}`` frame) and on its own timer when no offer
came for 1.5 intervals (site unreachable, beat down), the agent:

1. fetches ``tenzro_moeShardMap`` of every model in the offer and every model it holds
   (keeping the last map of each, used when the site cannot be reached);
2. recomputes ``plan_repair`` from that map (with the offer's exclusions) and keeps the
   first ``max_repairs_per_pass`` rows naming itself, over all models — an offered row its
   own plan does not confirm is declined ("not in this agent's plan");
3. for each kept row, fetches the blob through ``moe.blobs.fetch_blob`` (local store,
   then the site and the holders' HTTP endpoints; BLAKE3 verified) capped at the memory
   budget still free — a row that does not fit is declined with its reason, so the site's
   next plan asks the next candidate — and loads it; the runtime's tier listener sends the
   heartbeat that advertises it;
4. drops its replicas that ``plan_release`` names it for once they have stayed surplus for
   ``release_grace_s`` (an expert that cooled: Warm → dropped after a grace period).

It returns the outcome ``{accepted, declined, released, fetched_bytes, period_key}`` that
the site records. Nothing here can be made to allocate memory by a peer: rows come from the
agent's own plan. Imports nothing from Django.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Callable

import httpx

from moe.blobs import BlobStore, fetch_blob
from moe.runtime import ExpertRuntime, RuntimeFault
from moe.content import BlobError
from moe.placement import RepairRow, plan_release, plan_repair, view_from_map

log = logging.getLogger("tenzro.repair")


class RepairWorker:
    """Runs repair passes for one agent (thread-safe: one pass at a time).

    ``site``: the site's base URL; ``provider``: this agent's id; ``runtime`` / ``store``:
    where experts are loaded and blobs kept; ``interval_s``: seconds between own passes
    (updated from each offer); ``release_grace_s``: seconds a surplus replica is kept;
    ``clock``: seconds (monotonic), for tests.
    """

    def __init__(self, site: str, provider: str, runtime: ExpertRuntime, store: BlobStore,
                 interval_s: float = 120.0, release_grace_s: float = 600.0, max_repairs: int = 2,
                 clock: Callable[[], float] = time.monotonic, http_timeout: float = 30.0):
        self.site = site.rstrip("/")
        self.provider = provider
        self.runtime = runtime
        self.store = store
        self.interval_s = float(interval_s)
        self.release_grace_s = float(release_grace_s)
        self.max_repairs = max_repairs
        self.clock = clock
        self.http_timeout = http_timeout
        self.maps: dict[str, dict] = {}  # last shard map per model (used when the site is unreachable)
        self.surplus_since: dict[tuple[str, int, int], float] = {}
        self.last_offer = clock()
        self.passes = 0
        self._lock = threading.Lock()

    # -- inputs ------------------------------------------------------------------------------
    def _fetch_map(self, client: httpx.Client, model_id: str) -> dict | None:
        try:
            resp = client.post(f"{self.site}/rpc", json={"jsonrpc": "2.0", "id": 1, "method": "tenzro_moeShardMap",
                                                        "params": {"model_id": model_id}})
            body = resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            log.info("repair: shard map of %s unavailable (%s); using the last one", model_id, exc)
            return self.maps.get(model_id)
        if not isinstance(body, dict) or not isinstance(body.get("result"), dict):
            return self.maps.get(model_id)
        self.maps[model_id] = body["result"]
        return body["result"]

    def held_models(self) -> list[str]:
        """Models this agent holds experts of (the only ones its own pass considers)."""
        return sorted({h["model_id"] for h in self.runtime.holdings()})

    # -- the pass ----------------------------------------------------------------------------
    def run_pass(self, offer: dict | None = None) -> dict:
        """One pass (see the module doc). ``offer``: the site's offer, or None for an own pass.

        Returns ``{period_key, accepted: [...], declined: [{..., reason}], released: [...],
        fetched_bytes}``. Never raises for a bad row, source or map: each is a recorded decline.
        """
        offer = offer if isinstance(offer, dict) else {}
        with self._lock:
            if offer:
                self.last_offer = self.clock()
                if isinstance(offer.get("interval_s"), int) and offer["interval_s"] > 0:
                    self.interval_s = float(offer["interval_s"])
                if isinstance(offer.get("max_repairs"), int) and offer["max_repairs"] >= 0:
                    self.max_repairs = offer["max_repairs"]
            try:
                return self._pass(offer)
            finally:
                self.passes += 1

    def _pass(self, offer: dict) -> dict:
        out = {"period_key": offer.get("period_key"), "accepted": [], "declined": [], "released": [],
               "fetched_bytes": 0}
        offered = [r for r in offer.get("rows") or () if isinstance(r, dict)]
        models = sorted({str(m) for m in offer.get("models") or () if isinstance(m, str)} | set(self.held_models()))
        excluded: dict[str, list[tuple[int, int, str]]] = {}
        for ex in offer.get("excluded") or ():
            try:
                m, layer, expert, p = ex
                excluded.setdefault(str(m), []).append((int(layer), int(expert), str(p)))
            except (TypeError, ValueError):
                continue
        catalog_uri = {(r.get("model_id"), r.get("layer"), r.get("expert")): r.get("blob_uri") for r in offered}
        mine: list[tuple[RepairRow, list[str]]] = []
        views = {}
        with httpx.Client(timeout=self.http_timeout) as client:
            for model_id in models:
                smap = self._fetch_map(client, model_id)
                if smap is None:
                    continue
                try:
                    view = view_from_map(smap)
                    views[model_id] = view
                    rows = plan_repair(view, exclude=excluded.get(model_id, ()))
                except (ValueError, KeyError, TypeError) as exc:
                    log.warning("repair: cannot plan %s from its shard map: %s", model_id, exc)
                    continue
                for r in rows:
                    if r.provider == self.provider and len(mine) < self.max_repairs:
                        endpoints = [self.site] + [h.http_endpoint.rsplit("/rpc", 1)[0]
                                                   for h in view.holders(r.layer, r.expert) if h.http_endpoint]
                        mine.append((r, endpoints))
            planned = {(r.model_id, r.layer, r.expert) for r, _ in mine}
            for r in offered:
                key = (r.get("model_id"), r.get("layer"), r.get("expert"))
                if key not in planned:
                    out["declined"].append({"model_id": key[0], "layer": key[1], "expert": key[2],
                                            "reason": "not in this agent's plan from its shard view"})
            for r, endpoints in mine:
                self._pull(r, catalog_uri.get((r.model_id, r.layer, r.expert)), endpoints, client, out)
        for view in views.values():
            self._release(view, out)
        return out

    def _pull(self, r: RepairRow, offered_uri: str | None, endpoints: list[str], client: httpx.Client,
              out: dict) -> None:
        ref = {"model_id": r.model_id, "layer": r.layer, "expert": r.expert}
        uri = r.blob_uri or offered_uri
        if self.runtime.has(r.model_id, r.layer, r.expert):
            out["declined"].append({**ref, "reason": "already held (waiting for the next heartbeat)"})
            return
        if not uri:
            out["declined"].append({**ref, "reason": "no blob source: no holder or catalog names a blob_uri"})
            return
        free = self.runtime.budget - self.runtime.memory_bytes
        if free <= 0:
            out["declined"].append({**ref, "reason": f"memory budget full ({self.runtime.budget} bytes)"})
            return
        try:
            data = fetch_blob(uri, self.store, endpoints, client=client, max_bytes=free)
        except BlobError as exc:
            reason = str(exc)
            if "more than" in reason:
                reason = f"does not fit the free memory budget ({free} bytes): {reason}"
            out["declined"].append({**ref, "reason": reason[:500]})
            return
        if len(data) > free:  # a copy already in the local store skips the download cap
            out["declined"].append({**ref, "reason": f"blob of {len(data)} bytes does not fit the free memory "
                                                     f"budget ({free} bytes)"})
            return
        try:
            self.runtime.load_expert(r.model_id, r.layer, r.expert, data, uri)
        except RuntimeFault as exc:
            out["declined"].append({**ref, "reason": f"load failed: {exc}"[:500]})
            return
        out["accepted"].append({**ref, "bytes": len(data), "blob_uri": uri})
        out["fetched_bytes"] += len(data)
        log.info("repair: pulled %s layer %d expert %d (%d bytes)", r.model_id, r.layer, r.expert, len(data))

    def _release(self, view, out: dict) -> None:
        now = self.clock()
        surplus = {(r.model_id, r.layer, r.expert) for r in plan_release(view) if r.provider == self.provider}
        for key in list(self.surplus_since):
            if key[0] == view.model_id and key not in surplus:
                del self.surplus_since[key]  # hot again, or a peer left: keep it
        for key in surplus:
            since = self.surplus_since.setdefault(key, now)
            if now - since >= self.release_grace_s and self.runtime.unload_expert(*key):
                del self.surplus_since[key]
                out["released"].append({"model_id": key[0], "layer": key[1], "expert": key[2]})

    def due(self) -> bool:
        """Whether an own pass is due: no offer for 1.5 intervals (site unreachable or no beat)."""
        return self.clock() - self.last_offer >= 1.5 * self.interval_s

    async def own_passes(self, stopping: asyncio.Event) -> None:
        """Own passes, every interval, when the site sent no offer for 1.5 intervals; returns
        once ``stopping`` is set (checked each interval). A failed pass is logged, never raised."""
        while not stopping.is_set():
            await asyncio.sleep(self.interval_s)
            if self.due():
                try:
                    outcome = await asyncio.to_thread(self.run_pass, None)
                    if outcome["accepted"] or outcome["released"]:
                        log.info("own repair pass: %s", outcome)
                except Exception:  # a failed pass must not stop the timer
                    log.exception("own repair pass failed")
