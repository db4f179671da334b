"""Async websocket client: many concurrent requests on one connection.

    async with Client("ws://127.0.0.1:8000") as c:
        s1 = await c.generate(prompt="def fib(n):", max_tokens=64)
        s2 = await c.generate(messages=[ChatMessage("user", "Hi!")], speculative=None)
        async for frame in s1:            # Tokens frames, then the final Done
            ...
        result = await s2.collect()       # Completion: token_ids, text, finish_reason, usage, spec, timings

One reader task (in the client's own task group) decodes every server frame with a typed decoder and hands it to
the request's anyio memory object stream. A request's stream ends with its ``done``; an ``error`` frame with its
id raises :class:`RequestError`; a connection that closes while requests are pending raises
:class:`ConnectionLost` in each of them.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack, suppress
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from msgspec import UNSET, UnsetType
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from api.protocol import (
    Cancel, ChatMessage, Done, Error, Failure, FinishReason, Generate, ServerMessage, SpecStats, Speculative, Stats,
    StatsRequest, Timings, Tokens, Usage,
)

__all__ = ["Client", "GenerationStream", "Completion", "ClientError", "RequestError", "ConnectionLost",
           "ProtocolViolation"]


class ClientError(Exception):
    """Base of the client's errors."""


class RequestError(ClientError):
    """The server rejected a request with an ``error`` frame."""

    def __init__(self, frame: Error) -> None:
        super().__init__(f"request {frame.id!r} failed: {frame.code}: {frame.message}")
        self.frame = frame
        self.code = frame.code
        self.message = frame.message


class ConnectionLost(ClientError):
    """The connection closed before the request finished (or before it could be sent)."""


class ProtocolViolation(ConnectionLost):
    """The server sent a frame that is not a valid server message, so the client closed the connection."""


@dataclass(frozen=True)
class Completion:
    """A finished request: every token and the final ``done``'s report."""

    id: str
    token_ids: tuple[int, ...]
    text: str
    n_from_drafts: int
    finish_reason: FinishReason
    usage: Usage
    spec: SpecStats
    timings: Timings
    error: Failure | None = None


Item = Tokens | Done | Error


class GenerationStream:
    """The frames of one request: an async iterator of ``Tokens`` and the final ``Done``.

    Iteration raises :class:`RequestError` on the request's ``error`` frame and :class:`ConnectionLost` when the
    connection ends first. Tokens seen while iterating are accumulated, so :meth:`collect` after partial
    iteration still returns the whole result.
    """

    def __init__(self, client: Client, request_id: str, receive: MemoryObjectReceiveStream[Item]) -> None:
        self.id = request_id
        self._client = client
        self._receive = receive
        self._token_ids: list[int] = []
        self._text: list[str] = []
        self._n_from_drafts = 0
        self._finished = False
        self.done: Done | None = None

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> Tokens | Done:
        if self._finished:
            raise StopAsyncIteration
        try:
            item = await self._receive.receive()
        except anyio.EndOfStream:
            self._finish()
            raise self._client._lost(self.id) from None
        if isinstance(item, Tokens):
            self._token_ids.extend(item.token_ids)
            self._text.append(item.text)
            self._n_from_drafts += item.n_from_drafts
            return item
        self._finish()
        if isinstance(item, Error):
            raise RequestError(item)
        self.done = item
        return item

    def _finish(self) -> None:
        self._finished = True
        self._receive.close()

    async def collect(self) -> Completion:
        """Read the request to its end and return the whole result."""
        async for _ in self:
            pass
        if self.done is None:
            raise ClientError(f"request {self.id!r}: its stream already ended without a done frame")
        d = self.done
        return Completion(
            id=self.id, token_ids=tuple(self._token_ids), text="".join(self._text),
            n_from_drafts=self._n_from_drafts, finish_reason=d.finish_reason, usage=d.usage, spec=d.spec,
            timings=d.timings, error=d.error,
        )

    async def cancel(self) -> None:
        """Ask the server to stop this request; the stream then ends with a ``cancelled`` done."""
        await self._client.cancel(self.id)


