"""The websocket protocol: message types, server settings, validation, and per-connection state.

Frames are JSON text frames. Every frame is one object whose ``type`` field names the message (msgspec tagged
unions). Several requests share one connection; a client-chosen ``id`` names each request.

Client -> server: ``generate`` (start a request), ``cancel`` (stop one), ``stats`` (ask for the server's counts).
Server -> client: ``tokens`` (a streamed chunk), ``done`` (the last frame of a request), ``error`` (a rejected
frame or request; with an id it is the last frame of that request, except ``unknown_id``), ``stats``.

The server plugs in through :class:`Connection`, a Sans-I/O object holding one typed decoder and the ids in
flight: ``connection.receive(frame)`` returns a resolved :class:`GenerateRequest` (its sampling a
`jaxmodel.requests.Sampling`, its speculative settings a `drafters.policy.SpeculativeConfig`, as the engine takes
them), a :class:`Cancel`, a :class:`StatsRequest`, or an :class:`Error` to send back. ``python -m api.protocol
--schema`` prints the JSON Schema (docs/protocol.schema.json).
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from jaxmodel.requests import InvalidSetting, Rollback, Sampling, SpeculativeConfig
from scheduler.types import FinishReason

__all__ = [
    "ChatMessage", "Speculative", "Generate", "Cancel", "StatsRequest", "ClientMessage",
    "Usage", "DrafterStats", "RollbackSteps", "SpecStats", "Timings", "Failure", "Tokens", "Done", "Error", "Stats",
    "ServerMessage",
    "Rollback", "FinishReason", "ErrorCode", "ERROR_CODES",
    "Defaults", "Limits", "ServerSettings", "GenerateRequest",
    "resolve_generate", "check_prompt_tokens", "error", "Connection", "schema", "schema_json",
]

ErrorCode = Literal[
    "bad_json", "bad_message", "bad_value", "unknown_drafter", "prompt_too_long", "too_many_requests",
    "duplicate_id", "unknown_id", "message_too_large", "overloaded", "chat_template", "internal",
]
ERROR_CODES: tuple[str, ...] = ErrorCode.__args__

# Bounds every server shares; what a server may lower (tokens, prompt length, ...) is in Limits.
MAX_INT32 = 2**31 - 1
MAX_SEED = 2**32 - 1  # sampling keys are derived from 32-bit seeds, so a larger seed would be cut silently
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_MESSAGES = 1024
MAX_DRAFTERS = 16
MAX_NAME_CHARS = 64

RequestId = Annotated[str, Meta(min_length=1, max_length=128, description="Client-chosen request id.")]
TokenId = Annotated[int, Meta(ge=0, le=MAX_INT32)]
Name = Annotated[str, Meta(min_length=1, max_length=MAX_NAME_CHARS)]


# ---------------------------------------------------------------------------------------------------------------
# Client -> server


class ChatMessage(Struct, frozen=True, forbid_unknown_fields=True):
    """One chat turn, rendered into a prompt by the model's chat template."""

    role: Annotated[str, Meta(min_length=1, max_length=MAX_NAME_CHARS, description="system, user, assistant, ...")]
    content: Annotated[str, Meta(description="Counts towards the server's max_prompt_chars.")]


class Speculative(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Speculative-decoding policy of one request; a missing or null field takes the server's default."""

    drafters: (
        Annotated[list[Name], Meta(max_length=MAX_DRAFTERS,
                                   description="Drafter names in order of preference; [] = plain decoding.")]
        | None
    ) = None
    n_max: Annotated[int, Meta(ge=1, le=MAX_INT32, description="Longest draft per step.")] | None = None
    n_min: Annotated[int, Meta(ge=1, le=MAX_INT32, description="Shortest draft worth verifying.")] | None = None
    p_min: (
        Annotated[float, Meta(ge=0.0, le=1.0, description="Stop drafting below this draft probability.")] | None
    ) = None
    rollback: Annotated[Rollback, Meta(description="How rejected drafts are rolled back.")] | None = None


class Generate(Struct, frozen=True, tag="generate", forbid_unknown_fields=True, omit_defaults=True):
    """Start a request. Exactly one of prompt, prompt_ids, messages. Missing or null fields take server defaults;
    ``speculative`` missing means the server's default policy, null means plain decoding."""

    id: RequestId
    prompt: (
        Annotated[str, Meta(min_length=1, description="Raw text, tokenized as is; at most the server's "
                                                      "max_prompt_chars characters.")]
        | None
    ) = None
    prompt_ids: Annotated[list[TokenId], Meta(min_length=1, description="Token ids.")] | None = None
    messages: (
        Annotated[list[ChatMessage], Meta(min_length=1, max_length=MAX_MESSAGES,
                                          description="Chat turns, rendered with the chat template.")]
        | None
    ) = None
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_INT32, description="Most tokens to generate.")] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=100.0, description="0 = greedy.")] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: (
        Annotated[int, Meta(ge=0, le=MAX_INT32, description="0 = off; at most the model's vocabulary size.")] | None
    ) = None
    seed: Annotated[int, Meta(ge=0, le=MAX_SEED, description="Missing: the server draws one.")] | None = None
    stop: (
        Annotated[list[Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]],
                  Meta(max_length=MAX_STOP_STRINGS, description="Stop strings.")]
        | None
    ) = None
    speculative: Speculative | None | UnsetType = UNSET


