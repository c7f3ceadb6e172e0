"""Token generation on the site (the backbone node): the published backbone runs here, each
MoE layer goes through the distributed forward (``router.state.Router.forward``: failover,
receipts, settlement records) and each dense MLP layer through the dense split
(``Router.dense_forward``).

Every generation's sequences run in the model's continuous-batching scheduler
(``router.scheduler``): one task per model on the event loop steps all running sequences
together and awaits each layer's MLP call there (its backbone compute runs on the loop while
short, in a worker thread when long), so holder traffic keeps flowing while a step waits.
Hidden states stay numpy arrays from the backbone to the holders' wire and back (no JSON,
no base64 inside the process).
"""
from __future__ import annotations

import asyncio
import functools
import json
import uuid
from dataclasses import dataclass

import numpy as np
from channels.db import database_sync_to_async
from django.conf import settings

from router import services
from router.apps import current
from router.detokenize import MAX_STOP_CHARS, Detokenizer
from router.forward import ForwardResult
from router.scheduler import Request, Reservation, scheduler_for
from moe.backbone import Backbone, BackboneError
from moe.backbone.decode import Sampling, Sequence
from moe.backbone.weights import BACKBONE_KEY, load_backbone
from prepare.backbone import how_to_publish
from prepare.chat import ChatTemplate, ChatTemplateError
from prepare.dense import dense_model_id
from registry.models import MoeModel


# What ``carrier: "auto"`` means for a whole-model generation: f16 rows out and back
# (``wire.choose_carrier("f16")``). Every token crosses the wire at every layer, so the
# carrier's error compounds over depth: Q8_0 rows (the layer forward's "auto", ~5e-3 per
# value) put 1.2 % error on the DeepSeek fixture's residual stream by its third layer and
# flipped a near-tie routing choice there (prompt-logit cosine 0.9964); f16 rows (~3e-4) keep
# it at 0.24 % (cosine 0.999995). bf16 rows back (~2e-3) flipped routing in a Kimi-K2-like
# model's last layer (cosine 0.9962; 0.9999998 with f16 back: bench/carrier_error.py).
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

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters in the longest entry of the tokenizer's vocabulary (added tokens
        included; 1 without a tokenizer): no token of the vocabulary spells more text, so a
        prompt text longer than ``GEN_MAX_PROMPT_TOKENS`` times this cannot fit the token
        cap (``check_text_size``). Computed once per served model."""
        if self.tokenizer is None:
            return 1
        return max((len(t) for t in self.tokenizer.get_vocab(with_added_tokens=True)), default=1)

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``: the tokenizer's decode (special tokens skipped), or without a
        tokenizer the ids written out in decimal, separated by spaces."""
        return self.tokenizer.decode(ids) if self.tokenizer is not None else " ".join(str(t) for t in ids)

    def detokenizer(self, sampling: Sampling) -> Detokenizer:
        """A ``router.detokenize.Detokenizer`` for one sequence under ``sampling``'s stops."""
        return Detokenizer(self.decode, sampling.stop, sampling.stop_strings)


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
        raise NoBackbone(f"model {model_id!r} has experts but no backbone: {how_to_publish(model_id)}")
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
    served.max_token_chars  # noqa: B018 - read the vocabulary here (a thread), not on a request's event loop
    with router.models_lock:
        router.models[key] = served
    return served


async def served_model_cached(model_id: str) -> ServedModel:
    """``served_model`` from the router's TTL cache (``Router.fresh_or_load``, ``view_cache_s``: a
    republished backbone is seen as late as a changed shard view is) without a thread hop; a
    miss reads the database on the site's DB thread, once for all requests that missed
    together. Raises what ``served_model`` raises (errors are not cached)."""
    return await current().fresh_or_load(("served", model_id), lambda: database_sync_to_async(served_model)(model_id))


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


#: Prompt texts of one request together longer than this many characters are tokenized in a
#: worker thread by ``encode_prompts_async`` (the tokenizer's batch call releases the GIL), so
#: a long prompt does not stall the event loop every stream and request of the site runs on.
INLINE_TOKENIZE_CHARS = 16384


