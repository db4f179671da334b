"""Load-test statistics on recorded requests, prompt files, reports, and the driver against a canned server."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager

import anyio
import matplotlib.image
import msgspec
import pytest
from websockets.asyncio.server import ServerConnection, serve

from api.loadtest import (
    PROMPT_SETS, Chunk, Percentiles, Prompt, PromptFileError, RequestRecord, format_table, load_prompts,
    parse_prompt_lines, plot_throughput, run_loadtest, summarize, throughput_series,
)
from api.protocol import (
    Cancel, ChatMessage, ClientMessage, Done, DrafterStats, Error, RollbackSteps, SpecStats, Timings, Tokens, Usage,
)


def spec(drafters: dict[str, tuple[int, int]], snapshot: int = 0, checkpoint: int = 0, replay: int = 0) -> SpecStats:
    return SpecStats({k: DrafterStats(*v) for k, v in drafters.items()}, RollbackSteps(snapshot, checkpoint, replay))


RECORDS = (
    RequestRecord(index=0, worker=0, prompt_index=0, start=0.0, end=0.5, finish_reason="stop",
                  chunks=(Chunk(0.1, 1), Chunk(0.2, 2, 1), Chunk(0.5, 1)), prompt_tokens=5, completion_tokens=4,
                  spec=spec({"mtp": (4, 3)}, snapshot=2, checkpoint=1)),
    RequestRecord(index=1, worker=1, prompt_index=1, start=0.2, end=0.6, finish_reason="length",
                  chunks=(Chunk(0.4, 1), Chunk(0.6, 3, 3)), prompt_tokens=7, completion_tokens=4,
                  spec=spec({"mtp": (6, 3), "ngram": (10, 2)}, checkpoint=3, replay=5)),
    RequestRecord(index=2, worker=0, prompt_index=2, start=0.3, end=0.31, error="too_many_requests"),
    RequestRecord(index=3, worker=1, prompt_index=0, start=0.6, end=0.8, finish_reason="error",
                  chunks=(Chunk(0.7, 1),), completion_tokens=1),
    RequestRecord(index=4, worker=2, prompt_index=1, start=0.8, end=0.9, error="connection_lost"),
)


def test_summary_of_recorded_requests():
    s = summarize(RECORDS, wall_s=1.0)
    assert (s.requests, s.requests_ok, s.errors) == (5, 2, 3)
    assert s.error_kinds == {"connection_lost": 1, "finish_error": 1, "too_many_requests": 1}
    assert (s.completion_tokens, s.tokens_per_s, s.requests_per_s) == (8, 8.0, 2.0)
    assert s.per_seq_tokens_per_s == pytest.approx((3 / 0.4 + 3 / 0.2) / 2)
    assert s.ttft_ms == Percentiles(pytest.approx(150.0), pytest.approx(190.0), pytest.approx(199.0))
    # ITL samples: 50, 50 (2 tokens after 100 ms), 300, and 66.7 x3 (3 tokens after 200 ms)
    third = 200 / 3
    assert s.itl_ms == Percentiles(pytest.approx(third), pytest.approx(third + 0.5 * (300 - third)),
                                   pytest.approx(third + 0.95 * (300 - third)))
    assert s.drafted == {"mtp": (10, 6), "ngram": (10, 2)}
    assert s.acceptance == {"mtp": pytest.approx(0.6), "ngram": pytest.approx(0.2)}
    assert s.draft_token_share == pytest.approx(0.5)
    assert s.rollback == RollbackSteps(snapshot=2, checkpoint=4, replay=5)


def test_wall_time_defaults_to_the_span_of_the_records():
    assert summarize(RECORDS).wall_s == pytest.approx(0.9)
    assert summarize(RECORDS[:1]).tokens_per_s == pytest.approx(4 / 0.5)


def test_json_results_have_the_published_keys():
    out = summarize(RECORDS, wall_s=1.0).to_json(config={"concurrency": 4})
    assert json.loads(json.dumps(out)) == out
    for key in ("requests_ok", "errors", "tokens_per_s", "per_seq_tokens_per_s", "ttft_ms", "itl_ms",
                "acceptance", "rollback"):
        assert key in out
    assert set(out["ttft_ms"]) == set(out["itl_ms"]) == {"p50", "p90", "p99"}
    assert out["acceptance"] == {"mtp": pytest.approx(0.6), "ngram": pytest.approx(0.2)}
    assert out["rollback"] == {"snapshot": 2, "checkpoint": 4, "replay": 5}
    assert (out["requests_ok"], out["errors"], out["config"]) == (2, 3, {"concurrency": 4})


def test_text_table():
    table = format_table(summarize(RECORDS, wall_s=1.0))
    assert "2 ok, 3 errors (connection_lost: 1, finish_error: 1, too_many_requests: 1)" in table
    assert "8.0 tok/s aggregate, 11." in table and "tok/s per sequence, 8 tokens" in table
    assert "TTFT            150.00    190.00    199.00" in table
    assert "mtp                 10         6     0.600" in table
    assert "rollback steps: snapshot 2, checkpoint 4, replay 5" in table


def test_empty_run_is_reported_without_numbers():
    s = summarize([])
    assert (s.requests, s.tokens_per_s, s.per_seq_tokens_per_s, s.ttft_ms.p50, s.acceptance) == (0, 0.0, None,
                                                                                               None, {})
    assert "0 ok, 0 errors" in format_table(s)
    t, tps = throughput_series([])
    assert t.size == tps.size == 0


def test_throughput_series_bins_every_delivered_chunk():
    t, tps = throughput_series(RECORDS, bin_s=0.5)
    assert t.tolist() == [0.0, 0.5]
    assert tps.tolist() == [8.0, 10.0]


def test_throughput_plot_is_a_png(tmp_path):
    path = tmp_path / "throughput.png"
    plot_throughput(RECORDS, path, bin_s=0.25)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(path).shape == (400, 800, 4)
    plot_throughput([], tmp_path / "empty.png")
    assert (tmp_path / "empty.png").stat().st_size > 0


# ------------------------------------------------------------------------------------------------ prompts


def test_builtin_prompt_sets_are_varied():
    assert set(PROMPT_SETS) == {"code", "prose", "mixed"}
    for name, prompts in PROMPT_SETS.items():
        assert len(prompts) >= 5 and len(set(prompts)) == len(prompts)
        assert any(p.text for p in prompts) and any(p.messages for p in prompts)
    assert set(PROMPT_SETS["mixed"]) <= set(PROMPT_SETS["code"]) | set(PROMPT_SETS["prose"])


def test_jsonl_prompt_files(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Hello"}\n\n{"messages": [{"role": "user", "content": "Hi"}], "id": 7}\n')
    assert load_prompts(path) == (Prompt(text="Hello"), Prompt(messages=(ChatMessage("user", "Hi"),)))


@pytest.mark.parametrize("line, words", [
    ('{"prompt": "a"', "truncated"),
    ('{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "exactly one"),
    ('{"text": "a"}', "exactly one"),
    ('{"prompt": ""}', "empty prompt"),
    ('{"messages": []}', "empty messages"),
    ('{"messages": [{"role": "user"}]}', "`$.messages[0]`"),
    ('{"prompt": 3}', "`$.prompt`"),
])
def test_bad_prompt_lines_are_named(line, words):
    with pytest.raises(PromptFileError, match="prompts.jsonl:3: ") as info:
        parse_prompt_lines(['{"prompt": "ok"}', "", line], source="prompts.jsonl")
    assert words in str(info.value)


def test_a_prompt_file_without_prompts_is_an_error():
    with pytest.raises(PromptFileError, match="no prompts"):
        parse_prompt_lines(["", "  "], source="x.jsonl")


# ------------------------------------------------------------------------------------------------ driver


@asynccontextmanager
async def canned_server():
    """Replies to each generate with chunks of 1, 2, 1 tokens; prompt "reject" gets an error, "close" closes."""
    seen: list[tuple[int, ClientMessage]] = []
    connections = 0

    async def handler(ws: ServerConnection) -> None:
        nonlocal connections
        connections += 1
        conn_no = connections
        decoder, encoder = msgspec.json.Decoder(ClientMessage), msgspec.json.Encoder()
        async for raw in ws:
            msg = decoder.decode(raw)
            seen.append((conn_no, msg))
            if isinstance(msg, Cancel):
                continue
            if msg.prompt == "reject":
                await ws.send(encoder.encode(Error(id=msg.id, code="bad_value", message="no")), text=True)
                continue
            if msg.prompt == "close":
                await ws.close(1008, "too slow")
                return
            for n in (1, 2, 1):
                await ws.send(encoder.encode(Tokens(id=msg.id, token_ids=[9] * n, text="x" * n,
                                                    n_from_drafts=n - 1)), text=True)
            done = Done(id=msg.id, finish_reason="length", usage=Usage(2, 4),
                        spec=spec({"mtp": (2, 1)}, snapshot=1), timings=Timings(0.1, 1.0, 50.0))
            await ws.send(encoder.encode(done), text=True)

    async with serve(handler, "127.0.0.1", 0) as server:
        yield f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}", seen


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_driver_runs_requests_back_to_back_and_records_them():
    progress: list[int] = []
    prompts = (Prompt(text="a"), Prompt(text="reject"))
    with anyio.fail_after(10):
        async with canned_server() as (url, seen):
            result = await run_loadtest(url, concurrency=3, connections=2, prompts=prompts, requests=7,
                                        max_tokens=4, seed=100, speculative=None,
                                        progress=lambda rec, n: progress.append(n))
    assert progress == list(range(1, 8))
    assert sorted(r.index for r in result.records) == list(range(7))
    assert {r.worker for r in result.records} == {0, 1, 2}
    assert all(r.prompt_index == r.index % 2 for r in result.records)
    assert all(r.ok == (r.index % 2 == 0) for r in result.records)
    assert all(r.error == "bad_value" for r in result.records if r.index % 2)
    assert {conn for conn, _ in seen} == {1, 2}
    sent = {m.id: m for _, m in seen}
    assert sorted(m.seed for m in sent.values()) == list(range(100, 107))
    assert all(m.max_tokens == 4 and m.speculative is None for m in sent.values())
    s = result.summary()
    assert (s.requests_ok, s.errors, s.completion_tokens) == (4, 3, 16)
    assert s.acceptance == {"mtp": 0.5} and s.rollback == RollbackSteps(4, 0)
    assert s.draft_token_share == pytest.approx(0.25)
    ok = next(r for r in result.records if r.ok)
    assert [c.n_tokens for c in ok.chunks] == [1, 2, 1] and ok.start <= ok.first_token <= ok.end


@pytest.mark.anyio
async def test_driver_by_duration_and_a_lost_connection_stops_its_worker():
    with anyio.fail_after(10):
        async with canned_server() as (url, _):
            timed = await run_loadtest(url, concurrency=2, prompts=(Prompt(text="a"),), duration=0.05)
            lost = await run_loadtest(url, concurrency=1, prompts=(Prompt(text="a"), Prompt(text="close")),
                                      requests=5)
    assert timed.records and all(r.ok for r in timed.records)
    assert max(r.start for r in timed.records) < 0.05 <= timed.wall_s
    assert [r.error for r in lost.records] == [None, "connection_lost"]
    with pytest.raises(ValueError, match="exactly one"):
        await run_loadtest(url, concurrency=1, prompts=(Prompt(text="a"),), requests=1, duration=1.0)
