"""Prompt text over the size cap is refused before it is tokenized, and long text is tokenized
off the event loop (``router.generate.check_text_size``, ``encode_prompts_async``,
``router.openai_api.chat_prompt_async``).

Before: a 30 MB ``prompt`` (under ``TENZRO_MAX_BODY``) was tokenized whole on the site's event
loop only to be counted over ``TENZRO_GEN_MAX_PROMPT_TOKENS``: /healthz and every stream waited
25 s for the 400.
"""
from __future__ import annotations

import asyncio
import json
import threading

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from moe.backbone import BackboneError
from prepare.chat import ChatTemplate
from router import generate as gen
from router.generate import ServedModel, encode_prompts, encode_prompts_async
from router.openai_api import ApiError, chat_prompt, chat_prompt_async
from tests.conftest import QWEN2_TRAINED


class SpyTokenizer:
    """A ``tokenizers.Tokenizer`` that records its batch calls. With ``gate`` (a
    ``threading.Event``) a batch call first waits until the gate is set, as a long text's
    tokenization takes time with the GIL released; ``gate_opened`` records whether it was
    (a call on the event loop itself would wait out the generous deadline: nobody sets it)."""

    def __init__(self, gate: threading.Event | None = None):
        self.tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(16)} | {"longest_word": 16},
                                              unk_token="t0"))
        self.tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        self.calls: list[tuple[int, str]] = []
        self.gate = gate
        self.gate_opened: list[bool] = []

    def get_vocab(self, with_added_tokens=True):
        return self.tok.get_vocab(with_added_tokens=with_added_tokens)

    def encode_batch(self, texts, add_special_tokens=True):
        self.calls.append((sum(len(t) for t in texts), threading.current_thread().name))
        if self.gate is not None:
            self.gate_opened.append(self.gate.wait(timeout=30))
        return self.tok.encode_batch(texts, add_special_tokens=add_special_tokens)

    def encode(self, text, add_special_tokens=True):
        self.calls.append((len(text), threading.current_thread().name))
        return self.tok.encode(text, add_special_tokens=add_special_tokens)


def served(tok, template=None) -> ServedModel:
    return ServedModel("m", None, frozenset(), frozenset(), tok, template)


@pytest.fixture
def cap(settings):
    settings.TENZRO = {**settings.TENZRO, "GEN_MAX_PROMPT_TOKENS": 100}
    return 100 * len("longest_word")  # characters the cap can hold with this vocabulary


