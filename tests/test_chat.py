"""Chat templates (``prepare.chat``): read from a checkpoint as transformers does, rendered in
its sandboxed Jinja2 environment, and the chat prompt of ``/v1/chat/completions`` with and
without a template."""
from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from prepare.chat import ChatTemplate, ChatTemplateError, plain_chat, read_chat_template
from router.generate import ServedModel
from router.openai_api import ApiError, chat_prompt

# Qwen2-7B-Instruct's chat template (tokenizer_config.json on the Hub), verbatim.
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Mistral-7B-Instruct-v0.1's: special tokens and raise_exception.
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}{% endif %}{% endfor %}")


def test_chatml_renders_as_transformers():
    t = ChatTemplate(CHATML)
    text = t.render([{"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert not t.render([{"role": "user", "content": "Hi"}], add_generation_prompt=False).endswith("assistant\n")


def test_special_tokens_and_raise_exception(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": MISTRAL, "bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>"}))
    rec = read_chat_template(tmp_path)
    assert rec == {"template": MISTRAL, "special_tokens": {"bos_token": "<s>", "eos_token": "</s>"}}
    t = ChatTemplate(rec["template"], rec["special_tokens"])
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert t.render(msgs) == "<s>[INST] a [/INST]b</s> [INST] c [/INST]"
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        t.render([{"role": "assistant", "content": "x"}])


def test_read_template_sources(tmp_path):
    assert read_chat_template(tmp_path) is None  # no tokenizer_config.json
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert read_chat_template(tmp_path) is None  # no chat_template entry
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert read_chat_template(tmp_path)["template"] == "D"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages|length }}")
    assert read_chat_template(tmp_path)["template"] == "J{{ messages|length }}"  # the file wins
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        read_chat_template(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": 5}))
    with pytest.raises(ChatTemplateError, match="must be a string"):
        read_chat_template(tmp_path)


def test_sandbox_refuses_attribute_tricks():
    t = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        t.render([{"role": "user", "content": "x"}])


def _served(template: ChatTemplate | None) -> ServedModel:
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(16)} | {"user:": 16, "assistant:": 17},
                                     unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="t9 $A", special_tokens=[("t9", 9)])  # a BOS
    return ServedModel("m", None, frozenset(), frozenset(), tok, template)


def test_chat_prompt_with_and_without_template():
    msgs = [{"role": "user", "content": "t5 t6"}]
    with_template = _served(ChatTemplate("{{ bos_token }}{% for m in messages %}t1 {{ m['content'] }} t2 {% endfor %}"
                                         "{% if add_generation_prompt %}t3{% endif %}", {"bos_token": "t9 "}))
    # the template's own BOS, and none added by the tokenizer on top
    assert chat_prompt(with_template, msgs) == [9, 1, 5, 6, 2, 3]
    assert chat_prompt(_served(None), msgs) == plain_chat(msgs) == "user: t5 t6\nassistant:"
    with pytest.raises(ApiError) as exc:
        chat_prompt(_served(ChatTemplate("{{ raise_exception('no user turn') }}")), msgs)
    assert exc.value.status == 400 and exc.value.param == "messages" and "no user turn" in exc.value.message
    with pytest.raises(ApiError) as exc:
        chat_prompt(with_template, [{"role": "user"}])
    assert exc.value.param == "messages[0].content"
