"""Hostile and OpenAI-shaped inputs on the serving API (issue 24 items 8–11), in process: the
qwen fixture published for real with a tokenizer, generations on the site's fallback replica
(no holder online), requests through Django's test client, and the official ``openai`` SDK
as the client over the site's ASGI application.

- SSE text: a token that completes a character split over byte tokens sends that character
  once (never U+FFFD and then the text again).
- Sampling values that made NaN probabilities, an id past int64, lone surrogates, deep
  JSON on every JSON view: a JSON answer, never an HTML 500.
- Stop strings (one token or several, across token boundaries, streamed or not) are left out
  of the text like OpenAI's; chat content as text parts; ``GET /v1/models/{id}``; one
  ``max_tokens`` limit with one message.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from prepare.backbone import publish_backbone
from prepare.services import publish_checkpoint
from tests.conftest import QWEN

pytestmark = pytest.mark.django_db(transaction=True)

WORDS = "qwen-words"  # word-level vocabulary: token ``t{i}`` is id ``i``, text "t3 t17 …"
BYTES = "qwen-bytes"  # byte-pair vocabulary: every token ends inside or completes a 2-byte character
CHAT_TEMPLATE = ("{% for m in messages %}t1 {{ m['content'] }} t2 {% endfor %}"
                 "{% if add_generation_prompt %}t3{% endif %}")
PROMPT = [5, 77, 19, 200, 3, 42]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte ↔ printable-character table (what ``ByteLevel`` decodes through)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def byte_piece(i: int) -> bytes:
    """Token ``i``'s bytes: even ids are an ASCII letter then a UTF-8 lead byte, odd ids a
    continuation byte then an ASCII letter. An even token followed by an odd one splits a
    2-byte character over the two; any other pairing leaves an invalid byte (U+FFFD)."""
    j = i // 2
    return bytes([0x41 + j % 26, 0xC3 + j // 26]) if i % 2 == 0 else bytes([0x80 + j % 64, 0x61 + j // 64])


def byte_tokenizer() -> Tokenizer:
    table = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={"".join(table[b] for b in byte_piece(i)): i for i in range(256)}, merges=[]))
    tok.decoder = decoders.ByteLevel()
    return tok


def word_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def _publish(tmp_path, model_id: str, tok: Tokenizer, template: str | None = None) -> None:
    d = tmp_path / model_id
    d.mkdir()
    for f in QWEN.iterdir():
        (d / f.name).symlink_to(f)
    tok.save(str(d / "tokenizer.json"))
    if template:
        (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    publish_checkpoint(d, model_id)
    publish_backbone(d, model_id)


@pytest.fixture
def words(tmp_path):
    _publish(tmp_path, WORDS, word_tokenizer(), CHAT_TEMPLATE)
    return WORDS


@pytest.fixture
def byte_model(tmp_path):
    _publish(tmp_path, BYTES, byte_tokenizer())
    return BYTES


def post(client, path: str, body) -> tuple[int, str, object]:
    """(status, content type, parsed answer): JSON, or for a stream the list of its events."""
    raw = body if isinstance(body, (str, bytes)) else json.dumps(body)
    r = client.post(path, data=raw, content_type="application/json")
    ctype = r.headers.get("Content-Type", "")
    if r.streaming:
        async def collect() -> bytes:
            return b"".join([c async for c in r.streaming_content])

        text = (b"".join(r.streaming_content) if not r.is_async else asyncio.run(collect())).decode()
        events = [e[len("data: "):] for e in text.split("\n\n") if e.startswith("data: ")]
        return r.status_code, ctype, [json.loads(e) for e in events if e != "[DONE]"]
    return r.status_code, ctype, (r.json() if ctype.startswith("application/json") else r.content.decode())


def completion(client, model: str, **body) -> dict:
    status, _, r = post(client, "/v1/completions", {"model": model, "prompt": PROMPT, **body})
    assert status == 200, r
    return r


# -- item 8: streamed text is each character once ------------------------------------------------

def test_stream_sends_a_split_character_once_and_never_a_replacement(client, byte_model):
    """A token completing a character split over two byte tokens sent U+FFFD and then the
    whole text again; now each chunk carries only settled characters and the chunks add up
    to the answer's text."""
    body = {"max_tokens": 40, "temperature": 1.0, "seed": 7}
    whole = completion(client, byte_model, **body)["choices"][0]
    status, ctype, events = post(client, "/v1/completions", {"model": byte_model, "prompt": PROMPT, **body,
                                                             "stream": True})
    assert status == 200 and ctype.startswith("text/event-stream")
    ids = [t for e in events for t in e["choices"][0]["token_ids"]]
    assert ids == whole["token_ids"]
    assert any(a % 2 == 0 and b % 2 == 1 for a, b in zip(ids, ids[1:])), "no character split over two tokens"
    deltas = [e["choices"][0]["text"] for e in events]
    assert "".join(deltas) == whole["text"] == byte_tokenizer().decode(ids)
    # only the last chunk (the sequence's end) may carry a trailing lead byte's U+FFFD
    assert not any(d.endswith("\ufffd") for d in deltas[:-1]), deltas



