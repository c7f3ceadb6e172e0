"""Single-thread throughput of moe.quant (GGUF Q8_0 / Q4_K / Q6_K).

Usage:  .venv/bin/python bench/bench_quant.py [--rows 768] [--cols 2048] [--repeat 5]

Default shape is one Qwen3-30B-A3B expert projection (768 x 2048).  For each
type it times quantize (f32 -> blocks) and dequantize (blocks -> f32), reports
parameters per second (best of --repeat runs, and the median) and the time as a
multiple of a plain numpy float32 copy of the same array timed in the same run
(``np.copyto`` into a preallocated buffer), so numbers from different machines
can be compared.  Numpy's element-wise kernels are single-threaded; the BLAS
thread variables are pinned to 1 and, where the OS allows it, the process is
pinned to one CPU.
"""
from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
           "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe import quant  # noqa: E402


def _times(fn, repeat: int) -> list[float]:
    fn()  # warm up (allocations, caches)
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=768)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-pin", action="store_true", help="do not pin the process to one CPU")
    args = ap.parse_args(argv)

    pinned = "no"
    if not args.no_pin and hasattr(os, "sched_setaffinity"):
        try:
            cpu = sorted(os.sched_getaffinity(0))[0]
            os.sched_setaffinity(0, {cpu})
            pinned = f"cpu {cpu}"
        except OSError:
            pass

    rng = np.random.default_rng(args.seed)
    # weight-like values: bf16-representable normal(0, 0.02)
    x = (rng.standard_normal((args.rows, args.cols)) * 0.02).astype(np.float32)
    x = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    n = x.size
    buf = np.empty_like(x)

    print(f"moe.quant bench: {args.rows}x{args.cols} f32 ({n / 1e6:.2f} M params), "
          f"numpy {np.__version__}, single thread (pinned: {pinned}), best/median of {args.repeat}")
    copy_t = _times(lambda: np.copyto(buf, x), max(args.repeat, 20))
    copy_best = min(copy_t)
    print(f"{'f32 copy (baseline)':28s} {n / copy_best / 1e6:10.1f} Mparam/s"
          f"  ({copy_best * 1e3:.3f} ms)")
    header = f"{'operation':28s} {'best Mparam/s':>14s} {'median':>9s} {'ms':>9s} {'x copy':>8s}"
    print(header)
    print("-" * len(header))
    for qt in quant.QTYPES:
        q = quant.quantize(x, qt)
        rows = [
            (f"quantize {qt}", lambda qt=qt: quant.quantize(x, qt)),
            (f"dequantize {qt}", lambda qt=qt, q=q: quant.dequantize(q, qt, x.shape)),
            (f"dequantize_rows {qt}", lambda qt=qt, q=q: quant.dequantize_rows(q, qt)),
        ]
        if qt == "q8_0":
            rows.insert(1, ("quantize_q8_0_rows", lambda: quant.quantize_q8_0_rows(x)))
        for name, fn in rows:
            ts = _times(fn, args.repeat)
            best, med = min(ts), statistics.median(ts)
            print(f"{name:28s} {n / best / 1e6:14.2f} {n / med / 1e6:9.2f} {best * 1e3:9.2f}"
                  f" {best / copy_best:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
