"""The fixed-order dense product (``moe.rowwise.matmul_xt``) against numpy's BLAS ``x @ w.T``.

Usage:  .venv/bin/python bench/bench_rowwise.py [--threads 1,2] [--repeat 7]

Shapes ``out × in × rows``: a Qwen3-30B-A3B expert (768 × 2048 and 2048 × 768) and a 2048 × 2048
projection at 1, 16 and 256 rows, the DeepSeek-shaped expert of issue 24 (256 × 256 at 64 rows)
and a one-row 256 × 7168 gate. Per thread count (``TENZRO_KERNEL_THREADS``-like ``threads`` for
ours, ``threadpoolctl`` for OpenBLAS), the best of ``--repeat`` alternated runs of each; prints
ms and the ratio ours / BLAS, plus whether BLAS's own bits changed with the thread count (ours
never do: each output is one thread's fixed-order sum). CPU: the model name from /proc/cpuinfo.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import cpu_model  # noqa: E402  (this directory is sys.path[0] when run as a script)
from moe import rowwise  # noqa: E402

SHAPES = [(768, 2048, 1), (768, 2048, 16), (2048, 768, 16), (2048, 2048, 1), (2048, 2048, 16), (2048, 2048, 256),
          (256, 256, 64), (256, 7168, 1)]


def best(f, repeat: int) -> float:
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return min(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()
    threads = [int(t) for t in a.threads.split(",")]
    print(f"cpu: {cpu_model()}; native: {rowwise.available()}")
    rng = np.random.default_rng(0)
    for m, k, n in SHAPES:
        w = rng.standard_normal((m, k), dtype=np.float32)
        x = rng.standard_normal((n, k), dtype=np.float32)
        rowwise.matmul_xt(x, w, threads=1)  # JIT / first touch
        cells, blas_bits = [], set()
        for t in threads:
            with threadpool_limits(t):
                ours = best(lambda: rowwise.matmul_xt(x, w, threads=t), a.repeat)
                blas = best(lambda: x @ w.T, a.repeat)
                blas_bits.add((x @ w.T).tobytes())
            cells.append(f"{t} thr: ours {ours:8.3f} ms  BLAS {blas:8.3f} ms  ratio {ours / blas:5.2f}")
        print(f"{m:>5} x {k:>5} x {n:>3}  " + " | ".join(cells) +
              f"  | BLAS bits {'differ' if len(blas_bits) > 1 else 'same'} across threads")


if __name__ == "__main__":
    main()
