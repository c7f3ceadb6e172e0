"""Expert preparation speed: Q4_K_M on Qwen3-30B-A3B-shaped experts, parameters per second per core.

Usage:  .venv/bin/python bench/bench_prepare.py [--experts 6] [--hidden 2048] [--inter 768] [--repeat 2]

Writes a synthetic bf16 checkpoint of ``--experts`` experts of the Qwen3-30B-A3B shape
(H 2048, F 768: gate/up ``[768, 2048]``, down ``[2048, 768]``) to a temporary directory, then
times the whole per-expert pipeline that ``prepare.jobs.run_job`` runs, in one thread:
ranged read + bf16 decode (``load_expert``), Q4_K_M quantization (gate/up Q4_K, down Q6_K, the
llama.cpp reference bytes), canonical blob encoding, BLAKE3 and the atomic store write. It
prints parameters per second per core (best of ``--repeat``), and as ratios against two
baselines timed in the same run: the dense publication of the same experts (read, bf16
blob, hash, store) and a plain numpy float32 copy of the same parameter count. Bit-exactness
is checked on the way: every quantized projection in the blobs equals ``moe.quant.quantize``
of the source, whose bytes are pinned to ggml's golden vectors by tests/test_quant.py.
Goal (issue 5): >= 10 M params/s/core.
"""
from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS",
           "VECLIB_MAXIMUM_THREADS", "RAYON_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe.ffn import ExpertWeights  # noqa: E402
from moe.quant import quantize  # noqa: E402
from moe.blobs import BlobStore  # noqa: E402
from prepare.checkpoint import Checkpoint  # noqa: E402
from moe.codec import dumps_safetensors, encode_bf16  # noqa: E402
from prepare.layouts import load_expert, source_dtype, spec_from_config  # noqa: E402
from prepare.quantplan import parse_quant_plan, quantize_expert  # noqa: E402


def write_checkpoint(path: Path, experts: int, hidden: int, inter: int) -> None:
    rng = np.random.default_rng(0)
    cfg = {"model_type": "qwen3_moe", "num_experts": experts, "num_experts_per_tok": min(8, experts),
           "hidden_size": hidden, "moe_intermediate_size": inter, "num_hidden_layers": 1, "norm_topk_prob": True}
    tensors = {"model.layers.0.mlp.gate.weight": ("BF16", (experts, hidden),
                                                  encode_bf16(rng.standard_normal((experts, hidden),
                                                                                  np.float32) * 0.02).tobytes())}
    for e in range(experts):
        for p, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
            w = rng.standard_normal(shape, np.float32) * 0.02
            tensors[f"model.layers.0.mlp.experts.{e}.{p}.weight"] = ("BF16", shape, encode_bf16(w).tobytes())
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "model.safetensors").write_bytes(dumps_safetensors(tensors))


def prepare_all(ckpt: Checkpoint, store: BlobStore, plan) -> list[bytes]:
    spec = spec_from_config(ckpt.config)
    blobs = []
    for e in range(spec.num_experts):
        w = load_expert(ckpt, spec, 0, e)
        wq, fallbacks = quantize_expert(w, plan)
        blob = wq.to_blob(source_dtype(ckpt, spec, 0, e), {f"{k}.fallback": v for k, v in fallbacks.items()})
        store.put(blob)
        blobs.append(blob)
    return blobs


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
        except OSError:
            pass
    params = a.experts * 3 * a.hidden * a.inter
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(Path(tmp) / "ck", a.experts, a.hidden, a.inter)
        ckpt = Checkpoint(Path(tmp) / "ck")
        spec = spec_from_config(ckpt.config)
        plan = parse_quant_plan("q4_k_m")
        store = BlobStore(Path(tmp) / "blobs")
        blobs = prepare_all(ckpt, store, plan)  # warm-up, and the bit-exactness check below
        for e, blob in enumerate(blobs[:2]):
            w, src = ExpertWeights.from_blob(blob), load_expert(ckpt, spec, 0, e)
            for p, q in (("gate_proj", "q4_k"), ("up_proj", "q4_k"), ("down_proj", "q6_k")):
                m = getattr(w, p)
                assert m.qtype == q and np.array_equal(m.blocks, quantize(getattr(src, p), q)), (e, p)
        t_q = best(lambda: prepare_all(ckpt, store, plan), a.repeat)
        t_dense = best(lambda: prepare_all(ckpt, store, None), a.repeat)
        src = np.ones(params, np.float32)
        dst = np.empty_like(src)
        t_copy = best(lambda: np.copyto(dst, src), max(3, a.repeat))
    rate = params / t_q
    print(f"experts: {a.experts} x (gate/up [{a.inter}, {a.hidden}] Q4_K, down [{a.hidden}, {a.inter}] Q6_K), "
          f"{params / 1e6:.1f} M params, bf16 source, 1 core")
    print(f"Q4_K_M preparation: {rate / 1e6:.2f} M params/s/core ({t_q / a.experts * 1e3:.0f} ms per expert); "
          f"goal >= 10 M/s: {'met' if rate >= 10e6 else 'NOT met'}")
    print(f"ratio vs dense bf16 publication of the same experts: {t_q / t_dense:.1f}x the time "
          f"(dense: {params / t_dense / 1e6:.0f} M params/s)")
    print(f"ratio vs numpy f32 copy of the same parameters: {t_q / t_copy:.0f}x the time")
    print("bit-exact: quantized projections equal moe.quant.quantize (ggml reference bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
