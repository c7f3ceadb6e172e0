"""OpenAI-compatible ``POST /v1/completions`` and ``POST /v1/chat/completions`` over
``router.generate`` (thin views: parse, call the service, shape the answer).

Text in and out when the checkpoint ships ``tokenizer.json`` (``tokenizers`` library);
otherwise ``/v1/completions`` takes token ids as ``prompt`` (a list of ints, or a list of
such lists, as the OpenAI API allows) and answers each choice's ``text`` as the generated
ids separated by spaces, with the ids also in ``token_ids``. ``stream: true`` answers
Server-Sent Events (``data: {chunk}`` … ``data: [DONE]``); each chunk carries only newly
settled text: whole characters (a character split over byte tokens waits for its last
byte) and nothing a stop string may still claim (``router.detokenize``). Chat applies the
checkpoint's chat template (``prepare.chat``) or, without one, the plain ``<role>:
<content>`` rendering; a message's ``content`` is a string or a list of text parts
(``[{"type": "text", "text": …}]``, joined by newlines). Extensions: ``top_k`` and
``carrier``. ``stop`` takes strings of any length (matched on the decoded text, across
token boundaries, and left out of the answer like OpenAI's) and, as an extension, token
ids; at most ``MAX_STOPS``. ``GET /v1/models`` lists the models this site generates with,
``GET /v1/models/{model}`` retrieves one. Errors follow OpenAI's shape ``{"error":
{"message", "type", "param", "code"}}`` with HTTP 400/404/413/429 (any other ``/v1/`` path:
JSON 404; an unexpected failure: JSON 500, never an HTML page).

Parameters, like OpenAI's own server: a field it does not know is refused (400 "unrecognized
request argument", naming it); OpenAI parameters this server cannot honour (``logprobs``,
``top_logprobs``, ``echo``, ``best_of`` > 1, ``logit_bias``, ``suffix``, non-zero
``presence_penalty``/``frequency_penalty``; chat's ``tools``, ``tool_choice``,
``response_format``, ``store``, ``metadata``, ``service_tier``, ``modalities`` and the like:
``_CHAT_ONLY``) are accepted only at their no-op value (null, false, 1, {}, 0, [],
``{"type": "text"}``, ...) and otherwise refused (400 "... is not supported", naming it); ``user`` (a
string) is accepted and ignored. ``max_tokens`` has one upper limit, reported in one message: the
smallest of the context left after the prompt, the site's new-token cap and the KV budget
(``router.generate.new_token_limit``). Every check, including the generation size
(``router.generate.check_size``) and admission to the generation queue
(``router.generate.reserve_capacity``: a full queue is 429 with ``Retry-After``), runs before
a stream starts, so a refused request gets its 4xx, never a 200 stream with an error. A
client that disconnects cancels its generation (``router.generate.generate``).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from channels.db import database_sync_to_async
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from moe import jsonrpc, wire
from moe.jsonrpc import ParamError
from router.admission import Busy, check_forward_rate
from moe.backbone import BackboneError
from moe.backbone.decode import Sampling
from prepare.chat import ChatTemplateError, plain_chat
from router.forward import ForwardError
from router.detokenize import settled_text
from router.generate import (INLINE_TOKENIZE_CHARS, MAX_STOPS, NoBackbone, ServedModel, check_size, check_text_size,
                             encode_prompts_async, generate, reserve_capacity, served_models, served_model_cached,
                             tokenize)
from moe.runtime import GateNotLoaded

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An OpenAI-style error answer: HTTP ``status``, ``message``, the offending ``param``,
    ``kind`` (OpenAI's ``type``) and ``code`` (``model_not_found``, …; None by default)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 retry_after_s: float | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.retry_after_s, self.code = retry_after_s, code

    def response(self) -> JsonResponse:
        """The error as JSON with its HTTP status (and ``Retry-After`` when one is known)."""
        headers = {"Retry-After": str(max(1, int(self.retry_after_s + 0.999)))} if self.retry_after_s else None
        return JsonResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status=self.status, headers=headers)


#: The chat roles OpenAI's API accepts; anything else is refused naming the message.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def _body(request: HttpRequest) -> dict:
    try:
        raw = request.body or b"{}"
    except RequestDataTooBig:
        raise ApiError(413, f"request body is over the {settings.DATA_UPLOAD_MAX_MEMORY_SIZE}-byte limit "
                            f"(TENZRO_MAX_BODY)") from None
    try:
        body = jsonrpc.loads(raw)
    except ParamError as exc:  # nested too deeply, a lone surrogate (named by its path)
        raise ApiError(400, f"request body refused: {exc}", exc.field) from None
    except ValueError as exc:  # bad UTF-8/JSON, a 4,300-digit integer
        raise ApiError(400, f"request body is not JSON: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


# Parameters each endpoint knows; ``UNSUPPORTED`` ones only at their no-op values.
_COMMON = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream", "stream_options",
           "stop", "seed", "user", "logprobs", "logit_bias", "presence_penalty", "frequency_penalty", "top_k",
           "carrier"}
# Chat parameters of OpenAI's API about what this server does not have (tools, structured
# output, stored completions, tiers, audio, reasoning): a known name, so "not supported" at any
# value but its no-op one, never "unrecognized" (a client sending ``store: false`` or
# ``response_format: {"type": "text"}`` gets its answer).
_CHAT_ONLY = {"store": (None, False), "metadata": (None, {}), "service_tier": (None, "auto", "default"),
              "response_format": (None, {"type": "text"}), "tools": (None, []), "tool_choice": (None, "none"),
              "parallel_tool_calls": (None, True, False), "functions": (None, []), "function_call": (None, "none"),
              "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,), "reasoning_effort": (None,),
              "web_search_options": (None,), "verbosity": (None,)}
KNOWN = {False: _COMMON | {"prompt", "echo", "best_of", "suffix"},
         True: _COMMON | {"messages", "top_logprobs"} | set(_CHAT_ONLY)}
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
               "logit_bias": (None, {}), "suffix": (None,), "presence_penalty": (None, 0),
               "frequency_penalty": (None, 0), **_CHAT_ONLY}


def _same(v, n) -> bool:
    """JSON value ``v`` equals ``n`` (a number equals a number, never a boolean: ``0 != false``)."""
    if n is None or isinstance(n, bool):
        return v is n
    if isinstance(n, (int, float)):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v == n
    return type(v) is type(n) and v == n


def check_params(body: dict, chat: bool) -> None:
    """Refuse (400, naming the parameter) a field the endpoint does not know, and an OpenAI
    parameter this server cannot honour at a value other than its no-op one."""
    for name in body:
        if name not in KNOWN[chat]:
            raise ApiError(400, f"unrecognized request argument supplied: {name}", name)
    for name, noop in UNSUPPORTED.items():
        v = body.get(name)
        if name in body and not any(_same(v, n) for n in noop):
            allowed = " or ".join(json.dumps(n) for n in noop)
            raise ApiError(400, f"{name} is not supported by this server (give {allowed} or leave it out)", name)


def _number(body: dict, name: str, default, kind=float, lo=None, hi=None):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
        raise ApiError(400, f"{name} must be {'an integer' if kind is int else 'a number'}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"in [{lo}, {hi}]" if lo is not None and hi is not None else f"≥ {lo}" if lo is not None else f"≤ {hi}"
        raise ApiError(400, f"{name} must be {rng}, got {v}", name)
    return kind(v)


def _flag(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise ApiError(400, f"{name} must be a boolean", name)
    return bool(v)


def _stops(served: ServedModel, stop) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``stop`` as (token ids, strings): a string or a list of strings (OpenAI's stop
    sequences, any length: matched on the decoded text, ``router.detokenize``) and, as an
    extension, token ids."""
    if stop is None:
        return (), ()
    items = [stop] if isinstance(stop, (str, int)) else stop
    if not isinstance(items, list):
        raise ApiError(400, "stop must be a string, a token id or a list of them", "stop")
    if len(items) > MAX_STOPS:
        raise ApiError(400, f"stop: {len(items)} stops; at most {MAX_STOPS}", "stop")
    ids, strings = [], []
    for s in items:
        if isinstance(s, int) and not isinstance(s, bool):
            ids.append(s)
        elif isinstance(s, str) and served.tokenizer is not None:
            if not s:
                raise ApiError(400, "stop: a stop string must not be empty", "stop")
            strings.append(s)
        elif isinstance(s, str):
            raise ApiError(400, "stop strings need a model with tokenizer.json; give token ids", "stop")
        else:
            raise ApiError(400, "stop must be a string, a token id or a list of them", "stop")
    return tuple(ids), tuple(strings)


