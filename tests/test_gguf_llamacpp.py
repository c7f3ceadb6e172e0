"""llama.cpp as the oracle (issue 23): the fixtures written as GGUF (gguf-py, llama.cpp's
converter conventions), quantized by llama.cpp itself (``llama_model_quantize``: Q8_0 and
Q4_K_M), run by llama.cpp (llama-cpp-python) and by us from the same file: greedy ids over 4
token-id prompts and prompt-logit cosine per family × quant; and a model published here with
``--quant q4_k_m`` and written by ``export_gguf`` loads in llama.cpp and agrees with us.

Skipped when ``llama_cpp`` is not installed (its sdist builds llama.cpp from source).
``python tests/test_gguf_llamacpp.py`` prints the agreement table.
"""
from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

import numpy as np
import pytest

if __name__ == "__main__":  # the table script: run from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

llama_cpp = pytest.importorskip("llama_cpp")

from moe.backbone.decode import Generator, Sampling  # noqa: E402
from prepare.gguf import GgufCheckpoint  # noqa: E402
from tests.conftest import DEEPSEEK, MIXTRAL, QWEN, QWEN2  # noqa: E402
from tests.gguf_util import train_tokenizer, write_fixture_gguf  # noqa: E402
from tests.test_gguf import in_process  # noqa: E402

FAMILIES = {"qwen3_moe": QWEN, "qwen2_moe": QWEN2, "mixtral": MIXTRAL, "deepseek_v3": DEEPSEEK}
FTYPES = {"Q8_0": 7, "Q4_K_M": 15}  # llama.h LLAMA_FTYPE_MOSTLY_Q8_0 / _Q4_K_M
NEW_TOKENS = 12
QUANTS = ("F32", "BF16", "Q8_0", "Q4_K_M")


def prompts(ref_dir: Path, vocab: int = 256) -> list[list[int]]:
    """The reference prompt and three seeded random ones (token ids)."""
    from safetensors.numpy import load_file

    ref = load_file(str(ref_dir / "generation_reference.safetensors"))["input_ids"][0].tolist()
    rng = np.random.default_rng(23)
    return [ref] + [rng.integers(0, min(vocab, 147), size=n).tolist() for n in (8, 12, 16)]