class Cancel(Struct, frozen=True, tag="cancel", forbid_unknown_fields=True):
    """Stop a request; the server answers with its ``done`` (finish_reason ``cancelled``)."""

    id: RequestId


class StatsRequest(Struct, frozen=True, tag="stats", forbid_unknown_fields=True):
    """Ask for the server's counts; the server answers with a ``stats`` frame."""


ClientMessage = Generate | Cancel | StatsRequest


# ---------------------------------------------------------------------------------------------------------------
# Server -> client


class Usage(Struct, frozen=True):
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: Annotated[int, Meta(description="Prompt tokens taken over from the prefix cache.")] = 0


class DrafterStats(Struct, frozen=True):
    """Draft tokens one drafter proposed for a request and how many of them the target accepted."""

    drafted: int = 0
    accepted: int = 0
    drafts: Annotated[int, Meta(description="Verify steps that fed this drafter's drafts.")] = 0
    accepted_per_position: Annotated[
        list[int], Meta(description="Per draft position (0, 1, ...): how many of those drafts had it accepted.")] = []


class RollbackSteps(Struct, frozen=True):
    """Verification steps of a request per rollback mode."""

    snapshot: int = 0
    checkpoint: int = 0
    replay: int = 0


class SpecStats(Struct, frozen=True):
    """Speculative-decoding statistics of one request (empty for plain decoding)."""

    drafters: dict[str, DrafterStats] = {}
    rollback: RollbackSteps = RollbackSteps()


class Timings(Struct, frozen=True):
    """Server-side timings of one request."""

    queue_ms: Annotated[float, Meta(description="Arrival to first scheduled step.")]
    ttft_ms: Annotated[float, Meta(description="Arrival to first token; null if none was produced.")] | None
    tokens_per_s: Annotated[float, Meta(description="Completion tokens per second after the first token.")]


class Failure(Struct, frozen=True):
    """Why a request ended with finish_reason ``error``."""

    code: ErrorCode
    message: str


class Tokens(Struct, frozen=True, tag="tokens"):
    """A chunk of generated tokens. ``text`` is the UTF-8-safe text delta (it may lag token_ids while a
    multi-byte character or a possible stop string is incomplete)."""

    id: str
    token_ids: list[int]
    text: str
    n_from_drafts: Annotated[int, Meta(ge=0, description="How many of token_ids were accepted drafts.")]


class Done(Struct, frozen=True, tag="done"):
    """The last frame of a request."""

    id: str
    finish_reason: FinishReason
    usage: Usage
    spec: SpecStats
    timings: Timings
    error: Annotated[Failure, Meta(description="With finish_reason error: what failed.")] | None = None


class Error(Struct, frozen=True, tag="error"):
    """A rejected frame. With an id it ends that request (except ``unknown_id``, which changes nothing); with a
    null id it concerns the connection's frame as a whole. The connection and other requests live on."""

    id: str | None
    code: ErrorCode
    message: str


