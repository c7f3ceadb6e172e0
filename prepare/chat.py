"""Chat prompts: the checkpoint's own Jinja2 chat template when it ships one, else a plain
documented rendering.

A Hugging Face checkpoint carries its template as ``chat_template`` in
``tokenizer_config.json`` (a string, or a list of ``{name, template}`` of which ``default``
is used) or, from transformers 4.43 on, as the file ``chat_template.jinja``. It is rendered
the way transformers' ``apply_chat_template`` does (``utils/chat_template_utils.py``): an
immutable sandboxed Jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``, the
``tojson`` filter without HTML escaping, the globals ``raise_exception`` and
``strftime_now``, and the variables ``messages``, ``add_generation_prompt`` and the special
tokens of ``tokenizer_config.json`` (``bos_token``, ``eos_token``, …). The rendered text
already holds the template's special tokens, so it is tokenized without adding more.

Without a template, ``plain_chat`` renders ``<role>: <content>`` per message, one per line,
then ``assistant:``.

Pure Python (jinja2); imports nothing from Django.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The checkpoint's chat template does not compile, or refuses these messages
    (its ``raise_exception``); the message is the template's."""


def _token_text(value) -> str | None:
    """A special token of ``tokenizer_config.json``: a string or an ``AddedToken`` dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_chat_template(checkpoint: str | Path) -> dict | None:
    """``{"template": str, "special_tokens": {name: text}}`` of a checkpoint directory, or
    None when it ships no chat template. ``chat_template.jinja`` wins over the
    ``tokenizer_config.json`` entry (as in transformers). Raises ``ChatTemplateError`` for
    a ``tokenizer_config.json`` that is not JSON or a template entry of the wrong type."""
    d = Path(checkpoint)
    if not d.is_dir():
        return None
    cfg: dict = {}
    path = d / "tokenizer_config.json"
    if path.is_file():
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(f"{path} is not JSON: {exc}") from exc
    template = None
    if (d / "chat_template.jinja").is_file():
        template = (d / "chat_template.jinja").read_text(encoding="utf-8")
    elif "chat_template" in cfg:
        template = cfg["chat_template"]
        if isinstance(template, list):  # named templates: the one called "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not isinstance(template, str):
            raise ChatTemplateError(f"{path}: chat_template must be a string or a list with a 'default' entry")
    if template is None:
        return None
    specials = {k: t for k in SPECIAL_TOKENS if (t := _token_text(cfg.get(k))) is not None}
    compile_template(template)  # a broken template fails at publish time, not at the first chat
    return {"template": template, "special_tokens": specials}


def _raise(message):
    raise ChatTemplateError(str(message))


def compile_template(source: str):
    """The ``jinja2.Template`` of a chat template, in transformers' environment (module
    docstring). Raises ``ChatTemplateError`` for a syntax error."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc


@dataclass
class ChatTemplate:
    """A compiled chat template and the special tokens it may name."""

    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        self._template = compile_template(self.source)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` (``[{role, content}, …]``). Raises
        ``ChatTemplateError`` when the template refuses them or fails while rendering."""
        from jinja2 import TemplateError

        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except (TemplateError, TypeError, ValueError) as exc:  # ChatTemplateError (raise_exception) is a ValueError
            if isinstance(exc, ChatTemplateError):
                raise
            raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from exc


def plain_chat(messages: list[dict]) -> str:
    """The fallback rendering for checkpoints without a template: ``<role>: <content>`` per
    message, one per line, then ``assistant:``."""
    return "\n".join([f"{m['role']}: {m['content']}" for m in messages] + ["assistant:"])
