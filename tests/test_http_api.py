"""The OpenAI-compatible HTTP API over a real loopback socket, with the real `openai` client, beside the websocket
server of the same `Server` and engine (one of each for the module: the tests run on it one after another)."""

from __future__ import annotations

import contextlib
import json
import socket
from dataclasses import dataclass

import anyio
import httpx2
import openai
import pytest
from anyio.from_thread import start_blocking_portal
from conftest import ENGINE, plain_greedy
from prometheus_client.parser import text_string_to_metric_families

from api.client import Client
from api.protocol import ChatMessage, Defaults, Limits, ServerSettings, Speculative
from api.http import listening_http
from api.server import Access, Server, listening
from scheduler import Engine

KEY = "test-key"
MODEL = "tiny-qwen35-mtp"
ORIGIN = "https://app.example"
SETTINGS = ServerSettings(
    defaults=Defaults(drafters=("ngram",), max_tokens=12, n_max=3),
    limits=Limits(max_prompt_tokens=40, max_max_tokens=48, max_message_bytes=4096, max_queued=2,
                  known_drafters=("ngram", "mtp"), vocab_size=512),
)  # fmt: skip
MTP = {"drafters": ["mtp"], "n_max": 3, "p_min": 0.0, "rollback": "snapshot"}  # p_min 0: the tiny model drafts


