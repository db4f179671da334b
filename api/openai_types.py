"""The OpenAI HTTP API's request and response shapes (the subset this server speaks), and how a request becomes the
websocket protocol's `Generate`, to be checked and resolved by the same code (`api.protocol.resolve_generate`).

Requests decode with their types only; the ranges (temperature, top_k, seed, token ids, the ``speculative``
object, ...) are the websocket's, applied when the request is converted into a `Generate`. Fields OpenAI defines
that this server does not serve are declared so that a neutral value passes and any other is refused by name.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec
from msgspec import UNSET, Struct, UnsetType

from .protocol import ChatMessage, Generate, SpecStats

# ---------------------------------------------------------------------------------------------------------------
# Requests


class Refused(Exception):
    """A request this server will not serve as asked: message and the field it concerns (OpenAI's ``param``)."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.message = message
        self.param = param


class StreamOptions(Struct, frozen=True, forbid_unknown_fields=True):
    include_usage: bool = False


class TextPart(Struct, frozen=True, forbid_unknown_fields=True, tag_field="type", tag="text"):
    """A text content part of a chat message (images and audio are not served)."""

    text: str


class ChatMessageIn(Struct, frozen=True, forbid_unknown_fields=True):
    role: str
    content: str | list[TextPart]


class _Common(Struct, frozen=True, forbid_unknown_fields=True):
    """Fields both endpoints take."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    speculative: dict[str, Any] | None | UnsetType = UNSET  # the websocket's object, checked as its
    return_token_ids: bool = False  # vLLM's extension: each choice carries its token ids


class CompletionRequest(_Common, frozen=True, forbid_unknown_fields=True):
    """``POST /v1/completions``: prompt is text, token ids, or a list of one of them."""

    prompt: str | list[Any] | UnsetType = UNSET
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = None


class ChatCompletionRequest(_Common, frozen=True, forbid_unknown_fields=True):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessageIn] = []
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


def _refuse_unserved(request: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuse, by name, what OpenAI defines and this server does not do."""
    if request.n not in (None, 1):
        raise Refused(f"n {request.n}: this server returns one choice per request (n = 1)", "n")
    if request.presence_penalty not in (None, 0.0):
        raise Refused("presence_penalty is not supported (0 or absent only)", "presence_penalty")
    if request.frequency_penalty not in (None, 0.0):
        raise Refused("frequency_penalty is not supported (0 or absent only)", "frequency_penalty")
    if request.logit_bias:
        raise Refused("logit_bias is not supported", "logit_bias")
    if request.stream_options is not None and not request.stream:
        raise Refused("stream_options is only allowed with stream: true", "stream_options")
    if isinstance(request, CompletionRequest):
        if request.echo:
            raise Refused("echo is not supported", "echo")
        if request.best_of not in (None, 1):
            raise Refused(f"best_of {request.best_of}: this server returns one choice per request", "best_of")
        if request.suffix is not None:
            raise Refused("suffix (insertion) is not supported", "suffix")
        if request.logprobs is not None:
            raise Refused("logprobs are not supported", "logprobs")
    else:
        if request.logprobs or request.top_logprobs is not None:
            raise Refused("logprobs are not supported", "top_logprobs" if not request.logprobs else "logprobs")


def _prompt_fields(prompt: str | list[Any] | UnsetType) -> dict[str, Any]:
    """`Generate`'s prompt or prompt_ids for a completion's prompt (text, ids, or a list holding one of them)."""
    if prompt is UNSET:
        raise Refused("prompt is required", "prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise Refused(f"{len(prompt)} prompts: this server takes one prompt per request", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise Refused("the prompt is empty", "prompt")
        return {"prompt": prompt}
    if not prompt:
        raise Refused("the prompt is empty", "prompt")
    return {"prompt_ids": prompt}


def _chat_messages(messages: list[ChatMessageIn]) -> list[ChatMessage]:
    if not messages:
        raise Refused("messages is required and must hold at least one message", "messages")
    return [ChatMessage(m.role, m.content if isinstance(m.content, str) else "".join(p.text for p in m.content))
            for m in messages]


_PATH = re.compile(r"at `\$\.([^`]*)`")


def param_of(message: str) -> str | None:
    """The field a msgspec or protocol error message names (``at `$.speculative.n_max` `` -> ``speculative.n_max``)."""
    found = _PATH.search(message)
    return found.group(1) if found else None


def to_generate(request: CompletionRequest | ChatCompletionRequest, request_id: str) -> Generate:
    """The websocket's `generate` for an OpenAI request, its values checked against the websocket's ranges.
    Raises `Refused` naming the field."""
    _refuse_unserved(request)
    fields: dict[str, Any] = {"id": request_id}
    if isinstance(request, CompletionRequest):
        fields |= _prompt_fields(request.prompt)
        max_tokens = request.max_tokens
    else:
        fields["messages"] = _chat_messages(request.messages)
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    for name in ("temperature", "top_p", "top_k", "seed"):
        if getattr(request, name) is not None:
            fields[name] = getattr(request, name)
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    if request.stop is not None:
        fields["stop"] = [request.stop] if isinstance(request.stop, str) else request.stop
    if request.speculative is not UNSET:
        fields["speculative"] = request.speculative
    try:
        return msgspec.convert(fields, Generate)
    except msgspec.ValidationError as exc:
        message = str(exc).replace("`$.prompt_ids", "`$.prompt").replace("`$.max_tokens`", (
            "`$.max_completion_tokens`" if isinstance(request, ChatCompletionRequest)
            and request.max_completion_tokens is not None else "`$.max_tokens`"))
        raise Refused(message, param_of(message)) from None


# ---------------------------------------------------------------------------------------------------------------
# Responses


class ErrorBody(Struct, frozen=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Struct, frozen=True):
    error: ErrorBody


class PromptTokensDetails(Struct, frozen=True):
    cached_tokens: int = 0


class Usage(Struct, frozen=True):
    """OpenAI's usage, and the request's drafting statistics (the websocket done's ``spec``) as ``speculative``."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    speculative: SpecStats


class CompletionChoice(Struct, frozen=True, omit_defaults=True):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None
    token_ids: list[int] | None = None


class Completion(Struct, frozen=True):
    """A completion, or one streamed chunk of it (object text_completion either way)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: Literal["text_completion"] = "text_completion"
    usage: Usage | None = None


class AssistantMessage(Struct, frozen=True):
    content: str
    role: Literal["assistant"] = "assistant"


class ChatChoice(Struct, frozen=True, omit_defaults=True):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None
    token_ids: list[int] | None = None


class ChatCompletion(Struct, frozen=True):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"


class Delta(Struct, frozen=True, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(Struct, frozen=True, omit_defaults=True):
    index: int
    delta: Delta
    finish_reason: str | None
    logprobs: None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(Struct, frozen=True):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    usage: Usage | None = None


class Model(Struct, frozen=True):
    id: str
    created: int
    owned_by: str
    max_model_len: int
    object: Literal["model"] = "model"


class ModelList(Struct, frozen=True):
    data: list[Model]
    object: Literal["list"] = "list"
