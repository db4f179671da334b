"""The engine: the only async part. One task group owns the step loop; requests come in and events go out through
anyio memory object streams; each step (drafting, the target step, verification, commits) runs in a worker thread
so the event loop stays responsive.

    async with Engine(model, budget_bytes=64 << 20) as engine:
        async for event in engine.generate(GenerationRequest(prompt_ids=(1, 2, 3), max_tokens=32)):
            ...
"""

from __future__ import annotations

import gc
import itertools
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import astuple, dataclass

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from drafters.base import Drafter
from drafters.policy import PolicyParams
from jaxmodel.executor import Runtime
from jaxmodel.model import Model

from .assembly import DEFAULT_DRAFT_VOCAB, DEFAULT_ITERATIONS, DEFAULT_MAX_CALL_SECONDS, assemble
from .step_times import StepTimes
from .types import DoneEvent, Event, GenerationRequest, Request, StepPlan, TokensEvent

log = logging.getLogger("gdnspec.engine")


def available_cores() -> int:
    """The cores this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def freeze_heap() -> None:
    """Collect once, then move every object alive now out of the garbage collector's reach (`gc.freeze`): a warm-up
    leaves about a million of them (its traced and compiled step shapes), and each full collection walked them all,
    stalling a round of requests for a large fraction of a second; frozen, one takes milliseconds
    (docs/performance.md, "A full garbage collection once in a while"). Objects made later are collected as
    before."""
    gc.collect()
    gc.freeze()


@dataclass(frozen=True)
class Load:
    """What an engine holds at a moment: sequences running and waiting, its pools' free and usable pages and
    planes, and its prefix cache's entries, the pages and planes they hold, and its hits (requests that took a
    cached state over), the tokens those took over, and its evictions since start (a `stats` request's counts;
    `Replicas.load` sums its engines')."""

    running: int
    waiting: int
    pages_free: int
    pages_total: int
    planes_free: int
    planes_total: int
    cached_prefixes: int = 0
    cached_pages: int = 0
    cached_planes: int = 0
    prefix_hits: int = 0
    prefix_tokens: int = 0
    prefix_evictions: int = 0

    def __add__(self, other: Load) -> Load:
        return Load(*(a + b for a, b in zip(astuple(self), astuple(other))))


@dataclass
class RequestTiming:
    """perf_counter() instants of one request, filled in by the engine as they happen (`arrived` by whoever queued
    the request first, if it set it)."""

    arrived: float = 0.0
    scheduled: float | None = None  # first step that computed any of its tokens
    first_token: float | None = None
    finished: float | None = None


class Engine:
    """Continuous batching over one target model, its drafters and a memory budget."""

    def __init__(
        self,
        model: Model,
        *,
        tokenizer=None,
        draft_model: Model | None = None,
        extra_drafters: Sequence[Drafter] = (),
        budget_bytes: int = 256 << 20,
        max_running: int = 16,
        max_model_len: int = 2048,
        token_budget: int = 512,
        chunk_size: int = 128,
        page_size: int = 16,
        n_max: int = 16,
        policy_params: PolicyParams | None = None,
        adaptive: bool = True,
        iterations: int = DEFAULT_ITERATIONS,
        max_call_seconds: float | None = DEFAULT_MAX_CALL_SECONDS,
        stop_token_ids: Sequence[int] | None = None,
        draft_vocab: int | None = DEFAULT_DRAFT_VOCAB,
        background_warmup: bool = False,
        kv_dtype: str = "float32",
        row_buckets: tuple[int, ...] = (),
        prefix_cache: bool = False,
        tensor_parallel: int = 1,
        expert_parallel: int = 1,
    ):
        """budget_bytes: KV pages + GDN planes of the target. adaptive False: every step drafts with the request's
        drafters in order at n_max (the first non-empty draft wins), as fixed-drafter engines do; True: the
        policy in `drafters.policy` chooses drafter and length per sequence. iterations: the most speculative
        iterations (or plain decoding steps) one device call runs while the host has nothing to decide between
        them (no request waiting or arriving, no stop string to check, drafts only from the MTP head); the steps
        are compiled for it, and the attribute `iterations` may be lowered later (`bench.iterations` does).
        max_call_seconds: fewer iterations where the last decoding call at this many rows says that many would take
        longer (None: no bound), since a request arriving meanwhile waits for the call and streams get its tokens
        as one burst. stop_token_ids: end-of-generation ids (default: the tokenizer's). draft_vocab: the MTP head
        drafts among the token ids below it (None: the whole vocabulary; see `jaxmodel.speculative.iteration`).
        background_warmup: while running and idle, compile the shapes `warmup` would, one at a time, then calibrate
        (a server then listens at once; requests arriving meanwhile compile what they need first). kv_dtype: the
        target's KV pages (the MTP head's included), "float32" or "float16" (half the bytes a page, so twice the
        positions in the same budget, and half the bytes attention reads at a long context; docs/performance.md, "A
        float16 KV cache"). row_buckets: the batch sizes the steps compile (`Shapes.row_buckets`; default: powers of
        4). prefix_cache: keep computed states at chosen prompt boundaries and finished turns' ends, inside
        the budget, for the requests that start with them (`scheduler.prefix_cache`; `gdnspec serve` turns it on
        unless told --no-prefix-cache). tensor_parallel: split the target over this many devices
        (`Model.sharded`, `jaxmodel.sharding`; a model sharded already is taken as it is); budget_bytes then counts
        the pools of all of them, and the draft model stays on one device. expert_parallel: besides, split a MoE
        target's routed experts over this many groups of tensor_parallel devices (each group holds the pools
        whole, so budget_bytes counts one group's)."""
        if (tensor_parallel > 1 or expert_parallel > 1) and model.cfg.tensor_parallel is None:
            model = model.sharded(tensor_parallel, expert_parallel=expert_parallel)
        parts = assemble(model, tokenizer=tokenizer, draft_model=draft_model, extra_drafters=extra_drafters,
                         budget_bytes=budget_bytes, max_running=max_running, max_model_len=max_model_len,
                         token_budget=token_budget, chunk_size=chunk_size, page_size=page_size, n_max=n_max,
                         policy_params=policy_params, adaptive=adaptive, iterations=iterations,
                         max_call_seconds=max_call_seconds, stop_token_ids=stop_token_ids, draft_vocab=draft_vocab,
                         kv_dtype=kv_dtype, row_buckets=row_buckets, prefix_cache=prefix_cache)  # fmt: skip
        self.model, self._draft_model, self.tokenizer = model, draft_model, tokenizer
        self.memory, self.scheduler, self.speculator = parts.memory, parts.scheduler, parts.speculator
        self.stop_token_ids = parts.stop_token_ids
        self.n_max = n_max
        self.background_warmup = background_warmup
        self._ids = itertools.count()
        self._outputs: dict[int, MemoryObjectSendStream] = {}
        self._timings: dict[int, RequestTiming] = {}
        self._inbox_send, self._inbox = anyio.create_memory_object_stream(math.inf)
        self.steps = 0

    # ------------------------------------------------------------------------------------------------ the step

    def step(self, quiet: bool = True) -> list[Event]:
        """One step, synchronously: the speculator plans drafts per sequence, the scheduler schedules rows and the
        memory for them, the speculator runs them (proposals, one device call of one or more iterations, its costs
        and hooks), the scheduler commits. quiet: no request is arriving (so nothing waits for the host). Returns
        the events."""
        choices = self.speculator.plan()
        plan = self.scheduler.schedule(self.speculator.draft_plans(choices), self.speculator.rollback_costs())
        if not plan.rows:
            return []
        self._note_scheduled(plan)
        result = self.speculator.run(plan, choices, quiet)
        events = self.scheduler.update(result.plan, result.committed, result.continued, result.failed)
        for seq_id, exc in self.scheduler.faults:
            log.error("sequence %s failed in the detokenizer", seq_id, exc_info=(type(exc), exc, exc.__traceback__))
        for event in events:
            if isinstance(event, DoneEvent):
                self.speculator.release(event.seq_id)
        self.steps += 1
        return events

    def _note_scheduled(self, plan: StepPlan) -> None:
        """The instant each request's first row was scheduled (`RequestTiming.scheduled`)."""
        now = time.perf_counter()
        for row in plan.rows:
            timing = self._timings.get(row.seq_id)
            if timing is not None and timing.scheduled is None:
                timing.scheduled = now

    def warmup(self, threads: int | None = None) -> int:
        """Compile every step shape this engine can run, the target's `threads` at a time (default: one per core
        this process may use; `Runtime.compile`), then time a few of them for the drafter policy's costs
        (`executor.calibrate`); returns how many shapes compiled. `background_warmup` does the same while serving,
        one shape at a time."""
        self.runtime.compile(available_cores() if threads is None else threads)
        n = sum(1 for _ in self.speculator.shapes_to_compile())
        self._finish_warmup()
        return n

    def _finish_warmup(self) -> None:
        """After the shapes have compiled: time the runtime's steps (only while no step runs), lending it free
        planes to time snapshot's state writes in, then freeze the heap the warm-up leaves (`freeze_heap`)."""
        spare = self.memory.take_planes(min(self.memory.free_planes, 1 + self.n_max))
        try:
            self.speculator.calibrate(spare)
        finally:
            self.memory.give_planes(spare)
        freeze_heap()

    # ------------------------------------------------------------------------------------------------ faults

    def guarded_step(self, quiet: bool = True) -> list[Event]:
        """`step`, except that an exception no row accounts for (`step` ends a row's own fault's request alone)
        fails the requests of the step that raised it (done with finish_reason "error", their pages, planes and
        drafter state released) and the engine serves on."""
        try:
            return self.step(quiet)
        except Exception as exc:
            return self.fail_step(exc)

    def fail_step(self, exc: Exception) -> list[Event]:
        """End the requests of the step in flight (every live request when none is) with done(error)."""
        plan = self.scheduler.in_flight
        message = f"internal error in {self.speculator.culprit(exc)} ({type(exc).__name__})"
        log.error("step %s failed: %s", plan.step if plan else "?", message,
                  exc_info=(type(exc), exc, exc.__traceback__))  # fmt: skip
        if plan is None:
            events = self.scheduler.fail_all(message)
        else:
            events = self.scheduler.fail(plan, message)
            # Sequences the failed update had already finished lost their done event with it.
            ended = {event.seq_id for event in events}
            events += [DoneEvent(row.seq_id, "error", 0, 0, error=message) for row in plan.rows
                       if row.seq_id not in ended and row.seq_id not in self.scheduler]  # fmt: skip
        for event in events:
            self.speculator.release(event.seq_id)
        return events

    # ------------------------------------------------------------------------------------------------ async edge

    @asynccontextmanager
    async def running(self):
        self.warmed = anyio.Event()  # set once a background warm-up has finished (at once without one)
        if not self.background_warmup:
            self.warmed.set()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._loop)
            try:
                yield self
            finally:
                tg.cancel_scope.cancel()

    async def __aenter__(self) -> Engine:
        self._context = self.running()
        return await self._context.__aenter__()

    async def __aexit__(self, *exc) -> None:
        await self._context.__aexit__(*exc)

    async def _loop(self) -> None:
        uncompiled = self.speculator.shapes_to_compile() if self.background_warmup else None
        start, n_compiled = time.perf_counter(), 0
        while True:
            if not self.scheduler.has_work and uncompiled is not None:
                # Idle: compile the next shape. A request arriving meanwhile waits for this one shape only; the
                # shapes its own steps need compile on first use.
                finished = True
                try:
                    if await anyio.to_thread.run_sync(next, uncompiled, None, abandon_on_cancel=True) is not None:
                        n_compiled, finished = n_compiled + 1, False
                    else:
                        await anyio.to_thread.run_sync(self._finish_warmup)
                        log.info("warm-up: %d step shapes compiled in the background in %.1f s", n_compiled,
                                 time.perf_counter() - start)
                except Exception:  # the engine serves on; steps compile what they need on first use
                    log.exception("background warm-up stopped after %d step shapes", n_compiled)
                if finished:
                    uncompiled = None
                    self.warmed.set()
            elif not self.scheduler.has_work:
                self._apply(await self._inbox.receive())  # sleep until a request arrives
            while True:
                try:
                    self._apply(self._inbox.receive_nowait())
                except anyio.WouldBlock:
                    break
            if not self.scheduler.has_work:
                continue
            quiet = self._inbox.statistics().current_buffer_used == 0
            events = await anyio.to_thread.run_sync(self.guarded_step, quiet)
            for event in events:
                stream = self._outputs.get(event.seq_id)
                if stream is not None:
                    stream.send_nowait(event)
                    if isinstance(event, DoneEvent):
                        del self._outputs[event.seq_id]
                        stream.close()

    def _apply(self, message) -> None:
        kind, payload = message
        if kind == "add":
            try:
                self.scheduler.add(payload)
            except ValueError as exc:
                stream = self._outputs.pop(payload.seq_id, None)
                if stream is not None:
                    stream.send_nowait(DoneEvent(payload.seq_id, "error", len(payload.prompt), 0, error=str(exc)))
                    stream.close()
        else:
            for event in self.scheduler.abort(payload):
                stream = self._outputs.pop(event.seq_id, None)
                if stream is not None:
                    stream.send_nowait(event)
                    stream.close()
            self.speculator.release(payload)

    async def generate(
        self, request: GenerationRequest, timing: RequestTiming | None = None
    ) -> AsyncIterator[TokensEvent | DoneEvent]:
        """Stream a request's events; leaving the loop early (or being cancelled) aborts the request.
        timing, if given, receives the request's instants."""
        timing = timing or RequestTiming()
        timing.arrived = timing.arrived or time.perf_counter()  # a caller that queued the request set it already
        self.check(request)
        seq_id = next(self._ids)
        core_request = Request(seq_id, request.prompt_ids, request.max_tokens, self.stop_token_ids, request.stop,
                               request.sampling, request.speculative)  # fmt: skip
        send, receive = anyio.create_memory_object_stream(math.inf)
        self._outputs[seq_id] = send
        self._timings[seq_id] = timing
        self._inbox_send.send_nowait(("add", core_request))
        finished = False
        try:
            async with receive:
                async for event in receive:
                    if isinstance(event, TokensEvent) and timing.first_token is None:
                        timing.first_token = time.perf_counter()
                    if isinstance(event, DoneEvent):
                        finished = True
                        timing.finished = time.perf_counter()
                    yield event
        finally:
            self._timings.pop(seq_id, None)
            if not finished:
                self._outputs.pop(seq_id, None)
                self._inbox_send.send_nowait(("abort", seq_id))

    # The speculator's parts, which tests and benchmarks read (and a few set: a wrapped runtime, fewer iterations).

    @property
    def runtime(self) -> Runtime:
        return self.speculator.runtime

    @runtime.setter
    def runtime(self, runtime: Runtime) -> None:
        self.speculator.runtime = runtime

    @property
    def drafters(self) -> dict[str, Drafter]:
        return self.speculator.drafters

    @property
    def policy(self) -> DrafterPolicy:
        return self.speculator.policy

    @property
    def step_times(self) -> StepTimes:
        return self.speculator.step_times

    @property
    def iterations(self) -> int:
        """The most iterations one device call runs (may be lowered below what the steps were compiled for)."""
        return self.speculator.iterations

    @iterations.setter
    def iterations(self, iterations: int) -> None:
        self.speculator.iterations = iterations

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    @property
    def max_running(self) -> int:
        return self.scheduler.max_running

    @property
    def weights_bytes(self) -> int:
        """The target's and the draft model's weights on the device (`Model.weights_bytes`); the budget is beyond."""
        return self.model.weights_bytes + (self._draft_model.weights_bytes if self._draft_model else 0)

    def load(self) -> Load:
        memory, scheduler = self.memory, self.scheduler
        cache = scheduler.prefix_cache
        return Load(scheduler.n_running, scheduler.n_waiting, memory.free_pages, memory.usable_pages,
                    memory.free_planes, memory.usable_planes, len(cache or ()), cache.pages if cache else 0,
                    cache.planes if cache else 0, scheduler.prefix_hits, scheduler.prefix_tokens,
                    scheduler.prefix_evictions)

    @property
    def n_in_flight(self) -> int:
        """Requests `generate` is streaming (waiting, running, or their last events on the way)."""
        return len(self._outputs)

    def check(self, request: GenerationRequest) -> None:
        """ValueError for what this engine cannot serve: drafters it lacks, drafts longer than its n_max.
        (`api.server.Server` holds its limits to the engine's, so the protocol refuses these first.)"""
        spec = request.speculative
        if spec is None:
            return
        unknown = [name for name in spec.drafters if name not in self.drafters]
        if unknown:
            raise ValueError(f"drafters {unknown} are not among this engine's {list(self.drafters)}")
        if spec.n_max > self.n_max:
            raise ValueError(f"n_max {spec.n_max} exceeds this engine's {self.n_max}")
