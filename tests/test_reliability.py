"""Faults, hostile input, limits, access control and shutdown, over a real loopback websocket.

Faults are injected with real components that fail: a drafter whose proposals raise, a runtime wrapper whose step
raises for a poisoned prompt, a tokenizer whose detokenizer raises. Whatever fails, only the culprit's request
ends (done, finish_reason "error", an internal error naming the culprit), its batch-mates go on with their greedy
tokens, everything it held goes back to the pools, and the server keeps serving. Hostile chat templates fail
their request within their limits.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import anyio
import pytest
import websockets
from conftest import ENGINE, plain_greedy
from websockets.asyncio.client import connect

from api.client import Client, RequestError
from api.protocol import MAX_SEED, Defaults, Limits, ServerSettings, Speculative, Tokens
from api.server import Access, Server, is_loopback, listening, loggable
from api.templates import TemplateLimits
from drafters.base import Draft, Drafter
from scheduler import Engine

POISON = 509  # a prompt holding this token id makes the wrapped model step raise


def settings(**limits) -> ServerSettings:
    base = dict(max_prompt_tokens=40, max_prompt_chars=2000, max_max_tokens=48, max_message_bytes=4096,
                max_in_flight=4, known_drafters=("ngram", "mtp", "faulty"), vocab_size=512)  # fmt: skip
    return ServerSettings(defaults=Defaults(drafters=(), max_tokens=8), limits=Limits(**(base | limits)))


class FaultyDrafter(Drafter):
    """A drafter whose every proposal raises."""

    name = "faulty"

    def propose(self, requests):
        raise RuntimeError("the faulty drafter failed")


class PoisonedRuntime:
    """The engine's runtime, except that a step feeding POISON raises (as a device error would)."""

    def __init__(self, runtime):
        self._runtime = runtime

    def __getattr__(self, name):
        return getattr(self._runtime, name)

    def step(self, rows, iterations):
        if any(POISON in step_row.row.tokens for step_row in rows):
            raise MemoryError("device out of memory")
        return self._runtime.step(rows, iterations)


class PoisonedTokenizer:
    """The tokenizer, except that the detokenizer made after `arm()` raises on its first token."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.armed = False

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def arm(self) -> None:
        self.armed = True

    def detokenizer(self):
        inner = self._tokenizer.detokenizer()
        if not self.armed:
            return inner
        self.armed = False
        return _RaisingDetokenizer()


class _RaisingDetokenizer:
    def add(self, token_id: int) -> str:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    def flush(self) -> str:
        return ""


class GatedTokenizer:
    """The tokenizer, except that encoding a text of `min_chars` or more waits for `gate` first (as a very long
    prompt would take its time), so a test decides when that tokenization ends."""

    def __init__(self, tokenizer, min_chars: int):
        self._tokenizer, self.min_chars = tokenizer, min_chars
        self.gate, self.waiting = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def encode(self, text: str) -> list[int]:
        if len(text) >= self.min_chars:
            self.waiting.set()
            self.gate.wait(timeout=30)
        return self._tokenizer.encode(text)


def make_engine(model, tokenizer, **options) -> Engine:
    engine = Engine(model, tokenizer=tokenizer, **(ENGINE | options))
    engine.free_at_start = (engine.memory.free_pages, engine.memory.free_planes)
    return engine


@contextlib.asynccontextmanager
async def serving(engine, tokenizer, server_settings=None, **server_options):
    server = Server(engine, tokenizer, server_settings or settings(), **server_options)
    async with engine, listening(server) as (url, shutdown):
        yield url, server, shutdown


def pools_back(engine) -> bool:
    return (engine.memory.free_pages, engine.memory.free_planes) == engine.free_at_start


# ---- (1) fault isolation ----------------------------------------------------------------------------------------


class PoisonedDrafter(Drafter):
    """A drafter that drafts nothing, except for a sequence holding POISON: its proposal raises, or holds a token
    outside the vocabulary, or (after_step) its hook raises. Proposals are batched, so a raising proposal takes
    its batch-mates' with it."""

    name = "poisoned"

    def __init__(self, fault: str):
        self.fault, self.poisoned = fault, set()

    def propose(self, requests):
        for request in requests:
            if POISON in request.tokens:
                self.poisoned.add(request.seq_id)
                if self.fault == "propose":
                    raise RuntimeError("the poisoned drafter failed")
        return [Draft([-7] if self.fault == "draft" and r.seq_id in self.poisoned else []) for r in requests]

    def after_step(self, seq_id, n_tokens, result):
        if self.fault == "after_step" and seq_id in self.poisoned:
            raise KeyError(seq_id)

    def release(self, seq_id):
        self.poisoned.discard(seq_id)


