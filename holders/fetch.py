"""The agent's blobs and warm-up: fetching ``tenzro://blob/<hash>`` (local store, else the
site's ``/blobs/<hash>``, BLAKE3 checked), loading an expert the site asks for, and warming
the compute kernels and each fresh expert before it is declared, so no router plans a
first-call compile inside its deadline. Imports nothing from Django.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Executor
from typing import Callable

import numpy as np

from moe.blobs import MAX_BLOB_BYTES, BlobStore, fetch_blob
from moe.compute import ComputeBackend
from moe.runtime import ExpertRuntime, RuntimeFault

log = logging.getLogger("tenzro.agent")

WARM_ROWS = 64  # above the native and numba small-batch limits: the decode + BLAS path

Key = tuple[str, int, int]


class ExpertLoader:
    """Fetches blobs and loads and warms experts for one agent.

    ``site``: the site's base URL (no trailing slash); ``store``: the local blob store;
    ``runtime``: where experts are loaded; ``backend``: the compute backend whose ``warm()``
    JIT-compiles the kernels; ``compute``: the pool warm-up batches run on (the agent's
    compute threads); ``on_change``: called (from any thread) when what may be declared
    changed, e.g. the session's heartbeat trigger. ``kernels_warm`` is set once the kernels
    compiled (or failed to).
    """

    def __init__(self, site: str, store: BlobStore, runtime: ExpertRuntime, backend: ComputeBackend,
                 compute: Executor, on_change: Callable[[], None]):
        self.site = site
        self.store = store
        self.runtime = runtime
        self.backend = backend
        self.compute = compute
        self.on_change = on_change
        self.kernels_warm = threading.Event()
        self.warming: set[Key] = set()  # loaded, warm-up batch not yet run: not declared
        self._warmed_kinds: set[str | None] = set()  # quant kinds whose large-batch path ran once

    def fetch(self, uri: str) -> bytes:
        """Blob bytes for ``tenzro://blob/<hash>``: the local store, else the site's ``/blobs/``
        (``moe.blobs.fetch_blob``: hash checked, at most ``MAX_BLOB_BYTES``).

        Raises ``BlobError`` (bad URI, hash mismatch, not served, too large).
        """
        return fetch_blob(uri, self.store, [self.site], max_bytes=MAX_BLOB_BYTES)

    def start_kernel_warmup(self, skip: bool = False) -> None:
        """JIT the quantized kernels on a daemon thread (``compute-warm``) while the agent
        connects, not on the first batch; ``skip``: only mark them warm (a ``blackhole`` drill
        agent never computes)."""
        threading.Thread(target=self.warm_kernels, args=(skip,), name="compute-warm", daemon=True).start()

    def warm_kernels(self, skip: bool = False) -> None:
        """Run ``backend.warm()`` (unless ``skip``), then set ``kernels_warm`` and call ``on_change``.
        Never raises: a failed warm-up only means the first batch compiles."""
        try:
            if hasattr(self.backend, "warm") and not skip:
                self.backend.warm()
        except Exception:  # a failed warm-up only means the first batch compiles
            log.exception("compute warm-up failed")
        finally:
            self.kernels_warm.set()
            self.on_change()

    def declarable(self, held: list[dict]) -> list[dict]:
        """``held`` (``runtime.holdings()`` rows) as they may be declared now: without the
        experts still warming, and every one Cold while the kernels compile."""
        warming = set(self.warming)
        if warming:
            held = [h for h in held if (h["model_id"], h["layer"], h["expert"]) not in warming]
        if not self.kernels_warm.is_set():
            held = [{**h, "residency": "Cold"} for h in held]
        return held

    async def load(self, header: dict) -> None:
        """A ``load`` request (``uri``, ``model_id``, ``layer``, ``expert``): fetch, load into
        the runtime, run ``warm_expert`` on the compute pool, then ``on_change``. Raises
        ``BlobError``, ``RuntimeFault``, ``KeyError`` / ``ValueError`` (a malformed header)."""
        uri = header["uri"]
        key = (str(header["model_id"]), int(header["layer"]), int(header["expert"]))
        data = await asyncio.to_thread(self.fetch, uri)
        self.warming.add(key)
        try:
            row = await asyncio.to_thread(self.runtime.load_expert, *key, data, uri)
            await asyncio.get_running_loop().run_in_executor(self.compute, self.warm_expert, key, row["d_model"])
        finally:
            self.warming.discard(key)
            self.on_change()

    def warm_expert(self, key: Key, d_model: int) -> None:
        """Unmetered warm-up batches of a freshly loaded expert before it is declared Warm: one
        row (kernel dispatch, page faults), and for the first expert of each quant kind also
        ``WARM_ROWS`` rows, the decode + BLAS path of larger batches, whose numba kernels
        compile again for read-only blob buffers (measured: 5-6 s on the first 48-row
        DeepSeek Q4_K_M batch at load 18, after ``backend.warm``). A failed batch is logged."""
        self.kernels_warm.wait(600)
        held = self.runtime._held.get(key)
        kind = held.quant if held is not None else None
        sizes = (1,) if kind in self._warmed_kinds else (1, WARM_ROWS)
        try:
            for n in sizes:
                self.runtime.execute(*key, np.zeros((n, d_model), dtype=np.float32), n, d_model, False)
            self._warmed_kinds.add(kind)
        except (RuntimeFault, ValueError) as exc:
            log.warning("warm-up batch of %s failed: %s", key, exc)
