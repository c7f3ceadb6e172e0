"""Checking a distributed forward against a reference bundle and the monolithic forward (docs/DESIGN.md §4)."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from moe import wire
from moe.ffn import expert_forward, moe_layer_forward
from prepare.checkpoint import Checkpoint
from prepare.remote import open_checkpoint
from prepare.layouts import load_expert, load_gate, spec_from_config
from prepare.quantplan import parse_quant_plan, quantize_expert

REL_TOLERANCE = 1e-5


def reference_layers(reference: str | Path) -> tuple[dict[str, np.ndarray], list[int]]:
    """Load a reference bundle; returns (tensors, sorted MoE layers that have hidden_states and output).

    Raises ``ValueError`` when the file is missing, is not safetensors, holds a dtype numpy cannot
    read (e.g. a bf16 checkpoint passed by mistake), or has no ``layer{L}.hidden_states`` /
    ``layer{L}.output`` pair.
    """
    path = Path(reference)
    if not path.is_file():
        raise ValueError(f"{reference} is not a file")
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error type for a bad header
        raise ValueError(f"{reference} is not a readable safetensors reference bundle: {exc}") from exc
    layers = sorted(int(k[len("layer"):].split(".")[0]) for k in tensors
                    if k.startswith("layer") and k.endswith(".hidden_states") and
                    k.replace(".hidden_states", ".output") in tensors)
    if not layers:
        raise ValueError(f"{reference} holds no layer{{L}}.hidden_states / layer{{L}}.output pairs")
    return tensors, layers


def monolithic(checkpoint: Checkpoint, layer: int, hidden_states: np.ndarray, quant=None) -> np.ndarray:
    """The in-process layer forward straight from the checkpoint (gate and every expert local).

    With ``quant`` (preset or per-projection object) each expert is quantized exactly as
    publishing does, so the holders and this forward use the same dequantized weights.
    """
    spec = spec_from_config(checkpoint.config)
    gate = load_gate(checkpoint, spec, layer)
    plan = parse_quant_plan(quant)
    # Every product is moe.rowwise's fixed order: the same bits as the holders whatever the
    # BLAS/OpenMP thread counts on either side.
    out, _ = moe_layer_forward(gate, lambda e: quantize_expert(load_expert(checkpoint, spec, layer, e), plan)[0],
                               hidden_states)
    return out


def max_rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    """max |out − ref| / max |ref| (0 when both are zero)."""
    denom = float(np.max(np.abs(ref)))
    diff = float(np.max(np.abs(out.astype(np.float64) - ref.astype(np.float64))))
    return diff / denom if denom > 0 else diff


def verify_layers(rpc, model_id: str, checkpoint: str | Path, reference: str | Path, quant=None) -> list[dict]:
    """Run ``tenzro_moeForward`` for every layer of the bundle and compare.

    ``rpc(method, params) -> result``. Each row: layer, tokens, holders (count),
    max_rel_err_vs_reference, max_abs_diff_vs_monolithic, ms (forward wall time), quant, ok.
    Dense (``quant`` None): ok iff the relative error is ≤ ``REL_TOLERANCE`` and sharded
    equals monolithic exactly. Quantized: the monolithic forward uses the same quantized
    experts and must still match exactly; the error against the reference is reported (and
    ``max_rel_err_vs_dense``, against the dense monolithic forward), not held to 1e-5.
    """
    ckpt = open_checkpoint(checkpoint)
    tensors, layers = reference_layers(reference)
    rows = []
    for layer in layers:
        x = tensors[f"layer{layer}.hidden_states"].astype(np.float32)
        ref = tensors[f"layer{layer}.output"].astype(np.float32)
        t0 = time.perf_counter()
        res = rpc("tenzro_moeForward", {"model_id": model_id, "layer": layer, "d_model": int(x.shape[1]),
                                        "hidden_states": wire.rows_to_b64(x), "carrier": "f32"})
        ms = (time.perf_counter() - t0) * 1e3
        out = wire.rows_from_b64(res["outputs"], int(x.shape[1]), field="outputs")
        mono = monolithic(ckpt, layer, x, quant)
        rel = max_rel_err(out, ref)
        absdiff = float(np.max(np.abs(out - mono)))
        # The compact wire (Q8_0 rows when d_model % 32 == 0, bf16 outputs): reported, not gated.
        q = rpc("tenzro_moeForward", {"model_id": model_id, "layer": layer, "d_model": int(x.shape[1]),
                                      "hidden_states": wire.rows_to_b64(x), "carrier": "auto"})
        out_q = wire.rows_from_b64(q["outputs"], int(x.shape[1]), field="outputs")
        row = {"layer": layer, "tokens": int(x.shape[0]), "holders": len(res["holders"]),
               "max_rel_err_vs_reference": rel, "max_abs_diff_vs_monolithic": absdiff,
               "ms": round(ms, 1), "quant": quant, "compact_wire_rel_err": max_rel_err(out_q, ref),
               "bytes_per_element": {"f32": _per_elem(res), "compact": _per_elem(q)},
               "receipts": res.get("receipts", 0),
               "ok": absdiff == 0.0 and (quant is not None or rel <= REL_TOLERANCE)}
        if quant is not None:
            row["max_rel_err_vs_dense"] = max_rel_err(out, monolithic(ckpt, layer, x))
        rows.append(row)
    return rows


def _per_elem(res: dict) -> dict:
    """Wire bytes per routed element each way from a forward result's ``wire`` field."""
    w = res.get("wire") or {}
    n = max(1, w.get("routed_elements", 0))
    return {"out": round(w.get("bytes_out", 0) / n, 4), "back": round(w.get("bytes_back", 0) / n, 4)}