@pytest.mark.parametrize("fault", ["propose", "draft", "after_step", "model step"])
def test_a_fault_in_one_row_of_eight_ends_that_request_only(model, tokenizer, fault):
    """Eight requests run in one batch; one holds POISON, which makes its drafter's batched proposal raise, or its
    draft leave the vocabulary, or its drafter's hook raise, or the model step raise for any batch it is in. That
    request ends with an error naming the culprit; the other seven equal plain greedy; the pools come back."""
    drafter = PoisonedDrafter(fault)
    engine = make_engine(model, tokenizer, max_running=8, extra_drafters=[drafter])
    if fault == "model step":
        engine.runtime = PoisonedRuntime(engine.runtime)
    prompts = [[POISON, 5, 6] if i == 3 else [10 + i, 20 + i, 30 + i] for i in range(8)]

    async def main():
        server_settings = settings(max_in_flight=8, known_drafters=("ngram", "mtp", "poisoned"))
        async with serving(engine, tokenizer, server_settings) as (url, _, _):
            async with Client(url) as client:
                streams = [await client.generate(prompt_ids=prompt, max_tokens=12, speculative=Speculative(
                    drafters=["poisoned"])) for prompt in prompts]  # fmt: skip
                dones = [None] * len(streams)

                async def collect(i):
                    dones[i] = await streams[i].collect()

                async with anyio.create_task_group() as tg:
                    for i in range(len(streams)):
                        tg.start_soon(collect, i)
                return dones, await client.stats()

    dones, stats = anyio.run(main)
    culprit = {"propose": "drafter 'poisoned' (RuntimeError)", "draft": "drafter 'poisoned' (ValueError)",
               "after_step": "drafter 'poisoned' (KeyError)", "model step": "the model step (MemoryError)"}[fault]
    for prompt, done in zip(prompts, dones):
        if POISON in prompt:
            assert done.finish_reason == "error" and done.error.message == f"internal error in {culprit}"
        else:
            assert list(done.token_ids) == plain_greedy(model, prompt, 12, tokenizer.eog_ids), (prompt, fault)
    assert pools_back(engine) and (stats.pages_free, stats.planes_free) == engine.free_at_start
    assert not drafter.poisoned and not engine.policy.sequences


