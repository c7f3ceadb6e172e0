"""One BLAS thread for the products whose bits are compared (issue 24 item 1).

OpenBLAS may pick another kernel, or split a product differently, with another thread count
(on an AMD EPYC a DeepSeek-shaped layer differed by 5.96e-08 between a site with the default
threads and holders pinned to one). ``BlasPin`` runs a product with the process's BLAS libraries
set to one thread, whatever ``OPENBLAS_NUM_THREADS``, ``--blas-threads`` or a surrounding
``threadpool_limits`` say, so an expert's rows and the router's logits are the same bits on
the holders, in the site's monolithic check and in its audits. Parallelism comes from running
experts side by side (a holder's compute pool), never from splitting one product.

Pinned sections nest and may run in many threads at once: the first to enter sets one thread,
the last to leave restores what was there. Bits still depend on the BLAS kernel the CPU
selects: holders and the site compare equal on one machine (or with the same
``OPENBLAS_CORETYPE``).
"""
from __future__ import annotations

import threading

from threadpoolctl import ThreadpoolController


class BlasPin:
    """A reentrant, thread-safe "BLAS on one thread" section: ``with BlasPin.shared(): y = x @ w.T``."""

    _process: "BlasPin | None" = None  # one per process: BLAS thread counts are process-wide
    _create = threading.Lock()

    def __init__(self):
        self._lock = threading.Lock()
        self._depth = 0
        self._saved: list[tuple[object, int]] = []
        self._controllers: list | None = None

    @classmethod
    def shared(cls) -> "BlasPin":
        """The process's pin (created on first use)."""
        with cls._create:
            if cls._process is None:
                cls._process = cls()
            return cls._process

    def _blas(self) -> list:
        # Found on first use: numpy (and its BLAS) is loaded by the time a product runs.
        if self._controllers is None:
            self._controllers = [c for c in ThreadpoolController().lib_controllers if c.user_api == "blas"]
        return self._controllers

    def depth(self) -> int:
        """Pinned sections open now (tests)."""
        return self._depth

    def __enter__(self) -> "BlasPin":
        with self._lock:
            if self._depth == 0:
                self._saved = [(c, c.get_num_threads()) for c in self._blas()]
                for c, n in self._saved:
                    if n != 1:
                        c.set_num_threads(1)
            self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                for c, n in self._saved:
                    if n != 1:
                        c.set_num_threads(n)
                self._saved = []