def _prompt_texts(prompt) -> list[str] | None:
    """The texts of a text prompt (one string or a non-empty list of strings), else None."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return prompt
    return None


def check_text_size(served: ServedModel, texts: list[str], field: str) -> None:
    """Refuse, before tokenizing, prompt text that cannot fit ``GEN_MAX_PROMPT_TOKENS``: more
    characters in all of ``texts`` together than the cap times the model's longest token
    (``ServedModel.max_token_chars``). Tokenizing a 30 MB prompt only to count it over the
    cap held the event loop, and with it every request of the site, for 25 s.

    Raises ``BackboneError`` naming ``field``."""
    cap = int(settings.TENZRO["GEN_MAX_PROMPT_TOKENS"])
    chars, longest = sum(len(t) for t in texts), served.max_token_chars
    if chars > cap * longest:
        raise BackboneError(f"{field}: {chars} characters of prompt text; this site takes at most {cap} prompt "
                            f"tokens per request (TENZRO_GEN_MAX_PROMPT_TOKENS), which hold at most "
                            f"{cap * longest} characters of model {served.model_id!r}'s vocabulary (its longest "
                            f"token has {longest})", field)


def tokenize(served: ServedModel, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
    """Token ids of each of ``texts`` (the tokenizer's batch call: it releases the GIL, so a
    worker thread running it leaves the event loop free)."""
    return [e.ids for e in served.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)]


def encode_prompts(served: ServedModel, prompt, field: str = "input_ids") -> list[np.ndarray]:
    """Prompts as id arrays: text (one string or a list) through the tokenizer, or ids (one
    list or a list of lists). Text over the size cap is refused untokenized
    (``check_text_size``). Raises ``BackboneError`` naming ``field``, the parameter the
    caller got the prompt in (``input_ids``, ``prompt``). Runs where it is called; the
    serving paths call ``encode_prompts_async``."""
    texts = _prompt_texts(prompt)
    if texts is not None:
        if served.tokenizer is None:
            raise BackboneError(f"{field}: model {served.model_id!r} ships no tokenizer.json, so text is not "
                                f"accepted; send token ids", field)
        check_text_size(served, texts, field)
        out = [np.asarray(ids, dtype=np.int64) for ids in tokenize(served, texts)]
        for i, (t, p) in enumerate(zip(texts, out)):
            if not p.size and t:  # (an empty text is check_size's "needs at least one token")
                where = field if isinstance(prompt, str) else f"{field}[{i}]"
                raise BackboneError(f"{where}: the text encodes to no tokens of model {served.model_id!r}'s "
                                    f"vocabulary (none of its characters is in it)", field)
        return out

    def ids(p: list) -> np.ndarray:
        try:
            return np.asarray(p, dtype=np.int64)
        except OverflowError:  # an id past int64 (2**63): outside every vocabulary
            raise BackboneError(f"{field}: token ids must be in 0..{served.backbone.vocab_size - 1}", field) from None

    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [ids(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) and p and
                                                   all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                                                   for p in prompt):
        return [ids(p) for p in prompt]
    raise BackboneError(f"{field} must be a non-empty list of token ids, a list of such lists, or text", field)


async def encode_prompts_async(served: ServedModel, prompt, field: str = "input_ids") -> list[np.ndarray]:
    """``encode_prompts`` on the event loop, or in a worker thread when the prompt is text of
    more than ``INLINE_TOKENIZE_CHARS`` characters (oversized text is still refused before
    any tokenizing). Raises what ``encode_prompts`` raises."""
    texts = _prompt_texts(prompt)
    if texts is not None and served.tokenizer is not None and sum(len(t) for t in texts) > INLINE_TOKENIZE_CHARS:
        check_text_size(served, texts, field)
        return await asyncio.to_thread(encode_prompts, served, prompt, field)
    return encode_prompts(served, prompt, field)


MAX_STOPS = 64  # stop token ids and stop strings of one generation (each checked per chosen token)


def new_token_limit(served: ServedModel, prompts: list[np.ndarray]) -> tuple[int, str]:
    """The most new tokens each of ``prompts`` may ask for here, and why: the smallest of
    the context left after the longest prompt (OpenAI: prompt + completion ≤ context), the
    site's ``GEN_MAX_NEW_TOKENS`` shared by the prompts, and the KV cache budget
    (``GEN_KV_BUDGET_BYTES``) per sequence. The one limit every entry point reports."""
    limits = settings.TENZRO
    context = served.backbone.max_position
    longest = max(int(p.size) for p in prompts)
    cap = int(limits["GEN_MAX_NEW_TOKENS"])
    budget = int(limits.get("GEN_KV_BUDGET_BYTES", 4 << 30))
    per_token = served.backbone.kv_bytes_per_token()
    prompt = "the longest prompt" if len(prompts) > 1 else "the prompt"
    shared = f" shared by {len(prompts)} prompts" if len(prompts) > 1 else ""
    return min((context - longest, f"this model's maximum context length is {context} tokens and {prompt} has "
                                   f"{longest}"),
               (cap // len(prompts), f"this site generates at most {cap} tokens per request{shared} "
                                     f"(TENZRO_GEN_MAX_NEW_TOKENS)"),
               (budget // max(1, per_token) - longest, f"a sequence may hold at most {budget} bytes of KV cache "
                                                      f"({per_token} per token; TENZRO_KV_BUDGET_BYTES) and "
                                                      f"{prompt} has {longest} tokens"),
               key=lambda lim: lim[0])


def check_size(served: ServedModel, prompts: list[np.ndarray], sampling: Sampling, prompt_field: str = "input_ids",
               tokens_field: str = "max_new_tokens") -> None:
    """Refuse a generation before any work: more prompts than ``GEN_MAX_PROMPTS``, more prompt
    tokens together than ``GEN_MAX_PROMPT_TOKENS`` (settings ``TENZRO_GEN_*``), an id outside
    the vocabulary, a prompt that leaves no room in the context, more new tokens than
    ``new_token_limit`` (one limit, one message, whichever bound binds), more than
    ``MAX_STOPS`` stops, a stop id outside the vocabulary or a stop string over
    ``MAX_STOP_CHARS``. The one place every generation entry point (``tenzro_moeGenerate``,
    the OpenAI endpoints) checks its size.

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
    for i, p in enumerate(prompts):
        where = f"{prompt_field}[{i}]" if len(prompts) > 1 else prompt_field
        if p.size == 0:
            raise BackboneError(f"{where}: a prompt needs at least one token", prompt_field)
        if p.min() < 0 or p.max() >= vocab:
            raise BackboneError(f"{where}: token ids must be in 0..{vocab - 1}", prompt_field)
        if p.size >= context:
            raise BackboneError(f"{where}: the prompt has {p.size} tokens; the context holds {context} with room "
                                f"for one new token", prompt_field)
    limit, why = new_token_limit(served, prompts)
    if sampling.max_new_tokens > limit:
        raise BackboneError(f"{tokens_field}: at most {max(limit, 0)} new tokens fit this request ({why}); "
                            f"you asked for {sampling.max_new_tokens}", tokens_field)
    stops = len(sampling.stop) + len(sampling.stop_strings)
    if stops > MAX_STOPS:
        raise BackboneError(f"stop: {stops} stops; at most {MAX_STOPS}", "stop")
    for i, t in enumerate(sampling.stop):
        if not 0 <= t < vocab:
            raise BackboneError(f"stop.{i}: token id {t} is outside the vocabulary 0..{vocab - 1}", "stop")
    for text in sampling.stop_strings:
        if len(text) > MAX_STOP_CHARS:
            raise BackboneError(f"stop: a stop string has {len(text)} characters; at most {MAX_STOP_CHARS}", "stop")


