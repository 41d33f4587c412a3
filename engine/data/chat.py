"""Chat rendering: messages -> text with the tokenizer's chat template, and which characters
of that text each assistant turn produced (so SFT can put the loss on them alone).

A tokenizer directory without a chat template gets DEFAULT: `<|role|>content<eos>` per
message, the tokenizer's bos token first if it has one, and `<|assistant|>` as the
generation prompt (the template engine/data/tokenizer.py writes for trained tokenizers).
Templates are rendered with Jinja2 set up as transformers sets it up (sandboxed,
trim_blocks, lstrip_blocks, raise_exception, tojson, strftime_now, {% generation %}), so a
Hugging Face template gives the text `tokenizer.apply_chat_template` gives
(tests/test_sft.py checks that against transformers).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.config import ConfigError
from engine.data.tokenizer import DEFAULT_CHAT_ROLES, TokenizerBundle, default_chat_template

Message = dict[str, Any]


def chat_template(bundle: TokenizerBundle) -> str:
    """The tokenizer's template, or the documented default."""
    return bundle.chat_template or default_chat_template(DEFAULT_CHAT_ROLES, add_bos=bundle.bos_token is not None)


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (assistant-mask markers): render the body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render(
    bundle: TokenizerBundle, messages: list[Message], *, add_generation_prompt: bool = False, tools: list | None = None
) -> str:
    """The template's text of `messages`; `tools` (function schemas) is the template's `tools`
    variable, as in `apply_chat_template(tools=...)` (a template that never reads it ignores it)."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ConfigError(f"message {i} must be a mapping with 'role' and 'content' (got {message!r})")
    try:
        return _compile(chat_template(bundle)).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bundle.bos_token or "",
            eos_token=bundle.eos_token,
            pad_token=bundle.pad_token or "",
            tools=tools,
        )
    except Exception as e:  # noqa: BLE001 - jinja raises many types; all are bad input here
        raise ConfigError(f"the chat template cannot render these messages: {e}") from None


def assistant_spans(bundle: TokenizerBundle, messages: list[Message]) -> tuple[str, list[tuple[int, int]]]:
    """(rendered conversation, [(start, end) character span of each assistant turn]).

    A turn's span is what rendering it added after the generation prompt that precedes it:
    render(messages[:i], add_generation_prompt=True) must be a prefix of
    render(messages[:i+1]), which holds for every common template.
    """
    text = render(bundle, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(bundle, messages[:i], add_generation_prompt=True)
        through = render(bundle, messages[: i + 1])
        if not through.startswith(before) or not text.startswith(through):
            raise ConfigError(
                "the chat template is not prefix-stable (rendering fewer messages does not give a prefix "
                "of the full conversation), so assistant tokens cannot be located; use loss_on: all"
            )
        spans.append((len(before), len(through)))
    return text, spans
