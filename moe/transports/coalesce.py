"""Request coalescing for the router's transports: the batches sent to one holder in the same
event-loop turn travel in one message.

A forward starts one task per planned batch together, so their ``send`` calls reach the
transport in the same loop iteration. ``Coalescer.submit`` queues each request under its
destination key and flushes the queue one loop turn later (``loop.call_soon``): a queue of one
goes out as before (``send_one``), a longer one as one message (``send_many``) whose per-request
outcomes resolve each caller's future on its own, so one failing sub-request fails only itself
and each caller keeps its own deadline (cancelling a caller's wait cancels only its future; the
shared exchange is cancelled when every caller has stopped waiting).

``TENZRO_COALESCE=0`` turns it off (every request alone), for before/after measurements;
``TENZRO_MESSAGE_RECEIPTS=0`` keeps one signed receipt per request inside a coalesced message.
Pure asyncio; imports nothing from Django.
"""
from __future__ import annotations

import asyncio
import os
from typing import Awaitable, Callable, Generic, Hashable, TypeVar

Req = TypeVar("Req")
Ans = TypeVar("Ans")

# send_many(requests) -> one outcome per request, in order: its answer or the exception it raises.
# A streaming transport's send_many(requests, deliver) also calls deliver(index, outcome) as each
# answer arrives, so its caller resumes before the rest of the message is in.
SendMany = Callable[..., Awaitable[list]]

MAX_GROUP = 64  # requests per message: bounds one message's size and one holder's queue


def stream_answers() -> bool:
    """Whether a coalesced message asks the holder to answer request by request as each finishes
    (``TENZRO_STREAM_ANSWERS``, default 1; read at each call so a bench can flip it)."""
    return os.environ.get("TENZRO_STREAM_ANSWERS", "1").strip().lower() not in ("0", "false", "no", "off")


def message_receipts() -> bool:
    """Whether a coalesced message asks the holder for one message receipt instead of one signed
    receipt per request (``TENZRO_MESSAGE_RECEIPTS``, default 1; read at each call so a bench can
    flip it; ``moe.receipts`` describes both forms)."""
    return os.environ.get("TENZRO_MESSAGE_RECEIPTS", "1").strip().lower() not in ("0", "false", "no", "off")


def enabled() -> bool:
    """Whether coalescing is on (``TENZRO_COALESCE``, default 1; read at each call so a bench can flip it;
    ``Coalescer.submit`` reads it once per destination and loop turn)."""
    return os.environ.get("TENZRO_COALESCE", "1").strip().lower() not in ("0", "false", "no", "off")


class Coalescer(Generic[Req, Ans]):
    """Per-destination queues of requests flushed once per loop turn. One per event loop and
    transport client (the queues hold that loop's futures)."""

    def __init__(self):
        self._queues: dict[Hashable, list[tuple[Req, asyncio.Future]]] = {}
        self._tasks: set[asyncio.Task] = set()

    async def submit(self, key: Hashable, req: Req, send_one: Callable[[Req], Awaitable[Ans]],
                     send_many: SendMany, streaming: bool = False) -> Ans:
        """Send ``req`` to destination ``key``: alone via ``send_one(req)`` when coalescing is off
        or nothing else for ``key`` arrives this turn, else with the others via
        ``send_many(requests)`` (``send_many(requests, deliver)`` when ``streaming``: an outcome
        delivered early resolves its caller at once). Returns its answer or raises its own
        exception (whatever ``send_one``/``send_many`` raise or return as its outcome)."""
        loop = asyncio.get_running_loop()
        queue = self._queues.get(key)
        if queue is None:
            # The switch is read once per destination and loop turn, not per request: the
            # environment read cost more than the rest of a submit.
            if not enabled():
                return await send_one(req)
            queue = self._queues[key] = []
            loop.call_soon(self._flush, key, send_one, send_many, streaming)
        fut = loop.create_future()
        queue.append((req, fut))
        if len(queue) >= MAX_GROUP:
            self._queues.pop(key)
            self._start(queue, send_one, send_many, streaming)
        return await fut

    def _flush(self, key: Hashable, send_one, send_many, streaming: bool) -> None:
        queue = self._queues.pop(key, None)
        if queue:
            self._start(queue, send_one, send_many, streaming)

    def _start(self, queue: list, send_one, send_many, streaming: bool) -> None:
        reqs = [r for r, _ in queue]
        futs = [f for _, f in queue]

        def deliver(i: int, out) -> None:
            f = futs[i]
            if f.done():
                return
            if isinstance(out, BaseException):
                f.set_exception(out)
            else:
                f.set_result(out)

        if len(reqs) == 1:
            coro = send_one(reqs[0])
        else:
            coro = send_many(reqs, deliver) if streaming else send_many(reqs)
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)

        def settle(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            if t.cancelled():
                outcomes = [asyncio.CancelledError()] * len(futs)
            elif t.exception() is not None:
                outcomes = [t.exception()] * len(futs)
            else:
                outcomes = t.result() if len(futs) > 1 else [t.result()]
            for f, out in zip(futs, outcomes):
                if f.done():
                    continue
                if isinstance(out, asyncio.CancelledError):
                    f.cancel()
                elif isinstance(out, BaseException):
                    f.set_exception(out)
                else:
                    f.set_result(out)

        def abandoned(_f: asyncio.Future) -> None:
            # Every caller has its answer or stopped waiting; cancel only when one stopped (a
            # stream whose answers all arrived is still reading its end, which keeps the connection).
            if not task.done() and all(f.done() for f in futs) and any(f.cancelled() for f in futs):
                task.cancel()

        task.add_done_callback(settle)
        for f in futs:
            f.add_done_callback(abandoned)