@pytest.mark.parametrize("prompt,where", [("世界🎉", "prompt"), (["世界", "🎉"], "prompt[0]")])
def test_text_outside_the_vocabulary_is_named_as_such(client, byte_model, prompt, where):
    """Text none of whose characters the vocabulary has encodes to no token: the 400 says so
    (not the empty prompt's "needs at least one token")."""
    status, _, r = post(client, "/v1/completions", {"model": byte_model, "prompt": prompt, "max_tokens": 2})
    msg = r["error"]["message"]
    assert status == 400 and r["error"]["param"] == "prompt", r
    assert msg.startswith(f"{where}: the text encodes to no tokens of model {byte_model!r}'s vocabulary"), msg

def test_detokenizer_on_a_byte_fallback_vocabulary():
    """SentencePiece with byte fallback (``<0xC3>`` ``<0xA9>`` for é): pieces settle whole
    characters, keep the leading space, and add up to the decoded text."""
    from prepare.gguf_tokenizer import tokenizer_from_gguf
    from router.detokenize import Detokenizer
    from tests.test_gguf_tokenizer import _spm_meta

    tok = tokenizer_from_gguf(_spm_meta())
    ids = tok.encode("Hé world€ Hello").ids[1:]  # without BOS
    assert len(ids) > len("Hé world€ Hello".split())  # byte tokens among them
    det = Detokenizer(tok.decode)
    pieces = []
    for t in ids:
        before = det.text
        det.push(t)
        pieces.append(det.text[len(before):])
    det.flush()
    assert "".join(pieces) == det.text == tok.decode(ids) == "Hé world€ Hello"
    assert "\ufffd" not in "".join(pieces)


# -- item 9: no HTML 500s -----------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("sampling", [{"top_p": 1e-300}, {"temperature": 1e-310}, {"temperature": 1e-310,
                                                                                   "top_p": 5e-324}])
def test_extreme_sampling_values_are_the_greedy_limit_not_nan(client, words, sampling, stream):
    """``top_p: 1e-300`` (below float32's range) and ``temperature: 1e-310`` (subnormal) made
    the probabilities NaN: an HTML 500, or with ``stream`` a 200 with an error inside. Both
    are valid OpenAI values whose limit is greedy decoding, which they now give."""
    greedy = completion(client, words, max_tokens=6, temperature=0)["choices"][0]["token_ids"]
    status, _, r = post(client, "/v1/completions", {"model": words, "prompt": PROMPT, "max_tokens": 6, "seed": 3,
                                                    **sampling, "stream": stream})
    assert status == 200, r
    ids = [t for e in r for t in e["choices"][0]["token_ids"]] if stream else r["choices"][0]["token_ids"]
    assert ids == greedy and not any("error" in e for e in (r if stream else [r]))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": [1, 2**63]}, "prompt"),
    ("/v1/completions", {"prompt": [[1], [-(2**63) - 1]]}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2], "stop": [2**63]}, "stop"),
    ("/v1/completions", {"prompt": "t1 \ud800"}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2], "stop": ["\ud800"]}, "stop[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t1 \udfff t2"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "t1"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t1"},
                                           {"role": "user", "name": 5, "content": "t2"}]}, "messages[1].name"),
    ("/v1/completions", {"prompt": [1, 2], "user": 5}, "user"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t1"}], "user": ["x"]}, "user"),
])
def test_out_of_range_ids_and_lone_surrogates_are_a_json_400(client, words, path, body, param, stream):
    status, ctype, r = post(client, path, {"model": words, "max_tokens": 2, **body, "stream": stream})
    assert status == 400 and ctype.startswith("application/json"), (status, r)
    assert r["error"]["param"] == param and r["error"]["message"], r


def test_rpc_ids_past_int64_and_surrogates_are_invalid_params(client, words):
    def rpc(params):
        r = client.post("/rpc", data=json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tenzro_moeGenerate",
                                                 "params": {"model_id": words, **params}}),
                        content_type="application/json")
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("application/json")
        return r.json()["error"]

    err = rpc({"input_ids": [1, 2**63]})
    assert err["code"] == -32602 and err["data"]["field"] == "input_ids" and "0..255" in err["message"]
    err = rpc({"prompt": "t1 \ud800"})
    assert err["code"] == -32700 and err["data"]["field"] == "params.prompt"


DEEP = "[" * 50_000 + "]" * 50_000


