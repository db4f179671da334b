"""The websocket protocol (api.protocol), chat templates (api.chat) and the async client (api.client).

The client is tested against a small real websockets server defined here that speaks the protocol with canned
replies chosen by the prompt text.
"""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import gguf
import msgspec
import pytest
from hypothesis import given, settings, strategies as st
from websockets.asyncio.server import ServerConnection, serve

from api.chat import ChatTemplateError, render_chat
from api.client import Client, ClientError, ConnectionLost, ProtocolViolation, RequestError
from api.protocol import (
    ERROR_CODES, Cancel, ChatMessage, ClientMessage, Connection, Defaults, DrafterStats, Done, Error, Generate,
    GenerateRequest, Limits, RollbackSteps, ServerMessage, ServerSettings, SpecStats, Speculative, Stats,
    StatsRequest, Timings, Tokens, Usage, check_prompt_tokens, resolve_generate, schema_json,
)
from jaxmodel.requests import Sampling, SpeculativeConfig

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ServerSettings(
    defaults=Defaults(max_tokens=32, temperature=0.0, drafters=("mtp", "ngram"), n_max=4, n_min=1, p_min=0.5),
    limits=Limits(max_prompt_tokens=8, max_max_tokens=64, max_message_bytes=512, max_in_flight=2, max_n_max=16,
                  known_drafters=("mtp", "ngram", "draft_model"), vocab_size=512),
)


def frame(**fields) -> bytes:
    return json.dumps(fields).encode()


def resolve(**fields) -> GenerateRequest | Error:
    msg = msgspec.json.decode(frame(type="generate", **fields), type=ClientMessage)
    return resolve_generate(msg, SETTINGS, seed_source=lambda: 1234)


# ------------------------------------------------------------------------------------------------ messages


def test_every_message_round_trips_through_the_typed_decoders():
    client_msgs = [
        Generate(id="a", prompt="hi"),
        Generate(id="b", prompt_ids=[1, 2, 3], max_tokens=5, temperature=0.7, top_p=0.9, top_k=20, seed=7,
                 stop=["\n\n"], speculative=Speculative(drafters=["ngram"], n_max=8, n_min=2, p_min=0.3,
                                                        rollback="checkpoint")),
        Generate(id="c", messages=[ChatMessage("user", "hello")], speculative=None),
        Cancel(id="a"),
    ]
    spec = SpecStats(drafters={"mtp": DrafterStats(drafted=10, accepted=7)}, rollback=RollbackSteps(3, 1))
    server_msgs = [
        Tokens(id="a", token_ids=[5, 6], text="é", n_from_drafts=1),
        Done(id="a", finish_reason="length", usage=Usage(3, 2), spec=spec, timings=Timings(1.5, 20.0, 55.5)),
        Error(id=None, code="bad_json", message="JSON is malformed"),
    ]
    for msgs, union in ((client_msgs, ClientMessage), (server_msgs, ServerMessage)):
        decoder = msgspec.json.Decoder(union)
        for m in msgs:
            assert decoder.decode(msgspec.json.encode(m)) == m


def test_frames_use_lowercase_type_tags_and_speculative_is_tri_state():
    assert json.loads(msgspec.json.encode(Generate(id="a", prompt="x"))) == {"type": "generate", "id": "a",
                                                                             "prompt": "x"}
    assert json.loads(msgspec.json.encode(Generate(id="a", prompt="x", speculative=None)))["speculative"] is None
    assert json.loads(msgspec.json.encode(Cancel(id="a")))["type"] == "cancel"
    assert json.loads(msgspec.json.encode(Error(id=None, code="bad_json", message="m"))) == {
        "type": "error", "id": None, "code": "bad_json", "message": "m"}


# ------------------------------------------------------------------------------------------------ resolution


def test_missing_fields_take_server_defaults():
    req = resolve(id="a", prompt="hi")
    assert req == GenerateRequest(
        id="a", prompt="hi", prompt_ids=None, messages=None, max_tokens=32,
        sampling=Sampling(temperature=0.0, top_p=1.0, top_k=0, seed=1234), stop=(),
        speculative=SpeculativeConfig(("mtp", "ngram"), n_max=4, n_min=1, p_min=0.5, rollback="auto"))
    assert resolve(id="a", prompt="hi", max_tokens=None, seed=None) == req