def test_text_over_the_cap_is_refused_untokenized(cap):
    spy = SpyTokenizer()
    m = served(spy)
    assert m.max_token_chars == len("longest_word")
    ok = "t1 " * (cap // 3)  # within the character bound: tokenized (check_size counts its tokens)
    assert len(encode_prompts(m, ok, "prompt")[0]) == cap // 3 and spy.calls
    spy.calls.clear()
    for prompt, field in (("t1" * (cap // 2 + 1), "prompt"), (["t1 " * 200, "t2 " * 300], "input_ids")):
        with pytest.raises(BackboneError) as exc:
            encode_prompts(m, prompt, field)
        assert exc.value.field == field and "TENZRO_GEN_MAX_PROMPT_TOKENS" in str(exc.value), exc.value
        assert f"at most {cap} characters" in str(exc.value)
    assert spy.calls == []  # never tokenized


def test_chat_over_the_cap_is_refused_untokenized(cap):
    spy = SpyTokenizer()
    msgs = [{"role": "user", "content": "t1 " * 300},
            {"role": "user", "content": [{"type": "text", "text": "t2 " * 200}]}]
    for template in (None, ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}")):
        with pytest.raises(ApiError) as exc:
            chat_prompt(served(spy, template), msgs)
        assert exc.value.status == 400 and exc.value.param == "messages"
        assert "TENZRO_GEN_MAX_PROMPT_TOKENS" in exc.value.message
    # a template that multiplies the text past the cap: refused after rendering, before tokenizing
    with pytest.raises(ApiError) as exc:
        chat_prompt(served(spy, ChatTemplate("{% for i in range(50) %}{{ messages[0]['content'] }}{% endfor %}")),
                    [{"role": "user", "content": "t1 " * 10}])
    assert exc.value.param == "messages"
    assert spy.calls == []
    assert chat_prompt(served(spy, ChatTemplate("{{ messages[0]['content'] }}")),
                       [{"role": "user", "content": "t3 t4"}]) == [3, 4]


@pytest.mark.asyncio
@pytest.mark.parametrize("chat", [False, True])
async def test_long_text_is_tokenized_off_the_event_loop(settings, chat):
    """The tokenizer runs in a worker thread for a long text (the loop keeps running while it
    works: a task on the loop opens the tokenizer's gate) and on the loop for a short one (no
    thread hop per ordinary request)."""
    settings.TENZRO = {**settings.TENZRO, "GEN_MAX_PROMPT_TOKENS": 100_000}
    gate = threading.Event()
    spy = SpyTokenizer(gate)
    m = served(spy, ChatTemplate("{{ messages[0]['content'] }}") if chat else None)

    async def opener():
        while not spy.calls:  # the tokenizer has started: the loop runs beside it and opens its gate
            await asyncio.sleep(0.001)
        gate.set()

    t = asyncio.ensure_future(opener())
    long_text = "t1 " * (gen.INLINE_TOKENIZE_CHARS // 3 + 1)
    try:
        if chat:
            ids = await chat_prompt_async(m, [{"role": "user", "content": long_text}])
        else:
            ids = (await encode_prompts_async(m, long_text, "prompt"))[0].tolist()
    finally:
        t.cancel()
    assert ids == [1] * (gen.INLINE_TOKENIZE_CHARS // 3 + 1)
    assert spy.calls[-1][1] != threading.main_thread().name and spy.gate_opened == [True], (spy.calls,
                                                                                            spy.gate_opened)
    spy.gate = None
    if chat:
        assert await chat_prompt_async(m, [{"role": "user", "content": "t2"}]) == [2]
    else:
        assert (await encode_prompts_async(m, "t2", "prompt"))[0].tolist() == [2]
    assert spy.calls[-1][1] == threading.main_thread().name
    if chat:  # a million empty messages is work too: checked and rendered in the worker thread
        ids = await chat_prompt_async(m, [{"role": "user", "content": "t2"}]
                                      + [{"role": "user", "content": ""}] * gen.INLINE_TOKENIZE_CHARS)
        assert ids == [2] and spy.calls[-1][1] != threading.main_thread().name


def test_encode_batch_gives_the_ids_encode_gives():
    """The batch call the site now uses (it releases the GIL) tokenizes as ``encode`` did."""
    tok = Tokenizer.from_file(str(QWEN2_TRAINED / "tokenizer.json"))
    texts = ["The router scores every expert", "héllo 世界 🚀", " x  y\n\tz", "a" * 1000]
    assert [e.ids for e in tok.encode_batch(texts)] == [tok.encode(t).ids for t in texts]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "a" * 2_000_000}),
    ("/v1/completions", {"prompt": ["a" * 700_000] * 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 2_000_000}]}),
])
def test_openai_huge_text_is_a_quick_400(client, settings, monkeypatch, path, body):
    """The trained fixture (a byte-level BPE whose longest token has 13 characters) published
    for real: a 2 MB prompt text is refused naming its field without being tokenized (it took
    seconds of the event loop before; 25 s at 30 MB)."""
    from prepare.backbone import publish_backbone
    from prepare.services import publish_checkpoint
    from router import openai_api

    publish_checkpoint(QWEN2_TRAINED, "trained-size-test")
    publish_backbone(QWEN2_TRAINED, "trained-size-test")
    settings.TENZRO = {**settings.TENZRO, "GEN_MAX_PROMPT_TOKENS": 8192}
    tokenized, real = [], gen.tokenize

    def spy(served_model, texts, add_special_tokens=True):
        tokenized.append(sum(len(t) for t in texts))
        return real(served_model, texts, add_special_tokens)

    monkeypatch.setattr(gen, "tokenize", spy)
    monkeypatch.setattr(openai_api, "tokenize", spy)
    r = client.post(path, data=json.dumps({"model": "trained-size-test", **body}), content_type="application/json")
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == ("messages" if "chat" in path else "prompt"), err
    assert "characters of prompt text" in err["message"] and "TENZRO_GEN_MAX_PROMPT_TOKENS" in err["message"]
    assert tokenized == []  # refused by its length, before any tokenizing
    r = client.post(path, data=json.dumps({"model": "trained-size-test", "max_tokens": 2, "temperature": 0,
                                           **({"messages": [{"role": "user", "content": "The router"}]}
                                              if "chat" in path else {"prompt": "The router scores every"})}),
                    content_type="application/json")
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2, r.json()
    assert len(tokenized) == 1  # the ordinary request went through the same tokenizer call


@pytest.mark.django_db(transaction=True)
def test_the_vocabulary_is_measured_when_the_model_loads():
    """``max_token_chars`` (a pass over the whole vocabulary: 150k entries for real models) is
    computed where ``served_model`` runs (the site's DB thread), not by the first request on
    the event loop."""
    from prepare.backbone import publish_backbone
    from prepare.services import publish_checkpoint
    from router.generate import served_model

    publish_checkpoint(QWEN2_TRAINED, "trained-vocab-test")
    publish_backbone(QWEN2_TRAINED, "trained-vocab-test")
    assert vars(served_model("trained-vocab-test"))["max_token_chars"] == 13
