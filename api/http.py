"""The OpenAI-compatible HTTP API: Starlette on uvicorn, beside the websocket server and from the same `Server`
(its engine, settings, access rules, request count and metrics).

``POST /v1/completions`` and ``POST /v1/chat/completions`` (streamed as server-sent events with ``stream: true``),
``GET /v1/models``, ``GET /health`` (no API key needed) and ``GET /metrics`` (Prometheus). A request is converted
into the websocket's ``generate`` and checked by the same code (`api.openai_types.to_generate`,
`api.protocol.resolve_generate`), then run as a `api.generation.Generation`. A client that disconnects cancels
its request, which frees its memory in the engine at once.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from .generation import Generation
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .openai_types import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                           ChatCompletionRequest, Completion, CompletionChoice, CompletionRequest, Delta, ErrorBody,
                           ErrorResponse, Model, ModelList, PromptTokensDetails, Refused, Usage, param_of,
                           to_generate)
from .protocol import Done, Error, GenerateRequest, resolve_generate
from .server import Server, is_loopback

log = logging.getLogger("gdnspec.http")

# How each websocket error code answers over HTTP: status and OpenAI error type.
_STATUS = {
    "bad_json": (400, "invalid_request_error"), "bad_message": (400, "invalid_request_error"),
    "bad_value": (400, "invalid_request_error"), "unknown_drafter": (400, "invalid_request_error"),
    "prompt_too_long": (400, "invalid_request_error"), "chat_template": (400, "invalid_request_error"),
    "message_too_large": (413, "invalid_request_error"), "overloaded": (429, "rate_limit_error"),
    "too_many_requests": (429, "rate_limit_error"), "internal": (500, "server_error"),
}  # fmt: skip
_encoder = msgspec.json.Encoder()
_decoders = {kind: msgspec.json.Decoder(kind) for kind in (CompletionRequest, ChatCompletionRequest)}


class ApiError(Exception):
    """An HTTP error response in OpenAI's shape."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.body, self.headers = status, ErrorBody(message, kind, param, code), headers

    def response(self) -> Response:
        return Response(_encoder.encode(ErrorResponse(self.body)), self.status, self.headers,
                        media_type="application/json")

    @staticmethod
    def of(frame: Error, prompt_field: str) -> ApiError:
        """The HTTP error for a protocol error; its param names the OpenAI request's field."""
        status, kind = _STATUS.get(frame.code, (400, "invalid_request_error"))
        message = frame.message.replace("`$.prompt_ids", f"`$.{prompt_field}")
        param = param_of(message) or (prompt_field if frame.code == "prompt_too_long" else None)
        headers = {"Retry-After": "1"} if status == 429 else None
        return ApiError(status, message, kind, param, frame.code, headers)


def _json(struct) -> Response:
    return Response(_encoder.encode(struct), media_type="application/json")