def test_speculative_null_means_plain_decoding_and_partial_policies_are_completed():
    assert resolve(id="a", prompt="hi", speculative=None).speculative is None
    assert resolve(id="a", prompt="hi", speculative={"drafters": []}).speculative is None
    assert resolve(id="a", prompt="hi", speculative={}).speculative == resolve(id="a", prompt="hi").speculative
    req = resolve(id="a", prompt="hi", speculative={"drafters": ["ngram"], "n_max": 12, "rollback": "snapshot"})
    assert req.speculative == SpeculativeConfig(("ngram",), n_max=12, n_min=1, p_min=0.5, rollback="snapshot")
    short = resolve(id="a", prompt="hi", speculative={"n_max": 1})
    assert (short.speculative.n_max, short.speculative.n_min) == (1, 1)


def test_request_values_override_defaults():
    req = resolve(id="a", prompt_ids=[1, 2], max_tokens=64, temperature=0.8, top_p=0.5, top_k=3, seed=9,
                  stop=["END"])
    assert (req.prompt_ids, req.max_tokens, req.sampling, req.stop) == (
        (1, 2), 64, Sampling(temperature=0.8, top_p=0.5, top_k=3, seed=9), ("END",))
    chat = resolve(id="a", messages=[{"role": "user", "content": "x"}])
    assert chat.messages == (ChatMessage("user", "x"),)


@pytest.mark.parametrize("fields, code, words", [
    ({}, "bad_value", "exactly one of prompt, prompt_ids, messages"),
    ({"prompt": "x", "prompt_ids": [1]}, "bad_value", "['prompt', 'prompt_ids']"),
    ({"prompt": "x", "max_tokens": 65}, "bad_value", "`$.max_tokens`"),
    ({"prompt_ids": [1, 512]}, "bad_value", "`$.prompt_ids[1]`"),
    ({"prompt_ids": list(range(9))}, "prompt_too_long", "9 tokens"),
    ({"prompt": "x", "speculative": {"drafters": ["mtp", "eagle"]}}, "unknown_drafter", "['eagle']"),
    ({"prompt": "x", "speculative": {"drafters": ["mtp", "mtp"]}}, "bad_value", "repeat"),
    ({"prompt": "x", "speculative": {"n_max": 17}}, "bad_value", "`$.speculative.n_max`"),
    ({"prompt": "x", "speculative": {"n_max": 2, "n_min": 3}}, "bad_value", "`$.speculative.n_min`"),
])
def test_invalid_requests_get_a_stable_code_and_a_message_naming_the_problem(fields, code, words):
    err = resolve(id="r1", **fields)
    assert isinstance(err, Error)
    assert (err.id, err.code) == ("r1", code)
    assert words in err.message


def test_prompt_length_after_tokenization():
    assert check_prompt_tokens("a", 8, SETTINGS.limits) is None
    err = check_prompt_tokens("a", 9, SETTINGS.limits)
    assert (err.id, err.code) == ("a", "prompt_too_long")


def test_settings_reject_defaults_outside_their_limits_and_load_from_plain_data():
    with pytest.raises(ValueError, match="known_drafters"):
        ServerSettings(defaults=Defaults(drafters=("mtp",)), limits=Limits(known_drafters=("ngram",)))
    with pytest.raises(ValueError, match="max_tokens"):
        ServerSettings(defaults=Defaults(max_tokens=100), limits=Limits(max_max_tokens=10))
    loaded = msgspec.convert({"defaults": {"max_tokens": 16}, "limits": {"max_in_flight": 4}}, ServerSettings)
    assert (loaded.defaults.max_tokens, loaded.limits.max_in_flight) == (16, 4)
    with pytest.raises(msgspec.ValidationError, match="max_tokenz"):
        msgspec.convert({"defaults": {"max_tokenz": 16}}, ServerSettings)


# ------------------------------------------------------------------------------------------------ connection


def test_connection_classifies_bad_frames():
    conn = Connection(SETTINGS)
    bad_json = conn.receive(b'{"type": "generate", ')
    assert (bad_json.id, bad_json.code) == (None, "bad_json")
    wrong_type = conn.receive(frame(type="generate", id="a", prompt="x", max_tokens=0))
    assert (wrong_type.id, wrong_type.code) == ("a", "bad_message")
    assert "Expected `int` >= 1 - at `$.max_tokens`" in wrong_type.message
    typo = conn.receive(frame(type="generate", id="b", prompt="x", max_token=3))
    assert typo.code == "bad_message" and "max_token" in typo.message
    unknown = conn.receive(frame(type="generat", id="c"))
    assert (unknown.id, unknown.code) == ("c", "bad_message")
    bad_enum = conn.receive(frame(type="generate", id="d", prompt="x", speculative={"rollback": "undo"}))
    assert bad_enum.code == "bad_message" and "`$.speculative.rollback`" in bad_enum.message
    no_draft = conn.receive(frame(type="generate", id="f", prompt="x", speculative={"n_min": 0}))
    assert no_draft.code == "bad_message" and "Expected `int` >= 1 - at `$.speculative.n_min`" in no_draft.message
    not_object = conn.receive("[1, 2]")
    assert (not_object.id, not_object.code) == (None, "bad_message")
    too_big = conn.receive(frame(type="generate", id="e", prompt="x" * 600))
    assert (too_big.id, too_big.code) == ("e", "message_too_large")
    assert conn.in_flight == frozenset()