def verify_dense_layers(rpc, model_id: str, checkpoint: str | Path, reference: str | Path, parts: int) -> list[dict]:
    """Run ``tenzro_moeDenseForward`` for every dense MLP layer of the checkpoint and compare.

    The bundle holds no dense-layer output, so the input is the first MoE layer's hidden
    states (activations of the right width and scale) and the checks are against the
    unsplit MLP in process (``max_rel_err_vs_unsplit`` ≤ ``REL_TOLERANCE``: regrouped f32
    sums) and the same split summed in process (``max_abs_diff_vs_split`` exactly 0).
    """
    from prepare.dense import split_dense, split_forward
    from prepare.services import dense_layers, load_dense

    ckpt = open_checkpoint(checkpoint)
    tensors, moe = reference_layers(reference)
    x = tensors[f"layer{moe[0]}.hidden_states"].astype(np.float32)
    rows = []
    for layer in dense_layers(ckpt):
        w = load_dense(ckpt, layer)
        t0 = time.perf_counter()
        res = rpc("tenzro_moeDenseForward", {"model_id": model_id, "layer": layer, "d_model": int(x.shape[1]),
                                             "hidden_states": wire.rows_to_b64(x), "carrier": "f32"})
        ms = (time.perf_counter() - t0) * 1e3
        out = wire.rows_from_b64(res["outputs"], int(x.shape[1]), field="outputs")
        whole = expert_forward(w, x)
        split = split_forward(split_dense(w, parts), x)
        rel = max_rel_err(out, whole)
        absdiff = float(np.max(np.abs(out - split)))
        rows.append({"layer": layer, "tokens": int(x.shape[0]), "parts": res["parts"], "holders": len(res["holders"]),
                     "max_rel_err_vs_unsplit": rel, "max_abs_diff_vs_split": absdiff, "ms": round(ms, 1),
                     "ok": rel <= REL_TOLERANCE and absdiff == 0.0 and res["parts"] == parts})
    return rows


GEN_TOLERANCE = 1e-4
COMPACT_ARGMAX_MIN = 15 / 16
COMPACT_COSINE_MIN = 0.999