def test_a_failing_drafter_model_step_or_detokenizer_fails_only_its_request(model, tokenizer):
    """One request runs at a time, so the request queued behind a failing one is in no failed step: it must
    finish with exactly its plain greedy tokens, and every pool, drafter and policy entry must come back."""
    poisoned = PoisonedTokenizer(tokenizer)
    engine = make_engine(model, poisoned, max_running=1, extra_drafters=[FaultyDrafter()])
    engine.runtime = PoisonedRuntime(engine.runtime)
    expected = plain_greedy(model, [1, 2, 3], 8, tokenizer.eog_ids)

    async def pair(client, failing, healthy):
        results = {}

        async def run(key, stream):
            results[key] = await (await stream).collect()

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "failing", failing)
            tg.start_soon(run, "healthy", healthy)
        return results["failing"], results["healthy"]

    async def main():
        out = {}
        async with serving(engine, tokenizer) as (url, server, _):
            async with Client(url) as client:
                out["drafter"] = await pair(
                    client, client.generate(prompt_ids=[4, 5, 6], speculative=Speculative(drafters=["faulty"])),
                    client.generate(prompt_ids=[1, 2, 3], speculative=None))
                out["model step"] = await pair(
                    client, client.generate(prompt_ids=[POISON, 5, 6], speculative=None),
                    client.generate(prompt_ids=[1, 2, 3], speculative=Speculative(drafters=["mtp", "ngram"])))
                poisoned.arm()
                failing = await (await client.generate(prompt_ids=[7, 8, 9], speculative=None)).collect()
                healthy = await (await client.generate(prompt_ids=[1, 2, 3], speculative=None)).collect()
                out["detokenizer"] = failing, healthy
                stats = await client.stats()
        return out, stats

    out, stats = anyio.run(main)
    for culprit, (failing, healthy) in out.items():
        assert failing.finish_reason == "error", culprit
        assert failing.error.code == "internal"
        assert {"drafter": "drafter 'faulty'", "model step": "the model step",
                "detokenizer": "the detokenizer"}[culprit] in failing.error.message  # fmt: skip
        assert list(healthy.token_ids) == expected and healthy.finish_reason in ("length", "stop"), culprit
    assert pools_back(engine)
    assert (stats.pages_free, stats.planes_free) == engine.free_at_start
    assert stats.requests_running == stats.requests_waiting == stats.requests_in_flight == 0
    assert not engine.policy.sequences and not engine.drafters["ngram"].indexes
    assert not engine.drafters["mtp"].ready


# ---- (2), (3) hostile frames ------------------------------------------------------------------------------------

HOSTILE = [
    ({"type": "generate", "id": "a", "prompt": "x", "top_k": 2**64}, "bad_message", "$.top_k"),
    ({"type": "generate", "id": "b", "prompt": "x", "top_k": 2**40}, "bad_message", "$.top_k"),
    ({"type": "generate", "id": "c", "prompt": "x", "top_k": 513}, "bad_value", "512"),
    ({"type": "generate", "id": "d", "prompt": "x", "seed": MAX_SEED + 1}, "bad_message", "$.seed"),
    ({"type": "generate", "id": "e", "prompt": "x", "stop": ["s"] * 17}, "bad_message", "$.stop"),
    ({"type": "generate", "id": "f", "prompt": "x", "stop": ["s" * 257]}, "bad_message", "$.stop[0]"),
    ({"type": "generate", "id": "g", "prompt": "x" * 2001}, "prompt_too_long", "2000"),
    ({"type": "generate", "id": "h", "messages": [{"role": "user", "content": "x" * 1001}] * 2},
     "prompt_too_long", "$.messages"),
    ({"type": "generate", "id": "i", "prompt": "x", "max_tokens": 2**63}, "bad_message", "$.max_tokens"),
    ({"type": "generate", "id": "j", "prompt": "x", "speculative": {"n_max": 2**33}}, "bad_message",
     "$.speculative.n_max"),
    ({"type": "generate", "id": "k", "prompt_ids": [2**31]}, "bad_message", "$.prompt_ids[0]"),
    ({"type": "generate", "id": "l", "prompt": "x", "speculative": {"drafters": ["d" * 65]}}, "bad_message",
     "$.speculative.drafters[0]"),
]  # fmt: skip


