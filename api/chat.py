"""Chat templates: render a model's Jinja chat template (GGUF ``tokenizer.chat_template``) into a prompt.

Templates come from model files, so they run in jinja2's ``ImmutableSandboxedEnvironment`` (no attribute access
to internals, no mutation of the messages). The environment matches what Hugging Face's ``apply_chat_template``
offers templates: trim_blocks, lstrip_blocks, loop controls, ``raise_exception``, ``strftime_now`` and a
``tojson`` that keeps non-ASCII text.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplateError", "RenderedTooLong", "render_chat", "render_chunks"]


class ChatTemplateError(ValueError):
    """The template failed to compile or render, or rejected the conversation (``raise_exception``)."""


class RenderedTooLong(ChatTemplateError):
    """The rendered prompt grew past the caller's limit (`render_chat`'s max_chars)."""


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, separators: tuple[str, str] | None = None,
            sort_keys: bool = False, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chunks(template: str, messages: Sequence[Any], add_generation_prompt: bool = True,
                  **variables: Any) -> Iterator[str]:
    """The rendered prompt as jinja2 generates it, chunk by chunk (so a caller can stop a render that grows too
    long before it is whole). messages: `api.protocol.ChatMessage`s or mappings with role and content.

    Raises :class:`ChatTemplateError` with the template's own message when it fails.
    """
    turns = [dict(m) if isinstance(m, Mapping) else {"role": m.role, "content": m.content} for m in messages]
    try:
        yield from _compile(template).generate(messages=turns, add_generation_prompt=add_generation_prompt,
                                               **variables)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template: {exc}") from exc


def render_chat(template: str, messages: Sequence[Any], add_generation_prompt: bool = True,
                max_chars: int | None = None, **variables: Any) -> str:
    """Render ``messages`` with a chat template; ``variables`` (e.g. bos_token) are passed to the template.

    Raises :class:`ChatTemplateError` with the template's own message when it fails, :class:`RenderedTooLong` as
    soon as the prompt passes max_chars characters.
    """
    chunks, length = [], 0
    for chunk in render_chunks(template, messages, add_generation_prompt, **variables):
        length += len(chunk)
        if max_chars is not None and length > max_chars:
            raise RenderedTooLong(f"the rendered chat prompt passed {max_chars} characters")
        chunks.append(chunk)
    return "".join(chunks)
