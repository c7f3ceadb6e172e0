"""Expert execute at the Qwen3-30B-A3B expert shape (d_model 2048, d_ff 768), dense and quantized.

Usage:  .venv/bin/python bench/bench_expert.py [--batches 1,8,64,512] [--repeat 7] [--experts 4]

For each batch size it times ``holders.ffn.expert_forward`` (the compute seam, selected
backend) on dense float32 weights, on Q8_0 weights and on Q4_K_M weights (gate/up Q4_K,
down Q6_K, llama.cpp's preset), and a plain numpy float32 pipeline of the same shapes
(``x@Wg.T``, ``x@Wu.T``, silu·mul, ``@Wd.T``) in the same run. Calls cycle over
``--experts`` distinct experts so that weights come from memory rather than the CPU cache,
as they do on a holder; variants are timed round-robin and the best of ``--repeat`` rounds
is kept (the machine is shared; the median is printed too). Ratios are throughput against
numpy (>1 = faster) and the issue's goals are checked: dense ≥ 0.95× numpy at batch 512;
Q4_K_M ≥ 0.8× dense throughput at batch 512 and ≤ 0.5× dense latency at batch 1.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

# --threads must reach OpenBLAS and numba before they load.
for _i, _a in enumerate(sys.argv):
    _n = sys.argv[_i + 1] if _a == "--threads" and _i + 1 < len(sys.argv) else \
        _a.split("=", 1)[1] if _a.startswith("--threads=") else None
    if _n:
        for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
            os.environ[_v] = _n

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from holders import compute  # noqa: E402
from holders.ffn import ExpertWeights, expert_forward  # noqa: E402
from holders.quant import QuantizedMatrix, quantize  # noqa: E402

PRESETS = {"q8_0": ("q8_0", "q8_0", "q8_0"), "q4_k_m": ("q4_k", "q4_k", "q6_k")}


def numpy_pipeline(wg: np.ndarray, wu: np.ndarray, wd: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The baseline: plain numpy float32 SwiGLU of the same shapes."""
    g = x @ wg.T
    u = x @ wu.T
    return (g / (np.float32(1) + np.exp(-g)) * u) @ wd.T


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--d-ff", type=int, default=768)
    ap.add_argument("--batches", default="1,8,64,512")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--experts", type=int, default=4, help="distinct experts cycled through (defeats CPU caches)")
    ap.add_argument("--backend", default=None, help="compute backend (auto, cpu, cuda)")
    ap.add_argument("--threads", type=int, default=None, help="BLAS and numba threads (default: all cores)")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    be = compute.select_backend(args.backend)
    compute.set_backend(be)
    rng = np.random.default_rng(0)
    h, f = args.d_model, args.d_ff

    dense, quant = [], {p: [] for p in PRESETS}
    for _ in range(args.experts):
        wg, wu = (rng.standard_normal((f, h), dtype=np.float32) * 0.02 for _ in range(2))
        wd = rng.standard_normal((h, f), dtype=np.float32) * 0.02
        dense.append(ExpertWeights(wg, wu, wd))
        for p, kinds in PRESETS.items():
            mats = [QuantizedMatrix(k, w.shape, quantize(w, k)) for k, w in zip(kinds, (wg, wu, wd))]
            quant[p].append(ExpertWeights(*mats))

    variants = {"numpy f32": lambda i, x: numpy_pipeline(dense[i].gate_proj, dense[i].up_proj, dense[i].down_proj, x),
                "dense": lambda i, x: expert_forward(dense[i], x)}
    for p in PRESETS:
        variants[p] = (lambda ws: lambda i, x: expert_forward(ws[i], x))(quant[p])

    print(f"expert {h}x{f} (gate/up [{f},{h}], down [{h},{f}]), backend {be.tag}, {args.experts} experts cycled, "
          f"best of {args.repeat}, threads {os.environ.get('OPENBLAS_NUM_THREADS', 'all')}")
    print(f"{'batch':>6} {'variant':>10} {'best ms':>9} {'median ms':>10} {'tok/s':>10} {'vs numpy':>9}")
    best: dict[tuple[int, str], float] = {}
    for n in batches:
        x = rng.standard_normal((n, h), dtype=np.float32)
        times = {v: [] for v in variants}
        for fn in variants.values():  # warm-up: JIT, allocations
            fn(0, x)
        for r in range(args.repeat):
            for v, fn in variants.items():
                i = r % args.experts
                t0 = time.perf_counter()
                fn(i, x)
                times[v].append(time.perf_counter() - t0)
        base = min(times["numpy f32"])
        for v, ts in times.items():
            best[(n, v)] = min(ts)
            print(f"{n:>6} {v:>10} {min(ts) * 1e3:>9.3f} {statistics.median(ts) * 1e3:>10.3f} "
                  f"{n / min(ts):>10.0f} {base / min(ts):>8.2f}x")

    def goal(text: str, value: float, ok: bool) -> None:
        print(f"goal {text}: {value:.2f} {'met' if ok else 'MISSED'}")

    print()
    if 512 in batches:
        r = best[(512, "numpy f32")] / best[(512, "dense")]
        goal("dense throughput / numpy at batch 512 >= 0.95", r, r >= 0.95)
        r = best[(512, "dense")] / best[(512, "q4_k_m")]
        goal("Q4_K_M throughput / dense at batch 512 >= 0.8", r, r >= 0.8)
    if 1 in batches:
        r = best[(1, "q4_k_m")] / best[(1, "dense")]
        goal("Q4_K_M latency / dense at batch 1 <= 0.5", r, r <= 0.5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