def _tokens_field(body: dict) -> str:
    """The name the client gave the new-token count under (OpenAI has two)."""
    return "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"


def _sampling(served: ServedModel, body: dict) -> Sampling:
    if _number(body, "n", 1, int) != 1:
        raise ApiError(400, "n must be 1: one choice per prompt (send several prompts for several completions)", "n")
    field = _tokens_field(body)
    stop_ids, stop_strings = _stops(served, body.get("stop"))
    try:  # the upper limit of max_tokens is check_size's (router.generate.new_token_limit), said once
        return Sampling(max_new_tokens=_number(body, field, 16, int, 1),
                        temperature=_number(body, "temperature", 1.0, float, 0, 2),
                        top_p=_number(body, "top_p", 1.0, float), top_k=_number(body, "top_k", 0, int, 0),
                        seed=_number(body, "seed", None, int, 0), stop=stop_ids, stop_strings=stop_strings)
    except BackboneError as exc:  # top_p's range, said once (moe.backbone.decode.Sampling)
        raise ApiError(400, str(exc), exc.field) from exc


async def _served(body: dict) -> ServedModel:
    model = body.get("model")
    if model is None or model == "":
        raise ApiError(400, "model is required (a published model id)", "model")
    if not isinstance(model, str):
        raise ApiError(400, "model must be a string (a published model id)", "model")
    try:
        return await served_model_cached(model)
    except NoBackbone as exc:
        raise _generation_error(exc) from exc
    except BackboneError as exc:  # published, but its backbone or chat template is malformed
        raise ApiError(400, str(exc), "model") from exc


