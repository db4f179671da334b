"""One request's run, whichever protocol carries it (websocket frames or HTTP): render its chat template (in a
worker process), tokenize (in a worker thread), stream the engine's events as `Tokens`, and end with its `Done`,
or the `Error` that refused it. The protocol around it only moves these messages and cancels it."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing

import anyio

from scheduler import DoneEvent, Engine, GenerationRequest, Replicas, RequestTiming, TokensEvent

from .chat import ChatTemplateError
from .protocol import (DrafterStats, Done, Error, Failure, GenerateRequest, Limits, RollbackSteps, SpecStats,
                       Timings, Tokens, Usage, check_prompt_tokens, error)
from .templates import TemplateLimitExceeded, TemplateRenderer

log = logging.getLogger("gdnspec.server")


def loggable(request_id: str) -> str:
    """A client-chosen id as it may go into a log line: quoted, every control or non-ASCII character escaped."""
    return ascii(request_id)


class Generation:
    """One accepted request. `prepare()` then `tokens()` run it, within `cancellable()` blocks; `final()` is its
    last message once they have ended (or were left: by `cancel()`, its client going or a shutdown). `finished`
    is set when the server lets go of it (`Server.end`)."""

    def __init__(self, request: GenerateRequest, engine: Engine | Replicas, tokenizer,
                 templates: TemplateRenderer | None, limits: Limits, prepare_limiter: anyio.CapacityLimiter):
        self.request = request
        self.engine = engine
        self.tokenizer = tokenizer
        self.templates = templates
        self.limits = limits
        self.prepare_limiter = prepare_limiter
        self.cancelled = False
        self._scopes: set[anyio.CancelScope] = set()
        self.finished = anyio.Event()
        self.timing = RequestTiming(arrived=time.perf_counter())
        self.prepared: GenerationRequest | None = None
        self.refusal: Error | None = None
        self.done: DoneEvent | None = None
        self.completion = 0

    def cancel(self) -> None:
        """End the request: its `cancellable` blocks now and later."""
        self.cancelled = True
        for scope in self._scopes:
            scope.cancel()

    @contextlib.contextmanager
    def cancellable(self) -> Iterator[None]:
        """A block `cancel()` ends (the request's steps may run in several: HTTP prepares it before its response
        streams it)."""
        with anyio.CancelScope() as scope:
            self._scopes.add(scope)
            if self.cancelled:
                scope.cancel()
            try:
                yield
            finally:
                self._scopes.discard(scope)

    async def prepare(self) -> bool:
        """Render a chat request's template and tokenize its prompt; False when that refused it (`final()` is then
        the error) or failed."""
        try:
            text = await self._render() if self.request.messages is not None else None
            if isinstance(text, Error):
                self.refusal = text
                return False
            prepared = await anyio.to_thread.run_sync(self._prepare, text, limiter=self.prepare_limiter)
            await anyio.lowlevel.checkpoint()  # cancelled while tokenizing: it ends cancelled, whatever came
        except Exception as exc:
            self._failed(exc)
            return False
        if isinstance(prepared, Error):
            self.refusal = prepared
            return False
        self.prepared = prepared
        return True

    async def tokens(self) -> AsyncIterator[Tokens]:
        """The prepared request's chunks as the engine commits them; a failure inside the engine or here ends it
        with finish_reason error."""
        request = self.request
        try:
            # aclosing: a request whose consumer leaves (a slow or gone client) is aborted in the engine at once
            async with aclosing(self.engine.generate(self.prepared, self.timing)) as events:
                async for event in events:
                    if isinstance(event, TokensEvent):
                        self.completion += len(event.token_ids)
                        yield Tokens(request.id, list(event.token_ids), event.text, event.n_from_drafts)
                    else:
                        self.done = event
        except Exception as exc:
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        """The request fails; the connection and other requests go on."""
        log.exception("request %s failed", loggable(self.request.id))
        self.done = DoneEvent(self.request.id, "error", 0, self.completion,
                              error=f"internal error ({type(exc).__name__})")

    async def _render(self) -> str | Error:
        """A chat request's prompt text, from the model's template in a worker process."""
        request = self.request
        if self.tokenizer is None:
            return error(request.id, "bad_value", "this model has no tokenizer; send prompt_ids")
        if self.templates is None:
            return error(request.id, "bad_value", "this model has no chat template; send prompt or prompt_ids")
        try:
            return await self.templates.render([{"role": m.role, "content": m.content} for m in request.messages])
        except TemplateLimitExceeded as exc:
            return error(request.id, "chat_template", str(exc))
        except ChatTemplateError as exc:
            return error(request.id, "bad_value", f"chat template failed: {exc}")

    def _prepare(self, text: str | None) -> GenerationRequest | Error:
        """The engine's request: the prompt (`text`, a chat request's rendered prompt, or the request's own)
        tokenized and checked."""
        request = self.request
        if request.prompt_ids is not None:
            ids = list(request.prompt_ids)  # checked against the vocabulary by the protocol
        elif self.tokenizer is None:
            return error(request.id, "bad_value", "this model has no tokenizer; send prompt_ids")
        else:
            ids = self.tokenizer.encode(text if text is not None else request.prompt)
        if not ids:
            return error(request.id, "bad_value", "the prompt tokenizes to nothing")
        too_long = check_prompt_tokens(request.id, len(ids), self.limits)
        if too_long is not None:
            return too_long
        return GenerationRequest(tuple(ids), request.max_tokens, request.sampling, request.stop, request.speculative)

    def final(self) -> Done | Error:
        """The request's last message: its refusal, or its done (finish_reason cancelled when it never got the
        engine's)."""
        if self.refusal is not None:
            return self.refusal
        request_id, done, completion, timing = self.request.id, self.done, self.completion, self.timing
        now = time.perf_counter()
        first = timing.first_token
        tokens_per_s = completion / (now - first) if first is not None and now > first and completion else 0.0
        timings = Timings(
            queue_ms=((timing.scheduled or now) - timing.arrived) * 1e3,
            ttft_ms=(first - timing.arrived) * 1e3 if first is not None else None,
            tokens_per_s=tokens_per_s,
        )
        n_prompt = len(self.prepared.prompt_ids) if self.prepared is not None else 0
        if done is None:  # cancelled by the client, its disconnection or the server's shutdown
            return Done(request_id, "cancelled", Usage(n_prompt, completion), SpecStats(), timings)
        if done.finish_reason == "error":
            return Done(request_id, "error", Usage(n_prompt, completion), SpecStats(), timings,
                        Failure("internal", done.error or "the server failed"))
        spec = SpecStats(
            drafters={name: DrafterStats(s.drafted, s.accepted, s.drafts, list(s.accepted_per_position))
                      for name, s in done.drafters.items()},
            rollback=RollbackSteps(done.rollback_steps.get("snapshot", 0), done.rollback_steps.get("checkpoint", 0),
                                   done.rollback_steps.get("replay", 0)),
        )
        usage = Usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens)
        return Done(request_id, done.finish_reason, usage, spec, timings)
