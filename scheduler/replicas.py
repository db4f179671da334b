"""Several engines over one model, serving side by side: data parallelism over a CPU's cores.

On a 2-core CPU one engine's device call uses the second core only inside its kernels; XLA's operations around
them run on one core while the other waits (docs/performance.md, "Two engines side by side"). Two engines, each with
half the rows and half the memory budget, run their steps in worker threads of their own at the same time (JAX
releases the GIL while a call runs), so each core works through its own rows. Requests wait in one queue, first
come first served, until some engine has a free row; a request then runs on the engine whose prefix cache holds
the longest start of its prompt, or else the one with the fewest requests in flight (of those, the one with the
most free pages), for its whole life: its pages and planes live in that engine's pools. A row's tokens do not
depend on its batch (`tests/test_batch_invariance.py`), so they are the ones a single engine would give.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, aclosing
from dataclasses import replace

import anyio

from jaxmodel.executor import share_buckets

from .engine import Engine, Load, RequestTiming
from .types import DoneEvent, GenerationRequest, TokensEvent


class Replicas:
    """`Engine`'s serving interface over several engines of one model: what the server uses (`generate`, `check`,
    `warmup`, `load`, `async with`, the limits) with the counts summed over the engines."""

    def __init__(self, engines: Sequence[Engine]):
        if not engines:
            raise ValueError("no engines to serve with")
        if len({id(engine.model) for engine in engines}) != 1:
            raise ValueError("replicas serve one model")
        self.engines = list(engines)
        first = self.engines[0]
        self.model, self.tokenizer, self.drafters, self.n_max = first.model, first.tokenizer, first.drafters, first.n_max
        # One token per row of all the engines, handed out in order of arrival: a request holding one finds an
        # engine with a free row, instead of queueing behind a long request on an engine chosen at arrival.
        self._rows = anyio.CapacityLimiter(self.max_running)

    @classmethod
    def build(cls, model, n: int, *, budget_bytes: int = 256 << 20, max_running: int = 16, **engine_args) -> Replicas:
        """n engines over `model`, each with 1/n of the memory budget and of the running sequences, compiling
        their share of rows as their largest batch (`share_buckets`); engine_args as `Engine` takes them."""
        if n < 1:
            raise ValueError(f"{n} replicas: at least one is needed")
        rows = math.ceil(max_running / n)
        return cls([Engine(model, budget_bytes=budget_bytes // n, max_running=rows,
                           row_buckets=share_buckets(rows) if n > 1 else (), **engine_args)
                    for _ in range(n)])  # fmt: skip

    @property
    def max_model_len(self) -> int:
        return min(engine.max_model_len for engine in self.engines)

    @property
    def max_running(self) -> int:
        return sum(engine.max_running for engine in self.engines)

    @property
    def weights_bytes(self) -> int:
        """The engines' weights, counted once (they share one model's arrays)."""
        return self.engines[0].weights_bytes

    @property
    def steps(self) -> int:
        return sum(engine.steps for engine in self.engines)

    @property
    def background_warmup(self) -> bool:
        return all(engine.background_warmup for engine in self.engines)

    @background_warmup.setter
    def background_warmup(self, value: bool) -> None:
        for engine in self.engines:
            engine.background_warmup = value

    def load(self) -> Load:
        loads = [engine.load() for engine in self.engines]
        total = sum(loads[1:], loads[0])
        return replace(total, waiting=total.waiting + self._rows.statistics().tasks_waiting)  # for a row of any engine

    def warmup(self, threads: int | None = None) -> int:
        """Every engine's `warmup` (compiling and calibrating); returns the step shapes warmed in all. Runtimes of
        one model share their compiled steps, so the second engine compiles none of the first's shapes again
        (docs/performance.md, "Two engines side by side")."""
        return sum(engine.warmup(threads) for engine in self.engines)

    def check(self, request: GenerationRequest) -> None:
        self.engines[0].check(request)  # the engines differ in their share of memory and rows only

    async def __aenter__(self) -> Replicas:
        self._stack = AsyncExitStack()
        for engine in self.engines:
            await self._stack.enter_async_context(engine)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._stack.__aexit__(*exc)

    def least_busy(self, prompt: Sequence[int] = ()) -> Engine:
        """The engine a request that holds a row goes to: of those with a free row, the one whose prefix cache holds
        the longest start of `prompt` (a conversation's next turn goes where its last turn's state is), then the
        one with the fewest requests in flight, then the most free pages (the first on ties)."""
        free = [engine for engine in self.engines if engine.n_in_flight < engine.max_running] or self.engines
        return min(free, key=lambda engine: (-engine.scheduler.cached_length(prompt) if prompt else 0,
                                             engine.n_in_flight, -engine.memory.free_pages))

    async def generate(self, request: GenerationRequest, timing: RequestTiming | None = None
                       ) -> AsyncIterator[TokensEvent | DoneEvent]:
        """`Engine.generate` on the least busy engine once a row is free (requests wait for one in order of
        arrival; the wait counts in `timing`); closing this stream closes that one (which aborts the request) at
        once."""
        self.check(request)
        timing = timing or RequestTiming()
        timing.arrived = timing.arrived or time.perf_counter()
        holder = object()  # a token per request: one task may stream several requests
        await self._rows.acquire_on_behalf_of(holder)
        try:
            async with aclosing(self.least_busy(request.prompt_ids).generate(request, timing)) as events:
                async for event in events:
                    yield event
        finally:
            self._rows.release_on_behalf_of(holder)
