"""Drill faults of a holder agent (chaos tests only; off by default): ``corrupt:P`` and ``stall:S``.

``corrupt:P`` perturbs the output rows of a fraction ``P`` (0 < P ≤ 1) of the agent's served
batches *before* they are signed: a signed lie, exactly what receipt sampling and audits
must catch (disputes and self-tests are answered honestly, as a cheat would). The
perturbation adds Gaussian noise of 0.5 × the row's RMS to every element, so the top
features, their values and the whole-row sketch all move. ``stall:S`` sleeps ``S`` seconds
(0 < S ≤ 3600) before every batch. Imports nothing from Django.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Fault:
    """A parsed drill fault: ``kind`` "corrupt" (``value`` = probability) or "stall" (seconds)."""

    kind: str
    value: float

    def __str__(self) -> str:
        return f"{self.kind}:{self.value:g}"


def parse_fault(text: str | None) -> Fault | None:
    """``"corrupt:P"`` / ``"stall:S"`` → ``Fault``; None or "" → None.

    Raises ``ValueError`` with a message naming the accepted forms.
    """
    if not text:
        return None
    kind, _, raw = text.partition(":")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"--fault {text!r}: expected corrupt:P (0 < P <= 1) or stall:S (seconds)") from None
    if kind == "corrupt" and 0 < value <= 1:
        return Fault("corrupt", value)
    if kind == "stall" and 0 < value <= 3600:
        return Fault("stall", value)
    raise ValueError(f"--fault {text!r}: expected corrupt:P (0 < P <= 1) or stall:S (0 < S <= 3600 seconds)")


class FaultInjector:
    """Applies a ``Fault`` to served batches; ``rng`` seeds the corrupt draws (tests)."""

    def __init__(self, fault: Fault | None, rng: random.Random | None = None):
        self.fault = fault
        self.rng = rng or random.Random()
        self.corrupted = 0

    def before_batch(self) -> None:
        """Sleep for ``stall:S`` (called on the compute thread, before executing)."""
        if self.fault is not None and self.fault.kind == "stall":
            time.sleep(self.fault.value)

    def corrupt(self, rows: np.ndarray) -> np.ndarray | None:
        """For ``corrupt:P``, with probability P: perturbed copy f32 ``[n, H]`` of ``rows``; else None."""
        if self.fault is None or self.fault.kind != "corrupt" or self.rng.random() >= self.fault.value:
            return None
        rows = np.asarray(rows, dtype=np.float32)
        rms = np.sqrt(np.mean(rows.astype(np.float64) ** 2, axis=1, keepdims=True)) + 1e-6
        noise = np.random.default_rng(self.rng.getrandbits(64)).standard_normal(rows.shape)
        self.corrupted += 1
        return (rows + 0.5 * rms * noise).astype(np.float32)
