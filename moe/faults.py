"""Drill faults of a holder agent (chaos tests and benchmarks only; off by default):
``corrupt:P``, ``stall:S`` and ``blackhole``.

``corrupt:P`` perturbs the output rows of a fraction ``P`` (0 < P ≤ 1) of the agent's served
batches *before* they are signed: a signed lie, exactly what receipt sampling and audits
must catch (disputes and self-tests are answered honestly, as a cheat would). The
perturbation adds Gaussian noise of 0.5 × the row's RMS to every element, so the top
features, their values and the whole-row sketch all move. ``stall:S`` sleeps ``S`` seconds
(0 < S ≤ 3600) before every batch. ``blackhole`` is the stalling liar of issue 15: the agent
declares every expert any provider declares on the site (``GET /api/v1/holdings``) plus its
own, all Warm with ``committed_tps`` ``BLACKHOLE_TPS``, and never answers an execute
request (no reply, no error; relayed RPCs, loads and repair still work). Imports nothing
from Django.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

import numpy as np

BLACKHOLE_TPS = 1_000_000
FORMS = "corrupt:P (0 < P <= 1), stall:S (0 < S <= 3600 seconds) or blackhole"


@dataclass(frozen=True)
class Fault:
    """A parsed drill fault: ``kind`` "corrupt" (``value`` = probability), "stall" (seconds) or
    "blackhole" (``value`` 0)."""

    kind: str
    value: float

    def __str__(self) -> str:
        return self.kind if self.kind == "blackhole" else f"{self.kind}:{self.value:g}"


def parse_fault(text: str | None) -> Fault | None:
    """``"corrupt:P"`` / ``"stall:S"`` / ``"blackhole"`` → ``Fault``; None or "" → None.

    Raises ``ValueError`` with a message naming the accepted forms.
    """
    if not text:
        return None
    if text == "blackhole":
        return Fault("blackhole", 0.0)
    kind, _, raw = text.partition(":")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"--fault {text!r}: expected {FORMS}") from None
    if kind == "corrupt" and 0 < value <= 1:
        return Fault("corrupt", value)
    if kind == "stall" and 0 < value <= 3600:
        return Fault("stall", value)
    raise ValueError(f"--fault {text!r}: expected {FORMS}")


class FaultInjector:
    """Applies a ``Fault`` to served batches; ``rng`` seeds the corrupt draws (tests)."""

    def __init__(self, fault: Fault | None, rng: random.Random | None = None):
        self.fault = fault
        self.rng = rng or random.Random()
        self.corrupted = 0

    @property
    def blackhole(self) -> bool:
        """Whether execute requests are swallowed and every known expert is advertised."""
        return self.fault is not None and self.fault.kind == "blackhole"

    def advertise(self, own: list[dict], others: list[dict]) -> list[dict]:
        """Heartbeat holdings under ``blackhole``: ``own`` (the runtime's) plus ``others``
        (``{model_id, layer, expert, blob_uri}`` rows declared on the site), one per
        expert, all Warm at ``BLACKHOLE_TPS``; unchanged ``own`` for any other fault."""
        if not self.blackhole:
            return own
        out: dict[tuple, dict] = {}
        for h in [*own, *others]:
            key = (h["model_id"], int(h["layer"]), int(h["expert"]))
            out.setdefault(key, {"model_id": key[0], "layer": key[1], "expert": key[2], "residency": "Warm",
                                 "committed_tps": BLACKHOLE_TPS, "blob_uri": h.get("blob_uri")})
        return [out[k] for k in sorted(out)]

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
