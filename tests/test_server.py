"""The websocket server over a real loopback socket, with the real client."""

from __future__ import annotations

import contextlib
import json

import anyio
import pytest
import websockets
from conftest import ENGINE, plain_greedy
from websockets.asyncio.client import connect

from api.client import Client, RequestError
from api.protocol import Defaults, Limits, ServerSettings, Speculative
from api.server import Server, listening
from jaxmodel.requests import SpeculativeConfig
from scheduler import Engine, GenerationRequest


SETTINGS = ServerSettings(
    defaults=Defaults(drafters=("ngram",), max_tokens=12, n_max=3),
    limits=Limits(max_prompt_tokens=40, max_max_tokens=48, max_message_bytes=4096, max_in_flight=4,
                  known_drafters=("ngram", "mtp"), vocab_size=512),
)  # fmt: skip


@contextlib.asynccontextmanager
async def serving(model, tokenizer, **engine_options):
    engine = Engine(model, tokenizer=tokenizer, **(ENGINE | engine_options))
    free = (engine.memory.free_pages, engine.memory.free_planes)
    async with engine, listening(Server(engine, tokenizer, SETTINGS)) as (url, _):
        yield url, engine
    engine.free_at_start = free


def test_streaming_equals_plain_greedy_and_text_concatenates(model, tokenizer):
    prompt = "def fib(n):"
    ids = tokenizer.encode(prompt)
    expected = plain_greedy(model, ids, 12, tokenizer.eog_ids)

    async def main():
        async with serving(model, tokenizer) as (url, engine):
            async with Client(url) as client:
                plain = await (await client.generate(prompt, max_tokens=12, speculative=None)).collect()
                drafted = await (await client.generate(prompt, max_tokens=12, speculative=Speculative(
                    drafters=["mtp"], n_max=3, rollback="snapshot"))).collect()
                chunks = []
                async for frame in await client.generate(prompt_ids=ids, max_tokens=12):
                    chunks.append(frame)
        return plain, drafted, chunks, engine

    plain, drafted, chunks, engine = anyio.run(main)
    assert list(plain.token_ids) == expected and list(drafted.token_ids) == expected
    assert plain.text == tokenizer.decode(expected)
    assert plain.finish_reason == ("length" if len(expected) == 12 else "stop")
    streamed = [c for c in chunks if c.__class__.__name__ == "Tokens"]
    assert [t for c in streamed for t in c.token_ids] == expected
    assert "".join(c.text for c in streamed) == tokenizer.decode(expected)
    assert plain.spec.drafters == {}  # plain decoding honoured
    assert set(drafted.spec.drafters) <= {"mtp"}
    assert (engine.memory.free_pages, engine.memory.free_planes) == engine.free_at_start


def test_concurrent_requests_on_one_and_many_connections(model, tokenizer):
    prompts = ["import os\n", "class A:", "for i in range(10):", "x = 1\ny = 2\n"]
    expected = {p: plain_greedy(model, tokenizer.encode(p), 10, tokenizer.eog_ids) for p in prompts}

    async def main():
        results = {}
        async with serving(model, tokenizer) as (url, engine):
            async def on_one(client, key, prompt):
                results[key] = await (await client.generate(prompt, max_tokens=10)).collect()

            async with Client(url) as shared, anyio.create_task_group() as tg:
                for i, p in enumerate(prompts):
                    tg.start_soon(on_one, shared, ("shared", i), p)

            async def own_connection(i, p):
                async with Client(url) as own:
                    await on_one(own, ("own", i), p)

            async with anyio.create_task_group() as tg:
                for i, p in enumerate(prompts):
                    tg.start_soon(own_connection, i, p)
        return results, engine

    results, engine = anyio.run(main)
    for (kind, i), result in results.items():
        assert list(result.token_ids) == expected[prompts[i]], (kind, i)
    assert (engine.memory.free_pages, engine.memory.free_planes) == engine.free_at_start


def test_cancel_and_disconnect_mid_stream_free_the_sequence(model, tokenizer):
    async def main():
        async with serving(model, tokenizer) as (url, engine):
            engine.iterations = 1  # one frame per step (a step's iterations are one frame), to cancel mid-way
            async with Client(url) as client:
                stream = await client.generate("while True:", max_tokens=40, speculative=None)
                frames = []
                async for frame in stream:
                    frames.append(frame)
                    if len(frames) == 2:
                        await stream.cancel()
                done = frames[-1]
            async with connect(url) as ws:  # a raw client that goes away mid-stream
                await ws.send(json.dumps({"type": "generate", "id": "gone", "prompt": "abc", "max_tokens": 40}))
                await ws.recv()
            async with Client(url) as client:  # the server and engine carry on
                after = await (await client.generate("abc", max_tokens=3)).collect()
            while engine.scheduler.has_work:
                await anyio.sleep(0.01)
            return done, after, engine

    done, after, engine = anyio.run(main)
    assert done.finish_reason == "cancelled"
    assert after.finish_reason == "length" and len(after.token_ids) == 3
    assert (engine.memory.free_pages, engine.memory.free_planes) == engine.free_at_start


BAD_FRAMES = [
    ("not json", "bad_json"),
    (json.dumps({"type": "generate", "id": "a", "prompt": 5}), "bad_message"),
    (json.dumps({"type": "fly", "id": "a"}), "bad_message"),
    (json.dumps({"type": "generate", "id": "b", "prompt": "x", "speculative": {"drafters": ["telepathy"]}}),
     "unknown_drafter"),
    (json.dumps({"type": "generate", "id": "c", "prompt": "x", "max_tokens": -3}), "bad_message"),
    (json.dumps({"type": "generate", "id": "d", "prompt": "x", "max_tokens": 10**9}), "bad_value"),
    (json.dumps({"type": "generate", "id": "e", "prompt": "x" * 5000}), "message_too_large"),
    (json.dumps({"type": "generate", "id": "f", "prompt_ids": list(range(45))}), "prompt_too_long"),
    (json.dumps({"type": "generate", "id": "g", "prompt_ids": [600]}), "bad_value"),
    (json.dumps({"type": "cancel", "id": "nobody"}), "unknown_id"),
]