@pytest.mark.parametrize("path", ["/api/auth/challenge", "/api/auth/node-token", "/api/expert-coverage",
                                  "/v1/completions", "/v1/chat/completions"])
def test_deep_json_is_a_json_400_on_every_json_view(client, path):
    status, ctype, r = post(client, path, DEEP)
    assert status in (400, 401) and ctype.startswith("application/json"), (status, r)
    if status == 400:
        assert "nested too deeply" in json.dumps(r), r


def test_market_login_refuses_deep_json_and_surrogates(client):
    for body in (DEEP, json.dumps({"wallet": "\ud800"}), '{"wallet": ' + "[" * 65 + "]" * 65 + "}"):
        for path in ("/api/auth/challenge", "/api/auth/node-token"):
            status, ctype, r = post(client, path, body)
            assert status == 400 and ctype.startswith("application/json") and r["error"], (path, status, r)
    status, _, r = post(client, "/api/auth/challenge", {"wallet": "0x" + "ab" * 20})  # still answers
    assert status == 200 and r["nonce"], r


# -- items 10 and 11: OpenAI semantics -----------------------------------------------------------

def test_single_token_stop_string_is_left_out(client, words):
    free = completion(client, words, max_tokens=8, temperature=0)["choices"][0]
    words_out = free["text"].split(" ")
    stop = words_out[3]  # one token, e.g. "t42"
    r = completion(client, words, max_tokens=8, temperature=0, stop=stop)["choices"][0]
    cut = free["text"].index(stop)
    assert r["text"] == free["text"][:cut] and stop not in r["text"] and r["finish_reason"] == "stop"


def test_stop_token_id_is_left_out_of_the_text(client, words):
    free = completion(client, words, max_tokens=8, temperature=0)["choices"][0]
    stop_id = free["token_ids"][2]
    r = completion(client, words, max_tokens=8, temperature=0, stop=[stop_id])["choices"][0]
    first = free["token_ids"].index(stop_id)
    assert r["token_ids"] == free["token_ids"][:first + 1] and r["finish_reason"] == "stop"
    assert r["text"] == word_tokenizer().decode(free["token_ids"][:first])


def test_max_tokens_has_one_limit_and_one_message(client, words):
    """100000 said "[1, 65536]" and 9000 "at most 8192"; now both name the same limit (the
    context left after the prompt here: the fixture's context is 128)."""
    msgs = []
    for n in (100_000, 9000, 2**70, 123):
        status, _, r = post(client, "/v1/completions", {"model": words, "prompt": PROMPT, "max_tokens": n})
        assert status == 400 and r["error"]["param"] == "max_tokens", r
        msgs.append(r["error"]["message"])
    limit = 128 - len(PROMPT)
    assert all(f"at most {limit} new tokens" in m and "maximum context length is 128" in m for m in msgs), msgs
    assert completion(client, words, max_tokens=limit, temperature=0)["usage"]["completion_tokens"] == limit


@pytest.fixture
def sdk():
    """The official ``openai`` SDK (async) talking to the site's ASGI application."""
    from openai import AsyncOpenAI

    from tenzro_site.asgi import application

    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://testserver")
    return AsyncOpenAI(api_key="unused", base_url="http://testserver/v1", http_client=http, max_retries=0)


def test_openai_sdk_stop_strings_across_tokens_streamed_and_whole(words, sdk):
    async def go():
        free = await sdk.completions.create(model=words, prompt=PROMPT, max_tokens=10, temperature=0)
        text = free.choices[0].text
        # a stop spanning a token boundary: the end of the 3rd word, the space, the start of the 4th
        start = len(" ".join(text.split(" ")[:2])) + 2
        stop = text[start:start + 4]
        assert " " in stop
        whole = await sdk.completions.create(model=words, prompt=PROMPT, max_tokens=10, temperature=0,
                                             stop=[stop, "never-there"])
        pieces = []
        async for chunk in await sdk.completions.create(model=words, prompt=PROMPT, max_tokens=10, temperature=0,
                                                        stop=stop, stream=True):
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason
        return text, stop, whole.choices[0], pieces, finish

    text, stop, whole, pieces, finish = asyncio.run(go())
    assert whole.text == text[:text.index(stop)] and whole.finish_reason == "stop"
    assert "".join(pieces) == whole.text and not any(stop in p for p in pieces) and finish == "stop"


