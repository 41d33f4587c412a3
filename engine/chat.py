"""Chat rendering: messages -> text with the tokenizer's chat template, and which characters
of that text each assistant turn produced (so SFT can put the loss on them alone).

A tokenizer directory without a chat template gets DEFAULT: `<|role|>content<eos>` per
message, the tokenizer's bos token first if it has one, and `<|assistant|>` as the
generation prompt (the template engine/tokenizer.py writes for trained tokenizers).
Templates are rendered by transformers' own Jinja renderer, so a Hugging Face template
gives here the text `tokenizer.apply_chat_template` gives.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.tokenizer import DEFAULT_CHAT_ROLES, TokenizerBundle, default_chat_template

Message = dict[str, Any]


def chat_template(bundle: TokenizerBundle) -> str:
    """The tokenizer's template, or the documented default."""
    return bundle.chat_template or default_chat_template(DEFAULT_CHAT_ROLES, add_bos=bundle.bos_token is not None)


def render(bundle: TokenizerBundle, messages: list[Message], *, add_generation_prompt: bool = False) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ConfigError(f"message {i} must be a mapping with 'role' and 'content' (got {message!r})")
    try:
        texts, _ = render_jinja_template(
            conversations=[messages], chat_template=chat_template(bundle),
            add_generation_prompt=add_generation_prompt,
            bos_token=bundle.bos_token or "", eos_token=bundle.eos_token, pad_token=bundle.pad_token or "",
        )
    except Exception as e:  # noqa: BLE001 - jinja raises many types; all are bad input here
        raise ConfigError(f"the chat template cannot render these messages: {e}") from None
    return texts[0]


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