def test_bad_input_gets_errors_while_the_connection_and_other_requests_continue(model, tokenizer):
    async def main():
        async with serving(model, tokenizer) as (url, engine):
            async with connect(url) as ws:
                await ws.send(json.dumps({"type": "generate", "id": "good", "prompt": "def f():", "max_tokens": 20,
                                          "speculative": None}))  # fmt: skip
                for frame, _ in BAD_FRAMES:
                    await ws.send(frame)
                await ws.send(json.dumps({"type": "generate", "id": "good", "prompt": "again"}))  # duplicate id
                good_tokens, done = [], None
                errors = []
                while done is None:
                    message = json.loads(await ws.recv())
                    if message["type"] == "error":
                        errors.append(message)
                    elif message["type"] == "tokens":
                        good_tokens += message["token_ids"]
                    elif message["type"] == "done":
                        done = message
            return errors, good_tokens, done

    errors, good_tokens, done = anyio.run(main)
    codes = [e["code"] for e in errors]
    for _, code in BAD_FRAMES:
        assert code in codes, (code, errors)
    assert "duplicate_id" in codes
    assert all(e["message"] for e in errors)
    assert done["id"] == "good" and done["finish_reason"] in ("length", "stop")
    assert good_tokens == plain_greedy(model, tokenizer.encode("def f():"), 20, tokenizer.eog_ids)


def test_limits_are_held_to_what_the_engine_serves(model, tokenizer):
    """The protocol checks requests against the limits alone; the server narrows them to the engine's drafters
    and n_max and sets its vocabulary, so nothing the protocol accepts is refused or changed by the engine."""
    engine = Engine(model, tokenizer=tokenizer, budget_bytes=700_000, max_running=4, max_model_len=64, n_max=3)
    wide = ServerSettings(defaults=Defaults(n_max=3), limits=Limits(known_drafters=("ngram", "mtp", "eagle")))
    limits = Server(engine, tokenizer, wide).settings.limits
    assert (limits.known_drafters, limits.max_n_max, limits.max_prompt_tokens, limits.vocab_size) == (
        ("ngram", "mtp"), 3, 63, model.cfg.n_vocab)
    with pytest.raises(ValueError, match="vocab_size"):
        Server(engine, tokenizer, ServerSettings(defaults=Defaults(n_max=3), limits=Limits(vocab_size=100)))
    with pytest.raises(ValueError, match="known_drafters"):
        Server(engine, tokenizer, ServerSettings(defaults=Defaults(drafters=("eagle",)),
                                                 limits=Limits(known_drafters=("eagle",))))  # fmt: skip
    for spec in (SpeculativeConfig(("eagle",), n_max=3), SpeculativeConfig(("mtp",), n_max=4)):
        with pytest.raises(ValueError):
            engine.check(GenerationRequest((1, 2), speculative=spec))


def test_client_raises_on_error_frames(model, tokenizer):
    async def main():
        async with serving(model, tokenizer) as (url, _):
            async with Client(url) as client:
                with pytest.raises(RequestError) as info:
                    await (await client.generate("x", speculative=Speculative(drafters=["telepathy"]))).collect()
                return info.value

    error = anyio.run(main)
    assert error.code == "unknown_drafter"


def test_loadtest_against_the_server(model, tokenizer, tmp_path):
    from api.loadtest import Prompt, plot_throughput, run_loadtest

    prompts = [Prompt(text="def f(x):"), Prompt(text="import re\n"), Prompt(text="a = [1, 2, 3]")]

    async def main():
        async with serving(model, tokenizer) as (url, engine):
            return await run_loadtest(url, concurrency=3, prompts=prompts, requests=6, max_tokens=8,
                                      speculative=Speculative(drafters=["mtp", "ngram"], n_max=3))

    result = anyio.run(main)
    summary = result.summary().to_json()
    assert summary["requests_ok"] == 6 and summary["errors"] == 0
    assert summary["tokens_per_s"] > 0 and summary["ttft_ms"]["p50"] > 0
    assert set(summary["acceptance"]) <= {"mtp", "ngram"}
    plot_throughput(result.records, tmp_path / "throughput.png")
    assert (tmp_path / "throughput.png").stat().st_size > 0


def test_shutdown_ends_in_flight_requests_with_cancelled(model, tokenizer):
    """What Ctrl-C does: every running request gets its done frame (cancelled), then the connection closes."""

    async def main():
        engine = Engine(model, tokenizer=tokenizer, **ENGINE)
        async with engine, listening(Server(engine, tokenizer, SETTINGS)) as (url, shutdown):
            async with connect(url) as ws:
                for i in range(2):
                    await ws.send(json.dumps({"type": "generate", "id": f"r{i}", "prompt_ids": [1, 2, 3],
                                              "max_tokens": 48, "speculative": None}))  # fmt: skip
                frames = [json.loads(await ws.recv())]
                shutdown.set()
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    while True:
                        frames.append(json.loads(await ws.recv()))
        return frames, closed.value

    frames, closed = anyio.run(main)
    done = {f["id"]: f for f in frames if f["type"] == "done"}
    assert set(done) == {"r0", "r1"}
    assert all(f["finish_reason"] == "cancelled" for f in done.values())
    assert closed.rcvd.code == 1001
