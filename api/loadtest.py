"""Load testing: prompt sets, per-request records, the summary statistics, reports and the async driver.

Everything but :func:`run_loadtest` is pure and works on recorded :class:`RequestRecord` values, so statistics
are tested without a server. Definitions used in the summary:

- ``tokens_per_s``: completion tokens of successful requests / wall time of the run.
- ``per_seq_tokens_per_s``: mean over successful requests of the decode rate after the first chunk,
  (tokens - tokens of the first chunk) / (last chunk time - first chunk time); requests with one chunk are left out.
- ``ttft_ms``: request sent -> first tokens frame received.
- ``itl_ms``: inter-token latency. A chunk of n tokens arriving g ms after the previous chunk gives n samples of
  g / n ms (a speculative step delivers several tokens at once; each counts at its amortised latency).
- ``acceptance``: per drafter, accepted / drafted summed over requests.
- A request is ok when it ends with ``done`` and finish_reason ``stop`` or ``length``; anything else counts in
  ``errors`` (by error code, ``connection_lost``, ``disconnected``, or ``finish_error`` / ``finish_cancelled``).

For soaks, :class:`Chaos` makes the clients hostile (random cancels, dropped connections, mixed drafters) and
``stats_every`` samples the server's ``stats`` (pages, planes, requests, resident memory) during the run.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec
import numpy as np
from msgspec import UNSET, UnsetType

from api.client import Client, ConnectionLost, RequestError
from api.protocol import ChatMessage, Done, RollbackSteps, SpecStats, Speculative, Stats, Timings, Tokens

__all__ = [
    "Prompt", "PROMPT_SETS", "PromptFileError", "load_prompts", "parse_prompt_lines",
    "Chunk", "RequestRecord", "Percentiles", "Summary", "summarize", "format_table", "throughput_series",
    "plot_throughput", "Chaos", "StatsSample", "LoadTestResult", "run_loadtest",
]


# ---------------------------------------------------------------------------------------------------------------
# Prompts


@dataclass(frozen=True)
class Prompt:
    """One load-test prompt: raw text or chat messages (exactly one)."""

    text: str | None = None
    messages: tuple[ChatMessage, ...] | None = None

    def __post_init__(self) -> None:
        if (self.text is None) == (self.messages is None):
            raise ValueError("a prompt is either text or messages")


def _chat(*turns: tuple[str, str]) -> Prompt:
    return Prompt(messages=tuple(ChatMessage(role, content) for role, content in turns))


_CODE = (
    Prompt(text="def quicksort(xs: list[int]) -> list[int]:\n    \"\"\"Sort xs with quicksort.\"\"\"\n"),
    Prompt(text="# Python: parse a CSV file of (name, score) rows and print the top 3 names by score.\nimport csv\n"),
    Prompt(text=(
        "class LRUCache:\n    def __init__(self, capacity: int) -> None:\n        self.capacity = capacity\n"
        "        self.items: dict[int, int] = {}\n\n    def get(self, key: int) -> int:\n")),
    Prompt(text="// Rust: a function that returns the n-th Fibonacci number iteratively.\nfn fib(n: u64) -> u64 {\n"),
    Prompt(text=(
        "SELECT customers.name, COUNT(orders.id) AS n_orders\nFROM customers\n"
        "JOIN orders ON orders.customer_id = customers.id\n")),
    _chat(("user", "Write a JavaScript function debounce(fn, ms) and explain how it works in two sentences.")),
    _chat(("system", "You are a careful senior engineer."),
          ("user", "Refactor this into a list comprehension:\nresult = []\nfor x in data:\n    if x > 0:\n"
                   "        result.append(x * x)")),
)
_PROSE = (
    Prompt(text="The history of the printing press begins"),
    Prompt(text="Once upon a time, in a village at the edge of a great forest, there lived"),
    Prompt(text="Photosynthesis is the process by which plants"),
    _chat(("user", "Summarise the causes of the French Revolution in five bullet points.")),
    _chat(("user", "Write a short poem about autumn rain.")),
    _chat(("system", "Answer in one paragraph."), ("user", "Why is the sky blue?")),
    _chat(("user", "Translate to French: 'The meeting is moved to Thursday at ten.'"),
          ("assistant", "La réunion est déplacée à jeudi à dix heures."),
          ("user", "And to German?")),
)
PROMPT_SETS: Mapping[str, tuple[Prompt, ...]] = {
    "code": _CODE,
    "prose": _PROSE,
    "mixed": tuple(p for pair in zip(_CODE, _PROSE) for p in pair),
}


class PromptFileError(ValueError):
    """A prompt file line that is not a valid prompt; the message names the file and line."""


class _PromptLine(msgspec.Struct):
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


def parse_prompt_lines(lines: Iterable[str], source: str = "<prompts>") -> tuple[Prompt, ...]:
    """Parse JSONL prompt lines: ``{"prompt": text}`` or ``{"messages": [{role, content}, ...]}`` per line.

    Blank lines are skipped; other fields are ignored. Raises :class:`PromptFileError` naming ``source:line``.
    """
    decoder = msgspec.json.Decoder(_PromptLine)
    prompts = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = decoder.decode(line)
        except msgspec.DecodeError as exc:
            raise PromptFileError(f"{source}:{lineno}: {exc}") from None
        if (row.prompt is None) == (row.messages is None):
            raise PromptFileError(f"{source}:{lineno}: expected exactly one of \"prompt\" or \"messages\"")
        if row.prompt is not None and not row.prompt:
            raise PromptFileError(f"{source}:{lineno}: empty prompt")
        if row.messages is not None and not row.messages:
            raise PromptFileError(f"{source}:{lineno}: empty messages")
        prompts.append(Prompt(text=row.prompt, messages=tuple(row.messages) if row.messages else None))
    if not prompts:
        raise PromptFileError(f"{source}: no prompts")
    return tuple(prompts)


def load_prompts(path: str | Path) -> tuple[Prompt, ...]:
    """Load a JSONL prompt file (see :func:`parse_prompt_lines`)."""
    with open(path, encoding="utf-8") as f:
        return parse_prompt_lines(f, source=str(path))


# ---------------------------------------------------------------------------------------------------------------
# Records and statistics


@dataclass(frozen=True)
class Chunk:
    """One ``tokens`` frame as the client saw it: arrival time (s since the run started) and token counts."""

    t: float
    n_tokens: int
    n_from_drafts: int = 0


@dataclass(frozen=True)
class RequestRecord:
    """What happened to one request; times are seconds since the run started."""

    index: int
    worker: int
    prompt_index: int
    start: float
    end: float
    chunks: tuple[Chunk, ...] = ()
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    spec: SpecStats = field(default_factory=SpecStats)
    server_timings: Timings | None = None

    @property
    def ok(self) -> bool:
        """Ended with ``done`` and a normal finish reason."""
        return self.error is None and self.finish_reason in ("stop", "length")

    @property
    def first_token(self) -> float | None:
        """Arrival time of the first non-empty chunk."""
        return next((c.t for c in self.chunks if c.n_tokens), None)

    @property
    def error_kind(self) -> str | None:
        """Why the request is not ok: an error code, ``connection_lost``, or ``finish_<reason>``."""
        if self.ok:
            return None
        return self.error if self.error is not None else f"finish_{self.finish_reason}"


@dataclass(frozen=True)
class Percentiles:
    """p50 / p90 / p99 of a sample, None when the sample is empty."""

    p50: float | None
    p90: float | None
    p99: float | None

    @staticmethod
    def of(values: Sequence[float]) -> Percentiles:
        """Linear-interpolated percentiles of ``values``."""
        if len(values) == 0:
            return Percentiles(None, None, None)
        p50, p90, p99 = np.percentile(np.asarray(values, dtype=np.float64), [50, 90, 99])
        return Percentiles(float(p50), float(p90), float(p99))

    def to_json(self) -> dict[str, float | None]:
        """``{"p50": ..., "p90": ..., "p99": ...}``."""
        return {"p50": self.p50, "p90": self.p90, "p99": self.p99}


@dataclass(frozen=True)
class Summary:
    """The statistics of a run (see the module docstring for definitions)."""

    requests: int
    requests_ok: int
    errors: int
    error_kinds: Mapping[str, int]
    wall_s: float
    requests_per_s: float
    completion_tokens: int
    tokens_per_s: float
    per_seq_tokens_per_s: float | None
    ttft_ms: Percentiles
    itl_ms: Percentiles
    drafted: Mapping[str, tuple[int, int]]
    acceptance: Mapping[str, float]
    draft_token_share: float | None
    rollback: RollbackSteps

    def to_json(self, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The JSON results; ``config`` (the run's settings) is stored under ``"config"`` when given."""
        out: dict[str, Any] = {
            "requests": self.requests,
            "requests_ok": self.requests_ok,
            "errors": self.errors,
            "error_kinds": dict(self.error_kinds),
            "wall_s": self.wall_s,
            "requests_per_s": self.requests_per_s,
            "completion_tokens": self.completion_tokens,
            "tokens_per_s": self.tokens_per_s,
            "per_seq_tokens_per_s": self.per_seq_tokens_per_s,
            "ttft_ms": self.ttft_ms.to_json(),
            "itl_ms": self.itl_ms.to_json(),
            "acceptance": dict(self.acceptance),
            "drafted": {name: {"drafted": d, "accepted": a} for name, (d, a) in self.drafted.items()},
            "draft_token_share": self.draft_token_share,
            "rollback": {"snapshot": self.rollback.snapshot, "checkpoint": self.rollback.checkpoint,
                         "replay": self.rollback.replay},
        }
        if config is not None:
            out["config"] = dict(config)
        return out