def test_hostile_frames_get_errors_and_the_connection_reads_on(model, tokenizer):
    engine = make_engine(model, tokenizer)
    server_settings = settings(max_message_bytes=1 << 20)
    nested = '{"type": "generate", "id": "n", "prompt": "x", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}"

    async def main():
        async with serving(engine, tokenizer, server_settings) as (url, _, _):
            async with connect(url) as ws:
                await ws.send(json.dumps({"type": "generate", "id": "good", "prompt_ids": [1, 2, 3],
                                          "max_tokens": 20, "speculative": None}))  # fmt: skip
                for message, _, _ in HOSTILE:
                    await ws.send(json.dumps(message))
                await ws.send(b"\x00\x01binary")
                await ws.send(nested)
                await ws.send("[" * 100_000)
                await ws.send('{"type": "stats"}')
                frames, done = [], None
                while done is None:
                    frame = json.loads(await ws.recv())
                    frames.append(frame)
                    if frame["type"] == "done":
                        done = frame
                return frames

    frames = anyio.run(main)
    errors = {f["id"]: f for f in frames if f["type"] == "error" and f["id"] is not None}
    for message, code, where in HOSTILE:
        got = errors[message["id"]]
        assert got["code"] == code and where in got["message"], got
    anonymous = [f for f in frames if f["type"] == "error" and f["id"] is None]
    assert len(anonymous) == 3 and {f["code"] for f in anonymous} <= {"bad_message", "bad_json"}
    assert anonymous[0]["code"] == "bad_message" and "binary" in anonymous[0]["message"]
    assert any(f["type"] == "stats" for f in frames)
    tokens = [t for f in frames if f["type"] == "tokens" for t in f["token_ids"]]
    assert tokens == plain_greedy(model, [1, 2, 3], 20, tokenizer.eog_ids)
    assert pools_back(engine)


