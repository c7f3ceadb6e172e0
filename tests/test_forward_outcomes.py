"""``router.state.ForwardOutcomes``: a generation's forwards reach the forward listeners
(settlement) together, at the flush interval and at close, each exactly once."""
from __future__ import annotations

import asyncio

from router import hooks
from router.hooks import ForwardRecord
from router.state import ForwardOutcomes, Router


def rec(i: int) -> ForwardRecord:
    return ForwardRecord(f"f{i}", "m", 0, [])


def test_records_are_handed_on_in_batches_and_after_close_at_once():
    seen: list[list[str]] = []

    async def listener(records):
        seen.append([r.forward_id for r in records])

    router = Router()

    async def scene():
        o = ForwardOutcomes(router, flush_s=3600)
        o.add([], {}, rec(1))
        o.add([], {}, None)  # a failed forward: no record
        o.add([], {}, rec(2))
        await asyncio.sleep(0)
        await router.drain()
        assert seen == []  # held until the interval or close
        o.close()
        await router.drain()
        assert seen == [["f1", "f2"]]
        o.add([], {}, rec(3))  # a cancelled generation's thread finishing a forward
        await router.drain()
        assert seen == [["f1", "f2"], ["f3"]]
        o2 = ForwardOutcomes(router, flush_s=0)  # interval elapsed: every add flushes
        o2.add([], {}, rec(4))
        await router.drain()
        assert seen[-1] == ["f4"]

    hooks.add_forward_listener(listener)
    try:
        asyncio.run(scene())
    finally:
        hooks.remove_forward_listener(listener)