def test_openai_sdk_chat_parts_models_retrieve_and_limits(words, sdk):
    import openai

    async def go():
        parts = await sdk.chat.completions.create(
            model=words, max_tokens=4, temperature=0,
            messages=[{"role": "user", "content": [{"type": "text", "text": "t5"}, {"type": "text", "text": "t6"}]}])
        plain = await sdk.chat.completions.create(model=words, max_tokens=4, temperature=0,
                                                  messages=[{"role": "user", "content": "t5\nt6"}])
        model = await sdk.models.retrieve(words)
        listed = [m.id async for m in sdk.models.list()]
        errors = []
        for call in (sdk.models.retrieve("no-such-model"),
                     sdk.chat.completions.create(model=words, max_tokens=4, messages=[
                         {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
                     sdk.completions.create(model=words, prompt=PROMPT, max_tokens=100_000),
                     sdk.completions.create(model=words, prompt=PROMPT, max_tokens=9000)):
            try:
                await call
            except openai.APIStatusError as exc:
                errors.append(exc)
        return parts, plain, model, listed, errors

    parts, plain, model, listed, errors = asyncio.run(go())
    assert parts.choices[0].message.content == plain.choices[0].message.content  # parts joined by "\n"
    assert model.id == words and model.object == "model" and words in listed
    missing, image, huge, big = errors
    assert isinstance(missing, openai.NotFoundError) and missing.code == "model_not_found"
    assert isinstance(image, openai.BadRequestError) and "text only" in image.message
    assert isinstance(huge, openai.BadRequestError) and isinstance(big, openai.BadRequestError)
    assert huge.message.replace("100000", "N") == big.message.replace("9000", "N")


@pytest.mark.parametrize("chat", [False, True])
def test_openai_sdk_streamed_requests_past_the_queue_get_429_with_retry_after(words, sdk, settings, chat):
    """Concurrent streamed requests over a full generation queue (1 running, 1 waiting): the
    ones refused get 429 + Retry-After before any stream (the SDK's RateLimitError, which it
    retries), never a 200 stream with an error inside; the admitted ones stream to the end."""
    import openai

    settings.TENZRO = {**settings.TENZRO, "GEN_MAX_RUNNING": 1, "GEN_QUEUE": 1}

    async def one():
        if chat:
            stream = await sdk.chat.completions.create(model=words, max_tokens=6, stream=True,
                                                       messages=[{"role": "user", "content": "t5 t6"}])
        else:
            stream = await sdk.completions.create(model=words, prompt=PROMPT, max_tokens=6, stream=True)
        return [c async for c in stream]

    async def go():
        return await asyncio.gather(*(one() for _ in range(6)), return_exceptions=True)

    results = asyncio.run(go())
    refused = [r for r in results if isinstance(r, BaseException)]
    assert refused and all(isinstance(r, openai.RateLimitError) for r in refused), results
    assert all(int(r.response.headers["Retry-After"]) >= 1 and "TENZRO_GEN_QUEUE" in r.message for r in refused)
    assert len(refused) < len(results)  # the admitted ones streamed


# -- item 10: a JSON-RPC generation whose client left ---------------------------------------------

@pytest.mark.parametrize("batch", [False, True])
def test_rpc_generation_is_cancelled_when_its_client_disconnects(words, batch):
    """``tenzro_moeGenerate`` (alone or in a JSON-RPC batch) through the site's ASGI
    application: once tokens flow the client disconnects (``http.disconnect``, what daphne
    sends when the socket closes); the request leaves the scheduler at its next step instead of
    generating all 8 × 100 tokens."""
    from router.apps import current
    from tenzro_site.asgi import application

    tokens = current().metrics.tokens.labels(words)
    call = {"jsonrpc": "2.0", "id": 1, "method": "tenzro_moeGenerate",
            "params": {"model_id": words, "input_ids": [PROMPT] * 8, "max_new_tokens": 100}}
    body = json.dumps([call] if batch else call).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/rpc", "raw_path": b"/rpc", "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"host", b"testserver")],
             "client": ("127.0.0.1", 50000), "server": ("testserver", 80)}

    async def go() -> tuple[float, float]:
        start = tokens._value.get()
        left = asyncio.Event()
        sent = []

        async def receive():
            if not sent:
                sent.append(1)
                return {"type": "http.request", "body": body, "more_body": False}
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            pass

        app = asyncio.ensure_future(application(scope, receive, send))
        loop = asyncio.get_running_loop()
        end = loop.time() + 120
        while tokens._value.get() == start and loop.time() < end:
            await asyncio.sleep(0.05)
        left.set()
        await asyncio.wait_for(app, 120)
        last, quiet = tokens._value.get(), loop.time()
        while loop.time() - quiet < 2.0 and loop.time() < end + 120:  # the worker thread stopped
            await asyncio.sleep(0.1)
            if tokens._value.get() != last:
                last, quiet = tokens._value.get(), loop.time()
        return start, last

    start, last = asyncio.run(go())
    assert last > start, "the generation never started"
    assert last - start < 8 * 100 / 2, f"{last - start} tokens generated after the client left"