def llama_quantize(src: Path, dst: Path, ftype: int) -> Path:
    """``llama_model_quantize`` (llama.cpp's own quantizer, its type mix for the preset)."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 1
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize returned {rc}"
    return dst


def open_llama(path: Path, **kw):
    """``llama_cpp.Llama`` on ``path`` (1 thread, quiet) with llama.cpp's extra buffer types off
    (``use_extra_bufts``: AMX and runtime weight repacking): a build on an AMX CPU crashes in
    ``ggml_backend_amx_mul_mat`` on Q8_0 weights, and the oracle should not depend on the CPU's
    extensions; the plain CPU kernels quantize activations the same way."""
    from llama_cpp import llama_cpp as capi

    default = capi.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    capi.llama_model_default_params = params
    try:
        return llama_cpp.Llama(model_path=str(path), n_threads=1, verbose=False, **kw)
    finally:
        capi.llama_model_default_params = default


def llama_generate(path: Path, prompt_sets: list[list[int]], n_new: int = NEW_TOKENS,
                   forced: list[list[int]] | None = None):
    """llama.cpp's (prompt logits ``[T, V]``, greedy new ids, argmax after each of ``forced``'s
    tokens: teacher-forced on our continuation, so one near-tie does not derail the rest) per prompt."""
    llm = open_llama(path, n_ctx=64, n_batch=64, n_ubatch=64, logits_all=True)
    out = []
    for i, p in enumerate(prompt_sets):
        llm.reset()
        llm.eval(p)
        logits = np.array(llm.scores[:len(p)], dtype=np.float32)
        ids = []
        for _ in range(n_new):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            ids.append(tok)
            llm.eval([tok])
        tf = []
        if forced is not None:
            llm.reset()
            llm.eval(p + forced[i])
            tf = [int(np.argmax(llm.scores[len(p) - 1 + j])) for j in range(len(forced[i]))]
        out.append((logits, ids, tf))
    llm.close()
    return out


def our_generate(path: Path, ref_dir: Path, prompt_sets: list[list[int]], n_new: int = NEW_TOKENS):
    """Ours on the same file (backbone and experts as imported; in process: the distributed
    forward equals it bit for bit with the f32 carrier, see tests/test_gguf_cluster.py)."""
    bb, mlp, _ = in_process(GgufCheckpoint(path), ref_dir)
    seqs = Generator(bb, mlp, Sampling(max_new_tokens=n_new)).run([np.asarray(p) for p in prompt_sets],
                                                                  keep_logits=True)
    return [(s.prompt_logits, s.output) for s in seqs]


def agreement(ours, theirs) -> dict:
    """``ids_equal`` (prompts whose greedy ids agree), ``forced_agreement`` (fraction of our new
    tokens that are also llama.cpp's argmax given the same prefix) and the mean per-position
    prompt-logit cosine."""
    eq = sum(a[1] == b[1] for a, b in zip(ours, theirs))
    agree = [x == y for a, b in zip(ours, theirs) for x, y in zip(a[1], b[2])]
    cos = []
    for a, b in zip(ours, theirs):
        la, lb = a[0], b[0]
        num = (la * lb).sum(-1)
        cos.append(float(np.mean(num / (np.linalg.norm(la, axis=-1) * np.linalg.norm(lb, axis=-1)))))
    return {"ids_equal": int(eq), "prompts": len(ours), "forced_agreement": float(np.mean(agree)) if agree else None,
            "logit_cosine": float(np.mean(cos))}


def family_row(tmp: Path, fam: str, quant: str) -> dict:
    """One row of the table: the fixture as an F32 or BF16 GGUF, or the F32 one quantized by
    llama.cpp to ``quant`` (bf16 values widen to f32 exactly, so that is the checkpoint's data)."""
    src = FAMILIES[fam]
    base = write_fixture_gguf(src, tmp / f"{fam}-{quant}-src.gguf", tokenizer=train_tokenizer(),
                              f32=quant != "BF16")
    path = llama_quantize(base, tmp / f"{fam}-{quant}.gguf", FTYPES[quant]) if quant in FTYPES else base
    ps = prompts(src)
    ours = our_generate(path, src, ps)
    return {"family": fam, "quant": quant,
            **agreement(ours, llama_generate(path, ps, forced=[o[1] for o in ours]))}


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("fam", list(FAMILIES))
def test_llama_cpp_agrees_with_us_on_the_same_file(tmp_path, fam, quant):
    """F32: llama.cpp and we compute the same model (every greedy id, logits to float error).
    BF16 and llama.cpp's quants: llama.cpp rounds activations too (bf16 / Q8_0 / Q8_K before
    each matmul, f16 KV cache), so on these random tiny models a near-tie can flip a free-running
    greedy continuation; teacher-forced argmax agreement and prompt-logit cosine are held."""
    row = family_row(tmp_path, fam, quant)
    if quant == "F32":
        assert row["ids_equal"] == row["prompts"] and row["logit_cosine"] >= 0.99999, row
    else:
        assert row["forced_agreement"] >= 0.9 and row["logit_cosine"] >= 0.99, row
        assert row["ids_equal"] >= 1, row


@pytest.mark.django_db(transaction=True)
def test_exported_q4_k_m_model_runs_in_llama_cpp(tmp_path):
    from django.core.management import call_command

    from prepare.backbone import publish_backbone
    from prepare.services import publish_checkpoint

    publish_checkpoint(QWEN2, "q2", quant="q4_k_m")
    publish_backbone(QWEN2, "q2")
    out = tmp_path / "q2.gguf"
    call_command("export_gguf", "--model-id", "q2", "--out", str(out))
    ps = prompts(QWEN2)
    ours = our_generate(out, QWEN2, ps)
    row = agreement(ours, llama_generate(out, ps, forced=[o[1] for o in ours]))
    print("export q4_k_m row", row)
    assert row["ids_equal"] >= 3 and row["forced_agreement"] >= 0.9 and row["logit_cosine"] >= 0.999, row


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        print(f"llama-cpp-python {llama_cpp.__version__}")
        print(f"{'family':<12} {'quant':<7} {'ids equal':>9} {'forced':>9} {'logit cosine':>13}")
        for fam in FAMILIES:
            for quant in QUANTS:
                r = family_row(Path(d), fam, quant)
                print(f"{fam:<12} {quant:<7} {r['ids_equal']:>5}/{r['prompts']:<3} {r['forced_agreement']:>9.3f} "
                      f"{r['logit_cosine']:>13.6f}")
                sys.stdout.flush()
        print(json.dumps({"done": True}))


@pytest.mark.cluster
@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K_M"])
def test_cluster_serves_llama_cpp_quantized_qwen2_like_llama_cpp(tmp_path, quant):
    """Issue 23's bar: the qwen2-MoE fixture written by gguf-py, quantized by llama.cpp, served by
    ``tenzro_cluster --checkpoint FILE.gguf --holders 2``: ``/v1/completions`` greedy ids (12 new
    tokens, token-id prompts) equal ours in process on the same file exactly (f32 carrier), and
    llama.cpp's; prompt-logit cosine and teacher-forced agreement as above."""
    import httpx

    from tests.cluster_util import running_cluster

    base = write_fixture_gguf(QWEN2, tmp_path / "src.gguf", tokenizer=train_tokenizer(), f32=True)
    path = llama_quantize(base, tmp_path / f"qwen2_moe-{quant.lower()}.gguf", FTYPES[quant])
    ps = prompts(QWEN2)
    ours = our_generate(path, QWEN2, ps)
    theirs = llama_generate(path, ps, forced=[o[1] for o in ours])
    with running_cluster(tmp_path, [path], holders=2) as (info, _):
        served = [httpx.post(f"{info['url']}/v1/completions", json={
            "model": info["model_id"], "prompt": p, "max_tokens": NEW_TOKENS, "temperature": 0, "carrier": "f32"},
            timeout=120).json()["choices"][0]["token_ids"] for p in ps]
    assert served == [o[1] for o in ours]
    row = agreement(ours, theirs)
    print(f"cluster qwen2_moe {quant}", row)
    assert row["forced_agreement"] >= 0.9 and row["logit_cosine"] >= 0.999 and row["ids_equal"] >= 2, row


def _vocab_file(path: Path, meta_writer) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_head_count(2)
    meta_writer(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _ours_and_llama(path: Path):
    from prepare.gguf import parse_gguf_header
    from prepare.gguf_tokenizer import tokenizer_from_gguf

    data = path.read_bytes()
    meta, _ = parse_gguf_header(lambda o, n: data[o:o + n], len(data), str(path))
    return tokenizer_from_gguf(meta), llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


def test_vocabularies_tokenize_like_llama_cpp(tmp_path):
    from tests.gguf_util import add_tokenizer
    from tests.test_gguf_tokenizer import TEXTS, _spm_meta

    ours, llm = _ours_and_llama(_vocab_file(tmp_path / "gpt2.gguf", lambda w: add_tokenizer(w, train_tokenizer(), 256)))
    for text in [*TEXTS, "dog<|endoftext|>"]:
        assert ours.encode(text).ids == llm.tokenize(text.encode(), add_bos=False, special=True), text
    m = _spm_meta()

    def spm(w):
        w.add_tokenizer_model("llama")
        w.add_token_list(m["tokenizer.ggml.tokens"])
        w.add_token_scores(m["tokenizer.ggml.scores"])
        w.add_token_types(m["tokenizer.ggml.token_type"])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)

    ours, llm = _ours_and_llama(_vocab_file(tmp_path / "spm.gguf", spm))
    for text in ["Hello world", "Hé", "Hello  world\nHello", "wor ld Hellod", " Hello"]:
        ids = llm.tokenize(text.encode(), add_bos=True, special=False)
        assert ours.encode(text).ids == ids, text
        assert ours.decode(ids) == llm.detokenize(ids).decode() == text