class Stats(Struct, frozen=True, tag="stats"):
    """The server's counts at the moment of the ``stats`` request."""

    connections: int
    requests_running: Annotated[int, Meta(description="Sequences holding memory in the engine.")]
    requests_waiting: Annotated[int, Meta(description="Sequences queued in the engine.")]
    requests_in_flight: Annotated[int, Meta(description="Accepted requests without their final frame, all "
                                                        "connections.")]
    pages_free: int
    pages_total: Annotated[int, Meta(description="KV pages that can be handed out.")]
    planes_free: int
    planes_total: Annotated[int, Meta(description="GDN state planes that can be handed out.")]
    steps: Annotated[int, Meta(description="Engine steps since start.")]
    rss_bytes: Annotated[int, Meta(description="The server process's resident memory.")]
    weights_bytes: Annotated[int, Meta(description="The model weights' bytes in memory (the target's and the draft "
                                                   "model's); the state pools' budget comes on top.")] = 0
    cached_prefixes: Annotated[int, Meta(description="Finished requests' states kept for the requests that "
                                                     "continue them (--prefix-cache).")] = 0
    cached_pages: Annotated[int, Meta(description="KV pages the prefix cache holds (not free).")] = 0
    cached_planes: Annotated[int, Meta(description="GDN state planes the prefix cache holds (not free).")] = 0
    prefix_hits: Annotated[int, Meta(description="Requests that took a cached state over, since start.")] = 0
    prefix_tokens: Annotated[int, Meta(description="Prompt tokens those requests took over, since start.")] = 0
    prefix_evictions: Annotated[int, Meta(description="Cached states evicted for memory or for a newer state, "
                                                      "since start.")] = 0


ServerMessage = Tokens | Done | Error | Stats


# ---------------------------------------------------------------------------------------------------------------
# Server settings


