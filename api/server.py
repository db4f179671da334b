"""The websocket server: one connection, many requests multiplexed by id, each streamed from the engine.

Each connection has its own task group: a reader (frames -> `api.protocol.Connection` -> request tasks), one
task per request (engine events -> frames), and a writer draining a bounded outbound stream. A client too slow
to drain its stream gets its connection closed with 1008 and its requests cancelled, so it never stalls others.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass

import anyio
import websockets
from anyio.abc import TaskGroup
from websockets.asyncio.server import ServerConnection, serve

from scheduler.engine import Engine, GenerationRequest, RequestTiming
from jaxmodel.runtime import Sampling
from scheduler.types import DoneEvent, TokensEvent
from drafters.policy import SpeculativeConfig

from .chat import ChatTemplateError, render_chat
from .protocol import (Cancel, Connection, Done, DrafterStats, Error, GenerateRequest, RollbackSteps,
                       ServerSettings, SpecStats, Timings, Tokens, Usage, check_prompt_tokens, error)

log = logging.getLogger("gdnspec.server")

OUTBOUND_FRAMES = 1024  # per connection; a client this far behind is closed (1008)


class SlowClient(Exception):
    pass


@dataclass
class _Outbound:
    send: anyio.abc.ObjectSendStream
    connection: Connection

    def put(self, message: Tokens | Done | Error) -> None:
        try:
            self.send.send_nowait(self.connection.encode(message))
        except anyio.WouldBlock:
            raise SlowClient from None


@dataclass(eq=False)
class _Client:
    """One connection: its protocol state, outbound frames and the cancel scopes of its running requests."""

    ws: ServerConnection
    outbound: _Outbound
    requests: dict[str, anyio.CancelScope]
    finished: dict[str, anyio.Event]


class Server:
    """Serves an engine over websockets. `tokenizer` turns prompts and chat messages into ids."""

    def __init__(self, engine: Engine, tokenizer, settings: ServerSettings):
        self.engine = engine
        self.tokenizer = tokenizer
        self.settings = settings
        self.chat_template = tokenizer.chat_template if tokenizer is not None else None
        self.clients: set[_Client] = set()

    async def handle(self, ws: ServerConnection) -> None:
        send, receive = anyio.create_memory_object_stream(OUTBOUND_FRAMES)
        client = _Client(ws, _Outbound(send, Connection(self.settings)), {}, {})
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
        """Cancel every running request (each gets its done frame, finish_reason cancelled), let the frames go
        out, then close every connection."""
        for client in list(self.clients):
            for scope in client.requests.values():
                scope.cancel()
        for client in list(self.clients):
            for finished in list(client.finished.values()):
                await finished.wait()
            client.outbound.send.close()

    @staticmethod
    async def _writer(ws: ServerConnection, receive) -> None:
        async with receive:
            async for frame in receive:
                await ws.send(frame, text=True)

    async def _reader(self, client: _Client, tg: TaskGroup) -> None:
        connection, outbound = client.outbound.connection, client.outbound
        try:
            async for frame in client.ws:
                result = connection.receive(frame)
                match result:
                    case Error():
                        outbound.put(result)
                    case Cancel(id=request_id):
                        scope = client.requests.get(request_id)
                        if scope is not None:
                            scope.cancel()
                    case GenerateRequest():
                        prepared = self._prepare(result)
                        if isinstance(prepared, Error):
                            outbound.put(prepared)
                            connection.finish(result.id)
                        else:
                            client.requests[result.id] = anyio.CancelScope()
                            client.finished[result.id] = anyio.Event()
                            tg.start_soon(self._run, result, prepared, client)
        except websockets.ConnectionClosed:
            pass
        tg.cancel_scope.cancel()  # the client went away: its requests are cancelled with the task group

    def _prepare(self, request: GenerateRequest) -> GenerationRequest | Error:
        if request.prompt_ids is not None:
            ids = list(request.prompt_ids)
            vocab = self.engine.model.cfg.n_vocab
            bad = [t for t in ids if t >= vocab]
            if bad:
                return error(request.id, "bad_value", f"prompt_ids {bad[:5]} are outside the vocabulary of {vocab}")
        elif self.tokenizer is None:
            return error(request.id, "bad_value", "this model has no tokenizer; send prompt_ids")
        elif request.messages is not None:
            if not self.chat_template:
                return error(request.id, "bad_value", "this model has no chat template; send prompt or prompt_ids")
            try:
                text = render_chat(self.chat_template, [{"role": m.role, "content": m.content} for m in request.messages])
            except ChatTemplateError as exc:
                return error(request.id, "bad_value", f"chat template failed: {exc}")
            ids = self.tokenizer.encode(text)
        else:
            ids = self.tokenizer.encode(request.prompt)
        if not ids:
            return error(request.id, "bad_value", "the prompt tokenizes to nothing")
        too_long = check_prompt_tokens(request.id, len(ids), self.settings.limits)
        if too_long is not None:
            return too_long
        spec = request.speculative
        speculative = None
        if spec is not None and spec.drafters:
            speculative = SpeculativeConfig(tuple(spec.drafters), n_max=spec.n_max, n_min=max(spec.n_min, 1),
                                            p_min=spec.p_min)  # fmt: skip
        return GenerationRequest(
            prompt_ids=tuple(ids),
            max_tokens=request.max_tokens,
            sampling=Sampling(request.temperature, request.top_p, request.top_k, request.seed),
            stop=request.stop,
            speculative=speculative,
            rollback=spec.rollback if spec is not None else "auto",
        )

    async def _run(self, request: GenerateRequest, prepared: GenerationRequest, client: _Client) -> None:
        timing = RequestTiming()
        completion, done = 0, None
        outbound = client.outbound
        with client.requests[request.id]:
            async for event in self.engine.generate(prepared, timing):
                if isinstance(event, TokensEvent):
                    completion += len(event.token_ids)
                    outbound.put(Tokens(request.id, list(event.token_ids), event.text, event.n_from_drafts))
                else:
                    done = event
        del client.requests[request.id]
        frame = self._done_frame(request.id, prepared, done, completion, timing)
        try:
            outbound.put(frame)
        finally:
            outbound.connection.finish(request.id)
            client.finished.pop(request.id).set()
        spec = frame.spec
        acceptance = ", ".join(f"{k} {v.accepted}/{v.drafted}" for k, v in spec.drafters.items()) or "none"
        log.info("request %s: %d+%d tokens, %s, accepted %s, snapshot %d / checkpoint %d steps, %.1f tokens/s",
                 request.id, frame.usage.prompt_tokens, frame.usage.completion_tokens, frame.finish_reason,
                 acceptance, spec.rollback.snapshot, spec.rollback.checkpoint, frame.timings.tokens_per_s)

    @staticmethod
    def _done_frame(request_id: str, prepared: GenerationRequest, done: DoneEvent | None, completion: int,
                    timing: RequestTiming) -> Done:
        now = time.perf_counter()
        first = timing.first_token
        tokens_per_s = completion / (now - first) if first is not None and now > first and completion else 0.0
        timings = Timings(
            queue_ms=((timing.scheduled or now) - timing.arrived) * 1e3,
            ttft_ms=(first - timing.arrived) * 1e3 if first is not None else None,
            tokens_per_s=tokens_per_s,
        )
        if done is None:  # cancelled by the client, its disconnection or the server's shutdown
            return Done(request_id, "cancelled", Usage(len(prepared.prompt_ids), completion), SpecStats(), timings)
        spec = SpecStats(
            drafters={name: DrafterStats(s.drafted, s.accepted) for name, s in done.drafters.items()},
            rollback=RollbackSteps(done.rollback_steps.get("snapshot", 0), done.rollback_steps.get("checkpoint", 0)),
        )
        usage = Usage(done.prompt_tokens, done.completion_tokens)
        return Done(request_id, done.finish_reason, usage, spec, timings)


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


async def run_server(server: Server, host: str, port: int, *, ready=None, shutdown: anyio.Event | None = None) -> None:
    """Serve until `shutdown` is set (or forever). ready(port) is called once listening (port 0 picks one)."""
    max_size = server.settings.limits.max_message_bytes * 2 + 1024  # oversized frames get an error, not a close
    async with serve(server.handle, host, port, max_size=max_size) as ws_server:
        bound = ws_server.sockets[0].getsockname()[1]
        log.info("serving on ws://%s:%d", host, bound)
        if ready is not None:
            ready(bound)
        if shutdown is None:
            await anyio.sleep(math.inf)
        else:
            await shutdown.wait()
        await server.stop()
