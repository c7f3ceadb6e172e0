"""What machine a benchmark ran on, which cores it uses, and argparse types: shared by the bench scripts.

Pure standard library; the scripts import it as ``machine`` (this directory is ``sys.path[0]``
when a script runs).
"""
from __future__ import annotations

import argparse
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
    Raises ``ValueError`` on a malformed list or a CPU this process may not run on."""
    if not text:
        return sorted(os.sched_getaffinity(0))
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        try:
            out.extend(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise ValueError(f"--cpus must look like 0-3,6; got {text!r}") from None
    allowed = os.sched_getaffinity(0)
    if not out or not set(out) <= allowed:
        raise ValueError(f"--cpus {text!r}: this process may run on CPUs {sorted(allowed)} only")
    return sorted(set(out))


def int_at_least(low: int):
    """An argparse ``type``: an integer >= ``low`` (argparse names the flag in its error)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {n}")
        return n
    return parse


def int_list(low: int):
    """An argparse ``type``: a comma list of integers >= ``low``, such as ``2,4``."""
    one = int_at_least(low)

    def parse(text: str) -> list[int]:
        values = [one(v) for v in text.split(",") if v.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}")
        return values
    return parse


# The machine class each native-kernel SIMD path stands for (moe.kernels: TENZRO_KERNEL_ISA).
KERNEL_CLASSES = {"avx512vnni": "AVX-512 VNNI", "avxvnni": "AVX2-only", "avx2": "AVX2-only",
                  "neondot": "ARM NEON", "neon": "ARM NEON", "portable": "portable"}


def kernel_class(isa: str | None) -> str:
    """The machine class of a SIMD path: ``AVX-512 VNNI``, ``AVX2-only`` (avx2, avxvnni), ``ARM NEON``,
    ``portable``, or ``no native kernels`` for None."""
    return KERNEL_CLASSES.get(isa, "no native kernels") if isa else "no native kernels"


def cpu_seconds(info: dict) -> dict[str, float]:
    """User + system CPU seconds so far of the cluster's processes by part (``sites``, ``agents``,
    ``balancer``, ``celery``), from ``/proc/<pid>/stat``; a process that is gone counts 0."""
    tick = os.sysconf("SC_CLK_TCK")
    parts = {"sites": info["site_pids"], "agents": [a["pid"] for a in info["agents"]],
             "balancer": [info["balancer_pid"]] if info.get("balancer_pid") else [],
             "celery": info.get("celery_pids") or []}
    out = {}
    for part, pids in parts.items():
        total = 0.0
        for pid in pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        out[part] = total
    return out