def test_connection_tracks_ids_in_flight():
    conn = Connection(SETTINGS, seed_source=lambda: 5)
    assert isinstance(conn.receive(frame(type="generate", id="a", prompt="x")), GenerateRequest)
    dup = conn.receive(frame(type="generate", id="a", prompt="y"))
    assert (dup.id, dup.code) == (None, "duplicate_id") and "'a'" in dup.message
    bad_for_running = conn.receive(frame(type="generate", id="a", prompt="y", top_p=2))
    assert (bad_for_running.id, bad_for_running.code) == (None, "bad_message")
    assert isinstance(conn.receive(frame(type="generate", id="b", prompt="x")), GenerateRequest)
    full = conn.receive(frame(type="generate", id="c", prompt="x"))
    assert (full.id, full.code) == ("c", "too_many_requests")
    assert conn.receive(frame(type="cancel", id="a")) == Cancel(id="a")
    unknown = conn.receive(frame(type="cancel", id="zz"))
    assert (unknown.id, unknown.code) == ("zz", "unknown_id")
    assert conn.in_flight == {"a", "b"}
    conn.finish("a")
    assert isinstance(conn.receive(frame(type="generate", id="c", prompt="x")), GenerateRequest)
    assert isinstance(conn.receive(frame(type="generate", id="a", prompt="again")), Error)
    assert conn.in_flight == {"b", "c"}
    done = Done(id="b", finish_reason="stop", usage=Usage(1, 1), spec=SpecStats(), timings=Timings(0, 1, 2))
    assert msgspec.json.decode(conn.encode(done), type=ServerMessage) == done


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)
keys = st.sampled_from(["type", "id", "prompt", "prompt_ids", "messages", "max_tokens", "temperature", "top_p",
                        "top_k", "seed", "stop", "speculative"])
loose_frames = st.dictionaries(keys, json_values | st.sampled_from(["generate", "cancel", "a"]), max_size=6)
small_ints = st.integers(-2, 70)
generate_frames = st.fixed_dictionaries(
    {"type": st.just("generate"), "id": st.text(min_size=1, max_size=4)},
    optional={
        "prompt": st.text(max_size=4), "prompt_ids": st.lists(st.integers(-1, 600), max_size=10),
        "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", ""]), "content": st.text()}),
                             max_size=2),
        "max_tokens": small_ints | st.none(), "temperature": st.floats(-1, 2) | st.none(),
        "top_p": st.floats(0, 1.5), "top_k": small_ints, "seed": st.integers(-1, 2**64),
        "stop": st.lists(st.text(max_size=3), max_size=3),
        "speculative": st.none() | st.fixed_dictionaries({}, optional={
            "drafters": st.lists(st.sampled_from(["mtp", "ngram", "draft_model", "eagle"]), max_size=3),
            "n_max": small_ints, "n_min": small_ints, "p_min": st.floats(-0.5, 1.5),
            "rollback": st.sampled_from(["auto", "snapshot", "checkpoint", "replay", "undo"])}),
    },
)
frames = loose_frames | generate_frames


@settings(max_examples=300, deadline=None)
@given(frames)
def test_any_json_frame_gets_a_request_a_cancel_or_a_coded_error(obj):
    conn = Connection(SETTINGS, seed_source=lambda: 0)
    out = conn.receive(json.dumps(obj))
    assert isinstance(out, GenerateRequest | Cancel | Error)
    if isinstance(out, Error):
        assert out.code in ERROR_CODES and out.message
    if isinstance(out, GenerateRequest):
        assert sum(x is not None for x in (out.prompt, out.prompt_ids, out.messages)) == 1
        assert 1 <= out.max_tokens <= SETTINGS.limits.max_max_tokens
        assert out.speculative is None or 1 <= out.speculative.n_min <= out.speculative.n_max <= 16
        assert conn.in_flight == {out.id}


# ------------------------------------------------------------------------------------------------ schema


def test_committed_schema_matches_the_code():
    assert (ROOT / "docs" / "protocol.schema.json").read_text() == schema_json()


