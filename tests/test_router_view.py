"""``router.state.Router.view``: the full shard view is built once per cached set of provider
rows and reused by every forward in the cache window; an exclusion or fresh rows build anew."""
from __future__ import annotations

import asyncio
import time

import pytest

from moe.shardmap import HoldingInfo, ProviderInfo
from router.forward import ForwardConfig
from router.state import Router

A, B = "a" * 64, "b" * 64


def infos(*providers: str) -> tuple:
    rows = [ProviderInfo(p, roles=("ExpertHolder",), holdings=tuple(HoldingInfo("m", 0, e, "Warm", 0, None)
                                                                    for e in range(4))) for p in providers]
    return rows, [(0, e) for e in range(4)]


def test_full_view_is_reused_while_the_provider_rows_are_cached():
    router = Router(ForwardConfig(view_cache_s=3600))
    router._ttl[("infos", "m")] = (time.monotonic(), infos(A, B))

    async def scene():
        first = await router.view("m", frozenset())
        assert await router.view("m", frozenset()) is first  # same rows: the same (immutable) view
        assert [h.provider for h in first.holders(0, 1)] == [A, B]
        without = await router.view("m", frozenset({A}))  # a forward that excluded a failed holder
        assert without is not first and [h.provider for h in without.holders(0, 1)] == [B]
        assert await router.view("m", frozenset()) is first  # the exclusion did not replace the full view
        router._ttl[("infos", "m")] = (time.monotonic(), infos(B))  # the rows were read again
        fresh = await router.view("m", frozenset())
        assert fresh is not first and [h.provider for h in fresh.holders(0, 1)] == [B]

    asyncio.run(scene())


def test_fresh_or_load_shares_one_read_among_concurrent_misses_and_caches_no_error():
    router = Router(ForwardConfig(view_cache_s=3600))
    reads = []

    async def load():
        reads.append(1)
        await asyncio.sleep(0.05)  # a database read on another thread
        return "served"

    async def failing():
        reads.append(1)
        await asyncio.sleep(0)
        raise LookupError("no backbone")

    async def scene():
        got = await asyncio.gather(*(router.fresh_or_load(("served", "m"), load) for _ in range(16)))
        assert got == ["served"] * 16 and len(reads) == 1  # 16 requests that missed together: one read
        assert await router.fresh_or_load(("served", "m"), load) == "served" and len(reads) == 1  # cached
        reads.clear()
        errors = await asyncio.gather(*(router.fresh_or_load(("served", "x"), failing) for _ in range(4)),
                                      return_exceptions=True)
        assert len(reads) == 1 and all(isinstance(e, LookupError) for e in errors)
        with pytest.raises(LookupError):  # the error was not cached: the next caller reads again
            await router.fresh_or_load(("served", "x"), failing)
        assert len(reads) == 2
        # A caller that goes away does not cancel the read the others wait on.
        waiter = asyncio.ensure_future(router.fresh_or_load(("served", "y"), load))
        other = asyncio.ensure_future(router.fresh_or_load(("served", "y"), load))
        await asyncio.sleep(0.01)
        waiter.cancel()
        assert await other == "served"

    asyncio.run(scene())


def test_an_expired_value_is_served_while_one_read_refreshes_it():
    ttl = 3600.0
    router = Router(ForwardConfig(view_cache_s=ttl))
    reads, gate = [], None

    async def load():
        reads.append(1)
        await gate.wait()  # the database read, held until the test lets it finish
        return "new"

    async def scene():
        nonlocal gate
        gate = asyncio.Event()
        router._ttl[("served", "m")] = (time.monotonic() - 1.5 * ttl, "old")  # expired, within the stale window
        got = await asyncio.gather(*(router.fresh_or_load(("served", "m"), load) for _ in range(8)))
        assert got == ["old"] * 8 and len(reads) == 1  # nobody waited on the read; one read refreshes
        gate.set()
        await router._loading[("served", "m")]
        assert router.fresh(("served", "m")) == "new" and await router.fresh_or_load(("served", "m"), load) == "new"
        assert len(reads) == 1
        # Past twice the cache's age the old value is not served: the caller waits for the read.
        router._ttl[("served", "m")] = (time.monotonic() - 2.5 * ttl, "ancient")
        gate = asyncio.Event()
        waiting = asyncio.ensure_future(router.fresh_or_load(("served", "m"), load))
        await asyncio.sleep(0)
        assert not waiting.done()
        gate.set()
        assert await waiting == "new" and len(reads) == 2

    asyncio.run(scene())


@pytest.mark.django_db  # the refresh runs on the DB thread (channels closes stale connections around it)
def test_view_plans_on_stale_rows_while_one_background_read_refreshes_them():
    ttl = 3600.0
    router = Router(ForwardConfig(view_cache_s=ttl))
    calls = []

    def live_infos(model_id):  # the DB read (on the DB thread), storing what it read
        calls.append(model_id)
        router._ttl[("infos", model_id)] = (time.monotonic(), infos(B))
        return infos(B)

    router.live_infos = live_infos
    router._ttl[("infos", "m")] = (time.monotonic() - 1.5 * ttl, infos(A, B))

    async def scene():
        views = [await router.view("m", frozenset()) for _ in range(3)]
        assert all([h.provider for h in v.holders(0, 1)] == [A, B] for v in views)  # the stale rows, no wait
        await router._loading[("infos", "m")]
        assert calls == ["m"]  # one refresh for the three forwards
        fresh = await router.view("m", frozenset())
        assert [h.provider for h in fresh.holders(0, 1)] == [B] and len(calls) == 1
        router._ttl[("infos", "m")] = (time.monotonic() - 2.5 * ttl, infos(A))  # too old to plan on
        assert [h.provider for h in (await router.view("m", frozenset())).holders(0, 1)] == [B]
        assert len(calls) == 2

    asyncio.run(scene())


def test_a_failed_background_refresh_is_logged_and_the_stale_value_still_served(caplog):
    ttl = 3600.0
    router = Router(ForwardConfig(view_cache_s=ttl))

    async def failing():
        raise LookupError("database gone")

    async def scene():
        router._ttl[("served", "m")] = (time.monotonic() - 1.5 * ttl, "old")
        assert await router.fresh_or_load(("served", "m"), failing) == "old"
        await asyncio.gather(router._loading[("served", "m")], return_exceptions=True)
        await asyncio.sleep(0)  # the done-callback runs
        assert ("served", "m") not in router._loading and router.fresh(("served", "m")) is None

    with caplog.at_level("WARNING", logger="router.state"):
        asyncio.run(scene())
    assert any("background refresh of ('served', 'm') failed: database gone" in r.getMessage() for r in caplog.records)
