"""The websocket server: one connection, many requests multiplexed by id, each streamed from the engine.

Each connection has its own task group: a reader (frames -> `api.protocol.Connection` -> request tasks), one
task per request (tokenizing in a worker thread, then engine events -> frames), and a writer draining a bounded
outbound stream. A client too slow to drain its stream gets its connection closed with 1008 and its requests
cancelled, so it never stalls others. Whatever a frame holds, the reader answers it and reads on.

The handshake is where access is decided (`Access`): an API key when one is set, the Origin header (browsers
send one; only listed origins are let in) and the number of connections.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from http import HTTPStatus

import anyio
import msgspec
import websockets
from anyio.abc import TaskGroup
from websockets.asyncio.server import ServerConnection, serve
from websockets.http11 import Request, Response

from scheduler import Engine, Replicas

from .generation import Generation, loggable
from .metrics import Metrics
from .templates import TemplateLimits, TemplateRenderer
from .protocol import (Cancel, Connection, Done, Error, Failure, GenerateRequest, ServerSettings, SpecStats, Stats,
                       StatsRequest, Timings, Tokens, Usage, error)

log = logging.getLogger("gdnspec.server")

OUTBOUND_FRAMES = 1024  # per connection; a client this far behind is closed (1008)
PREPARE_THREADS = 2  # tokenizing runs in at most this many worker threads at once
SHUTDOWN_GRACE_S = 5.0  # stop(): how long in-flight requests get to send their done frames
CLOSE_TIMEOUT_S = 2.0  # a closing handshake the peer does not answer is cut after this
API_KEY_ENV = "GDNSPEC_API_KEY"


@dataclass(frozen=True)
class Access:
    """Who may connect. api_key: required as ``Authorization: Bearer <key>`` when set (compared in constant
    time). origins: the browser origins let in (``https://app.example``); a handshake without an Origin header
    (any non-browser client) is always let in, one with an unlisted origin is refused with 403, so no web page
    can use a server it was not meant to."""

    api_key: str | None = None
    origins: tuple[str, ...] = ()

    @staticmethod
    def from_env(api_key: str | None = None, origins: Sequence[str] = ()) -> Access:
        """The key given, else the GDNSPEC_API_KEY environment variable (empty means none)."""
        return Access(api_key or os.environ.get(API_KEY_ENV) or None, tuple(origins))

    def admits_key(self, authorization: str | None) -> bool:
        """Whether an Authorization header carries the key (always, when none is set)."""
        if self.api_key is None:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    def admits_origin(self, origin: str | None) -> bool:
        """Whether a request with this Origin header (None: a client that is not a browser) is let in."""
        return origin is None or origin in self.origins


def is_loopback(host: str) -> bool:
    """Whether `host` names only this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resident_bytes() -> int:
    """This process's resident memory (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def limited_to(settings: ServerSettings, engine: Engine | Replicas) -> ServerSettings:
    """`settings` with limits no wider than the engine serves: its drafters, its longest draft, its context (a
    prompt leaves room for one token) and its vocabulary. The protocol checks requests against the limits alone,
    so what it accepts the engine serves as asked. ValueError when the limits name another vocabulary or the
    defaults need what the engine lacks."""
    lim, vocab = settings.limits, engine.model.cfg.n_vocab
    if lim.vocab_size not in (None, vocab):
        raise ValueError(f"limits.vocab_size {lim.vocab_size} is not the model's {vocab}")
    limits = msgspec.structs.replace(
        lim, known_drafters=tuple(name for name in lim.known_drafters if name in engine.drafters),
        max_n_max=min(lim.max_n_max, engine.n_max),
        max_prompt_tokens=min(lim.max_prompt_tokens, engine.max_model_len - 1), vocab_size=vocab)
    narrowed = [f"{name} {getattr(limits, name)}" for name in ("known_drafters", "max_n_max", "max_prompt_tokens")
                if getattr(limits, name) != getattr(lim, name)]
    if narrowed:
        log.info("limits narrowed to the engine: %s", ", ".join(narrowed))
    return ServerSettings(settings.defaults, limits)


class SlowClient(Exception):
    pass


@dataclass
class _Outbound:
    send: anyio.abc.ObjectSendStream
    connection: Connection

    def put(self, message: Tokens | Done | Error | Stats) -> None:
        try:
            self.send.send_nowait(self.connection.encode(message))
        except anyio.WouldBlock:
            raise SlowClient from None
        except anyio.ClosedResourceError:
            pass  # the connection is closing (shutdown): nothing more goes out


@dataclass(eq=False)
class _Client:
    """One connection: its protocol state, outbound frames and its running requests by id."""

    ws: ServerConnection
    outbound: _Outbound
    requests: dict[str, Generation]


class Server:
    """Serves an engine (or `Replicas` of one) over websockets. `tokenizer` turns prompts and chat messages into
    ids, its chat template rendered out of process under `templates` (`api.templates`); `settings` are held to
    what the engine serves (`limited_to`)."""

    def __init__(self, engine: Engine | Replicas, tokenizer, settings: ServerSettings, access: Access = Access(),
                 shutdown_grace_s: float = SHUTDOWN_GRACE_S, templates: TemplateLimits = TemplateLimits()):
        self.engine = engine
        self.tokenizer = tokenizer
        self.settings = limited_to(settings, engine)
        self.access = access
        self.shutdown_grace_s = shutdown_grace_s
        chat_template = tokenizer.chat_template if tokenizer is not None else None
        self.templates = TemplateRenderer(chat_template, templates) if chat_template else None
        self.clients: set[_Client] = set()
        self.generations: set[Generation] = set()  # accepted and not finished, both protocols
        self.closing = False
        self.metrics = Metrics(engine.load, lambda: len(self.generations))
        self._prepare_limiter = anyio.CapacityLimiter(PREPARE_THREADS)

    @property
    def n_requests(self) -> int:
        """Requests accepted and not finished, all connections of both protocols."""
        return len(self.generations)

    def check_handshake(self, ws: ServerConnection, request: Request) -> Response | None:
        """websockets' process_request: refuse a missing or wrong API key (401) and a connection beyond
        max_connections (503). Origins are checked by websockets itself (`run_server`)."""
        if not self.access.admits_key(request.headers.get("Authorization")):
            log.warning("refused a connection from %s: missing or wrong API key", ws.remote_address)
            return ws.respond(HTTPStatus.UNAUTHORIZED, "missing or wrong API key\n")
        if self.closing:
            return ws.respond(HTTPStatus.SERVICE_UNAVAILABLE, "the server is shutting down\n")
        if len(self.clients) >= self.settings.limits.max_connections:
            log.warning("refused a connection from %s: %d connections open", ws.remote_address, len(self.clients))
            return ws.respond(HTTPStatus.SERVICE_UNAVAILABLE, "too many connections; try again later\n")
        return None

    def stats(self) -> Stats:
        """The counts a `stats` request gets."""
        load = self.engine.load()
        return Stats(connections=len(self.clients), requests_running=load.running, requests_waiting=load.waiting,
                     requests_in_flight=self.n_requests, pages_free=load.pages_free, pages_total=load.pages_total,
                     planes_free=load.planes_free, planes_total=load.planes_total, steps=self.engine.steps,
                     rss_bytes=resident_bytes(), weights_bytes=self.engine.weights_bytes,
                     cached_prefixes=load.cached_prefixes, cached_pages=load.cached_pages,
                     cached_planes=load.cached_planes, prefix_hits=load.prefix_hits, prefix_tokens=load.prefix_tokens,
                     prefix_evictions=load.prefix_evictions)  # fmt: skip

    @property
    def max_requests(self) -> int:
        """Requests the server holds at once: those the engine runs plus max_queued waiting."""
        return self.engine.max_running + self.settings.limits.max_queued

    async def handle(self, ws: ServerConnection) -> None:
        send, receive = anyio.create_memory_object_stream(OUTBOUND_FRAMES)
        client = _Client(ws, _Outbound(send, Connection(self.settings)), {})
        self.clients.add(client)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._reader, client, tg)
                await self._writer(ws, receive)  # ends when stop() closes the outbound stream
                await ws.close(1001, "server shutting down")
                tg.cancel_scope.cancel()
        except* SlowClient:
            log.warning("closing a slow client: %d frames waiting", OUTBOUND_FRAMES)
            await ws.close(1008, "client too slow to read its stream")
        except* websockets.ConnectionClosed:
            pass
        finally:
            self.clients.discard(client)

    async def stop(self) -> None:
        """Cancel every running request (each gets its done frame, finish_reason cancelled, as does every request
        that arrives meanwhile), let the frames go out, then close every connection; all within
        shutdown_grace_s, whatever the clients do."""
        self.closing = True
        for generation in list(self.generations):
            generation.cancel()
        with anyio.move_on_after(self.shutdown_grace_s):
            for generation in list(self.generations):
                await generation.finished.wait()
        for client in list(self.clients):
            client.outbound.send.close()

    @staticmethod
    async def _writer(ws: ServerConnection, receive) -> None:
        async with receive:
            async for frame in receive:
                await ws.send(frame, text=True)

    async def _reader(self, client: _Client, tg: TaskGroup) -> None:
        try:
            async for frame in client.ws:
                try:
                    self._on_frame(frame, client, tg)
                except SlowClient:
                    raise
                except Exception:  # a bug in handling one frame must not end the connection's other requests
                    log.exception("failed to handle a frame from %s", client.ws.remote_address)
                    client.outbound.put(error(None, "internal", "the server failed to handle this frame"))
        except websockets.ConnectionClosed:
            pass
        tg.cancel_scope.cancel()  # the client went away: its requests are cancelled with the task group

    def _on_frame(self, frame: str | bytes, client: _Client, tg: TaskGroup) -> None:
        connection, outbound = client.outbound.connection, client.outbound
        if isinstance(frame, bytes):
            outbound.put(error(None, "bad_message",
                               f"a binary frame of {len(frame)} bytes; this protocol uses JSON text frames"))
            return
        result = connection.receive(frame)
        match result:
            case Error():
                outbound.put(result)
            case StatsRequest():
                outbound.put(self.stats())
            case Cancel(id=request_id):
                generation = client.requests.get(request_id)
                if generation is not None:
                    generation.cancel()
            case GenerateRequest() if self.closing:
                usage, timings = Usage(0, 0), Timings(queue_ms=0.0, ttft_ms=None, tokens_per_s=0.0)
                outbound.put(Done(result.id, "cancelled", usage, SpecStats(), timings))
                connection.finish(result.id)
            case GenerateRequest():
                generation = self.admit(result)
                if isinstance(generation, Error):
                    outbound.put(generation)
                    connection.finish(result.id)
                    return
                client.requests[result.id] = generation
                tg.start_soon(self._run, generation, client)

    async def _run(self, generation: Generation, client: _Client) -> None:
        request, outbound = generation.request, client.outbound
        try:
            with generation.cancellable():
                if await generation.prepare():
                    async with contextlib.aclosing(generation.tokens()) as chunks:
                        async for chunk in chunks:
                            outbound.put(chunk)
            frame = generation.final()
            try:
                outbound.put(frame)
            except (TypeError, ValueError):  # a frame that cannot be encoded fails its request, not the connection
                log.exception("request %s: its final frame could not be encoded", loggable(request.id))
                frame = Done(request.id, "error", frame.usage, SpecStats(), frame.timings,
                             Failure("internal", "the server could not encode this request's final frame"))
                outbound.put(frame)
        finally:
            client.requests.pop(request.id, None)
            outbound.connection.finish(request.id)
            self.end(generation)

    def admit(self, request: GenerateRequest) -> Generation | Error:
        """Hold a checked request for either protocol, or refuse it (overloaded) when the server holds its most.
        Whoever runs the returned generation calls `end` once it is over."""
        if len(self.generations) >= self.max_requests:
            return error(request.id, "overloaded",
                         f"the server holds {len(self.generations)} requests, its most; try again later")
        generation = Generation(request, self.engine, self.tokenizer, self.templates, self.settings.limits,
                                self._prepare_limiter)  # fmt: skip
        self.generations.add(generation)
        return generation

    def end(self, generation: Generation) -> None:
        """Let go of a generation whose stream is over: count it in the metrics and log it."""
        self.generations.discard(generation)
        generation.finished.set()
        frame = generation.final()
        request_id = loggable(generation.request.id)
        match frame:
            case Error(code=code):
                log.info("request %s refused: %s", request_id, code)
                return
            case Done(error=Failure(message=message)):
                log.warning("request %s failed: %s", request_id, message)
            case Done(spec=spec):
                acceptance = ", ".join(f"{k} {v.accepted}/{v.drafted}" for k, v in spec.drafters.items()) or "none"
                log.info("request %s: %d+%d tokens, %s, accepted %s, snapshot %d / checkpoint %d steps, "
                         "%.1f tokens/s", request_id, frame.usage.prompt_tokens,
                         frame.usage.completion_tokens, frame.finish_reason, acceptance, spec.rollback.snapshot,
                         spec.rollback.checkpoint, frame.timings.tokens_per_s)  # fmt: skip
        self.metrics.observe(frame, generation.timing)


@contextlib.asynccontextmanager
async def listening(server: Server, host: str = "127.0.0.1", port: int = 0):
    """Run `server` in a task group of its own; yields its ws:// URL and the event that stops it, which is set
    when the block exits (in-flight requests then end with done(cancelled))."""
    async with anyio.create_task_group() as tg:
        ready, shutdown, bound = anyio.Event(), anyio.Event(), []

        def on_ready(port_in_use: int) -> None:
            bound.append(port_in_use)
            ready.set()

        tg.start_soon(lambda: run_server(server, host, port, ready=on_ready, shutdown=shutdown))
        await ready.wait()
        try:
            yield f"ws://{host}:{bound[0]}", shutdown
        finally:
            shutdown.set()


async def run_server(server: Server, host: str, port: int, *, ready=None, shutdown: anyio.Event | None = None,
                     compression: bool = False) -> None:
    """Serve until `shutdown` is set (or forever). ready(port) is called once listening (port 0 picks one).
    compression: offer permessage-deflate (off by default: it costs CPU and memory per connection for little on
    short frames)."""
    max_size = server.settings.limits.max_message_bytes * 2 + 1024  # oversized frames get an error, not a close
    if server.templates is not None:
        await server.templates.check()
    if server.access.api_key is None and not is_loopback(host):
        log.warning("serving on %s beyond loopback without an API key: anyone who can reach it may use it "
                    "(set --api-key or %s)", host, API_KEY_ENV)  # fmt: skip
    async with serve(server.handle, host, port, max_size=max_size, origins=[None, *server.access.origins],
                     process_request=server.check_handshake, compression="deflate" if compression else None,
                     close_timeout=CLOSE_TIMEOUT_S) as ws_server:
        bound = ws_server.sockets[0].getsockname()[1]
        log.info("serving on ws://%s:%d; weights %.1f MiB in memory, state pools beyond them", host, bound,
                 server.engine.weights_bytes / 2**20)
        if ready is not None:
            ready(bound)
        try:
            if shutdown is None:
                await anyio.sleep(math.inf)
            else:
                await shutdown.wait()
            await server.stop()
        finally:
            if server.templates is not None:
                await server.templates.aclose()