def test_schema_entry_point_prints_the_schema():
    out = subprocess.run([sys.executable, "-m", "api.protocol", "--schema"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert out == schema_json()
    doc = json.loads(out)
    assert set(doc["$defs"]["ClientMessage"]["discriminator"]["mapping"]) == {"generate", "cancel", "stats"}
    assert set(doc["$defs"]["ServerMessage"]["discriminator"]["mapping"]) == {"tokens", "done", "error", "stats"}
    assert set(doc["$defs"]["Error"]["properties"]["code"]["enum"]) == set(ERROR_CODES)


def test_every_json_example_in_the_protocol_doc_is_a_valid_message():
    text = (ROOT / "docs" / "protocol.md").read_text()
    examples = [block.split("```", 1)[0] for block in text.split("```json\n")[1:]]
    assert len(examples) >= 8
    decoders = [msgspec.json.Decoder(ClientMessage), msgspec.json.Decoder(ServerMessage)]
    types = set()
    for example in examples:
        decoded = []
        for decoder in decoders:
            try:
                decoded.append(decoder.decode(example))
            except msgspec.ValidationError:
                pass
        assert len(decoded) == 1, example
        types.add(type(decoded[0]))
    assert types == {Generate, Cancel, StatsRequest, Tokens, Done, Error, Stats}


# ------------------------------------------------------------------------------------------------ chat


def gguf_chat_template() -> str:
    reader = gguf.GGUFReader(ROOT / "tests" / "data" / "tiny-qwen35-mtp.gguf")
    return reader.fields["tokenizer.chat_template"].contents()


def test_render_chat_with_the_model_template():
    msgs = [ChatMessage("system", "Be brief."), {"role": "user", "content": "Hi"}]
    text = render_chat(gguf_chat_template(), msgs)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert not render_chat(gguf_chat_template(), msgs, add_generation_prompt=False).endswith("assistant\n")


def test_render_chat_is_sandboxed_and_reports_template_errors():
    msgs = [ChatMessage("user", "Hi")]
    with pytest.raises(ChatTemplateError, match="unsafe"):
        render_chat("{{ messages.__class__.__mro__ }}", msgs)
    with pytest.raises(ChatTemplateError):
        render_chat("{% set _ = messages.append(1) %}", msgs)
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat("{{ raise_exception('roles must alternate') }}", msgs)
    with pytest.raises(ChatTemplateError):
        render_chat("{% for m in messages %}", msgs)
    assert render_chat("{{ bos_token }}{{ messages | tojson }}", msgs, bos_token="<s>") == \
        '<s>[{"role": "user", "content": "Hi"}]'


# ------------------------------------------------------------------------------------------------ client


def done_frame(rid: str, reason: str, n: int, spec: SpecStats | None = None) -> Done:
    return Done(id=rid, finish_reason=reason, usage=Usage(prompt_tokens=3, completion_tokens=n),
                spec=spec or SpecStats(), timings=Timings(queue_ms=0.5, ttft_ms=2.0, tokens_per_s=100.0))


@asynccontextmanager
async def canned_server():
    """A websockets server whose replies depend on the prompt; yields (url, frames it received)."""
    received: list[ClientMessage] = []

    async def handler(ws: ServerConnection) -> None:
        decoder, encoder = msgspec.json.Decoder(ClientMessage), msgspec.json.Encoder()
        pairs: list[str] = []
        held: set[str] = set()

        async def send(msg) -> None:
            await ws.send(encoder.encode(msg), text=True)

        async for raw in ws:
            msg = decoder.decode(raw)
            received.append(msg)
            if isinstance(msg, Cancel):
                if msg.id in held:
                    held.discard(msg.id)
                    await send(done_frame(msg.id, "cancelled", 1))
                else:
                    await send(Error(id=msg.id, code="unknown_id", message=f"no request {msg.id!r}"))
            elif msg.prompt == "pair":
                pairs.append(msg.id)
                if len(pairs) == 2:
                    a, b = pairs
                    for i in range(3):
                        await send(Tokens(id=b, token_ids=[100 + i], text=f"b{i}", n_from_drafts=0))
                        await send(Tokens(id=a, token_ids=[i, i + 10], text=f"a{i}", n_from_drafts=1))
                    spec = SpecStats({"ngram": DrafterStats(4, 3)}, RollbackSteps(snapshot=2))
                    await send(done_frame(b, "length", 3))
                    await send(done_frame(a, "stop", 6, spec))
            elif msg.prompt == "hold":
                held.add(msg.id)
                await send(Tokens(id=msg.id, token_ids=[1], text="x", n_from_drafts=0))
            elif msg.prompt == "reject":
                await send(Error(id=msg.id, code="prompt_too_long", message="prompt has 9 tokens"))
            elif msg.prompt == "notice":
                await send(Error(id=None, code="bad_json", message="JSON is malformed"))
                await send(done_frame(msg.id, "stop", 0))
            elif msg.prompt == "close":
                await ws.close(1008, "client too slow")
            elif msg.prompt == "garbage":
                await ws.send('{"type": "tokens", "id": 3}')
            else:
                await send(Tokens(id=msg.id, token_ids=[7], text=msg.prompt or "", n_from_drafts=0))
                await send(done_frame(msg.id, "stop", 1))

    async with serve(handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        yield f"ws://127.0.0.1:{port}", received


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_concurrent_requests_interleave_on_one_connection():
    with anyio.fail_after(10):
        async with canned_server() as (url, received), Client(url) as c:
            s1 = await c.generate("pair", max_tokens=6, speculative=Speculative(drafters=["ngram"]))
            s2 = await c.generate("pair", speculative=None)
            assert c.pending == {s1.id, s2.id}
            kinds = [type(f).__name__ async for f in s2]
            assert kinds == ["Tokens", "Tokens", "Tokens", "Done"]
            r1, r2 = await s1.collect(), await s2.collect()
            assert (r1.token_ids, r1.text, r1.n_from_drafts, r1.finish_reason) == (
                (0, 10, 1, 11, 2, 12), "a0a1a2", 3, "stop")
            assert r1.spec.drafters == {"ngram": DrafterStats(4, 3)} and r1.spec.rollback.snapshot == 2
            assert (r2.token_ids, r2.text, r2.finish_reason, r2.usage.completion_tokens) == (
                (100, 101, 102), "b0b1b2", "length", 3)
            assert c.pending == frozenset()
            assert received[0] == Generate(id=s1.id, prompt="pair", max_tokens=6,
                                           speculative=Speculative(drafters=["ngram"]))
            assert received[1].speculative is None


@pytest.mark.anyio
async def test_cancel_ends_the_stream_with_a_cancelled_done():
    with anyio.fail_after(10):
        async with canned_server() as (url, received), Client(url) as c:
            s = await c.generate("hold", id="mine")
            first = await s.__anext__()
            assert first.token_ids == [1]
            await s.cancel()
            result = await s.collect()
            assert (result.id, result.token_ids, result.finish_reason) == ("mine", (1,), "cancelled")
            assert received[-1] == Cancel(id="mine")
            assert await c.cancel("mine") is False


@pytest.mark.anyio
async def test_error_frames_with_and_without_id():
    seen: list[Error] = []
    with anyio.fail_after(10):
        async with canned_server() as (url, _), Client(url, on_notice=seen.append) as c:
            bad = await c.generate("reject")
            with pytest.raises(RequestError, match="prompt_too_long") as info:
                await bad.collect()
            assert info.value.code == "prompt_too_long" and info.value.frame.id == bad.id
            ok = await c.generate("notice")
            assert (await ok.collect()).finish_reason == "stop"
            assert seen == c.notices == [Error(id=None, code="bad_json", message="JSON is malformed")]
            still = await c.generate("fine")
            assert (await still.collect()).text == "fine"
            with pytest.raises(ValueError, match="already pending"):
                held = await c.generate("hold", id="h")
                await c.generate("again", id="h")
            await held.cancel()
            await held.collect()


@pytest.mark.anyio
async def test_server_closing_the_connection_fails_pending_streams():
    with anyio.fail_after(10):
        async with canned_server() as (url, _), Client(url) as c:
            held = await c.generate("hold")
            await held.__anext__()
            closer = await c.generate("close")
            with pytest.raises(ConnectionLost, match="1008: client too slow"):
                await held.collect()
            with pytest.raises(ConnectionLost, match="1008"):
                async for _ in closer:
                    pass
            assert c.pending == frozenset()
            with pytest.raises(ConnectionLost):
                await c.generate("late")
            assert await c.cancel(held.id) is False


@pytest.mark.anyio
async def test_invalid_server_frame_is_a_protocol_violation():
    with anyio.fail_after(10):
        async with canned_server() as (url, _), Client(url) as c:
            s = await c.generate("garbage")
            with pytest.raises(ProtocolViolation, match="invalid frame"):
                await s.collect()


@pytest.mark.anyio
async def test_leaving_the_client_fails_what_is_still_pending():
    with anyio.fail_after(10):
        async with canned_server() as (url, _):
            async with Client(url) as c:
                held = await c.generate("hold")
            with pytest.raises(ConnectionLost, match="1000"):
                await held.collect()
            with pytest.raises(ClientError):
                await held.collect()