@dataclass
class Live:
    http: str
    ws: str
    engine: Engine
    server: Server
    portal: object
    free: tuple[int, int]

    def openai(self, **options) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.http + "/v1", api_key=KEY, max_retries=0, **options)

    def websocket(self, prompt=None, messages=None, **options):
        """The websocket's answer to the same request (`api.client.Completion`)."""

        async def ask():
            async with Client(self.ws, additional_headers={"Authorization": f"Bearer {KEY}"}) as client:
                return await (await client.generate(prompt, messages=messages, **options)).collect()

        return self.portal.call(ask)

    def idle(self) -> tuple[int, int]:
        """The engine's free pages and planes once it holds no request."""

        async def settle():
            while self.engine.scheduler.has_work or self.engine.n_in_flight or self.server.n_requests:
                await anyio.sleep(0.01)
            return self.engine.memory.free_pages, self.engine.memory.free_planes

        return self.portal.call(settle)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Every sample of /metrics: (name, sorted labels) -> value, parsed by prometheus_client."""
        text = httpx2.get(self.http + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}


@contextlib.asynccontextmanager
async def _serving(model, tokenizer):
    engine = Engine(model, tokenizer=tokenizer, adaptive=False, max_call_seconds=None, **ENGINE)  # drafts as asked
    server = Server(engine, tokenizer, SETTINGS, Access(api_key=KEY, origins=(ORIGIN,)))
    free = (engine.memory.free_pages, engine.memory.free_planes)
    async with engine, listening(server) as (ws, _), listening_http(server, model_name=MODEL) as (http, _):
        yield Live(http, ws, engine, server, None, free)


@pytest.fixture(scope="module")
def live(model, tokenizer):
    with start_blocking_portal() as portal, portal.wrap_async_context_manager(_serving(model, tokenizer)) as served:
        served.portal = portal
        yield served


def test_completions_and_chat_equal_the_websocket_streamed_or_not(live, model, tokenizer):
    client = live.openai()
    prompt = "def fib(n):"
    expected = plain_greedy(model, tokenizer.encode(prompt), 12, tokenizer.eog_ids)
    reference = live.websocket(prompt, max_tokens=12, speculative=None)
    assert list(reference.token_ids) == expected
    for speculative in (None, MTP):
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                          extra_body={"speculative": speculative, "return_token_ids": True})
        choice = whole.choices[0]
        assert choice.text == reference.text and choice.model_extra["token_ids"] == expected
        assert choice.finish_reason == reference.finish_reason
        usage = whole.usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (reference.usage.prompt_tokens,
                                                                  reference.usage.completion_tokens)
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        drafters = usage.model_extra["speculative"]["drafters"]
        assert drafters == {} if speculative is None else set(drafters) <= {"mtp"}
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"speculative": speculative}))  # fmt: skip
        assert "".join(c.choices[0].text for c in chunks if c.choices) == reference.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reference.finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == usage.completion_tokens

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    chat_reference = live.websocket(messages=[ChatMessage(**m) for m in messages], max_tokens=10,
                                    speculative=Speculative(**MTP))  # fmt: skip
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                          extra_body={"speculative": MTP})  # fmt: skip
    assert chat.choices[0].message.content == chat_reference.text and chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == chat_reference.usage.prompt_tokens
    assert chat.usage.completion_tokens == chat_reference.usage.completion_tokens
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
             messages[1]]  # fmt: skip
    stream = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=10, stream=True,
                                            stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_reference.text
    assert chunks[-1].usage.prompt_tokens == chat_reference.usage.prompt_tokens
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert live.idle() == live.free


def _counters(sample: dict) -> dict:
    prefix = "gdnspec:"
    return {key: value for key, value in sample.items()
            if key[0].startswith(prefix) and key[0].endswith("_total")}


def test_metrics_counters_are_the_sums_of_the_requests_done_statistics(live):
    client = live.openai()
    before = live.metrics()
    usages = []
    both = MTP | {"drafters": ["ngram", "mtp"], "rollback": "checkpoint"}
    for prompt, spec in (("while True:", MTP), ("class A:", both), ("import os\n", None)):
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                             extra_body={"speculative": spec})
        usages.append(response.usage)
    after = live.metrics()

    def moved(name, **labels):
        key = (f"gdnspec:{name}", tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert moved("prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert moved("generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert moved("prefix_cache_queries_total") == sum(u.prompt_tokens for u in usages)
    assert moved("prefix_cache_hits_total") == sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert moved("request_success_total", finished_reason="length") + moved(
        "request_success_total", finished_reason="stop") == 3
    drafted = {}
    for usage in usages:
        for name, stats in usage.model_extra["speculative"]["drafters"].items():
            total = drafted.setdefault(name, {"drafts": 0, "drafted": 0, "accepted": 0, "positions": {}})
            for field in ("drafts", "drafted", "accepted"):
                total[field] += stats[field]
            for position, n in enumerate(stats["accepted_per_position"]):
                total["positions"][position] = total["positions"].get(position, 0) + n
            assert sum(stats["accepted_per_position"]) == stats["accepted"]
    assert sum(t["drafted"] for t in drafted.values()) > 0, usages  # the test drafts something
    for name, total in drafted.items():
        assert moved("spec_decode_num_drafts_total", drafter=name) == total["drafts"]
        assert moved("spec_decode_num_draft_tokens_total", drafter=name) == total["drafted"]
        assert moved("spec_decode_num_accepted_tokens_total", drafter=name) == total["accepted"]
        for position, n in total["positions"].items():
            assert moved("spec_decode_num_accepted_tokens_per_pos_total", drafter=name, position=str(position)) == n
    for mode in ("snapshot", "checkpoint", "replay"):
        assert moved("spec_decode_rollback_steps_total", mode=mode) == sum(
            u.model_extra["speculative"]["rollback"][mode] for u in usages)
    assert moved("time_to_first_token_seconds_count") == moved("e2e_request_latency_seconds_count") == 3
    assert after[("gdnspec:kv_pages_total", ())] == live.engine.load().pages_total > 0
    assert after[("gdnspec:gdn_planes_total", ())] == live.engine.load().planes_total > 0
    assert after[("gdnspec:num_requests_running", ())] == after[("gdnspec:num_requests_waiting", ())] == 0
    load = live.engine.load()
    assert after[("gdnspec:prefix_cache_states", ())] == load.cached_prefixes
    assert after[("gdnspec:prefix_cache_kv_pages", ())] == load.cached_pages
    assert after[("gdnspec:prefix_cache_evictions_total", ())] == load.prefix_evictions


def _post(live, path, body, headers=None):
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx2.post(live.http + path, content=content,
                       headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"} | (headers or {}))


BAD_REQUESTS = [  # (path, body, status, param or None)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 101}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 2}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 2}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "tools": []}, 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 600]}, 400, "prompt[1]"),
    ("/v1/completions", {"model": MODEL, "prompt": list(range(45))}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "speculative": {"drafters": ["telepathy"]}}, 400,
     "speculative.drafters"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "speculative": {"n_max": 0}}, 400, "speculative.n_max"),
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 5000}, 413, None),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, 400, "messages[0]"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True},
     400, "logprobs"),
    ("/v1/nowhere", {}, 404, None),
]


def test_bad_requests_get_openai_errors_while_a_stream_carries_on(live, model, tokenizer):
    prompt = "class A:"
    expected = plain_greedy(model, tokenizer.encode(prompt), 40, tokenizer.eog_ids)
    iterations, live.engine.iterations = live.engine.iterations, 1  # one chunk per step: the stream runs on
    try:
        with httpx2.stream("POST", live.http + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                           json={"model": MODEL, "prompt": prompt, "max_tokens": 40, "stream": True,
                                 "return_token_ids": True, "speculative": None}) as stream:  # fmt: skip
            lines = stream.iter_lines()
            events = [next(line for line in lines if line)]
            for path, body, status, param in BAD_REQUESTS:
                response = _post(live, path, body)
                error = response.json()["error"]
                assert response.status_code == status, (body, response.text)
                assert set(error) == {"message", "type", "param", "code"} and error["message"], error
                assert error["param"] == param, (body, error)
            events += [line for line in lines if line]
    finally:
        live.engine.iterations = iterations
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
    assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == expected

    no_key = httpx2.post(live.http + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert no_key.status_code == 401 and no_key.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=live.http + "/v1", api_key="wrong", max_retries=0).models.list()
    foreign = _post(live, "/v1/completions", {"model": MODEL, "prompt": "x"}, {"Origin": "https://evil.example"})
    assert foreign.status_code == 403 and foreign.json()["error"]["type"] == "permission_error"
    listed = _post(live, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}, {"Origin": ORIGIN})
    assert listed.status_code == 200 and listed.headers["access-control-allow-origin"] == ORIGIN
    assert httpx2.get(live.http + "/health").json() == {"status": "ok"}
    assert live.idle() == live.free


def test_overloaded_server_answers_429(live):
    """Requests beyond those the engine runs plus max_queued, held here through the server's own admission, get
    429 with Retry-After; once they end, requests are served again."""
    from api.protocol import resolve_generate, Generate

    held = []
    for i in range(live.server.max_requests):
        resolved = resolve_generate(Generate(id=f"hold{i}", prompt="x"), live.server.settings)
        held.append(live.server.admit(resolved))
    try:
        with pytest.raises(openai.RateLimitError) as refused:
            live.openai().completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert refused.value.response.headers["retry-after"] == "1"
        assert refused.value.body["code"] == "overloaded"
    finally:
        for generation in held:
            live.portal.call(lambda g=generation: live.server.end(g))
    assert live.openai().completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].finish_reason


def test_a_dropped_stream_frees_its_pages_and_planes(live):
    iterations, live.engine.iterations = live.engine.iterations, 1
    try:
        for path, body in (("/v1/completions", {"prompt": "while True:"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count to 50."}]})):
            with httpx2.stream("POST", live.http + path, headers={"Authorization": f"Bearer {KEY}"},
                               json={"model": MODEL, "max_tokens": 48, "stream": True, "speculative": MTP} | body
                               ) as stream:  # fmt: skip
                lines = stream.iter_lines()
                next(line for line in lines if line)
                next(line for line in lines if line)
                held = live.engine.load()
                assert held.pages_free < held.pages_total  # the request holds memory when its client goes
            assert live.idle() == live.free
        # a whole (not streamed) request whose client goes as soon as it has sent it is cancelled too
        cancelled = ("gdnspec:request_success_total", (("finished_reason", "cancelled"),))
        before = live.metrics().get(cancelled, 0)
        body = json.dumps({"model": MODEL, "prompt": "while True:", "max_tokens": 48, "speculative": None}).encode()
        host, port = live.http.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer " + KEY.encode()
                         + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        assert live.idle() == live.free
        assert live.metrics()[cancelled] == before + 1
    finally:
        live.engine.iterations = iterations
    text = live.openai().completions.create(model=MODEL, prompt="abc", max_tokens=3).choices[0].text
    assert isinstance(text, str)


def test_loadtest_over_http(live):
    from api.loadtest import Prompt, run_loadtest

    prompts = [Prompt(text="def f(x):"), Prompt(messages=(ChatMessage("user", "Hi"),))]
    result = live.portal.call(lambda: run_loadtest(
        live.http, concurrency=2, prompts=prompts, requests=4, max_tokens=6, api_key=KEY,
        speculative=Speculative(drafters=["mtp"], n_max=3)))  # fmt: skip
    summary = result.summary()
    assert summary.requests_ok == 4 and summary.errors == 0 and summary.completion_tokens > 0
    assert set(summary.drafted) <= {"mtp"}
    assert live.idle() == live.free