def reserve_capacity(served: ServedModel, prompts: int = 1) -> Reservation:
    """Room for ``prompts`` sequences in the model's scheduler queue (``TENZRO_GEN_QUEUE``),
    taken now for a ``generate(..., reservation=)`` to come: the streaming endpoint decides
    its 429 before its 200 goes out, and concurrent requests cannot overflow the queue
    between that decision and the submission. Raises ``Busy`` (HTTP 429 / -32005 with
    ``retry_after_s``) when the queue is full. Called on the event loop."""
    return scheduler_for(current(), served).reserve(prompts)


async def generate(model_id: str, prompt, sampling: Sampling, carrier: str = "auto", return_logits: bool = False,
                   on_tokens=None, fallback: bool = True, prompt_field: str = "input_ids",
                   tokens_field: str = "max_new_tokens", reservation: Reservation | None = None) -> dict:
    """``tenzro_moeGenerate``: prefill and decode ``prompt`` (see ``encode_prompts``) on the
    published backbone with distributed MLP layers, every sequence batched with the others
    of the model in its scheduler (``router.scheduler``: one distributed forward per layer
    per step for all running sequences; prompts prefilled in chunks).

    ``carrier``: of every layer forward, ``auto`` being ``GENERATION_AUTO_CARRIER``.
    ``on_tokens(list[Sequence])`` is called on the event loop (the scheduler's step) as tokens
    are chosen. ``fallback`` (default on): the site's fallback replica (``router.fallback``) runs
    batches that every remote holder failed. ``prompt_field``/``tokens_field``: the caller's
    names of the prompt and of ``max_new_tokens``, named by size errors (``check_size``).
    ``reservation``: queue room taken by ``reserve_capacity`` (then the queue cannot refuse it).
    Cancelling the awaiting task makes the sequences leave at the next step.
    Returns ``{model_id, output_ids ([ids] for one prompt, [[ids], …] for several), text?,
    finish_reasons, prompt_logits? (f32 array [T, vocab]; one prompt only), forward_ids
    (one per distributed layer forward the generation took part in: generation/step/layer),
    layers (batches, receipts, failures, transports, wire of those forwards, shared with the
    step's other sequences), timings_ms (queued, prefill, decode, total), tokens_per_s}``.
    Raises ``NoBackbone``, ``BackboneError``, ``Busy`` (queue full) and the forward's errors.
    """
    served = await served_model_cached(model_id)
    prompts = await encode_prompts_async(served, prompt, prompt_field)
    check_size(served, prompts, sampling, prompt_field, tokens_field)
    if return_logits and len(prompts) != 1:
        raise BackboneError("return_logits needs exactly one prompt", "return_logits")
    stats = LayerStats()
    req = Request(uuid.uuid4().hex[:12], prompts, sampling, generation_carrier(carrier), fallback, stats,
                  keep_logits=return_logits, on_tokens=on_tokens)
    scheduler = scheduler_for(current(), served)
    scheduler.submit(req, reservation)
    try:
        seqs: list[Sequence] = await req.future
    except asyncio.CancelledError:  # the client went away (Django cancels the view): free the slot
        scheduler.cancel(req)
        raise
    timings = req.timings
    total = timings["total"]
    new = sum(len(s.output) for s in seqs)
    decode_tokens = new - len(seqs)
    single = not (isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)))
    outs = [s.output for s in seqs]
    result = {"model_id": model_id, "output_ids": outs[0] if single else outs,
              "finish_reasons": [s.finish_reason for s in seqs], "forward_ids": stats.forward_ids,
              "layers": stats.to_json(), "prompt_tokens": int(sum(p.size for p in prompts)),
              "timings_ms": timings,
              "tokens_per_s": round(new / (total / 1e3), 3) if total > 0 else None,
              "decode_tokens_per_s": (round(decode_tokens / (timings["decode"] / 1e3), 3)
                                      if timings["decode"] > 0 else None)}
    if served.tokenizer is not None:  # each sequence's settled text: stops left out (router.detokenize)
        texts = [s.text for s in seqs]
        result["text"] = texts[0] if single else texts
    if return_logits:
        result["prompt_logits"] = seqs[0].prompt_logits
    return result