def _event(struct) -> bytes:
    return b"data: " + _encoder.encode(struct) + b"\n\n"


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    """Cancel `scope` when the client goes away (the request's body has been read: what comes next is that)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


class EventStream(Response):
    """A server-sent event stream whose `produce(write)` is cancelled when the client disconnects."""

    media_type = "text/event-stream"

    def __init__(self, produce: Callable[[Callable[[bytes], Awaitable[None]]], Awaitable[None]]):
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # no body: no Content-Length
        self.produce = produce

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})

        async def write(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        async with anyio.create_task_group() as tg:
            tg.start_soon(_cancel_on_disconnect, receive, tg.cancel_scope)
            await self.produce(write)
            tg.cancel_scope.cancel()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class Guard:
    """ASGI middleware holding HTTP requests to the server's access rules: a browser origin not listed (403), a
    missing or wrong API key (401; ``/health`` needs none), more requests at once than max_connections (503)."""

    def __init__(self, app: ASGIApp, server: Server):
        self.app = app
        self.server = server
        self.open = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers, access = Headers(scope=scope), self.server.access
        refusal = None
        if not access.admits_origin(headers.get("origin")):
            refusal = ApiError(403, f"origin {headers['origin']!r} is not allowed", "permission_error",
                               code="origin_not_allowed")
        elif scope["path"] != "/health" and not access.admits_key(headers.get("authorization")):
            refusal = ApiError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                               "authentication_error", code="invalid_api_key")
        elif self.open >= self.server.settings.limits.max_connections:
            refusal = ApiError(503, f"{self.open} requests are open, this server's most; try again later",
                               "server_error", code="too_many_connections")
        if refusal is not None:
            return await refusal.response()(scope, receive, send)
        self.open += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.open -= 1


class HttpApi:
    """The HTTP endpoints of one `Server`; `app` is the ASGI application. model_name: the id ``/v1/models`` lists
    and requests must name."""

    def __init__(self, server: Server, model_name: str):
        self.server = server
        self.model_name = model_name
        self.created = int(time.time())
        middleware = [Middleware(Guard, server=server)]
        if server.access.origins:  # answers listed origins' preflight requests, before the guard asks for a key
            middleware.insert(0, Middleware(CORSMiddleware, allow_origins=list(server.access.origins),
                                            allow_methods=["GET", "POST"],
                                            allow_headers=["Authorization", "Content-Type"]))  # fmt: skip
        self.app = Starlette(
            routes=[Route("/v1/completions", self.completions, methods=["POST"]),
                    Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                    Route("/v1/models", self.models, methods=["GET"]),
                    Route("/health", self.health, methods=["GET"]),
                    Route("/metrics", self.metrics, methods=["GET"])],
            middleware=middleware,
            exception_handlers={ApiError: self._api_error, HTTPException: self._http_error,
                                Exception: self._internal_error},
        )  # fmt: skip

    # -------------------------------------------------------------------------------------------- endpoints

    async def health(self, request: Request) -> Response:
        if self.server.closing:
            return Response(b'{"status":"shutting down"}', 503, media_type="application/json")
        return Response(b'{"status":"ok"}', media_type="application/json")

    async def models(self, request: Request) -> Response:
        model = Model(self.model_name, self.created, "gdnspec", self.server.engine.max_model_len)
        return _json(ModelList([model]))

    async def metrics(self, request: Request) -> Response:
        return Response(self.server.metrics.exposition(), media_type=METRICS_CONTENT_TYPE)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionRequest, "cmpl")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, ChatCompletionRequest, "chatcmpl")

    # -------------------------------------------------------------------------------------------- one request

    async def _generate(self, request: Request, kind: type, id_prefix: str) -> Response:
        body = await self._body(request)
        try:
            query = _decoders[kind].decode(body)
        except msgspec.ValidationError as exc:
            raise ApiError(400, str(exc), param=param_of(str(exc)), code="bad_message") from None
        except msgspec.DecodeError as exc:
            raise ApiError(400, f"the body is not JSON: {exc}", code="bad_json") from None
        except RecursionError:
            raise ApiError(400, "JSON nested too deeply", code="bad_json") from None
        if query.model != self.model_name:
            raise ApiError(404, f"model {query.model!r} does not exist; this server serves {self.model_name!r}",
                           "not_found_error", "model", "model_not_found")  # fmt: skip
        prompt_field = "prompt" if kind is CompletionRequest else "messages"
        try:
            generate = to_generate(query, f"{id_prefix}-{secrets.token_hex(12)}")
        except Refused as exc:
            raise ApiError(400, exc.message, param=exc.param, code="bad_value") from None
        resolved = resolve_generate(generate, self.server.settings)
        if isinstance(resolved, Error):
            raise ApiError.of(resolved, prompt_field)
        if self.server.closing:
            raise ApiError(503, "the server is shutting down", "server_error", code="shutting_down")
        generation = self.server.admit(resolved)
        if isinstance(generation, Error):
            raise ApiError.of(generation, prompt_field)
        try:
            with generation.cancellable():
                prepared = await generation.prepare()
        except BaseException:
            self.server.end(generation)
            raise
        if not prepared:
            self.server.end(generation)
            raise self._failure(generation.final(), prompt_field)
        shape = _Shape(kind is ChatCompletionRequest, resolved, self.model_name, query.return_token_ids)
        if query.stream:
            usage = query.stream_options is not None and query.stream_options.include_usage
            return EventStream(lambda write: self._stream(generation, shape, usage, write))
        return await self._complete(generation, shape, request.receive, prompt_field)

    async def _body(self, request: Request) -> bytes:
        """The request's body, refused (413) beyond the server's max_message_bytes."""
        limit = self.server.settings.limits.max_message_bytes
        too_large = ApiError(413, f"the body exceeds this server's {limit} bytes", code="message_too_large")
        try:
            declared = int(request.headers.get("content-length", 0))
        except ValueError:
            raise ApiError(400, "Content-Length is not a number", code="bad_message") from None
        if declared > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    @staticmethod
    def _failure(frame: Done | Error, prompt_field: str) -> ApiError:
        """The HTTP error of a request that was refused after admission, cancelled or failed."""
        if isinstance(frame, Error):
            return ApiError.of(frame, prompt_field)
        if frame.finish_reason == "cancelled":
            return ApiError(503, "the request was cancelled: its client went away or the server is shutting down",
                            "server_error", code="cancelled")
        return ApiError(500, frame.error.message if frame.error else "the server failed", "server_error",
                        code="internal")

    async def _complete(self, generation: Generation, shape: _Shape, receive: Receive, prompt_field: str
                        ) -> Response:
        """Run a request to its end and answer with the whole completion."""
        texts, token_ids = [], []
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_cancel_on_disconnect, receive, tg.cancel_scope)
                with generation.cancellable():
                    async with contextlib.aclosing(generation.tokens()) as chunks:
                        async for chunk in chunks:
                            texts.append(chunk.text)
                            token_ids += chunk.token_ids
                tg.cancel_scope.cancel()
        finally:
            self.server.end(generation)
        final = generation.final()
        if not isinstance(final, Done) or final.finish_reason not in ("stop", "length"):
            raise self._failure(final, prompt_field)
        return _json(shape.whole("".join(texts), token_ids, final))

    async def _stream(self, generation: Generation, shape: _Shape, include_usage: bool,
                      write: Callable[[bytes], Awaitable[None]]) -> None:
        """Stream a request as server-sent events: its chunks, the one with its finish_reason, its usage when asked
        for, ``[DONE]``; an error event instead of the finish_reason when it failed or was cancelled."""
        try:
            if shape.chat:
                await write(_event(shape.chunk(Delta(role="assistant", content=""), None)))
            with generation.cancellable():
                async with contextlib.aclosing(generation.tokens()) as chunks:
                    async for chunk in chunks:
                        if chunk.text or shape.token_ids:
                            await write(_event(shape.piece(chunk.text, chunk.token_ids)))
        finally:
            self.server.end(generation)
        final = generation.final()
        if isinstance(final, Done) and final.finish_reason in ("stop", "length"):
            await write(_event(shape.last(final.finish_reason)))
            if include_usage:
                await write(_event(shape.usage_chunk(final)))
        else:
            await write(_event(ErrorResponse(self._failure(final, "prompt").body)))
        await write(b"data: [DONE]\n\n")

    # -------------------------------------------------------------------------------------------- errors

    async def _api_error(self, request: Request, exc: ApiError) -> Response:
        return exc.response()

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        kind, code = ("not_found_error", "not_found") if exc.status_code == 404 else ("invalid_request_error", None)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return ApiError(exc.status_code, message, kind, code=code, headers=exc.headers).response()

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        log.exception("failed to answer %s %s", request.method, request.url.path)
        return ApiError(500, "the server failed to answer this request", "server_error", code="internal").response()


class _Shape:
    """The OpenAI objects of one request: completion or chat, whole or in chunks."""

    def __init__(self, chat: bool, request: GenerateRequest, model: str, token_ids: bool):
        self.chat, self.id, self.model, self.token_ids = chat, request.id, model, token_ids
        self.created = int(time.time())

    @staticmethod
    def usage(done: Done) -> Usage:
        u = done.usage
        return Usage(u.prompt_tokens, u.completion_tokens, u.prompt_tokens + u.completion_tokens,
                     PromptTokensDetails(u.cached_tokens), done.spec)

    def whole(self, text: str, token_ids: list[int], done: Done) -> Completion | ChatCompletion:
        ids = token_ids if self.token_ids else None
        if self.chat:
            choice = ChatChoice(0, AssistantMessage(text), done.finish_reason, token_ids=ids)
            return ChatCompletion(self.id, self.created, self.model, [choice], self.usage(done))
        choice = CompletionChoice(0, text, done.finish_reason, token_ids=ids)
        return Completion(self.id, self.created, self.model, [choice], usage=self.usage(done))

    def chunk(self, delta: Delta, finish_reason: str | None, token_ids: list[int] | None = None):
        return ChatCompletionChunk(self.id, self.created, self.model,
                                   [ChatChunkChoice(0, delta, finish_reason, token_ids=token_ids)])

    def piece(self, text: str, token_ids: list[int]) -> Completion | ChatCompletionChunk:
        ids = token_ids if self.token_ids else None
        if self.chat:
            return self.chunk(Delta(content=text), None, ids)
        return Completion(self.id, self.created, self.model, [CompletionChoice(0, text, None, token_ids=ids)])

    def last(self, finish_reason: str) -> Completion | ChatCompletionChunk:
        if self.chat:
            return self.chunk(Delta(), finish_reason)
        return Completion(self.id, self.created, self.model, [CompletionChoice(0, "", finish_reason)])

    def usage_chunk(self, done: Done) -> Completion | ChatCompletionChunk:
        if self.chat:
            return ChatCompletionChunk(self.id, self.created, self.model, [], usage=self.usage(done))
        return Completion(self.id, self.created, self.model, [], usage=self.usage(done))


# ------------------------------------------------------------------------------------------------ serving


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        """The process's signals are its caller's (`gdnspec serve` stops both protocols on them), not uvicorn's."""
        yield


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (0 picks a free port). Its protocol is named (IPPROTO_TCP): asyncio
    sets TCP_NODELAY only on connections of such a socket, and without it Nagle's algorithm holds a response's
    second write until the client's delayed ACK, some 40 ms for every request after a connection's first."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


