"""What machine a benchmark ran on, and which cores it uses: shared by the bench scripts.

Pure standard library; the scripts import it as ``machine`` (this directory is ``sys.path[0]``
when a script runs).
"""
from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """CPU model name from ``/proc/cpuinfo`` (Linux), else ``platform.processor()``, else "unknown"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def parse_cpus(text: str | None) -> list[int]:
    """A CPU list such as ``"0-3,6"`` → [0, 1, 2, 3, 6]; None or "" → this process's affinity.
    Raises ``ValueError`` on a malformed list."""
    if not text:
        return sorted(os.sched_getaffinity(0))
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return sorted(set(out))
