"""Why llama.cpp and we part on a quantized GGUF: its activation rounding, emulated in numpy.

llama.cpp's CPU backend quantizes a matmul's input rows to the weight type's ``vec_dot_type``
(Q8_0 for Q8_0/Q5_x/Q4_x weights: blocks of 32, scale ``amax/127`` stored as f16; Q8_K for
Q4_K/Q5_K/Q6_K: blocks of 256, ``-127/max``, f32 scale; f16 / bf16 for F16 / BF16), and its
default f16 KV cache rounds K, V, the query and the softmax probabilities to f16 (no flash
attention). We multiply f32 rows by the exact dequantized weights. This script runs the
qwen2-MoE fixture (or ``--checkpoint`` DIR of another qwen2_moe checkpoint) written as GGUF
and quantized by llama.cpp, four ways: ours (the product's in-process forward), a numpy
reference of the same model without and with llama.cpp's rounding, and llama.cpp with f16
and f32 KV caches. It prints greedy ids equal (4 prompts, 12 tokens), mean prompt-logit
cosine and max |Δlogit| of each against llama.cpp, and our top-1 − top-2 margin where a
continuation parts.

    .venv/bin/python bench/gguf_llamacpp_rounding.py [--quant Q8_0|Q4_K_M] [--checkpoint DIR]

Needs ``llama-cpp-python`` (requirements-test.txt). The reference handles ``qwen2_moe`` only.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

F32 = np.float32


def q8_0(x: np.ndarray) -> np.ndarray:
    """Rows ``[n, k]`` through ggml's ``quantize_row_q8_0`` (AVX path) and back."""
    n, k = x.shape
    b = x.reshape(n, k // 32, 32)
    amax = np.abs(b).max(-1, keepdims=True)
    d = (amax / F32(127)).astype(np.float16).astype(F32)
    inv = np.where(amax != 0, F32(127) / np.where(amax != 0, amax, 1), 0).astype(F32)
    return (np.rint(b * inv) * d).reshape(n, k).astype(F32)


def q8_k(x: np.ndarray) -> np.ndarray:
    """Rows ``[n, k]`` through ggml's ``quantize_row_q8_K_ref`` and back."""
    n, k = x.shape
    b = x.reshape(n, k // 256, 256)
    mx = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)
    iscale = np.where(mx != 0, F32(-127) / np.where(mx != 0, mx, 1), 0).astype(F32)
    d = np.where(iscale != 0, F32(1) / np.where(iscale != 0, iscale, 1), 0).astype(F32)
    return (np.minimum(127, np.rint(iscale * b)) * d).reshape(n, k).astype(F32)


def _bf16(x):
    import ml_dtypes

    return x.astype(ml_dtypes.bfloat16).astype(F32)


VEC_DOT = {"Q8_0": q8_0, "Q5_0": q8_0, "Q5_1": q8_0, "Q4_0": q8_0, "Q4_1": q8_0, "Q2_K": q8_k, "Q3_K": q8_k,
           "Q4_K": q8_k, "Q5_K": q8_k, "Q6_K": q8_k, "F16": lambda x: x.astype(np.float16).astype(F32),
           "BF16": _bf16, "F32": lambda x: x}


class Reference:
    """A qwen2_moe forward over a ``GgufCheckpoint`` (whole sequence each step, f32 with f64
    dot products); ``rounding`` applies llama.cpp's activation quantization and f16 attention."""

    def __init__(self, ckpt, rounding: bool):
        self.cfg, self.rounding = ckpt.config, rounding
        self.w = {n: ckpt.read(n) for n in ckpt.names()}
        self.t = {n: ckpt.info(n).dtype for n in ckpt.names()}

    def mm(self, x, name):
        if self.rounding:
            x = VEC_DOT[self.t[name]](x)
        return (x.astype(np.float64) @ self.w[name].T.astype(np.float64)).astype(F32)

    def norm(self, x, w):
        return (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + F32(self.cfg["rms_norm_eps"]))).astype(F32) * w

    def ffn(self, x, pre):
        g, u = self.mm(x, pre + "gate_proj.weight"), self.mm(x, pre + "up_proj.weight")
        return self.mm((g / (1 + np.exp(-g)) * u).astype(F32), pre + "down_proj.weight")

    def forward(self, ids: np.ndarray) -> np.ndarray:
        c, w = self.cfg, self.w
        H, nh, nkv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
        hd, T = H // nh, len(ids)
        f16 = (lambda a: a.astype(np.float16).astype(F32)) if self.rounding else (lambda a: a)
        inv = 1.0 / (c.get("rope_parameters", {}).get("rope_theta", 10000.0) ** (np.arange(0, hd, 2) / hd))
        ang = np.arange(T)[:, None] * inv[None]
        cos, sin = (f(np.concatenate([ang, ang], -1)).astype(F32)[:, None] for f in (np.cos, np.sin))

        def rope(x):
            return x * cos + np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin

        h = w["model.embed_tokens.weight"][ids].astype(F32)
        for L in range(c["num_hidden_layers"]):
            p = f"model.layers.{L}."
            x = self.norm(h, w[p + "input_layernorm.weight"])
            q, k, v = (self.mm(x, p + f"self_attn.{n}_proj.weight") + w[p + f"self_attn.{n}_proj.bias"]
                       for n in "qkv")
            q, k, v = f16(rope(q.reshape(T, nh, hd))), f16(rope(k.reshape(T, nkv, hd))), f16(v.reshape(T, nkv, hd))
            k, v = np.repeat(k, nh // nkv, 1), np.repeat(v, nh // nkv, 1)
            s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + np.triu(np.full((T, T), -np.inf), 1)
            s = np.exp(s - s.max(-1, keepdims=True))
            s = f16(s / s.sum(-1, keepdims=True))
            h = h + self.mm(np.einsum("hqk,khd->qhd", s, v).reshape(T, H).astype(F32), p + "self_attn.o_proj.weight")
            x = self.norm(h, w[p + "post_attention_layernorm.weight"])
            lg = self.mm(x, p + "mlp.gate.weight")
            pr = np.exp(lg - lg.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            out = np.zeros_like(x)
            for t in range(T):
                for e in np.argsort(-pr[t], kind="stable")[:c["num_experts_per_tok"]]:
                    out[t] += pr[t, e] * self.ffn(x[t:t + 1], p + f"mlp.experts.{int(e)}.")[0]
            sg = self.mm(x, p + "mlp.shared_expert_gate.weight")
            h = h + out + self.ffn(x, p + "mlp.shared_expert.") / (1 + np.exp(-sg))
        h = self.norm(h, w["model.norm.weight"])
        return self.mm(h, "lm_head.weight" if "lm_head.weight" in w else "model.embed_tokens.weight")

    def generate(self, prompt: list[int], n: int):
        ids, out = list(prompt), []
        first = lg = self.forward(np.array(ids))
        for _ in range(n):
            out.append(int(np.argmax(lg[-1])))
            ids.append(out[-1])
            lg = self.forward(np.array(ids))
        return first, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quant", default="Q8_0", choices=["Q8_0", "Q4_K_M"])
    ap.add_argument("--checkpoint", default=None, help="a qwen2_moe checkpoint dir (default: the tiny fixture)")
    a = ap.parse_args()
    from tests.conftest import QWEN2

    src = Path(a.checkpoint) if a.checkpoint else QWEN2
    with tempfile.TemporaryDirectory() as d:
        report(*run(src, a.quant, Path(d)))


def run(src: Path, quant: str, d: Path):
    """(prompts, runs by name, the reference without rounding) on ``src`` quantized to ``quant`` in ``d``."""
    from prepare.gguf import GgufCheckpoint
    from tests.test_gguf_llamacpp import (FTYPES, NEW_TOKENS, llama_quantize, open_llama, our_generate, prompts,
                                          train_tokenizer, write_fixture_gguf)

    base = write_fixture_gguf(src, Path(d) / "f32.gguf", tokenizer=train_tokenizer(), f32=True)
    path = llama_quantize(base, Path(d) / f"{quant}.gguf", FTYPES[quant])
    ps = prompts(src)
    runs = {"ours": our_generate(path, src, ps)}
    for name, rounding in (("numpy reference", False), ("numpy + llama.cpp rounding", True)):
        ref = Reference(GgufCheckpoint(path), rounding)
        runs[name] = [ref.generate(p, NEW_TOKENS) for p in ps]
    for kv, code in (("f16", 1), ("f32", 0)):
        llm = open_llama(path, n_ctx=64, n_batch=64, n_ubatch=64, logits_all=True, type_k=code, type_v=code)
        res = []
        for p in ps:
            llm.reset()
            llm.eval(p)
            lg, ids = np.array(llm.scores[:len(p)], F32), []
            for _ in range(NEW_TOKENS):
                ids.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
                llm.eval([ids[-1]])
            res.append((lg, ids))
        llm.close()
        runs[f"llama.cpp kv {kv}"] = res
    print(f"{src.name} {quant}: {path.name}")
    return ps, runs, Reference(GgufCheckpoint(path), False)


def report(ps, runs, plain) -> None:
    """Print the table and where each continuation parts."""
    from tests.test_gguf_llamacpp import NEW_TOKENS

    print("against llama.cpp (f16 KV cache, its default)")
    print(f"{'run':<28} {'ids equal':>9} {'cosine':>12} {'max |dlogit|':>13}")
    theirs = runs["llama.cpp kv f16"]
    for name, r in runs.items():
        if name == "llama.cpp kv f16":
            continue
        eq = sum(x[1] == y[1] for x, y in zip(r, theirs))
        cos = np.mean([np.mean((x[0] * y[0]).sum(-1) / np.linalg.norm(x[0], axis=-1) / np.linalg.norm(y[0], axis=-1))
                       for x, y in zip(r, theirs)])
        mx = max(float(np.abs(x[0] - y[0]).max()) for x, y in zip(r, theirs))
        print(f"{name:<28} {eq:>7}/4 {cos:>12.9f} {mx:>13.5f}")
    for i, (o, t) in enumerate(zip(runs["ours"], theirs)):
        j = next((j for j, (x, y) in enumerate(zip(o[1], t[1])) if x != y), None)
        if j is not None:
            top = np.sort(plain.forward(np.array(ps[i] + o[1][:j]))[-1])
            print(f"prompt {i}: parts at new token {j} (ours {o[1][j]}, llama.cpp {t[1][j]}): our top-1 - top-2 "
                  f"margin {top[-1] - top[-2]:.4f}, logit std {plain.forward(np.array(ps[i]))[-1].std():.3f}")
        else:
            print(f"prompt {i}: all {NEW_TOKENS} ids equal")


if __name__ == "__main__":
    main()
