"""Where a lossy carrier's error goes in a whole-model generation, in process (no cluster).

Usage:  .venv/bin/python bench/carrier_error.py [--checkpoint tests/fixtures/deepseek_v3_tiny]
        [--carriers q8_0/bf16,f16/bf16,f16/f16,q8_0/f32,f32/bf16]

Runs the checkpoint's generation reference prompt through the numpy backbone with every
MLP (routed experts, shared expert, dense layers split in 2 slices as ``tenzro_cluster``
places them) executed on rows that went through the wire encodings ``IN/OUT``
(``moe.wire.encode_rows`` then ``decode_rows``, exactly what a holder receives and the
router gets back), combined as the router does. Prints per carrier pair the prompt-logit
measures against the transformers reference (``tenzro_site.verify.logit_measures``), and
per decoder layer the relative error of its input (the residual stream) against the exact
run and the tokens whose routed expert set changed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moe import wire  # noqa: E402
from moe.backbone import build_backbone  # noqa: E402
from moe.backbone.decode import Generator, Sampling  # noqa: E402
from prepare.dense import dense_routing, split_dense  # noqa: E402
from moe.ffn import ExpertWeights, combine, expert_forward  # noqa: E402
from moe.gating import route  # noqa: E402
from prepare.backbone import backbone_groups  # noqa: E402
from prepare.checkpoint import Checkpoint  # noqa: E402
from prepare.layouts import load_expert, load_gate, spec_from_config  # noqa: E402


def main() -> None:
    from safetensors.numpy import load_file

    from tenzro_site.verify import logit_measures

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default=str(ROOT / "tests" / "fixtures" / "deepseek_v3_tiny"))
    ap.add_argument("--carriers", default="q8_0/bf16,f16/bf16,f16/f16,q8_0/f32,f32/bf16")
    a = ap.parse_args()
    c = Checkpoint(a.checkpoint)
    spec = spec_from_config(c.config)
    bb = build_backbone(c.config, {n: c.read(n) for names in backbone_groups(c).values() for n in names})
    ref = load_file(str(Path(a.checkpoint) / "generation_reference.safetensors"))
    prompt = ref["input_ids"][0]
    gates, experts, dense = {}, {}, {}

    def trip(x, kind):
        return x if kind == "f32" else wire.decode_rows(wire.encode_rows(x, kind), kind, x.shape[1], x.shape[0])

    def mlp_with(kin, kout, seen):
        def mlp(layer, x):
            if x.shape[0] == len(prompt):
                seen[layer] = x.copy()
            if spec.is_moe_layer(layer):
                g = gates.setdefault(layer, load_gate(c, spec, layer))
                r = route(g, x)
                outs = {e: (tok, trip(expert_forward(experts.setdefault((layer, e), load_expert(c, spec, layer, e)),
                                                     trip(x[tok], kin)), kout))
                        for e, tok in r.tokens_by_expert().items()}
                return combine(r, outs, x.shape[1])
            if layer not in dense:
                w = ExpertWeights(*(c.read(f"model.layers.{layer}.mlp.{p}.weight")
                                    for p in ("gate_proj", "up_proj", "down_proj")))
                dense[layer] = split_dense(w, 2)
            tok = np.arange(x.shape[0])
            outs = {s: (tok, trip(expert_forward(w, trip(x, kin)), kout)) for s, w in enumerate(dense[layer])}
            return combine(dense_routing(x.shape[0], len(dense[layer])), outs, x.shape[1])
        return mlp

    exact_in: dict[int, np.ndarray] = {}
    Generator(bb, mlp_with("f32", "f32", exact_in), Sampling(max_new_tokens=1)).run([prompt])
    for pair in a.carriers.split(","):
        kin, kout = pair.split("/")
        seen: dict[int, np.ndarray] = {}
        seq = Generator(bb, mlp_with(kin, kout, seen), Sampling(max_new_tokens=8)).run([prompt], keep_logits=True)[0]
        m = logit_measures(seq.prompt_logits, ref["logits"])
        greedy = list(prompt) + seq.output == ref["greedy_ids"][0].tolist()
        print(f"{kin} rows out, {kout} back: argmax agreement {m['argmax_agreement']:.4f}, logit cosine "
              f"{m['logit_cosine']:.7f} (min per position {m['logit_cosine_min']:.5f}), greedy ids "
              f"{'equal' if greedy else 'DIFFER'}")
        for layer in sorted(seen):
            xe, xc = exact_in[layer], seen[layer]
            rel = np.linalg.norm(xe - xc, axis=1) / np.linalg.norm(xe, axis=1)
            line = f"   layer {layer} input: relative error mean {rel.mean():.2e} max {rel.max():.2e}"
            if spec.is_moe_layer(layer):
                re, rc = route(gates[layer], xe), route(gates[layer], xc)
                flips = [t for t in range(len(prompt)) if set(re.expert_ids[t]) != set(rc.expert_ids[t])]
                line += f"; routing changed at tokens {flips}"
            print(line)


if __name__ == "__main__":
    main()