async def run_http(server: Server, host: str, port: int, *, model_name: str, ready=None,
                   shutdown: anyio.Event | None = None) -> None:
    """Serve the HTTP API until `shutdown` is set (or forever); ready(port) is called once listening. Stopping
    cancels every request of the server (`Server.stop`) before the connections close."""
    api = HttpApi(server, model_name)
    sock = bind(host, port)
    config = uvicorn.Config(api.app, lifespan="off", log_config=None, access_log=False, ws="none",
                            http="httptools", timeout_graceful_shutdown=server.shutdown_grace_s)  # fmt: skip
    http_server = _Uvicorn(config)
    if server.access.api_key is None and not is_loopback(host):
        log.warning("serving HTTP on %s beyond loopback without an API key: anyone who can reach it may use it",
                    host)  # fmt: skip
    bound = sock.getsockname()[1]
    log.info("serving the OpenAI API on http://%s:%d (model %r)", host, bound, model_name)
    async with anyio.create_task_group() as tg:
        tg.start_soon(http_server.serve, [sock])
        if ready is not None:
            ready(bound)
        if shutdown is None:
            await anyio.sleep_forever()
        await shutdown.wait()
        await server.stop()
        http_server.should_exit = True


@contextlib.asynccontextmanager
async def listening_http(server: Server, host: str = "127.0.0.1", port: int = 0, *, model_name: str
                         ) -> AsyncIterator[tuple[str, anyio.Event]]:
    """Run the HTTP API of `server` in a task group of its own; yields its http:// URL and the event that stops
    it, which is set when the block exits."""
    async with anyio.create_task_group() as tg:
        ready, shutdown, bound = anyio.Event(), anyio.Event(), []

        def on_ready(port_in_use: int) -> None:
            bound.append(port_in_use)
            ready.set()

        tg.start_soon(lambda: run_http(server, host, port, model_name=model_name, ready=on_ready,
                                       shutdown=shutdown))  # fmt: skip
        await ready.wait()
        try:
            yield f"http://{host}:{bound[0]}", shutdown
        finally:
            shutdown.set()
