"""Registration point for what happens after a forward (the receipts economy lives above holders).

``settlement`` sits above ``holders`` in the layers, so the router cannot call it; instead the
settlement app registers a listener here from its ``AppConfig.ready()`` and the router
(``router.state.Router``) hands every finished forward to the listeners. Listeners are async
callables ``(list[ForwardRecord]) -> None`` started as background tasks on the router's event
loop: the forward's answer never waits on them, and a failing listener is logged, never
raised into the forward. A list, because a generation hands its many layer forwards over
together (one database round per batch instead of one per layer and step).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable

from router.forward import VerifiedBatch

log = logging.getLogger(__name__)


@dataclass
class ForwardRecord:
    """A finished forward: its ``forward_id``, the model id its experts belong to (a dense
    layer's slice model for ``tenzro_moeDenseForward``), the layer and the remote,
    receipt-verified batches in arrival order."""

    forward_id: str
    model_id: str
    layer: int
    verified: list[VerifiedBatch]


Listener = Callable[[list[ForwardRecord]], Awaitable[None]]
_listeners: list[Listener] = []  # a registration point, like a Django signal's receivers


def add_forward_listener(fn: Listener) -> None:
    """Register ``fn`` to receive every finished forward (idempotent for the same function)."""
    if fn not in _listeners:
        _listeners.append(fn)


def remove_forward_listener(fn: Listener) -> None:
    """Unregister ``fn`` (no-op when it is not registered)."""
    if fn in _listeners:
        _listeners.remove(fn)


async def _run(fn: Listener, records: list[ForwardRecord]) -> None:
    try:
        await fn(records)
    except Exception:  # a listener bug must never surface in (or after) the forward
        log.exception("forward listener %r failed for forwards %s", fn, [r.forward_id for r in records])


def emit_forwards(records: list[ForwardRecord]) -> list[asyncio.Task]:
    """Start every listener on ``records`` (finished forwards, in order) in the background of
    the running event loop; nothing when ``records`` is empty. Returns the started tasks,
    which the caller keeps referenced until done (``router.state.Router``)."""
    if not _listeners or not records:
        return []
    loop = asyncio.get_running_loop()
    return [loop.create_task(_run(fn, list(records))) for fn in list(_listeners)]
