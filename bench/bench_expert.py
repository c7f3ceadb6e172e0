"""Expert execute at the Qwen3-30B-A3B expert shape (d_model 2048, d_ff 768): dense, Q8_0, Q4_K_M vs numpy f32.

Usage:  .venv/bin/python bench/bench_expert.py [--batches 1,8,64,512] [--repeat 7] [--threads 1,all] [--switch]

For every batch size, thread setting (one thread; all cores) and cache state it times
``moe.ffn.expert_forward`` (the compute seam, selected backend) on dense float32 weights,
Q8_0 weights and Q4_K_M weights (gate/up Q4_K, down Q6_K, llama.cpp's preset) against a plain
numpy float32 SwiGLU of the same shape (``x@Wg.T``, ``x@Wu.T``, silu·mul, ``@Wd.T``) measured
in the same run. ``hot``: one expert, called again and again (weights in cache: an untimed call
before each timed round, as the variants run in between stream more than an LLC). ``cold``:
enough copies of the expert cycled to exceed twice the last-level cache (its size is printed),
so weights stream from memory, as on a holder serving many experts (at most ``--max-cold-experts``
copies: a variant the cap keeps under 2 x LLC is flagged "NOT cold" above its table). Variants run round-robin;
the best of ``--repeat`` rounds is kept (the machine is shared) and the ratio printed is
time / numpy time (lower is better). ``--clock cpu`` (one thread only) times the calling thread's
CPU time instead of wall time: on a machine shared with other jobs time slicing then drops out.

The machine class (``bench/machine.py``: the native kernels' SIMD path, ``TENZRO_KERNEL_ISA`` to
force one) is printed with the goals that apply (issue 25; hot, one thread): AVX-512 VNNI Q4_K_M
batch 1 <= 0.28, Q8_0 <= 0.36; AVX2-only (avx2, avxvnni) <= 0.50 / 0.45; batch 512 <= 1.0 on both.
To measure the AVX2 class on a CPU that has AVX-512, force the path and numpy's AVX2 SGEMM too:
``TENZRO_KERNEL_ISA=avx2 OPENBLAS_CORETYPE=Haswell``.

``--switch`` also times the native integer kernel against decode + BLAS on one matrix for a
range of batch sizes: the crossover is the CPU backend's ``TENZRO_QUANT_NATIVE_BATCH`` on the
one-row paths (portable, NEON); the x86 paths run every batch natively.

OpenBLAS reads OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE at load; to measure against numpy's own
kernel selection unset them for this command (``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE``);
the BLAS kernel in use is printed (threadpoolctl).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import numba
import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe import compute, kernels  # noqa: E402
from moe.compute.cpu import dequantize_matrix  # noqa: E402
from moe.ffn import ExpertWeights, expert_forward  # noqa: E402
from moe.quant import QuantizedMatrix, quantize  # noqa: E402
from machine import cpu_model, int_at_least, kernel_class  # noqa: E402  (this directory is sys.path[0] when run as a script)

PRESETS = {"q8_0": ("q8_0", "q8_0", "q8_0"), "q4_k_m": ("q4_k", "q4_k", "q6_k")}
# Issue 25's goals per machine class: time / numpy f32, hot, one thread (batch 1 per preset; batch 512).
GOALS = {"AVX-512 VNNI": {"q4_k_m": 0.28, "q8_0": 0.36}, "AVX2-only": {"q4_k_m": 0.50, "q8_0": 0.45}}
GOAL_512 = 1.0
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def numpy_pipeline(wg: np.ndarray, wu: np.ndarray, wd: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The baseline: plain numpy float32 SwiGLU of the same shapes."""
    g = x @ wg.T
    u = x @ wu.T
    return (g / (np.float32(1) + np.exp(-g)) * u) @ wd.T




def llc_bytes() -> int:
    """Size of the last-level cache in bytes (sysfs, the highest cache index of cpu0); 32 MiB if unknown."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    best = (0, 32 << 20)
    for d in base.glob("index*"):
        try:
            level = int((d / "level").read_text())
            size = (d / "size").read_text().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1], 1)
        nbytes = int(size.rstrip("KMG")) * mult
        if level >= best[0]:
            best = (level, nbytes)
    return best[1]


def expert_bytes(e: ExpertWeights) -> int:
    """Bytes of weights one expert call reads."""
    return sum(m.nbytes for m in (e.gate_proj, e.up_proj, e.down_proj))


def copies(e: ExpertWeights, k: int) -> list[ExpertWeights]:
    """``k`` experts with the same values in distinct memory (the cache sees different lines)."""
    def cp(m):
        return QuantizedMatrix(m.qtype, m.shape, m.blocks.copy()) if isinstance(m, QuantizedMatrix) else m.copy()
    return [e] + [ExpertWeights(cp(e.gate_proj), cp(e.up_proj), cp(e.down_proj)) for _ in range(k - 1)]


def under_llc(experts: dict[str, list], llc: int) -> list[str]:
    """Variants whose cycled experts together stay below twice the last-level cache (``llc`` bytes):
    their "cold" rows still hit the cache (``--max-cold-experts`` capped the copies)."""
    return [k for k, es in experts.items() if len(es) * expert_bytes(es[0]) < 2 * llc]


def set_threads(n: int) -> threadpool_limits:
    """BLAS, numba and the native kernels' row threads to ``n``; returns the BLAS limiter to keep alive."""
    numba.set_num_threads(n)
    os.environ["TENZRO_KERNEL_THREADS"] = str(n)
    return threadpool_limits(limits=n)