def _itl_samples_ms(record: RequestRecord) -> list[float]:
    chunks = [c for c in record.chunks if c.n_tokens]
    samples: list[float] = []
    for prev, cur in zip(chunks, chunks[1:]):
        samples.extend([(cur.t - prev.t) * 1000.0 / cur.n_tokens] * cur.n_tokens)
    return samples


def _decode_rate(record: RequestRecord) -> float | None:
    chunks = [c for c in record.chunks if c.n_tokens]
    if len(chunks) < 2 or chunks[-1].t <= chunks[0].t:
        return None
    return sum(c.n_tokens for c in chunks[1:]) / (chunks[-1].t - chunks[0].t)


def summarize(records: Sequence[RequestRecord], wall_s: float | None = None) -> Summary:
    """Summarise a run. ``wall_s`` defaults to the span from the first start to the last end."""
    if wall_s is None:
        wall_s = max((r.end for r in records), default=0.0) - min((r.start for r in records), default=0.0)
    ok = [r for r in records if r.ok]
    kinds = Counter(r.error_kind for r in records if not r.ok)
    tokens = sum(c.n_tokens for r in ok for c in r.chunks)
    from_drafts = sum(c.n_from_drafts for r in ok for c in r.chunks)
    rates = [x for x in map(_decode_rate, ok) if x is not None]
    drafted: dict[str, tuple[int, int]] = {}
    snapshot = checkpoint = replay = 0
    for r in records:
        for name, stats in r.spec.drafters.items():
            d, a = drafted.get(name, (0, 0))
            drafted[name] = (d + stats.drafted, a + stats.accepted)
        snapshot += r.spec.rollback.snapshot
        checkpoint += r.spec.rollback.checkpoint
        replay += r.spec.rollback.replay
    per_second = (lambda n: n / wall_s) if wall_s > 0 else (lambda n: 0.0)
    return Summary(
        requests=len(records),
        requests_ok=len(ok),
        errors=len(records) - len(ok),
        error_kinds=dict(sorted(kinds.items())),
        wall_s=wall_s,
        requests_per_s=per_second(len(ok)),
        completion_tokens=tokens,
        tokens_per_s=per_second(tokens),
        per_seq_tokens_per_s=float(np.mean(rates)) if rates else None,
        ttft_ms=Percentiles.of([(r.first_token - r.start) * 1000.0 for r in ok if r.first_token is not None]),
        itl_ms=Percentiles.of([s for r in ok for s in _itl_samples_ms(r)]),
        drafted=dict(sorted(drafted.items())),
        acceptance={name: a / d for name, (d, a) in sorted(drafted.items()) if d > 0},
        draft_token_share=from_drafts / tokens if tokens else None,
        rollback=RollbackSteps(snapshot=snapshot, checkpoint=checkpoint, replay=replay),
    )


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def format_table(summary: Summary) -> str:
    """A plain-text report of a summary."""
    s = summary
    errors = ", ".join(f"{k}: {n}" for k, n in s.error_kinds.items())
    lines = [
        f"requests      {s.requests_ok} ok, {s.errors} errors{f' ({errors})' if errors else ''}, "
        f"{s.wall_s:.2f} s, {s.requests_per_s:.2f} req/s",
        f"throughput    {s.tokens_per_s:.1f} tok/s aggregate, {_fmt(s.per_seq_tokens_per_s)} tok/s per sequence, "
        f"{s.completion_tokens} tokens",
        "",
        f"{'latency ms':<12}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for name, p in (("TTFT", s.ttft_ms), ("ITL", s.itl_ms)):
        lines.append(f"{name:<12}{_fmt(p.p50, 2):>10}{_fmt(p.p90, 2):>10}{_fmt(p.p99, 2):>10}")
    if s.drafted:
        lines += ["", f"{'drafter':<12}{'drafted':>10}{'accepted':>10}{'rate':>10}"]
        for name, (d, a) in s.drafted.items():
            rate = s.acceptance.get(name)
            lines.append(f"{name:<12}{d:>10}{a:>10}{_fmt(rate, 3):>10}")
        share = _fmt(None if s.draft_token_share is None else 100 * s.draft_token_share)
        lines.append(f"tokens from accepted drafts: {share} %")
    lines.append(f"rollback steps: snapshot {s.rollback.snapshot}, checkpoint {s.rollback.checkpoint}, "
                 f"replay {s.rollback.replay}")
    return "\n".join(lines)


def throughput_series(records: Sequence[RequestRecord], bin_s: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Tokens delivered per second in consecutive bins of ``bin_s`` from t = 0: (bin starts [N], tok/s [N]).

    Every received chunk counts, whether or not its request succeeded.
    """
    times = np.array([c.t for r in records for c in r.chunks], dtype=np.float64)
    counts = np.array([c.n_tokens for r in records for c in r.chunks], dtype=np.float64)
    if times.size == 0:
        return np.zeros(0), np.zeros(0)
    n_bins = int(math.floor(times.max() / bin_s)) + 1
    totals = np.bincount((times // bin_s).astype(np.int64), weights=counts, minlength=n_bins)
    return np.arange(n_bins) * bin_s, totals / bin_s


def _in_flight(records: Sequence[RequestRecord], at: np.ndarray) -> np.ndarray:
    starts = np.array([r.start for r in records])
    ends = np.array([r.end for r in records])
    return ((starts[None, :] <= at[:, None]) & (at[:, None] < ends[None, :])).sum(axis=1)


def plot_throughput(
    records: Sequence[RequestRecord], path: str | Path, bin_s: float = 1.0, title: str = "gdnspec load test"
) -> None:
    """Write a PNG of delivered tokens/s over time, with requests in flight on a second axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    t, tps = throughput_series(records, bin_s)
    fig = Figure(figsize=(8, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.step(t, tps, where="post", color="tab:blue", label="tokens/s")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("tokens/s", color="tab:blue")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    if len(t):
        ax2 = ax.twinx()
        ax2.step(t, _in_flight(records, t + bin_s / 2), where="post", color="tab:orange", alpha=0.7)
        ax2.set_ylabel("requests in flight", color="tab:orange")
        ax2.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")


# ---------------------------------------------------------------------------------------------------------------
# The driver


@dataclass(frozen=True)
class Chaos:
    """Hostile clients: each request is cancelled mid-stream with probability ``cancel``, or has its connection
    dropped mid-stream with probability ``disconnect`` (the worker then reconnects), after a random number of
    chunks (0: right after sending); its speculative policy is drawn from ``policies`` when given."""

    cancel: float = 0.0
    disconnect: float = 0.0
    policies: tuple[Speculative | None | UnsetType, ...] = ()
    max_chunks: int = 8
    seed: int = 0

    def fate(self, rng: random.Random) -> tuple[str, int] | None:
        """("cancel" or "disconnect", after how many chunks), or None to run the request to its end."""
        draw = rng.random()
        if draw < self.cancel:
            return "cancel", rng.randint(0, self.max_chunks)
        if draw < self.cancel + self.disconnect:
            return "disconnect", rng.randint(0, self.max_chunks)
        return None


@dataclass(frozen=True)
class StatsSample:
    """The server's ``stats`` at ``t`` seconds since the run started."""

    t: float
    stats: Stats


@dataclass(frozen=True)
class LoadTestResult:
    """Records of a run (in completion order), its wall time, and the server's stats sampled during it (the last
    one after every request ended)."""

    records: tuple[RequestRecord, ...]
    wall_s: float
    stats: tuple[StatsSample, ...] = ()

    def summary(self) -> Summary:
        """:func:`summarize` over the run."""
        return summarize(self.records, self.wall_s)


async def _one_request(
    client: Client, index: int, worker: int, prompt_index: int, prompt: Prompt, options: Mapping[str, Any],
    now: Callable[[], float], fate: tuple[str, int] | None = None, start: float | None = None,
) -> RequestRecord:
    start = now() if start is None else start
    chunks: list[Chunk] = []
    done: Done | None = None
    error: str | None = None
    acted = False

    async def act() -> None:
        nonlocal acted
        acted = True
        if fate[0] == "cancel":
            await stream.cancel()
        else:
            await client.close()

    try:
        stream = await client.generate(prompt.text, messages=prompt.messages, **options)
        if fate is not None and fate[1] == 0:
            await act()
        async for frame in stream:
            if isinstance(frame, Tokens):
                chunks.append(Chunk(now(), len(frame.token_ids), frame.n_from_drafts))
                if fate is not None and not acted and len(chunks) == fate[1]:
                    await act()
            else:
                done = frame
    except RequestError as exc:
        error = exc.code
    except ConnectionLost:
        error = "disconnected" if acted and fate[0] == "disconnect" else "connection_lost"
    if error is None and acted and fate[0] == "disconnect":
        # The frames up to `done` had arrived before the close (a device call's tokens come as one burst); the
        # connection is gone all the same, and the worker must not send on it again.
        error = "disconnected"
    return RequestRecord(
        index=index, worker=worker, prompt_index=prompt_index, start=start, end=now(), chunks=tuple(chunks),
        finish_reason=done.finish_reason if done else None, error=error,
        prompt_tokens=done.usage.prompt_tokens if done else 0,
        completion_tokens=done.usage.completion_tokens if done else 0,
        spec=done.spec if done else SpecStats(), server_timings=done.timings if done else None,
    )


class _HttpRequestFailed(Exception):
    def __init__(self, code: str):
        self.code = code


async def _one_http_request(
    http, model: str, index: int, worker: int, prompt_index: int, prompt: Prompt, options: Mapping[str, Any],
    now: Callable[[], float], start: float,
) -> RequestRecord:
    """One request over the OpenAI API, streamed with the token ids of each chunk and the usage at the end."""
    body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                            "return_token_ids": True}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        if options.get(name) is not None:
            body[name] = options[name]
    speculative = options.get("speculative", UNSET)
    if speculative is not UNSET:
        body["speculative"] = msgspec.to_builtins(speculative)
    if prompt.text is not None:
        path, body["prompt"] = "/v1/completions", prompt.text
    else:
        path, body["messages"] = "/v1/chat/completions", [msgspec.to_builtins(m) for m in prompt.messages]
    chunks: list[Chunk] = []
    finish_reason = error = None
    usage: dict[str, Any] = {}
    try:
        async with http.stream("POST", path, content=msgspec.json.encode(body),
                               headers={"Content-Type": "application/json"}) as response:  # fmt: skip
            if response.status_code != 200:
                raise _HttpRequestFailed(_http_error_code(await response.aread(), response.status_code))
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = msgspec.json.decode(line[6:])
                if "error" in event:
                    raise _HttpRequestFailed(event["error"].get("code") or "error")
                for choice in event.get("choices", ()):
                    if choice.get("token_ids"):
                        chunks.append(Chunk(now(), len(choice["token_ids"])))
                    finish_reason = choice.get("finish_reason") or finish_reason
                usage = event.get("usage") or usage
    except _HttpRequestFailed as exc:
        error = exc.code
    except OSError:
        error = "connection_lost"
    except Exception as exc:  # httpx2's transport errors
        error = "connection_lost" if type(exc).__module__.startswith("httpx2") else type(exc).__name__
    spec = msgspec.convert(usage["speculative"], SpecStats) if "speculative" in usage else SpecStats()
    return RequestRecord(
        index=index, worker=worker, prompt_index=prompt_index, start=start, end=now(), chunks=tuple(chunks),
        finish_reason=finish_reason, error=error, prompt_tokens=usage.get("prompt_tokens", 0),
        completion_tokens=usage.get("completion_tokens", 0), spec=spec,
    )


def _http_error_code(body: bytes, status: int) -> str:
    try:
        return msgspec.json.decode(body)["error"]["code"] or f"http_{status}"
    except (msgspec.DecodeError, KeyError, TypeError):
        return f"http_{status}"


async def _http_model(http) -> str:
    """The id of the model an OpenAI API serves (the first /v1/models lists)."""
    response = await http.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def run_loadtest(
    url: str,
    *,
    concurrency: int,
    prompts: Sequence[Prompt],
    requests: int | None = None,
    duration: float | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    speculative: Speculative | None | UnsetType = UNSET,
    connections: int | None = None,
    progress: Callable[[RequestRecord, int], None] | None = None,
    connect_options: Mapping[str, Any] | None = None,
    chaos: Chaos | None = None,
    stats_every: float | None = None,
    api_key: str | None = None,
) -> LoadTestResult:
    """Run ``concurrency`` workers, each sending requests back to back, until ``requests`` have been started or
    ``duration`` seconds have passed (give exactly one); requests in flight then finish.

    Request i uses ``prompts[i % len(prompts)]`` and seed ``seed + i`` (when a seed is given); unset sampling
    options and ``speculative`` take the server's defaults (``speculative=None``: plain decoding). Workers share
    ``connections`` websocket connections (default: one each). ``progress(record, n_finished)`` is called after
    every request. A worker whose connection is lost stops.

    With ``chaos``, every worker has a connection of its own and behaves as :class:`Chaos` says; a worker whose
    connection drops reconnects. With ``stats_every``, one more connection samples the server's ``stats`` that
    often, and once more after the run, when the server has let go of every request.

    An ``http://`` (or ``https://``) url drives the OpenAI API instead: each worker streams its requests over a
    pooled HTTP connection of its own, each chunk counted by its token ids; there chaos, stats_every and
    connections are not offered, and the share of tokens from accepted drafts is not reported. ``api_key`` is
    sent as ``Authorization: Bearer`` (for websockets pass it in connect_options' headers).
    """
    if (requests is None) == (duration is None):
        raise ValueError("give exactly one of requests or duration")
    if concurrency < 1 or not prompts:
        raise ValueError("need concurrency >= 1 and at least one prompt")
    over_http = url.startswith(("http://", "https://"))
    if over_http and (chaos is not None or stats_every is not None or connections is not None):
        raise ValueError("over HTTP, chaos, stats_every and connections are not offered")
    if api_key is not None and not over_http:
        headers = dict((connect_options or {}).get("additional_headers", {})) | {"Authorization": f"Bearer {api_key}"}
        connect_options = dict(connect_options or {}) | {"additional_headers": headers}
    n_conn = min(connections or concurrency, concurrency)
    options: dict[str, Any] = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                   speculative=speculative)
    records: list[RequestRecord] = []
    next_index = 0
    t0 = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - t0

    taken_at: dict[int, float] = {}  # a request starts when it is taken, the instant checked against duration

    def take() -> int | None:
        nonlocal next_index
        t = now()
        if requests is not None and next_index >= requests:
            return None
        if duration is not None and t >= duration:
            return None
        taken_at[next_index] = t
        next_index += 1
        return next_index - 1

    samples: list[StatsSample] = []

    async def run_one(client: Client, w: int, i: int, rng: random.Random | None) -> RequestRecord:
        per_request = dict(options, seed=None if seed is None else seed + i)
        fate = None
        if chaos is not None:
            fate = chaos.fate(rng)
            if chaos.policies:
                per_request["speculative"] = rng.choice(chaos.policies)
        record = await _one_request(client, i, w, i % len(prompts), prompts[i % len(prompts)], per_request, now,
                                    fate, taken_at.pop(i))  # fmt: skip
        records.append(record)
        if progress is not None:
            progress(record, len(records))
        return record

    async def worker(w: int, client: Client) -> None:
        while (i := take()) is not None:
            if (await run_one(client, w, i, None)).error == "connection_lost":
                return

    async def chaos_worker(w: int) -> None:
        rng = random.Random(chaos.seed * 100_003 + w)
        i = take()
        while i is not None:
            async with Client(url, id_prefix=f"w{w}-", **(connect_options or {})) as client:
                while i is not None:
                    record = await run_one(client, w, i, rng)
                    if record.error == "connection_lost":
                        return  # before taking another request, which no worker would then run
                    i = take()
                    if record.error == "disconnected":
                        break

    async def sample(client: Client) -> None:
        while True:
            samples.append(StatsSample(now(), await client.stats()))
            await anyio.sleep(stats_every)

    if over_http:
        return await _run_http(url, concurrency, prompts, options, seed, api_key, take, taken_at, now, records,
                               progress)  # fmt: skip

    async with AsyncExitStack() as stack:
        clients = [] if chaos is not None else [
            await stack.enter_async_context(Client(url, id_prefix=f"c{k}-", **(connect_options or {})))
            for k in range(n_conn)
        ]  # fmt: skip
        observer = None
        if stats_every is not None:
            observer = await stack.enter_async_context(Client(url, id_prefix="stats-", **(connect_options or {})))
        async with anyio.create_task_group() as sampling:
            if observer is not None:
                sampling.start_soon(sample, observer)
            async with anyio.create_task_group() as tg:
                for w in range(concurrency):
                    if chaos is not None:
                        tg.start_soon(chaos_worker, w)
                    else:
                        tg.start_soon(worker, w, clients[w % n_conn])
            sampling.cancel_scope.cancel()
        wall_s = now()
        if observer is not None:
            samples.append(StatsSample(now(), await _settled_stats(observer)))
    return LoadTestResult(records=tuple(records), wall_s=wall_s, stats=tuple(samples))


async def _run_http(url, concurrency, prompts, options, seed, api_key, take, taken_at, now, records, progress
                    ) -> LoadTestResult:
    """run_loadtest's workers over the OpenAI API."""
    import httpx2

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx2.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx2.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=None) as http:
        model = await _http_model(http)

        async def worker(w: int) -> None:
            while (i := take()) is not None:
                per_request = dict(options, seed=None if seed is None else seed + i)
                record = await _one_http_request(http, model, i, w, i % len(prompts), prompts[i % len(prompts)],
                                                 per_request, now, taken_at.pop(i))  # fmt: skip
                records.append(record)
                if progress is not None:
                    progress(record, len(records))

        async with anyio.create_task_group() as tg:
            for w in range(concurrency):
                tg.start_soon(worker, w)
        return LoadTestResult(records=tuple(records), wall_s=now())


async def _settled_stats(client: Client, patience_s: float = 10.0) -> Stats:
    """The server's stats once it holds no request: aborts of dropped connections reach the engine a moment
    after the clients saw their requests end, so this asks again (briefly) until they have."""
    deadline = time.perf_counter() + patience_s
    while True:
        stats = await client.stats()
        idle = stats.requests_in_flight == stats.requests_running == stats.requests_waiting == 0
        if idle or time.perf_counter() > deadline:
            return stats
        await anyio.sleep(0.1)
