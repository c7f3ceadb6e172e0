"""Token generation on the site (the backbone node): the published backbone runs here, each
MoE layer goes through the distributed forward (``router.state.Router.forward``: failover,
receipts, settlement records) and each dense MLP layer through the dense split
(``Router.dense_forward``).

The numpy backbone runs in a worker thread; its per-layer MLP calls are coroutines put
back on the caller's event loop, so holder traffic keeps flowing while the thread waits.
Hidden states stay numpy arrays from the backbone to the holders' wire and back (no JSON,
no base64 inside the process).
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np
from channels.db import database_sync_to_async
from django.conf import settings

from router import services
from router.apps import current
from router.forward import ForwardResult
from router.state import ForwardOutcomes, Router
from moe.backbone import Backbone, BackboneError
from moe.backbone.decode import Generator, Sampling, Sequence
from moe.backbone.weights import BACKBONE_KEY, load_backbone
from prepare.chat import ChatTemplate, ChatTemplateError
from prepare.dense import dense_model_id
from registry.models import MoeModel


# What ``carrier: "auto"`` means for a whole-model generation: f16 rows out, bf16 back
# (``wire.choose_carrier("f16")``). Every token crosses the wire at every layer, so the
# carrier's error compounds over depth: Q8_0 rows (the layer forward's "auto", ~5e-3 per
# value) put 1.2 % error on the DeepSeek fixture's residual stream by its third layer and
# flipped a near-tie routing choice there (prompt-logit cosine 0.9964); f16 rows (~3e-4) keep
# it at 0.24 % (cosine 0.999995).
GENERATION_AUTO_CARRIER = "f16"


def generation_carrier(carrier: str) -> str:
    """The layer forwards' ``carrier`` for a generation's ``carrier`` (``auto`` →
    ``GENERATION_AUTO_CARRIER``, anything else unchanged)."""
    return GENERATION_AUTO_CARRIER if carrier == "auto" else carrier


class NoBackbone(BackboneError):
    """The model is unknown here or was published without its backbone."""


@dataclass
class ServedModel:
    """A model this site can generate with: its backbone, MoE layers, dense layers, the
    optional ``tokenizers.Tokenizer`` (None: token ids in and out) and the checkpoint's chat
    template (None: ``prepare.chat.plain_chat``)."""

    model_id: str
    backbone: Backbone
    moe_layers: frozenset[int]
    dense_layers: frozenset[int]
    tokenizer: object | None
    chat_template: ChatTemplate | None = None


def served_model(model_id: str) -> ServedModel:
    """Load (once per published content, kept by the process's ``Router``) the backbone of
    ``model_id`` from its blobs.

    Raises ``NoBackbone`` (field ``model_id``) for an unknown model or one without a
    published backbone, ``BackboneError`` for a malformed one or a chat template that does
    not compile.
    """
    m = MoeModel.objects.filter(model_id=model_id).first()
    if m is None:
        raise NoBackbone(f"model {model_id!r} is not published on this site")
    record = (m.config or {}).get(BACKBONE_KEY)
    if not record:
        raise NoBackbone(f"model {model_id!r} has experts but no backbone: publish it with "
                         f"prepare.backbone.publish_backbone (tenzro_cluster and verify_generate do)")
    chat = record.get("chat_template")
    key = (model_id, tuple(sorted(record["blobs"].items())), record.get("tokenizer"),
           json.dumps(chat, sort_keys=True) if chat else None)
    router = current()
    with router.models_lock:
        hit = router.models.get(key)
    if hit is not None:
        return hit
    config = {k: v for k, v in m.config.items() if k != BACKBONE_KEY}
    backbone = load_backbone(config, record, lambda h: services.site_fetch(f"tenzro://blob/{h}"))
    dense = MoeModel.objects.filter(model_id=dense_model_id(model_id)).first()
    tokenizer = None
    if record.get("tokenizer"):
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_str(services.site_fetch(f"tenzro://blob/{record['tokenizer']}").decode())
    try:
        template = ChatTemplate(chat["template"], chat.get("special_tokens") or {}) if chat else None
    except ChatTemplateError as exc:
        raise BackboneError(f"model {model_id!r}: {exc}") from exc
    served = ServedModel(model_id, backbone, frozenset(m.moe_layers),
                         frozenset(dense.moe_layers) if dense else frozenset(), tokenizer, template)
    with router.models_lock:
        router.models[key] = served
    return served


def served_models() -> list[tuple[str, object]]:
    """(model_id, created datetime) of every model published with a backbone (those
    ``generate`` serves), by model id."""
    return [(m.model_id, m.created) for m in MoeModel.objects.order_by("model_id").only("model_id", "created", "config")
            if (m.config or {}).get(BACKBONE_KEY)]


class LayerStats:
    """What the distributed layer forwards of one generation took (summed over calls; the
    holders also per step, step 0 being the prefill)."""

    def __init__(self):
        self.forward_ids: list[str] = []
        self.batches = self.replans = self.receipts = self.bytes_out = self.bytes_back = 0
        self.failures: list[dict] = []
        self.transports: dict[str, int] = {}
        self.holders: set[str] = set()
        self.holders_by_step: list[set[str]] = []

    def add(self, fid: str, res: ForwardResult, step: int = 0) -> None:
        """Count one layer forward ``res`` as ``fid`` of decode step ``step``."""
        self.forward_ids.append(fid)
        while len(self.holders_by_step) <= step:
            self.holders_by_step.append(set())
        self.holders_by_step[step].update(res.holders)
        self.batches += res.batches
        self.replans += res.replans
        self.receipts += len(res.receipts)
        self.bytes_out += res.bytes_out
        self.bytes_back += res.bytes_back
        self.failures += res.failures
        self.holders.update(res.holders)
        for k, v in res.transports.items():
            self.transports[k] = self.transports.get(k, 0) + v

    def to_json(self) -> dict:
        return {"forwards": len(self.forward_ids), "batches": self.batches, "replans": self.replans,
                "receipts": self.receipts, "failures": self.failures, "transports": self.transports,
                "holders": sorted(self.holders), "holders_by_step": [sorted(h) for h in self.holders_by_step],
                "wire": {"bytes_out": self.bytes_out, "bytes_back": self.bytes_back}}


class GenerationCancelled(Exception):
    """The generation's caller went away (its task was cancelled): the worker thread stops."""


def distributed_mlp(router: Router, served: ServedModel, loop: asyncio.AbstractEventLoop, carrier: str,
                    stats: LayerStats, gen_id: str, fallback: bool = True, outcomes: ForwardOutcomes | None = None,
                    cancelled: threading.Event | None = None):
    """The backbone's ``mlp(layer, x f32 [T, H]) -> f32 [T, H]`` callback for a worker thread:
    MoE layers by ``router.forward``, dense layers by ``router.dense_forward``, run on ``loop``
    with the arrays themselves; with ``fallback`` the site's replica serves batches every
    remote holder failed; ``outcomes``: where the forwards' holder outcomes and settlement
    records gather (None: recorded per forward); ``cancelled``: once set, the next layer call
    raises ``GenerationCancelled`` (a thread cannot be stopped from outside).

    Raises ``BackboneError`` for a layer that is neither, ``GenerationCancelled``, and whatever
    the forward raises (``ForwardError``, ``GateNotLoaded``)."""
    steps: dict[int, int] = {}

    def mlp(layer: int, x: np.ndarray) -> np.ndarray:
        if cancelled is not None and cancelled.is_set():
            raise GenerationCancelled(f"generation {gen_id} cancelled: its caller went away")
        if layer in served.moe_layers:
            coro = router.forward(served.model_id, layer, x, carrier=carrier, fallback=fallback, outcomes=outcomes)
        elif layer in served.dense_layers:
            coro = router.dense_forward(served.model_id, layer, x, carrier=carrier, fallback=fallback,
                                        outcomes=outcomes)
        else:
            raise BackboneError(f"layer {layer} of {served.model_id!r} has neither published experts nor dense "
                                f"slices")
        res = asyncio.run_coroutine_threadsafe(coro, loop).result()
        step = steps.get(layer, 0)
        steps[layer] = step + 1
        stats.add(f"{gen_id}/{step}/{layer}", res, step)
        return res.output

    return mlp


def encode_prompts(served: ServedModel, prompt, field: str = "input_ids") -> list[np.ndarray]:
    """Prompts as id arrays: text (one string or a list) through the tokenizer, or ids (one
    list or a list of lists). Raises ``BackboneError`` naming ``field``, the parameter the
    caller got the prompt in (``input_ids``, ``prompt``)."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)):
        if served.tokenizer is None:
            raise BackboneError(f"{field}: model {served.model_id!r} ships no tokenizer.json, so text is not "
                                f"accepted; send token ids", field)
        texts = [prompt] if isinstance(prompt, str) else prompt
        return [np.asarray(served.tokenizer.encode(t).ids, dtype=np.int64) for t in texts]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [np.asarray(prompt, dtype=np.int64)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) and p and
                                                   all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                                                   for p in prompt):
        return [np.asarray(p, dtype=np.int64) for p in prompt]
    raise BackboneError(f"{field} must be a non-empty list of token ids, a list of such lists, or text", field)


MAX_STOP_IDS = 64  # stop token ids of one generation (checked per chosen token)


def check_size(served: ServedModel, prompts: list[np.ndarray], sampling: Sampling, prompt_field: str = "input_ids",
               tokens_field: str = "max_new_tokens") -> None:
    """Refuse a generation before any work: more prompts than ``GEN_MAX_PROMPTS``, more prompt
    tokens together than ``GEN_MAX_PROMPT_TOKENS``, more new tokens together (prompts ×
    ``max_new_tokens``) than ``GEN_MAX_NEW_TOKENS`` (settings ``TENZRO_GEN_*``), an id outside
    the vocabulary, a prompt that leaves no room in the context, more than ``MAX_STOP_IDS``
    stop ids or one outside the vocabulary. The one place every generation entry point
    (``tenzro_moeGenerate``, the OpenAI endpoints) checks its size.

    Raises ``BackboneError`` naming ``prompt_field`` / ``tokens_field`` / ``stop``.
    """
    limits = settings.TENZRO
    vocab, context = served.backbone.vocab_size, served.backbone.max_position
    if len(prompts) > limits["GEN_MAX_PROMPTS"]:
        raise BackboneError(f"{prompt_field}: {len(prompts)} prompts; this site takes at most "
                            f"{limits['GEN_MAX_PROMPTS']} per request (TENZRO_GEN_MAX_PROMPTS)", prompt_field)
    total = int(sum(p.size for p in prompts))
    if total > limits["GEN_MAX_PROMPT_TOKENS"]:
        raise BackboneError(f"{prompt_field}: {total} prompt tokens; this site takes at most "
                            f"{limits['GEN_MAX_PROMPT_TOKENS']} per request (TENZRO_GEN_MAX_PROMPT_TOKENS)",
                            prompt_field)
    new = len(prompts) * sampling.max_new_tokens
    if new > limits["GEN_MAX_NEW_TOKENS"]:
        raise BackboneError(f"{tokens_field}: {len(prompts)} prompt(s) × {sampling.max_new_tokens} new tokens = "
                            f"{new}; this site generates at most {limits['GEN_MAX_NEW_TOKENS']} per request "
                            f"(TENZRO_GEN_MAX_NEW_TOKENS)", tokens_field)
    for i, p in enumerate(prompts):
        where = f"{prompt_field}[{i}]" if len(prompts) > 1 else prompt_field
        if p.size == 0:
            raise BackboneError(f"{where}: a prompt needs at least one token", prompt_field)
        if p.min() < 0 or p.max() >= vocab:
            raise BackboneError(f"{where}: token ids must be in 0..{vocab - 1}", prompt_field)
        if p.size >= context:
            raise BackboneError(f"{where}: the prompt has {p.size} tokens; the context holds {context} with room "
                                f"for one new token", prompt_field)
    if len(sampling.stop) > MAX_STOP_IDS:
        raise BackboneError(f"stop: {len(sampling.stop)} stop ids; at most {MAX_STOP_IDS}", "stop")
    for i, t in enumerate(sampling.stop):
        if not 0 <= t < vocab:
            raise BackboneError(f"stop.{i}: token id {t} is outside the vocabulary 0..{vocab - 1}", "stop")


def decode_text(served: ServedModel, ids: list[int]) -> str | None:
    """Text of ``ids`` when the model has a tokenizer, else None."""
    return served.tokenizer.decode(ids) if served.tokenizer is not None else None


async def generate(model_id: str, prompt, sampling: Sampling, carrier: str = "auto", return_logits: bool = False,
                   on_tokens=None, fallback: bool = True, prompt_field: str = "input_ids",
                   tokens_field: str = "max_new_tokens") -> dict:
    """``tenzro_moeGenerate``: prefill and decode ``prompt`` (see ``encode_prompts``) on the
    published backbone with distributed MLP layers.

    ``carrier``: of every layer forward, ``auto`` being ``GENERATION_AUTO_CARRIER``.
    ``on_tokens(list[Sequence])`` is called from the worker thread as tokens are chosen.
    ``fallback`` (default on): the site's fallback replica (``router.fallback``) runs
    batches that every remote holder failed. ``prompt_field``/``tokens_field``: the caller's
    names of the prompt and of ``max_new_tokens``, named by size errors (``check_size``).
    Cancelling the awaiting task stops the worker thread at its next layer.
    Returns ``{model_id, output_ids ([ids] for one prompt, [[ids], …] for several), text?,
    finish_reasons, prompt_logits? (f32 array [T, vocab]; one prompt only), forward_ids
    (one per distributed layer forward: generation/step/layer), layers (batches, receipts,
    failures, transports, wire), timings_ms, tokens_per_s}``. Raises ``NoBackbone``,
    ``BackboneError`` and the forward's errors.
    """
    t0 = time.perf_counter()
    served = await database_sync_to_async(served_model)(model_id)
    prompts = encode_prompts(served, prompt, prompt_field)
    check_size(served, prompts, sampling, prompt_field, tokens_field)
    if return_logits and len(prompts) != 1:
        raise BackboneError("return_logits needs exactly one prompt", "return_logits")
    stats = LayerStats()
    gen_id = uuid.uuid4().hex[:12]
    loop = asyncio.get_running_loop()
    # Holder outcomes and settlement records of every layer forward go to the DB together
    # (every few seconds and at the end), not once per layer and step (ForwardOutcomes).
    router = current()
    outcomes = ForwardOutcomes(router)
    cancelled = threading.Event()
    gen = Generator(served.backbone, distributed_mlp(router, served, loop, generation_carrier(carrier), stats,
                                                     gen_id, fallback, outcomes, cancelled), sampling)
    try:
        seqs: list[Sequence] = await asyncio.to_thread(gen.run, prompts, return_logits, on_tokens)
    except asyncio.CancelledError:  # the client went away (Django cancels the view): stop computing
        cancelled.set()
        raise
    finally:
        outcomes.close()
    total = (time.perf_counter() - t0) * 1e3
    new = sum(len(s.output) for s in seqs)
    decode_tokens = new - len(seqs)
    single = not (isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)))
    outs = [s.output for s in seqs]
    result = {"model_id": model_id, "output_ids": outs[0] if single else outs,
              "finish_reasons": [s.finish_reason for s in seqs], "forward_ids": stats.forward_ids,
              "layers": stats.to_json(), "prompt_tokens": int(sum(p.size for p in prompts)),
              "timings_ms": {"prefill": round(gen.timings["prefill_ms"], 3),
                             "decode": round(gen.timings["decode_ms"], 3), "total": round(total, 3)},
              "tokens_per_s": round(new / (total / 1e3), 3) if total > 0 else None,
              "decode_tokens_per_s": (round(decode_tokens / (gen.timings["decode_ms"] / 1e3), 3)
                                      if gen.timings["decode_ms"] > 0 else None)}
    if served.tokenizer is not None:
        texts = [decode_text(served, o) for o in outs]
        result["text"] = texts[0] if single else texts
    if return_logits:
        result["prompt_logits"] = seqs[0].prompt_logits
    return result