def test_huge_prompts_do_not_stall_other_streams(model, tokenizer):
    """One client streams tokens while another sends 4 MB prompts, which the server tokenizes (in a worker
    thread) before refusing them as too long: the longest gap between two tokens frames of a stream stays far
    below the time one such prompt takes to tokenize (several seconds on this machine)."""
    engine = make_engine(model, tokenizer)
    line = "def f(x):\n    return x * 2  # a comment with words\n"
    huge = (line * ((4 << 20) // len(line) + 1))[: 4 << 20]
    server_settings = settings(max_message_bytes=5 << 20, max_prompt_chars=5 << 20)
    gaps, refusals, durations = [], [], []

    async def main():
        async with serving(engine, tokenizer, server_settings) as (url, _, _):
            async with Client(url) as streamer, Client(url) as flooder:
                await (await streamer.generate(prompt_ids=[1, 2], max_tokens=4, speculative=None)).collect()

                async def flood():
                    start = time.perf_counter()
                    with pytest.raises(RequestError) as refused:
                        await (await flooder.generate(huge, max_tokens=4)).collect()
                    durations.append(time.perf_counter() - start)
                    refusals.append(refused.value.code)
                    tg.cancel_scope.cancel()

                async def stream():
                    while True:
                        last = None
                        async for frame in await streamer.generate(prompt_ids=[1, 2, 3], max_tokens=48,
                                                                   speculative=None):  # fmt: skip
                            now = time.perf_counter()
                            if last is not None:
                                gaps.append(now - last)
                            last = now

                async with anyio.create_task_group() as tg:
                    tg.start_soon(stream)
                    tg.start_soon(flood)

    anyio.run(main)
    print(f"\nlongest inter-token gap {max(gaps) * 1e3:.0f} ms over {len(gaps)} gaps while 4 MB prompts took "
          f"{', '.join(f'{d:.1f}' for d in durations)} s each to refuse")
    assert refusals == ["prompt_too_long"]
    assert max(gaps) < min(durations) / 4


# ---- hostile chat templates ------------------------------------------------------------------------------------

# Renders the conversation as ChatML, except for a user turn that asks it to loop (10^10 iterations: jinja2's
# sandbox caps one range at 10^5), to allocate (a string of 10^10 characters), to grow (a prompt of 10^10
# characters, chunk by chunk) or to raise.
HOSTILE_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.content == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% elif m.content == 'alloc' %}{% set s = 'x' * 10000000000 %}{{ s | length }}"
    "{% elif m.content == 'grow' %}{% for i in range(100000) %}{{ 'y' * 100000 }}{% endfor %}"
    "{% elif m.content == 'raise' %}{{ raise_exception('this template takes no such turn') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEMPLATE_LIMITS = TemplateLimits(seconds=1.0, memory_mb=128, max_chars=100_000)


class TemplatedTokenizer:
    """The tokenizer, with another chat template (as a model file from a stranger would carry)."""

    def __init__(self, tokenizer, chat_template: str):
        self._tokenizer, self.chat_template = tokenizer, chat_template

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_hostile_chat_templates_fail_their_request_within_the_limits_and_stall_no_stream(model, tokenizer):
    """A template that loops, allocates, grows or raises fails its request with an error naming the limit (within
    it), while another client's stream keeps its pace and its greedy tokens; a chat turn the template accepts is
    answered, and the pools are full afterwards."""
    engine = make_engine(model, tokenizer)
    hostile = TemplatedTokenizer(tokenizer, HOSTILE_TEMPLATE)
    expected = plain_greedy(model, [1, 2, 3], 48, tokenizer.eog_ids)
    gaps, streams, outcomes = [], [], {}

    async def main():
        async with serving(engine, hostile, templates=TEMPLATE_LIMITS) as (url, server, _):
            assert server.templates.refused is None  # the check at load rendered a short conversation
            async with Client(url) as streamer, Client(url) as chatter:
                await (await streamer.generate(prompt_ids=[1, 2, 3], max_tokens=48, speculative=None)).collect()

                async def chat():
                    for content in ("loop", "alloc", "grow", "raise"):
                        start = time.perf_counter()
                        try:
                            done = await (await chatter.generate(messages=[{"role": "user", "content": content}],
                                                                 max_tokens=4, speculative=None)).collect()
                            outcomes[content] = (done.finish_reason, time.perf_counter() - start)
                        except RequestError as exc:
                            outcomes[content] = (exc.code, exc.message, time.perf_counter() - start)
                    tg.cancel_scope.cancel()

                async def stream():
                    last = None  # gaps run across requests: a stalled request start counts too
                    while True:
                        tokens = []
                        async for frame in await streamer.generate(prompt_ids=[1, 2, 3], max_tokens=48,
                                                                   speculative=None):  # fmt: skip
                            if not isinstance(frame, Tokens):
                                continue
                            now = time.perf_counter()
                            if last is not None:
                                gaps.append(now - last)
                            last = now
                            tokens += frame.token_ids
                        streams.append(tokens)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(stream)
                    tg.start_soon(chat)
                hello = await (await chatter.generate(messages=[{"role": "user", "content": "hello"}], max_tokens=4,
                                                      speculative=None)).collect()  # fmt: skip
                outcomes["hello"] = (hello.finish_reason, 0.0)
                return await streamer.stats()

    stats = anyio.run(main)
    print(f"\nlongest inter-token gap {max(gaps) * 1e3:.0f} ms over {len(gaps)} gaps; {outcomes}")
    limit = TEMPLATE_LIMITS.seconds
    assert outcomes["loop"][:2] == ("chat_template", f"chat template exceeded its time limit ({limit:g} s)")
    assert outcomes["alloc"][:2] == ("chat_template", "chat template exceeded its memory limit (128 MiB)")
    assert outcomes["grow"][:2] == ("chat_template", "the rendered chat prompt passed 100000 characters")
    assert outcomes["raise"][:2] == ("bad_value", "chat template failed: chat template: this template takes no "
                                                  "such turn")  # fmt: skip
    assert all(outcome[-1] < limit + 1.5 for outcome in outcomes.values()), outcomes
    assert outcomes["hello"][0] == "length"
    assert streams and all(tokens == expected for tokens in streams)
    assert max(gaps) < 0.5
    assert (stats.pages_free, stats.planes_free) == engine.free_at_start and pools_back(engine)


def test_a_template_that_fails_its_check_at_load_is_refused_and_prompts_still_serve(model, tokenizer):
    engine = make_engine(model, tokenizer)
    looping = TemplatedTokenizer(tokenizer, "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                                            "{% endfor %}")  # fmt: skip

    async def main():
        async with serving(engine, looping, templates=TEMPLATE_LIMITS) as (url, server, _):
            async with Client(url) as client:
                start = time.perf_counter()
                with pytest.raises(RequestError) as refused:
                    await (await client.generate(messages=[{"role": "user", "content": "hi"}], max_tokens=2)).collect()
                took = time.perf_counter() - start
                done = await (await client.generate(prompt_ids=[1, 2, 3], max_tokens=4, speculative=None)).collect()
                return server.templates.refused, refused.value, took, done

    refused_at_load, refusal, took, done = anyio.run(main)
    assert refused_at_load == "chat template exceeded its time limit (1 s)"
    assert refusal.code == "chat_template" and "refused at load: chat template exceeded its time limit" in refusal.message
    assert took < 0.5  # no render is tried again
    assert list(done.token_ids) == plain_greedy(model, [1, 2, 3], 4, tokenizer.eog_ids)


# ---- (4), (5) limits and access ---------------------------------------------------------------------------------


def test_limits_access_and_origins(model, tokenizer):
    engine = make_engine(model, tokenizer, max_running=1)
    server_settings = settings(max_connections=2, max_queued=1, max_in_flight=3)
    access = Access(api_key="s3cret", origins=("https://app.example",))
    key = {"Authorization": "Bearer s3cret"}

    async def refused(**options) -> int:
        with pytest.raises(websockets.InvalidStatus) as info:
            async with connect(url, **options):
                pass
        return info.value.response.status_code

    async def main():
        nonlocal url
        async with serving(engine, tokenizer, server_settings, access=access) as (url, server, _):
            statuses = {
                "no key": await refused(),
                "wrong key": await refused(additional_headers={"Authorization": "Bearer guess"}),
                "foreign origin": await refused(additional_headers=key, origin="https://evil.example"),
            }
            async with Client(url, additional_headers=key, origin="https://app.example") as first, \
                    Client(url, additional_headers=key) as second:  # fmt: skip
                statuses["third connection"] = await refused(additional_headers=key)
                # one request runs, one may wait, the third is refused
                streams = [await first.generate(prompt_ids=[1, 2, 3], max_tokens=40, speculative=None)
                           for _ in range(3)]  # fmt: skip
                outcomes = []
                for stream in streams:
                    try:
                        outcomes.append((await stream.collect()).finish_reason)
                    except RequestError as exc:
                        outcomes.append(exc.code)
                after = await (await second.generate(prompt_ids=[1, 2, 3], speculative=None)).collect()
        return statuses, outcomes, after

    url = None
    statuses, outcomes, after = anyio.run(main)
    assert statuses == {"no key": 401, "wrong key": 401, "foreign origin": 403, "third connection": 503}
    assert sorted(o if o == "overloaded" else "finished" for o in outcomes) == ["finished", "finished", "overloaded"]
    assert set(outcomes) <= {"length", "stop", "overloaded"} and after.finish_reason in ("length", "stop")
    assert pools_back(engine)
    assert loggable("a\nb\x1b[31m\u202e") == "'a\\nb\\x1b[31m\\u202e'"


def test_api_key_from_the_environment_and_what_counts_as_loopback(monkeypatch):
    monkeypatch.setenv("GDNSPEC_API_KEY", "from-env")
    assert Access.from_env().api_key == "from-env"
    assert Access.from_env("flag").api_key == "flag"
    monkeypatch.setenv("GDNSPEC_API_KEY", "")
    assert Access.from_env().api_key is None
    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.2", "::1", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "192.168.1.4", "example.com"]))


# ---- (7) shutdown -----------------------------------------------------------------------------------------------


def test_shutdown_ends_running_and_arriving_requests_within_the_deadline(model, tokenizer):
    """In-flight requests and one that arrives during shutdown end with done(cancelled); a client that never
    reads does not hold shutdown past its deadline. A long prompt still tokenizing keeps shutdown waiting (up to
    its grace period); the test holds that tokenization until the late request has had its answer."""
    engine = make_engine(model, tokenizer)
    long_prompt = "x y z " * 2000
    gated = GatedTokenizer(tokenizer, min_chars=len(long_prompt))
    server_settings = settings(max_prompt_chars=len(long_prompt), max_message_bytes=2 * len(long_prompt))

    async def main():
        async with serving(engine, gated, server_settings, shutdown_grace_s=5.0) as (url, server, shutdown):
            async with connect(url) as ws, connect(url, max_queue=1) as sleeper:
                for i in range(2):
                    await ws.send(json.dumps({"type": "generate", "id": f"r{i}", "prompt_ids": [1, 2, 3],
                                              "max_tokens": 48, "speculative": None}))  # fmt: skip
                await sleeper.send(json.dumps({"type": "generate", "id": "s", "prompt_ids": [1, 2, 3],
                                               "max_tokens": 48, "speculative": None}))  # fmt: skip
                frames = [json.loads(await ws.recv())]
                await ws.send(json.dumps({"type": "generate", "id": "long", "prompt": long_prompt}))
                await anyio.to_thread.run_sync(gated.waiting.wait, 10)
                assert gated.waiting.is_set(), "the long prompt never reached the tokenizer"
                start = time.perf_counter()
                shutdown.set()
                with anyio.fail_after(10):
                    while not server.closing:
                        await anyio.sleep(0.005)
                await ws.send(json.dumps({"type": "generate", "id": "late", "prompt_ids": [1, 2, 3]}))
                with anyio.fail_after(10):
                    while not any(f["type"] == "done" and f["id"] == "late" for f in frames):
                        frames.append(json.loads(await ws.recv()))
                gated.gate.set()
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    while True:
                        frames.append(json.loads(await ws.recv()))
                with anyio.fail_after(10):
                    while server.clients:
                        await anyio.sleep(0.05)
                return frames, closed.value, time.perf_counter() - start

    try:
        frames, closed, took = anyio.run(main)
    finally:
        gated.gate.set()
    done = {f["id"]: f for f in frames if f["type"] == "done"}
    assert set(done) == {"r0", "r1", "long", "late"}
    assert all(f["finish_reason"] == "cancelled" for f in done.values())
    assert closed.rcvd.code == 1001
    assert took < 8
    assert pools_back(engine)


# ---- (8) the soak, in small ---------------------------------------------------------------------------------------


def test_chaotic_loadtest_leaves_the_pools_as_they_were(model, tokenizer):
    """Mixed drafters, random cancels and dropped connections against a small budget: every request ends, and
    the server's own stats show every page and plane free afterwards."""
    from api.loadtest import Chaos, Prompt, run_loadtest

    engine = make_engine(model, tokenizer)
    prompts = [Prompt(text="def f(x):"), Prompt(text="import re\n"), Prompt(text="a = [1, 2, 3]")]
    # A request of 10 tokens streams in one or two bursts, so a fate after more chunks may never act, and how many
    # requests each worker draws fates for depends on timing. Acting within a chunk and this seed make every
    # worker's first request's fate certain: worker 3 drops its connection right after sending, worker 1 cancels
    # after its first chunk, workers 0 and 2 run to the end (the later requests' fates still vary).
    chaos = Chaos(cancel=0.25, disconnect=0.25, policies=(None, Speculative(drafters=["mtp"]),
                                                          Speculative(drafters=["ngram", "mtp"])),
                  max_chunks=1, seed=4)  # fmt: skip

    async def main():
        async with serving(engine, tokenizer) as (url, _, _):
            return await run_loadtest(url, concurrency=4, prompts=prompts, requests=16, max_tokens=10,
                                      chaos=chaos, stats_every=0.5)  # fmt: skip

    result = anyio.run(main)
    assert len(result.records) == 16
    kinds = {r.error_kind for r in result.records}
    assert kinds <= {None, "finish_cancelled", "disconnected"} and "disconnected" in kinds
    assert any(r.ok for r in result.records)
    final = result.stats[-1].stats
    assert (final.pages_free, final.planes_free) == (final.pages_total, final.planes_total)
    assert final.requests_in_flight == final.requests_running == final.requests_waiting == 0
    assert final.connections == 1 and len(result.stats) >= 2 and final.rss_bytes > 0
    assert final.weights_bytes == engine.weights_bytes > 0
    assert pools_back(engine)