def message_text(content, where: str) -> str:
    """A chat message's ``content`` as text: a string, or OpenAI's list of content parts
    ``[{"type": "text", "text": …}, …]`` whose texts are joined by newlines (as vLLM's
    OpenAI server does). Raises ``ApiError`` (400, naming ``where``) for anything else,
    other part types (images, audio) included: this server generates from text only."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise ApiError(400, f"{where} must be a string or a non-empty list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise ApiError(400, f"{where}[{j}] must be {{type: \"text\", text: string}}"
                                + (f"; {kind!r} parts are not supported (text only)" if isinstance(kind, str)
                                   and kind != "text" else ""), where)
        texts.append(part["text"])
    return "\n".join(texts)


def _chat_size(messages) -> int:
    """Characters of the text in ``messages`` (string contents and text parts) plus one per
    message and part: what rendering and tokenizing them costs (anything malformed counts
    its one and is refused by ``chat_prompt``)."""
    if not isinstance(messages, list):
        return 0
    n = len(messages)
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            n += len(content)
        elif isinstance(content, list):
            n += len(content) + sum(len(p["text"]) for p in content
                                    if isinstance(p, dict) and isinstance(p.get("text"), str))
    return n


def chat_prompt(served: ServedModel, messages) -> str | list[int]:
    """The prompt of a chat: the checkpoint's chat template applied to ``messages`` and
    tokenized without added special tokens (the template holds them), as token ids; or,
    for a checkpoint without a template, the plain rendering ``prepare.chat.plain_chat``
    as text. Raises ``ApiError`` (400) for bad messages, a template that refuses them,
    text over the prompt size cap (``router.generate.check_text_size``, checked before
    rendering and before tokenizing), or a model without ``tokenizer.json``. Long chats
    run it in a worker thread (``chat_prompt_async``)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be {{role: string, content: string or text parts}}",
                           f"messages[{i}]")
        if m["role"] not in CHAT_ROLES:
            raise ApiError(400, f"messages[{i}].role {m['role']!r} is not one of {', '.join(CHAT_ROLES)}",
                           f"messages[{i}].role")
        if "name" in m and not isinstance(m["name"], str):
            raise ApiError(400, f"messages[{i}].name must be a string", f"messages[{i}].name")
        turns.append({"role": m["role"], "content": message_text(m.get("content"), f"messages[{i}].content")})
    if served.tokenizer is None:
        raise ApiError(400, f"model {served.model_id!r} ships no tokenizer.json, so chat (text) is not available; "
                            f"use /v1/completions with token ids as prompt", "model")
    try:
        check_text_size(served, [t["content"] for t in turns], "messages")
        if served.chat_template is None:
            return plain_chat(turns)
        try:
            text = served.chat_template.render(turns)
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), "messages") from exc
        check_text_size(served, [text], "messages")
    except BackboneError as exc:
        raise ApiError(400, str(exc), exc.field) from exc
    ids = tokenize(served, [text], add_special_tokens=False)[0]
    if not ids:
        raise ApiError(400, "the chat template rendered these messages as an empty prompt", "messages")
    return ids