class Defaults(Struct, frozen=True, forbid_unknown_fields=True):
    """Values a request gets for the fields it leaves out."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    drafters: tuple[str, ...] = ("ngram",)
    n_max: int = 4
    n_min: int = 1
    p_min: float = 0.75
    rollback: Rollback = "auto"


class Limits(Struct, frozen=True, forbid_unknown_fields=True):
    """What the server accepts."""

    max_prompt_tokens: int = 32768
    max_prompt_chars: int = 256 * 1024  # text and chat content, checked before tokenizing
    max_max_tokens: int = 8192
    max_message_bytes: int = 2 * 1024 * 1024
    max_in_flight: int = 64  # per connection
    max_connections: int = 256
    max_queued: int = 256  # requests waiting for the engine beyond those it runs, all connections
    max_n_max: int = 64
    known_drafters: tuple[str, ...] = ("ngram",)
    vocab_size: int | None = None


class ServerSettings(Struct, frozen=True, forbid_unknown_fields=True):
    """Defaults and limits together; the defaults must satisfy the limits."""

    defaults: Defaults = Defaults()
    limits: Limits = Limits()

    def __post_init__(self) -> None:
        d, lim = self.defaults, self.limits
        unknown = [n for n in d.drafters if n not in lim.known_drafters]
        if unknown:
            raise ValueError(f"default drafters {unknown} are not in known_drafters {list(lim.known_drafters)}")
        if not 1 <= d.max_tokens <= lim.max_max_tokens:
            raise ValueError(f"default max_tokens {d.max_tokens} is not in [1, {lim.max_max_tokens}]")
        if not 1 <= d.n_min <= d.n_max <= lim.max_n_max:
            raise ValueError(f"defaults need 1 <= n_min {d.n_min} <= n_max {d.n_max} <= {lim.max_n_max}")


@dataclass(frozen=True)
class GenerateRequest:
    """A validated ``generate`` with every default filled in: the engine's request (`scheduler.GenerationRequest`)
    but for the prompt, which is tokenized later. Exactly one of prompt / prompt_ids / messages is set;
    ``speculative`` is None for plain decoding."""

    id: str
    prompt: str | None
    prompt_ids: tuple[int, ...] | None
    messages: tuple[ChatMessage, ...] | None
    max_tokens: int
    sampling: Sampling
    stop: tuple[str, ...]
    speculative: SpeculativeConfig | None


# ---------------------------------------------------------------------------------------------------------------
# Validation


def error(request_id: str | None, code: ErrorCode, message: str) -> Error:
    """Build an ``error`` frame."""
    return Error(id=request_id, code=code, message=message)


def _random_seed() -> int:
    return secrets.randbits(32)


def _resolve_speculative(msg: Generate, settings: ServerSettings) -> SpeculativeConfig | None | Error:
    d, lim = settings.defaults, settings.limits
    spec = msg.speculative
    if spec is None:
        return None
    if spec is UNSET:
        spec = Speculative()
    drafters = tuple(spec.drafters) if spec.drafters is not None else d.drafters
    if not drafters:
        return None
    unknown = [n for n in drafters if n not in lim.known_drafters]
    if unknown:
        return error(msg.id, "unknown_drafter",
                     f"unknown drafter(s) {unknown} at `$.speculative.drafters`; "
                     f"this server knows {list(lim.known_drafters)}")
    n_max = spec.n_max if spec.n_max is not None else d.n_max
    if n_max > lim.max_n_max:
        return error(msg.id, "bad_value", f"n_max {n_max} exceeds this server's {lim.max_n_max} - at "
                                          "`$.speculative.n_max`")
    try:
        return SpeculativeConfig(
            drafters=drafters,
            n_max=n_max,
            n_min=spec.n_min if spec.n_min is not None else min(d.n_min, n_max),
            p_min=spec.p_min if spec.p_min is not None else d.p_min,
            rollback=spec.rollback if spec.rollback is not None else d.rollback,
        )
    except InvalidSetting as exc:
        return error(msg.id, "bad_value", f"{exc} - at `$.speculative.{exc.field}`")


def resolve_generate(
    msg: Generate, settings: ServerSettings, seed_source: Callable[[], int] = _random_seed
) -> GenerateRequest | Error:
    """Check a decoded ``generate`` against the server's limits and fill in its defaults.

    Returns the resolved request, or an ``error`` frame (code ``bad_value``, ``unknown_drafter`` or
    ``prompt_too_long``) whose message names the offending field. ``seed_source`` draws the seed of a request
    that has none. Text and chat prompts are checked here in characters, before any tokenizing; their tokens
    are checked with :func:`check_prompt_tokens` after tokenization.
    """
    d, lim = settings.defaults, settings.limits
    given = [name for name in ("prompt", "prompt_ids", "messages") if getattr(msg, name) is not None]
    if len(given) != 1:
        return error(msg.id, "bad_value",
                     f"exactly one of prompt, prompt_ids, messages is required; got {given or 'none'}")
    if msg.prompt is not None and len(msg.prompt) > lim.max_prompt_chars:
        return error(msg.id, "prompt_too_long", f"prompt has {len(msg.prompt)} characters; this server accepts at "
                                                f"most {lim.max_prompt_chars} - at `$.prompt`")
    if msg.messages is not None:
        n_chars = sum(len(m.content) for m in msg.messages)
        if n_chars > lim.max_prompt_chars:
            return error(msg.id, "prompt_too_long", f"messages have {n_chars} characters of content; this server "
                                                    f"accepts at most {lim.max_prompt_chars} - at `$.messages`")
    if msg.prompt_ids is not None:
        if lim.vocab_size is not None:
            for i, tok in enumerate(msg.prompt_ids):
                if tok >= lim.vocab_size:
                    return error(msg.id, "bad_value",
                                 f"token id {tok} is not below vocab_size {lim.vocab_size} - at `$.prompt_ids[{i}]`")
        too_long = check_prompt_tokens(msg.id, len(msg.prompt_ids), lim)
        if too_long is not None:
            return too_long
    max_tokens = msg.max_tokens if msg.max_tokens is not None else d.max_tokens
    if max_tokens > lim.max_max_tokens:
        return error(msg.id, "bad_value",
                     f"max_tokens {max_tokens} exceeds this server's {lim.max_max_tokens} - at `$.max_tokens`")
    if msg.top_k is not None and lim.vocab_size is not None and msg.top_k > lim.vocab_size:
        return error(msg.id, "bad_value",
                     f"top_k {msg.top_k} exceeds the vocabulary size {lim.vocab_size} - at `$.top_k`")
    spec = _resolve_speculative(msg, settings)
    if isinstance(spec, Error):
        return spec
    return GenerateRequest(
        id=msg.id,
        prompt=msg.prompt,
        prompt_ids=tuple(msg.prompt_ids) if msg.prompt_ids is not None else None,
        messages=tuple(msg.messages) if msg.messages is not None else None,
        max_tokens=max_tokens,
        sampling=Sampling(
            temperature=msg.temperature if msg.temperature is not None else d.temperature,
            top_p=msg.top_p if msg.top_p is not None else d.top_p,
            top_k=msg.top_k if msg.top_k is not None else d.top_k,
            seed=msg.seed if msg.seed is not None else seed_source(),
        ),
        stop=tuple(msg.stop) if msg.stop is not None else (),
        speculative=spec,
    )


def check_prompt_tokens(request_id: str, n_tokens: int, limits: Limits) -> Error | None:
    """The ``prompt_too_long`` error for a prompt of ``n_tokens`` tokens, or None when it fits."""
    if n_tokens > limits.max_prompt_tokens:
        return error(request_id, "prompt_too_long",
                     f"prompt has {n_tokens} tokens; this server accepts at most {limits.max_prompt_tokens}")
    return None


class _IdOnly(Struct):
    id: str | None = None


_id_decoder = msgspec.json.Decoder(_IdOnly)


class Connection:
    """Protocol state of one websocket connection (Sans-I/O): one typed decoder and the request ids in flight.

    The server passes every received frame to :meth:`receive` and acts on the result: start a
    :class:`GenerateRequest`, cancel the request a :class:`Cancel` names, or send the :class:`Error` back. After
    it sends the final frame (``done``, or ``error`` with the id) of an accepted request, it calls :meth:`finish`.
    """

    def __init__(self, settings: ServerSettings, seed_source: Callable[[], int] = _random_seed) -> None:
        self.settings = settings
        self._seed_source = seed_source
        self._decoder = msgspec.json.Decoder(ClientMessage)
        self._encoder = msgspec.json.Encoder()
        self._in_flight: set[str] = set()

    @property
    def in_flight(self) -> frozenset[str]:
        """Ids of accepted requests whose final frame has not been sent."""
        return frozenset(self._in_flight)

    def _reply_id(self, frame: str | bytes) -> str | None:
        """The frame's id, if it has one that is not in flight (an error must not end a running request)."""
        try:
            rid = _id_decoder.decode(frame).id
        except (msgspec.DecodeError, RecursionError):
            return None
        return rid if rid is not None and rid not in self._in_flight else None

    def receive(self, frame: str | bytes) -> GenerateRequest | Cancel | StatsRequest | Error:
        """Decode and check one text frame (str, or its UTF-8 bytes). An accepted ``generate`` is registered as
        in flight. Never raises: whatever the frame holds, the answer is a message."""
        lim = self.settings.limits
        size = len(frame) if isinstance(frame, bytes) else len(frame.encode("utf-8", "surrogatepass"))
        if size > lim.max_message_bytes:
            return error(self._reply_id(frame), "message_too_large",
                         f"frame of {size} bytes exceeds this server's {lim.max_message_bytes}")
        try:
            msg = self._decoder.decode(frame)
        except msgspec.ValidationError as exc:
            return error(self._reply_id(frame), "bad_message", str(exc))
        except msgspec.DecodeError as exc:
            return error(None, "bad_json", str(exc))
        except RecursionError:
            return error(None, "bad_json", "JSON nested too deeply")
        match msg:
            case StatsRequest():
                return msg
            case Cancel():
                if msg.id not in self._in_flight:
                    return error(msg.id, "unknown_id", f"no request {msg.id!r} is in flight on this connection")
                return msg
        if msg.id in self._in_flight:
            return error(None, "duplicate_id", f"request {msg.id!r} is already in flight on this connection")
        if len(self._in_flight) >= lim.max_in_flight:
            return error(msg.id, "too_many_requests",
                         f"{len(self._in_flight)} requests are in flight; this server allows {lim.max_in_flight} "
                         "per connection")
        resolved = resolve_generate(msg, self.settings, self._seed_source)
        if isinstance(resolved, GenerateRequest):
            self._in_flight.add(resolved.id)
        return resolved

    def finish(self, request_id: str) -> None:
        """Forget a request after its final frame was sent; its id may be used again."""
        self._in_flight.discard(request_id)

    def encode(self, msg: Tokens | Done | Error | Stats) -> bytes:
        """Encode a server frame as UTF-8 JSON (send it as a text frame)."""
        return self._encoder.encode(msg)


# ---------------------------------------------------------------------------------------------------------------
# JSON Schema


def schema() -> dict[str, Any]:
    """The JSON Schema of the protocol: ``$defs`` holds ClientMessage, ServerMessage and every struct."""
    (client, server), components = msgspec.json.schema_components(
        [ClientMessage, ServerMessage], ref_template="#/$defs/{name}"
    )
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "gdnspec websocket protocol",
        "description": "JSON text frames; a client sends ClientMessage frames and receives ServerMessage frames.",
        "$defs": {"ClientMessage": client, "ServerMessage": server, **components},
    }


def schema_json() -> str:
    """The schema as the exact text of docs/protocol.schema.json."""
    return json.dumps(schema(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m api.protocol --schema`` prints the JSON Schema."""
    parser = argparse.ArgumentParser(prog="python -m api.protocol", description=__doc__.splitlines()[0])
    parser.add_argument("--schema", action="store_true", help="print the protocol's JSON Schema")
    args = parser.parse_args(argv)
    if not args.schema:
        parser.print_help()
        return 2
    sys.stdout.write(schema_json())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