def generation_reference(reference: str | Path) -> dict[str, np.ndarray]:
    """Load ``generation_reference.safetensors`` (``input_ids`` int64 ``[1, T]``, ``logits`` f32
    ``[T, vocab]``, ``greedy_ids`` int64 ``[1, T + n]``). Raises ``ValueError`` when the file is
    missing, unreadable or lacks one of those tensors."""
    path = Path(reference)
    if not path.is_file():
        raise ValueError(f"{reference} is not a file")
    try:
        t = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error type for a bad header
        raise ValueError(f"{reference} is not a readable safetensors file: {exc}") from exc
    missing = [k for k in ("input_ids", "logits", "greedy_ids") if k not in t]
    if missing:
        raise ValueError(f"{reference} lacks {', '.join(missing)} (a generation reference holds input_ids, logits "
                         f"and greedy_ids)")
    return t


def logit_measures(logits: np.ndarray, ref: np.ndarray) -> dict:
    """Agreement of prompt logits ``[T, vocab]`` with the reference: ``max_rel_err`` (as
    ``max_rel_err``), ``argmax_agreement`` (fraction of positions with the same argmax) and
    ``logit_cosine`` (cosine similarity of the whole ``[T, vocab]`` logits, Kvasir's measure)
    and ``logit_cosine_min`` (the smallest per-position cosine)."""
    a, b = logits.astype(np.float64), ref.astype(np.float64)
    cos = np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return {"max_rel_err": max_rel_err(logits, ref),
            "argmax_agreement": float(np.mean(np.argmax(a, axis=1) == np.argmax(b, axis=1))),
            "logit_cosine": float(np.sum(a * b) / (np.linalg.norm(a) * np.linalg.norm(b))),
            "logit_cosine_min": float(np.min(cos))}


def verify_generation(rpc, model_id: str, reference: str | Path, carrier: str = "f32") -> dict:
    """Run the reference prompt through ``tenzro_moeGenerate`` (greedy) with ``carrier`` and
    with the compact wire, and compare with the transformers reference.

    ``rpc(method, params) -> result``. Returns the ``verify_generate --json`` object
    ``{model_id, greedy_ids_equal, max_rel_err_logits, compact: {argmax_agreement,
    logit_cosine}}`` plus ``carrier``, ``output_ids``, ``reference_ids``, ``tokens_per_s``,
    ``layers`` (of the main run), ``compact_greedy_ids_equal`` and ``ok``: with ``f32``
    greedy ids equal and logits within ``GEN_TOLERANCE``; with ``auto`` argmax agreement ≥
    15/16 and cosine ≥ 0.999.
    """
    ref = generation_reference(reference)
    prompt = [int(t) for t in ref["input_ids"][0]]
    want = [int(t) for t in ref["greedy_ids"][0]]
    n_new = len(want) - len(prompt)
    vocab = int(ref["logits"].shape[1])

    def run(c: str) -> tuple[dict, np.ndarray]:
        res = rpc("tenzro_moeGenerate", {"model_id": model_id, "input_ids": prompt, "max_new_tokens": n_new,
                                         "carrier": c, "return_logits": True})
        return res, wire.decode_f32(wire.b64decode(res["prompt_logits"], "prompt_logits"), vocab)

    main, logits = run(carrier)
    compact, clogits = (main, logits) if carrier == "auto" else run("auto")
    m, cm = logit_measures(logits, ref["logits"]), logit_measures(clogits, ref["logits"])
    equal = prompt + main["output_ids"] == want
    ok = (equal and m["max_rel_err"] <= GEN_TOLERANCE) if carrier == "f32" else \
        (cm["argmax_agreement"] >= COMPACT_ARGMAX_MIN and cm["logit_cosine"] >= COMPACT_COSINE_MIN)
    return {"model_id": model_id, "greedy_ids_equal": equal, "max_rel_err_logits": m["max_rel_err"],
            "compact": {"argmax_agreement": cm["argmax_agreement"], "logit_cosine": cm["logit_cosine"]},
            "carrier": carrier, "output_ids": main["output_ids"], "reference_ids": want[len(prompt):],
            "compact_greedy_ids_equal": prompt + compact["output_ids"] == want,
            "compact_logit_cosine_min": cm["logit_cosine_min"],
            "tokens_per_s": main["tokens_per_s"], "layers": main["layers"], "ok": ok}