async def chat_prompt_async(served: ServedModel, messages) -> str | list[int]:
    """``chat_prompt`` on the event loop, or in a worker thread when the messages hold more
    than ``INLINE_TOKENIZE_CHARS`` characters of text, messages and parts (``_chat_size``:
    checking, rendering and tokenizing a long chat, or a million empty messages, would stall
    every other request and stream of the site)."""
    if _chat_size(messages) > INLINE_TOKENIZE_CHARS:
        return await asyncio.to_thread(chat_prompt, served, messages)
    return chat_prompt(served, messages)


async def _run(served: ServedModel, body: dict, prompt, chat: bool):
    """Validate everything (size included), then either the whole answer (JsonResponse) or an SSE stream."""
    sampling = _sampling(served, body)
    carrier = body.get("carrier", "auto")
    if carrier not in wire.CARRIER_CHOICES:
        raise ApiError(400, f"carrier must be one of {', '.join(wire.CARRIER_CHOICES)}", "carrier")
    stream = _flag(body, "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    unknown = sorted(set(opts) - {"include_usage"})
    if unknown:  # as unknown top-level fields are
        raise ApiError(400, f"stream_options: unknown field {unknown[0]!r} (supported: include_usage)",
                       f"stream_options.{unknown[0]}")
    include_usage = _flag(opts, "include_usage")
    if opts and not stream:  # OpenAI's rule and wording
        raise ApiError(400, "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                       "stream_options")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise ApiError(400, "user must be a string", "user")  # OpenAI's type; ignored otherwise
    prompt_field, tokens_field = ("messages" if chat else "prompt"), _tokens_field(body)
    try:
        prompts = await encode_prompts_async(served, prompt, prompt_field)
        if chat and len(prompts) != 1:
            raise ApiError(400, "one conversation per request", "messages")
        check_size(served, prompts, sampling, prompt_field, tokens_field)
    except BackboneError as exc:
        raise ApiError(400, str(exc), exc.field) from exc
    ids = [p.tolist() for p in prompts]
    fields = {"prompt_field": prompt_field, "tokens_field": tokens_field}
    cid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"
    base = {"id": cid, "created": created, "model": served.model_id}

    def choice(i: int, ids: list[int], finish) -> dict:
        text = settled_text(served.detokenizer(sampling), ids)  # the scheduler's text: stops left out
        c = {"index": i, "finish_reason": finish, "token_ids": ids}
        if chat:
            c["message"] = {"role": "assistant", "content": text}
        else:
            c.update(text=text, logprobs=None)
        return c

    if not stream:
        try:
            res = await generate(served.model_id, ids, sampling, carrier, **fields)
        except (BackboneError, ForwardError, GateNotLoaded, Busy) as exc:
            raise _generation_error(exc) from exc
        done = sum(len(o) for o in res["output_ids"])
        return JsonResponse({**base, "object": obj, "choices": [
            choice(i, o, f) for i, (o, f) in enumerate(zip(res["output_ids"], res["finish_reasons"]))],
            "usage": {"prompt_tokens": res["prompt_tokens"], "completion_tokens": done,
                      "total_tokens": res["prompt_tokens"] + done}, "timings_ms": res["timings_ms"]})
    try:  # a full queue answers 429 now, not inside a 200 stream; the room is held for the stream
        fields["reservation"] = reserve_capacity(served, len(ids))
    except Busy as exc:
        raise _generation_error(exc) from exc
    return StreamingHttpResponse(_stream(served, ids, sampling, carrier, base, chat, include_usage, fields),
                                 content_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _generation_error(exc: Exception) -> ApiError:
    if isinstance(exc, Busy):  # admission control: OpenAI's code for "slow down"
        return ApiError(429, exc.message, exc.field, "rate_limit_error", retry_after_s=exc.retry_after_s)
    if isinstance(exc, NoBackbone):  # OpenAI's answer for a model it does not serve (as GET /v1/models/{model})
        return ApiError(404, str(exc), "model", "invalid_request_error", code="model_not_found")
    if isinstance(exc, BackboneError):
        return ApiError(400, str(exc), exc.field)
    return ApiError(503, getattr(exc, "message", str(exc)), "model", "server_error")


async def _stream(served: ServedModel, prompts: list[list[int]], sampling: Sampling, carrier: str, base: dict,
                  chat: bool, include_usage: bool = False, fields: dict | None = None):
    """SSE chunks: each new token's text per choice as it is chosen, then (``include_usage``,
    OpenAI's ``stream_options``) one chunk with empty ``choices``, ``usage`` and the
    extensions ``layers`` (batches, failures, transports, holders by step) and
    ``timings_ms``, then ``[DONE]``. When the client goes away (the iterator is cancelled or
    closed) the generation is cancelled too."""
    queue: asyncio.Queue = asyncio.Queue()
    sent = [0] * len(prompts)
    texts = [""] * len(prompts)

    def on_tokens(seqs):  # on the loop; index: the prompt's position; text: settled (whole characters, no stop)
        queue.put_nowait(("tokens", [(s.index, list(s.output), s.text, s.finish_reason) for s in seqs]))

    task = asyncio.ensure_future(generate(served.model_id, prompts, sampling, carrier, on_tokens=on_tokens,
                                          **(fields or {})))
    task.add_done_callback(lambda t: queue.put_nowait(("done", None)))
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(i: int, delta_text: str, ids: list[int], finish) -> str:
        if chat:
            c = {"index": i, "delta": {"role": "assistant", "content": delta_text} if sent[i] == 0 and ids
                 else {"content": delta_text}, "finish_reason": finish, "token_ids": ids}
        else:
            c = {"index": i, "text": delta_text, "finish_reason": finish, "logprobs": None, "token_ids": ids}
        return f"data: {json.dumps({**base, 'object': obj, 'choices': [c]})}\n\n"

    try:
        while True:
            kind, snap = await queue.get()
            if kind == "done":
                break
            for i, output, text, finish in snap:
                yield chunk(i, text[len(texts[i]):], output[sent[i]:], finish)  # settled text only grows
                texts[i], sent[i] = text, len(output)
        exc = task.exception()
        if exc is not None:
            known = isinstance(exc, (BackboneError, ForwardError, GateNotLoaded, Busy))
            if not known:
                log.error("streamed generation failed", exc_info=exc)
            err = _generation_error(exc) if known else ApiError(500, "generation failed", None, "server_error")
            yield f"data: {json.dumps({'error': {'message': err.message, 'type': err.kind, 'param': err.param}})}\n\n"
        elif include_usage:
            res = task.result()
            done = sum(sent)
            usage = {"prompt_tokens": res["prompt_tokens"], "completion_tokens": done,
                     "total_tokens": res["prompt_tokens"] + done}
            last = {**base, "object": obj, "choices": [], "usage": usage, "layers": res["layers"],
                    "timings_ms": res["timings_ms"]}
            yield f"data: {json.dumps(last)}\n\n"
        yield "data: [DONE]\n\n"
    finally:  # the client went away (or the stream ended): never leave the generation computing
        if not task.done():
            task.cancel()
        if (fields or {}).get("reservation") is not None:  # queue room of a generation that never submitted
            fields["reservation"].release()


async def _handle(request: HttpRequest, chat: bool):
    if request.method != "POST":
        return ApiError(405, "use POST").response()
    try:
        try:
            await check_forward_rate(request.META.get("REMOTE_ADDR"))
        except Busy as exc:
            raise _generation_error(exc) from None
        body = _body(request)
        check_params(body, chat)
        served = await _served(body)
        if chat:
            prompt = await chat_prompt_async(served, body.get("messages"))
        else:
            prompt = body.get("prompt")
            if prompt is None:
                raise ApiError(400, "prompt is required", "prompt")
        return await _run(served, body, prompt, chat)
    except ApiError as exc:
        return exc.response()
    except Exception:  # a bug: OpenAI clients parse JSON, never an HTML 500 page (the log has the details)
        log.exception("OpenAI endpoint %s failed", request.path)
        return ApiError(500, "internal error; the site log has the details", None, "server_error").response()


@csrf_exempt
async def completions(request: HttpRequest):
    """``POST /v1/completions`` (OpenAI legacy completions)."""
    return await _handle(request, chat=False)


@csrf_exempt
async def chat_completions(request: HttpRequest):
    """``POST /v1/chat/completions`` (OpenAI chat completions; the checkpoint's chat template,
    or the plain role-prefixed prompt without one: ``chat_prompt``)."""
    return await _handle(request, chat=True)


@csrf_exempt
async def models(request: HttpRequest):
    """``GET /v1/models`` (OpenAI): ``{object: "list", data: [{id, object: "model", created,
    owned_by}]}`` of the models this site generates with (published with a backbone)."""
    if request.method != "GET":
        return ApiError(405, "use GET").response()
    rows = await database_sync_to_async(served_models)()
    return JsonResponse({"object": "list", "data": [_model_object(model_id, created) for model_id, created in rows]})


def _model_object(model_id: str, created) -> dict:
    return {"id": model_id, "object": "model", "created": int(created.timestamp()), "owned_by": "tenzro"}


@csrf_exempt
async def model(request: HttpRequest, model_id: str):
    """``GET /v1/models/{model}`` (OpenAI's retrieve): the model object of ``GET /v1/models``,
    or 404 ``model_not_found`` for a model this site does not generate with."""
    if request.method != "GET":
        return ApiError(405, "use GET").response()
    rows = dict(await database_sync_to_async(served_models)())
    if model_id not in rows:
        return ApiError(404, f"The model {model_id!r} does not exist on this site (GET /v1/models lists them)",
                        "model", "invalid_request_error", code="model_not_found").response()
    return JsonResponse(_model_object(model_id, rows[model_id]))


@csrf_exempt
async def not_found(request: HttpRequest, rest: str = ""):
    """Any other ``/v1/`` path: JSON 404 in OpenAI's error shape (clients parse it)."""
    return ApiError(404, f"unknown endpoint {request.method} {request.path}; this site serves GET /v1/models, "
                         f"GET /v1/models/{{model}}, POST /v1/completions and POST /v1/chat/completions", None,
                    "not_found_error").response()