class Client:
    """A websocket connection to a gdnspec server, used as ``async with Client(url) as c``.

    ``connect_options`` go to ``websockets.asyncio.client.connect``. Server ``error`` frames without an id (or
    with an id that is not pending here) are appended to :attr:`notices` and passed to ``on_notice``.
    """

    def __init__(
        self, url: str, *, on_notice: Callable[[Error], None] | None = None, id_prefix: str = "r",
        **connect_options: Any,
    ) -> None:
        self.url = url
        self.notices: list[Error] = []
        self._on_notice = on_notice
        self._connect_options = connect_options
        self._ids = (f"{id_prefix}{n}" for n in itertools.count())
        self._streams: dict[str, MemoryObjectSendStream[Item]] = {}
        self._decoder = msgspec.json.Decoder(ServerMessage)
        self._encoder = msgspec.json.Encoder()
        self._ws: ClientConnection | None = None
        self._stack: AsyncExitStack | None = None
        self._ended: str | None = None
        self._violation = False
        self._stats_waiting: deque[MemoryObjectSendStream[Stats]] = deque()

    async def __aenter__(self) -> Client:
        async with AsyncExitStack() as stack:
            self._ws = await stack.enter_async_context(connect(self.url, **self._connect_options))
            task_group = await stack.enter_async_context(anyio.create_task_group())
            task_group.start_soon(self._read)
            stack.push_async_callback(self._ws.close)
            self._stack = stack.pop_all()
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        stack, self._stack = self._stack, None
        assert stack is not None
        return await stack.__aexit__(*exc_info)

    async def close(self) -> None:
        """Close the connection now; requests still pending end with ConnectionLost (the server cancels them)."""
        if self._ws is not None:
            await self._ws.close()

    @property
    def pending(self) -> frozenset[str]:
        """Ids of requests sent and not yet finished."""
        return frozenset(self._streams)

    async def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        messages: Sequence[ChatMessage] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        speculative: Speculative | None | UnsetType = UNSET,
        id: str | None = None,
    ) -> GenerationStream:
        """Send a ``generate`` and return its stream. Fields left None take the server's defaults;
        ``speculative`` left out takes the server's policy, None asks for plain decoding."""
        msg = Generate(
            id=id if id is not None else next(self._ids),
            prompt=prompt,
            prompt_ids=list(prompt_ids) if prompt_ids is not None else None,
            messages=list(messages) if messages is not None else None,
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
            stop=list(stop) if stop is not None else None,
            speculative=speculative,
        )
        return await self.submit(msg)

    async def submit(self, msg: Generate) -> GenerationStream:
        """Send a prepared ``generate`` frame and return its stream."""
        if self._ws is None:
            raise ClientError("the client is not connected; use `async with Client(url) as c`")
        if self._ended is not None:
            raise self._lost(msg.id)
        if msg.id in self._streams:
            raise ValueError(f"request {msg.id!r} is already pending on this connection")
        send, receive = anyio.create_memory_object_stream[Item](math.inf)
        self._streams[msg.id] = send
        try:
            await self._ws.send(self._encoder.encode(msg), text=True)
        except ConnectionClosed:
            self._streams.pop(msg.id, None)
            send.close()
            receive.close()
            raise self._lost(msg.id) from None
        return GenerationStream(self, msg.id, receive)

    async def cancel(self, request_id: str) -> bool:
        """Ask the server to stop a pending request; False (and nothing sent) when it is not pending."""
        if self._ws is None or request_id not in self._streams or self._ended is not None:
            return False
        try:
            await self._ws.send(self._encoder.encode(Cancel(id=request_id)), text=True)
        except ConnectionClosed:
            return False
        return True

    async def stats(self) -> Stats:
        """The server's counts (connections, requests, free pages and planes, resident memory)."""
        if self._ws is None:
            raise ClientError("the client is not connected; use `async with Client(url) as c`")
        if self._ended is not None:
            raise ConnectionLost(f"stats: {self._ended}")
        send, receive = anyio.create_memory_object_stream[Stats](1)
        self._stats_waiting.append(send)
        with receive:
            try:
                await self._ws.send(self._encoder.encode(StatsRequest()), text=True)
                return await receive.receive()
            except (ConnectionClosed, anyio.EndOfStream):
                raise ConnectionLost(f"stats: {self._ended or 'connection closed'}") from None

    def _lost(self, request_id: str) -> ConnectionLost:
        kind = ProtocolViolation if self._violation else ConnectionLost
        return kind(f"request {request_id!r}: {self._ended or 'connection closed'}")

    def _notice(self, frame: Error) -> None:
        self.notices.append(frame)
        if self._on_notice is not None:
            self._on_notice(frame)

    def _deliver(self, request_id: str, item: Item, final: bool) -> None:
        send = self._streams.get(request_id)
        if send is None:
            if isinstance(item, Error):
                self._notice(item)
            return
        try:
            send.send_nowait(item)
        except anyio.BrokenResourceError:
            final = True
        if final:
            del self._streams[request_id]
            send.close()

    async def _read(self) -> None:
        """The reader task: dispatch frames until the connection ends, then fail whatever is still pending."""
        assert self._ws is not None
        ws = self._ws
        violation: str | None = None
        try:
            async for frame in ws:
                try:
                    msg = self._decoder.decode(frame)
                except msgspec.DecodeError as exc:
                    violation = f"server sent an invalid frame ({exc})"
                    await ws.close(1002, "invalid frame")
                    break
                match msg:
                    case Tokens():
                        self._deliver(msg.id, msg, final=False)
                    case Done():
                        self._deliver(msg.id, msg, final=True)
                    case Stats():
                        if self._stats_waiting:
                            with self._stats_waiting.popleft() as send, suppress(anyio.BrokenResourceError):
                                send.send_nowait(msg)  # broken: the caller was cancelled meanwhile
                    case Error() if msg.id is None or msg.code == "unknown_id":
                        self._notice(msg)
                    case Error():
                        self._deliver(msg.id, msg, final=True)
        except ConnectionClosed:
            pass
        finally:
            if violation is not None:
                self._ended, self._violation = violation, True
            else:
                code, reason = ws.close_code, ws.close_reason
                self._ended = f"connection closed (code {code}{': ' + reason if reason else ''})"
            streams, self._streams = self._streams, {}
            for send in streams.values():
                send.close()
            while self._stats_waiting:
                self._stats_waiting.popleft().close()