def run_table(experts: dict[str, list], batches: list[int], repeat: int, rng,
              clock=time.perf_counter) -> dict[tuple[int, str], float]:
    """Round-robin timing of every variant (``clock``: seconds); returns best seconds per (batch,
    variant) and prints a table."""
    h = experts["dense"][0].d_model
    fns = {"numpy f32": lambda e, x: numpy_pipeline(e.gate_proj, e.up_proj, e.down_proj, x)}
    fns.update({v: (lambda e, x: expert_forward(e, x)) for v in experts if v != "numpy"})
    pool = {"numpy f32": experts["numpy"], **{v: experts[v] for v in experts if v != "numpy"}}
    best: dict[tuple[int, str], float] = {}
    for n in batches:
        x = rng.standard_normal((n, h), dtype=np.float32)
        times = {v: [] for v in fns}
        for v, fn in fns.items():
            fn(pool[v][0], x)  # warm-up
        reps = max(3, repeat if n <= 64 else repeat // 2)
        for r in range(reps):
            for v, fn in fns.items():
                es = pool[v]
                calls = len(es) if len(es) > 1 else 4
                if len(es) == 1:  # hot: the variants run in between (two f32 copies) streamed past the LLC
                    fn(es[0], x)
                t0 = clock()
                for c in range(calls):
                    fn(es[(r + c) % len(es)], x)
                times[v].append((clock() - t0) / calls)
        base = min(times["numpy f32"])
        for v, ts in times.items():
            best[(n, v)] = min(ts)
            print(f"{n:>6} {v:>10} {min(ts) * 1e3:>9.3f} {n / min(ts):>10.0f} {min(ts) / base:>7.2f}")
    return best


def switch_table(h: int, f: int, rng) -> None:
    """Native kernel vs decode + BLAS on one [f, h] matrix per quant type, one thread, hot."""
    print("\nswitch point, one thread, one hot [%d, %d] matrix: native kernel / (decode + BLAS) time" % (f, h))
    w = rng.standard_normal((f, h), dtype=np.float32) * 0.02
    mats = {q: QuantizedMatrix(q, w.shape, quantize(w, q)) for q in ("q8_0", "q4_k", "q6_k")}
    print(f"{'batch':>6} " + " ".join(f"{q:>8}" for q in mats))
    for n in (8, 16, 24, 32, 48, 64, 96, 128):
        x = rng.standard_normal((n, h), dtype=np.float32)
        cells = []
        for m in mats.values():
            tn = min(_timed(lambda x=x, m=m: kernels.matmul_xt(x, m, threads=1)) for _ in range(7))
            td = min(_timed(lambda x=x, m=m: x @ dequantize_matrix(m).T) for _ in range(7))
            cells.append(f"{tn / td:>8.2f}")
        print(f"{n:>6} " + " ".join(cells))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _row_length(text: str) -> int:
    """argparse type: a positive multiple of 256 (Q4_K / Q6_K super-block; every matrix row is quantized)."""
    v = int_at_least(1)(text)
    if v % 256:
        raise argparse.ArgumentTypeError(f"must be a multiple of 256 (the Q4_K/Q6_K super-block), got {v}")
    return v


def _batches(text: str) -> list[int]:
    """argparse type: comma list of positive batch sizes, e.g. ``1,8,64,512``."""
    return [int_at_least(1)(b) for b in text.split(",")]


def _threads(text: str) -> list[str]:
    """argparse type: comma list of thread settings, each ``all`` or 1..cores of this process."""
    cores = len(os.sched_getaffinity(0))
    out = []
    for t in text.split(","):
        if t != "all":
            n = int_at_least(1)(t)
            if n > cores:
                raise argparse.ArgumentTypeError(f"{n} threads but this process may use {cores} cores")
        out.append(t)
    return out


def _caches(text: str) -> list[str]:
    """argparse type: comma list of ``hot`` / ``cold``."""
    out = text.split(",")
    bad = [c for c in out if c not in ("hot", "cold")]
    if bad:
        raise argparse.ArgumentTypeError(f"expected hot and/or cold, got {bad[0]!r}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=_row_length, default=2048, help="multiple of 256 (default 2048)")
    ap.add_argument("--d-ff", type=_row_length, default=768, help="multiple of 256 (default 768)")
    ap.add_argument("--batches", type=_batches, default="1,8,64,512", help="comma list of batch sizes")
    ap.add_argument("--repeat", type=int_at_least(1), default=7, help="rounds per variant (at least 3 run)")
    ap.add_argument("--threads", type=_threads, default="1,all", help="thread settings to run, e.g. 1,all")
    ap.add_argument("--cache", type=_caches, default="hot,cold", help="hot (one expert), cold (cycle past the LLC)")
    ap.add_argument("--max-cold-experts", type=int_at_least(2), default=48,
                    help="most expert copies cycled when cold (at least 2)")
    ap.add_argument("--switch", action="store_true", help="also measure the native-kernel / decode+BLAS switch point")
    ap.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                    help="wall time, or cpu: this thread's CPU time (one thread only; a shared machine's time slicing drops out)")
    args = ap.parse_args(argv)
    if args.clock == "cpu" and args.threads != ["1"]:
        ap.error("--clock cpu times the calling thread only: use it with --threads 1")
    batches = args.batches
    be = compute.select_backend("cpu")
    compute.set_backend(be)
    rng = np.random.default_rng(0)
    h, f = args.d_model, args.d_ff
    cores = len(os.sched_getaffinity(0))
    llc = llc_bytes()

    wg, wu = (rng.standard_normal((f, h), dtype=np.float32) * 0.02 for _ in range(2))
    wd = rng.standard_normal((h, f), dtype=np.float32) * 0.02
    base = {"numpy": ExpertWeights(wg, wu, wd), "dense": ExpertWeights(wg.copy(), wu.copy(), wd.copy())}
    for p, kinds in PRESETS.items():
        base[p] = ExpertWeights(*[QuantizedMatrix(k, w.shape, quantize(w, k)) for k, w in zip(kinds, (wg, wu, wd))])

    blas = [f"{i.get('internal_api')} {i.get('version')} {i.get('architecture')}" for i in threadpool_info()
            if i.get("user_api") == "blas"]
    print(f"CPU {cpu_model()}, {cores} cores, LLC {llc / 2**20:.0f} MiB; native kernels: "
          f"{kernels.isa() or 'not built'} (supported {', '.join(kernels.supported_isas()) or '-'}); "
          f"BLAS {'; '.join(blas)}; OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '')!r}")
    klass = kernel_class(kernels.isa())
    best = kernel_class(kernels.supported_isas()[-1]) if kernels.supported_isas() else klass
    goal = GOALS.get(klass)
    print(f"machine class: {klass} (SIMD path {kernels.isa() or '-'}); goals: "
          + (", ".join(f"{p} batch 1 <= {g}" for p, g in goal.items()) + f", batch 512 <= {GOAL_512}"
             if goal else "none for this class (speed is claimed only where measured)"))
    if best != klass:
        print(f"  NOTE: the {klass} path forced (TENZRO_KERNEL_ISA) on a CPU of class {best}: these are an {klass} "
              f"CPU's kernels measured on this CPU"
              + ("" if os.environ.get("OPENBLAS_CORETYPE") else
                 "; numpy keeps this CPU's SGEMM (OPENBLAS_CORETYPE=Haswell gives it an AVX2 CPU's)"))
    print(f"clock: {args.clock}")
    sizes = ", ".join(f"{k} {expert_bytes(e) / 2**20:.1f} MiB" for k, e in base.items() if k != "numpy")
    print(f"expert {h}x{f}; bytes per expert: {sizes}")
    results = {}
    for tset in args.threads:
        nt = cores if tset == "all" else int(tset)
        limiter = set_threads(nt)
        for cache in args.cache:
            if cache == "hot":
                experts = {k: [e] for k, e in base.items()}
            else:
                experts = {k: copies(e, min(args.max_cold_experts, max(2, math.ceil(2 * llc / expert_bytes(e)))))
                           for k, e in base.items()}
            print(f"\n{cache}, {nt} thread(s), experts cycled: "
                  + ", ".join(f"{k} {len(v)}" for k, v in experts.items()))
            if cache == "cold" and (short := under_llc(experts, llc)):
                print(f"  NOT cold for {', '.join(short)}: --max-cold-experts {args.max_cold_experts} keeps their "
                      f"working set under 2 x LLC ({2 * llc / 2**20:.0f} MiB); these rows are partly cache-resident")
            print(f"{'batch':>6} {'variant':>10} {'best ms':>9} {'tok/s':>10} {'/numpy':>7}")
            results[(tset, cache)] = run_table(experts, batches, args.repeat, rng, CLOCKS[args.clock])
            del experts
        limiter.restore_original_limits()
    if args.switch:
        set_threads(1)
        switch_table(h, f, rng)

    if goal:
        print(f"\ngoals ({klass}), time / numpy f32 (the issue's goals are for hot, one thread):")
        for (tset, cache), best_t in results.items():
            for p, g in goal.items():
                for n, lim in ((1, g), (512, GOAL_512)):
                    if n in batches:
                        r = best_t[(n, p)] / best_t[(n, "numpy f32")]
                        print(f"  {cache:>4} threads={tset:<3} {p:>7} batch {n:<3} {r:5.2f} (goal <= {lim}) "
                              f"{'met' if r <= lim else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