def check_kill_after_steps(ref: dict[str, np.ndarray], kill_after_steps: int) -> None:
    """Raise ``ValueError`` unless ``kill_after_steps`` is in ``1 .. new tokens − 2`` of the
    generation reference ``ref`` (the kill must land while decode steps remain)."""
    n_new = int(ref["greedy_ids"].shape[1] - ref["input_ids"].shape[1])
    if not 1 <= kill_after_steps <= n_new - 2:
        raise ValueError(f"--kill-holder-after-steps must be in 1..{n_new - 2} (the reference has {n_new} new "
                         f"tokens), got {kill_after_steps}")


def verify_generation_under_kill(url: str, model_id: str, reference: str | Path, kill_after_steps: int,
                                 stop, kill, hold_s: float = 0.5) -> dict:
    """Greedy generation of the reference prompt (f32 carriers) with one holder SIGKILLed
    mid-decode: the churn check of ``verify_generate --kill-holder-after-steps``.

    Streams ``POST {url}/v1/completions`` (SSE, ``stream_options.include_usage``); once the
    prefill token and ``kill_after_steps`` decode tokens arrived, ``stop()`` freezes the
    victim (SIGSTOP: the batches the running steps send it stay in flight), and after
    ``hold_s`` seconds (below the batch deadline) ``kill()`` SIGKILLs it and returns its
    provider id. Its in-flight batches then fail and go to the other holder of each expert
    (failover) or to the site's fallback replica. Returns ``{killed, kill_after_steps,
    greedy_ids_equal, output_ids, failovers (failures naming the victim), fallback (batches
    the fallback replica ran), replans, served_after_kill (the victim among the holders of
    the last step), ok}``; ``ok``: ids equal to ``greedy_ids``, the victim's batches were
    served elsewhere (``failovers + fallback > 0``) and it served nothing in the last step.
    Raises ``ValueError`` for a bad reference or ``kill_after_steps`` outside
    ``1 .. new tokens − 2`` (the kill must land while steps remain), and ``RuntimeError``
    when the stream ends with an error.
    """
    import json
    import httpx

    ref = generation_reference(reference)
    check_kill_after_steps(ref, kill_after_steps)
    prompt = [int(t) for t in ref["input_ids"][0]]
    want = [int(t) for t in ref["greedy_ids"][0]][len(prompt):]
    body = {"model": model_id, "prompt": prompt, "max_tokens": len(want), "temperature": 0, "carrier": "f32",
            "stream": True, "stream_options": {"include_usage": True}}
    ids: list[int] = []
    killed, usage = None, None
    with httpx.Client(timeout=300) as client, client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"/v1/completions answered {resp.status_code}: {resp.read().decode()[:500]}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(f"generation failed after the kill: {chunk['error']['message']}")
            if chunk.get("usage"):
                usage = chunk
            for c in chunk.get("choices", []):
                ids += c["token_ids"]
            if killed is None and len(ids) >= 1 + kill_after_steps:
                stop()
                time.sleep(hold_s)
                killed = kill()
    if usage is None or killed is None:
        raise RuntimeError("the stream ended without its usage chunk or before the kill")
    layers = usage["layers"]
    failovers = sum(1 for f in layers["failures"] if f.get("provider") == killed)
    fallback = int(layers["transports"].get("fallback", 0))
    last = layers["holders_by_step"][-1] if layers["holders_by_step"] else []
    equal = ids == want
    return {"killed": killed, "kill_after_steps": kill_after_steps, "greedy_ids_equal": equal, "output_ids": ids,
            "failovers": failovers, "fallback": fallback, "replans": layers["replans"],
            "served_after_kill": killed in last,
            "ok": equal and failovers + fallback > 0 and killed not in last}
