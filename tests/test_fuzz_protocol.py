"""Fuzzing the protocol as it is written: client frames drawn from its JSON Schema (docs/protocol.schema.json, as
`api.protocol.schema()` gives it) and mutations of them, sent raw over a real loopback websocket to one live server.

An example is a short list of frames sent on a fresh connection, each followed by a sentinel (a cancel of an id
never used, answered unknown_id) and a stats frame. The server reads a connection's frames in order and queues its
immediate answers in order, so a frame's answer (an error, a stats frame, or nothing for an accepted generate or a
cancel of a running request) comes before its sentinel's, and the stats after it count the requests in flight, which
tells whether the frame started one. That lets the test check, frame by frame:

- every reply decodes as a server message per the schema (jsonschema and the typed decoder);
- every frame gets its answer: exactly one immediate reply, or it was a generate the server accepted (its tokens,
  then exactly one final frame, done or error with its id) or a cancel of a request in flight (whose done follows);
- an error carries the id the protocol says (the frame's id, or null) and a code that agrees with the schema: a frame
  the schema accepts is never refused as bad_json / bad_message, one it rejects is never served; a frame over
  max_message_bytes gets message_too_large and only such a frame does; no error is ever ``internal`` and no request
  ends with finish_reason error. (Where the schema and the decoder may rightly differ the test does not judge: a
  frame that is not JSON may be answered bad_message, the decoder validating as it parses; JSON Schema counts 1.0 an
  integer where the decoder wants an integer token; repeated keys.)
- nothing arrives for an id after its final frame.

After each example: every accepted request has ended, the connection still serves a plain greedy request with its
exact tokens, and the server's stats show no request in flight and every KV page and GDN plane free.

The suite runs a bounded, derandomized number of examples. The longer form (random, new examples each run):

    GDNSPEC_FUZZ_EXAMPLES=5000 .venv/bin/python -m pytest -q tests/test_fuzz_protocol.py -s

hypothesis-jsonschema draws every part of the schema but its objects: its object strategy calls a private Hypothesis
API (``many.more()``) that current Hypothesis releases no longer have, so `schema_strategy` draws objects itself
(required properties, then any subset of the optional ones; no others, as the schema's additionalProperties false
says) and hands every other node to ``from_schema``.
"""

from __future__ import annotations

import collections
import copy
import json
import os
import threading
import time
from dataclasses import dataclass, field

import anyio
import msgspec
import pytest
from conftest import ENGINE, plain_greedy
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import jsonschema
from hypothesis_jsonschema import from_schema
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from api.protocol import Defaults, Limits, ServerMessage, ServerSettings, schema
from api.server import Server, listening
from scheduler import Engine

EXAMPLES_ENV = "GDNSPEC_FUZZ_EXAMPLES"
LONG_EXAMPLES = int(os.environ.get(EXAMPLES_ENV, "0"))
CI_EXAMPLES = 100
EXAMPLE_TIMEOUT_S = 60.0

VOCAB = 512  # the tiny model's
MAX_MESSAGE_BYTES = 1 << 16
TRANSPORT_MAX = MAX_MESSAGE_BYTES * 2 + 1024  # api.server.run_server: a frame past this closes the connection (1009)
SETTINGS = ServerSettings(
    defaults=Defaults(drafters=(), max_tokens=8, n_max=4),
    limits=Limits(max_prompt_tokens=40, max_prompt_chars=2000, max_max_tokens=32, max_message_bytes=MAX_MESSAGE_BYTES,
                  max_in_flight=3, known_drafters=("ngram", "mtp"), vocab_size=VOCAB),
)  # fmt: skip
CHECK_PROMPT, CHECK_TOKENS = [1, 2, 3], 8

# ---------------------------------------------------------------------------------------------------------------
# The schema, as written


SCHEMA = schema()
DEFS = SCHEMA["$defs"]
CLIENT_VALIDATOR = jsonschema.Draft202012Validator({"$defs": DEFS, "$ref": "#/$defs/ClientMessage"})
SERVER_VALIDATOR = jsonschema.Draft202012Validator({"$defs": DEFS, "$ref": "#/$defs/ServerMessage"})
SERVER_DECODER = msgspec.json.Decoder(ServerMessage)


def _resolve(node: dict, defs: dict) -> dict:
    while "$ref" in node:
        node = defs[node["$ref"].rsplit("/", 1)[1]]
    return node


def _holds_object(node: dict, defs: dict) -> bool:
    node = _resolve(node, defs)
    if node.get("type") == "object":
        return True
    return any(_holds_object(n, defs) for n in node.get("anyOf", [])) or (
        "items" in node and _holds_object(node["items"], defs))


def schema_strategy(node: dict, defs: dict = DEFS) -> st.SearchStrategy:
    """Values of a schema node: objects and arrays of objects drawn here, everything else by hypothesis-jsonschema
    (see the module's docstring). Arrays of objects are kept short (at most 4)."""
    node = _resolve(node, defs)
    if "anyOf" in node:
        return st.one_of([schema_strategy(n, defs) for n in node["anyOf"]])
    if node.get("type") == "object":
        assert node.get("additionalProperties") is False, node  # every client struct forbids unknown fields
        props, required = node["properties"], set(node.get("required", ()))
        return st.fixed_dictionaries({k: schema_strategy(props[k], defs) for k in props if k in required},
                                     optional={k: schema_strategy(props[k], defs) for k in props if k not in required})
    if node.get("type") == "array" and _holds_object(node["items"], defs):
        return st.lists(schema_strategy(node["items"], defs), min_size=node.get("minItems", 0),
                        max_size=min(node.get("maxItems", 4), 4))
    return from_schema({k: v for k, v in node.items() if k not in ("title", "description", "default")})


def servable_defs() -> dict:
    """The schema narrowed to what this server runs (its limits, the engine's drafters, exactly one prompt), so that
    many drawn generates are accepted and run."""
    defs = copy.deepcopy(DEFS)
    gen = defs["Generate"]["properties"]

    def non_null(name: str) -> dict:
        return next(n for n in gen[name]["anyOf"] if n.get("type") != "null")

    non_null("prompt_ids").update(maxItems=24)
    non_null("prompt_ids")["items"].update(maximum=VOCAB - 1)
    non_null("prompt").update(maxLength=60)
    non_null("messages").update(maxItems=2)
    defs["ChatMessage"]["properties"]["content"].update(maxLength=40)
    non_null("max_tokens").update(maximum=SETTINGS.limits.max_max_tokens)
    non_null("top_k").update(maximum=VOCAB)
    non_null("stop").update(maxItems=3)
    spec = defs["Speculative"]["properties"]
    drafters = next(n for n in spec["drafters"]["anyOf"] if n.get("type") == "array")
    drafters.update(maxItems=2, items={"enum": [*SETTINGS.limits.known_drafters, "draft_model"]})  # one it lacks
    for name in ("n_max", "n_min"):
        next(n for n in spec[name]["anyOf"] if n.get("type") == "integer").update(maximum=ENGINE["n_max"])
    variants = []
    for prompt in ("prompt", "prompt_ids", "messages"):  # exactly one prompt, not null
        variant = copy.deepcopy(defs["Generate"])
        for other in {"prompt", "prompt_ids", "messages"} - {prompt}:
            del variant["properties"][other]
        variant["properties"][prompt] = non_null(prompt)
        variant["required"] = [*variant["required"], prompt]
        variants.append(variant)
    defs["ServableGenerate"] = {"anyOf": variants}
    return defs


SERVABLE_DEFS = servable_defs()

# ---------------------------------------------------------------------------------------------------------------
# Frames: drawn from the schema, mutated, or raw


class Raw(str):
    """A JSON token written into a frame as is (``1e999``, ``NaN``, deep nesting, ...)."""


def dump(value, ensure_ascii: bool = True) -> str:
    """JSON text of `value`, its `Raw` parts spliced in as written. Strings holding lone surrogates are always
    escaped (``"\\ud800"``): a websocket text frame cannot carry them otherwise."""
    raws: list[str] = []

    def mark(v):
        if isinstance(v, Raw):
            raws.append(str(v))
            return f"\x01raw{len(raws) - 1}\x01"
        if isinstance(v, dict):
            return {mark(k) if isinstance(k, Raw) else k: mark(x) for k, x in v.items()}
        if isinstance(v, list):
            return [mark(x) for x in v]
        return v

    text = json.dumps(mark(value), ensure_ascii=ensure_ascii)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(mark(value), ensure_ascii=True)
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\x01raw{i}\x01"), raw, 1)
    return text


POOL_IDS = ("a", "b", "c")  # few ids, so that frames collide: duplicate_id, cancels that hit, ids reused
EXTREME_NUMBERS = [2**63, 2**63 - 1, 2**64, -(2**63) - 1, -1, 0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, VOCAB - 1,
                   VOCAB, 10**30, 1e308, -1e308, 1.7976931348623157e308, 5e-324, -0.0, 0.5, 1.0, 100.0, 100.5]
NASTY_STRINGS = ["", " ", "\x00", "a\x00b", "\u202e\u200fabc", "\u200b", "\ufeff", "😀", "👩\u200d💻", "e\u0301",
                 "\ud800", "\udfff", "x\udc00y", "\u2028\u2029", "NaN", "nan", "Infinity", "-Infinity", "1e308",
                 "null", "true", "0", "-1", "\\", '"', "\n\r\t", "{{ 7 * 7 }}", "{% raw %}", "%s%n", "<|im_end|>",
                 "generate", "cancel", "stats", "ngram", "mtp", "auto", "a", "b"]
RAW_TOKENS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1E400", "-0", "0.0", "1.0", "1e2", "01", "1.",
              ".5", "+1", "0x10", "1_000", "undefined", "True", "None", "'a'", '"\\ud800"', '"\\udc00\\ud800"',
              '"\\ud83d\\ude00"', '"\\u0000"', '"\\x41"', '"\\uZZZZ"', '"\t"', "[1,]", "{,}", '{"a":1,}', "[]",
              "{}", '""', "null", "18446744073709551616", "-9223372036854775809", "9223372036854775807",
              "1" + "0" * 400, "0." + "0" * 400 + "1"]
FIELD_NAMES = sorted({k for name in ("Generate", "Cancel", "StatsRequest", "Speculative", "ChatMessage")
                      for k in DEFS[name]["properties"]} | {"Type", "ID", "max_token", "prompt_id", "drafter", ""})


def _long_string(char: str, n: int) -> str:
    return char * n


def _deep(kind: str, depth: int) -> Raw:
    if kind == "list":
        return Raw("[" * depth + "]" * depth)
    if kind == "dict":
        return Raw('{"a":' * depth + "1" + "}" * depth)
    return Raw('{"speculative":' * depth + "null" + "}" * depth)


long_strings = st.builds(_long_string, st.sampled_from(["x", "é", "😀", "\u202e", "\x00", "ab "]),
                         st.sampled_from([65, 129, 257, 2001, 20_000, 40_000]))
deep_values = st.builds(_deep, st.sampled_from(["list", "dict", "spec"]), st.sampled_from([2, 64, 500, 2000, 20_000]))
huge_arrays = st.builds(lambda v, n: [v] * n, st.sampled_from([0, 1, VOCAB - 1, VOCAB, 2**31 - 1, -1, "x", None]),
                        st.sampled_from([0, 1, 41, 1000, 5000]))
scalars = st.one_of(
    st.sampled_from(EXTREME_NUMBERS), st.sampled_from(NASTY_STRINGS), st.sampled_from(RAW_TOKENS).map(Raw),
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
)
nasty_values = st.one_of(
    scalars,
    st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                 | st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=6), inner, max_size=3),
                 max_leaves=6),
    long_strings, deep_values, huge_arrays,
)

schema_messages = schema_strategy({"$ref": "#/$defs/ClientMessage"})
servable_generates = schema_strategy({"$ref": "#/$defs/ServableGenerate"}, SERVABLE_DEFS)


@st.composite
def pooled(draw, messages: st.SearchStrategy) -> dict:
    """A drawn message whose id, half the time, is one of a few shared ids."""
    message = dict(draw(messages))
    if "id" in message and draw(st.booleans()):
        message["id"] = draw(st.sampled_from(POOL_IDS))
    return message


cancels = st.fixed_dictionaries({"type": st.just("cancel"), "id": st.sampled_from(POOL_IDS)})
stats_requests = st.just({"type": "stats"})
valid_messages = st.one_of(pooled(schema_messages), pooled(servable_generates), pooled(servable_generates),
                           pooled(servable_generates), cancels, cancels, stats_requests)


def _containers(value, out: list) -> list:
    if isinstance(value, dict | list):
        out.append(value)
        for child in value.values() if isinstance(value, dict) else value:
            _containers(child, out)
    return out


@st.composite
def mutated(draw) -> str:
    """A valid message with one to three mutations (a field set to a hostile value, removed, renamed or added; an
    array element changed, added or the array emptied), then perhaps its text broken."""
    message = copy.deepcopy(draw(valid_messages))
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.integers(0, 19)) == 0:
            message = draw(nasty_values)  # the whole frame
            continue
        containers = _containers(message, [])
        if not containers:
            break
        target = draw(st.sampled_from(containers))
        if isinstance(target, dict):
            op = draw(st.sampled_from(["set", "set", "set", "delete", "rename", "add"]))
            if op == "delete" and target:
                del target[draw(st.sampled_from(sorted(target)))]
            elif op == "rename" and target:
                key = draw(st.sampled_from(sorted(target)))
                target[draw(st.sampled_from([key.upper(), key + " ", " " + key, key[:-1], key + "\x00"]))] = \
                    target.pop(key)
            else:
                key = draw(st.sampled_from(sorted(target) + FIELD_NAMES) if op == "set" else st.text(max_size=8))
                target[key] = draw(nasty_values)
        else:
            op = draw(st.sampled_from(["set", "append", "clear"]))
            if op == "set" and target:
                target[draw(st.integers(0, len(target) - 1))] = draw(nasty_values)
            elif op == "clear":
                target.clear()
            else:
                target.append(draw(nasty_values))
    text = dump(message, ensure_ascii=draw(st.booleans()))
    match draw(st.integers(0, 9)):
        case 0:
            text = text[: draw(st.integers(0, max(len(text) - 1, 0)))]  # truncated
        case 1:
            text = text + draw(st.sampled_from([" ", "\n", "x", "}", ",", "\x00", '{"type":"stats"}']))
        case 2:
            text = draw(st.sampled_from(["\ufeff", " \t\r\n", "\x00"])) + text
        case 3 if text.endswith("}") and len(text) > 2:  # a key repeated
            text = text[:-1] + "," + draw(st.sampled_from(['"type":"cancel"', '"type":"stats"', '"id":"a"',
                                                          '"id":null', '"prompt":"x"'])) + "}"
    return text


raw_frames = st.one_of(
    st.text(st.characters(exclude_categories=("Cs",)), max_size=40),
    st.sampled_from(["", " ", "null", "[]", "{}", "0", '"generate"', '{"type":null}', '{"type":"generate"}',
                     '{"type":"cancel"}', '{"type":"stats","type":"stats"}', '{"id":"a"}', "[" * 40_000,
                     '{"type":"stats"}' * 2, '{"type":"stats"}\x00', r'"\ud83d\ude00"', "\U0001f600"]),
    deep_values.map(str),
    nasty_values.map(dump),
    st.binary(max_size=16),
)


def fits(frame: str | bytes) -> bool:
    """A frame the transport carries (a larger one closes the connection, by design)."""
    return len(frame if isinstance(frame, bytes) else frame.encode()) <= TRANSPORT_MAX


valid_frames = valid_messages.flatmap(lambda m: st.booleans().map(lambda ascii_: dump(m, ascii_)))
frame_strategy = st.one_of(valid_frames, valid_frames, valid_frames, mutated(), mutated(), raw_frames).filter(fits)

# ---------------------------------------------------------------------------------------------------------------
# What the schema says of a frame, and what the server must answer


class _Undetermined(Exception):
    pass


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise _Undetermined("repeated key")
    for k, v in pairs:
        _check_text(k)
        if isinstance(v, str):
            _check_text(v)
    return dict(pairs)


def _check_text(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("a lone surrogate") from None


def _strict_parse(text: str):
    """The frame's JSON value per RFC 8259 as I-JSON narrows it (no NaN/Infinity, no lone surrogates); ValueError
    when it is not JSON, _Undetermined where the RFC leaves it open (repeated keys) or Python's parser gives up."""

    def constant(name):
        raise ValueError(name)

    try:
        value = json.loads(text, parse_constant=constant, object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise _Undetermined("too deep for Python's parser") from None
    if isinstance(value, str):
        _check_text(value)
    for item in _containers(value, []):
        if isinstance(item, list):
            for x in item:
                if isinstance(x, str):
                    _check_text(x)
    return value


def _is_integral_float(value) -> bool:
    return any(isinstance(x, float) and x.is_integer() for c in _containers(value, [])
               for x in (c.values() if isinstance(c, dict) else c))


class _IdOnly(msgspec.Struct):
    id: str | None = None


def verdict(frame: str | bytes) -> tuple[str, str | None]:
    """(what the schema says: "not_json" / "valid" / "invalid" / "open", the frame's id as the protocol reads it)."""
    if isinstance(frame, bytes):
        return "invalid", None
    try:
        value = _strict_parse(frame)
    except _Undetermined:
        # repeated keys (the last one counts), or nesting too deep for Python's parser: the id as the server's
        # decoder reads it
        try:
            return "open", msgspec.json.decode(frame, type=_IdOnly).id
        except (msgspec.DecodeError, RecursionError):
            return "open", None
    except ValueError:
        return "not_json", None
    rid = value.get("id") if isinstance(value, dict) and isinstance(value.get("id"), str) else None
    valid = CLIENT_VALIDATOR.is_valid(value)
    if valid and _is_integral_float(value):
        # JSON Schema counts 1.0 as an integer; the server's decoder (msgspec) wants an integer token. Known, and
        # reported: such a frame may get bad_message.
        return "open", rid
    return ("valid" if valid else "invalid"), rid


# codes the server can only answer after decoding the frame as a client message
DECODED_CODES = {"bad_value", "unknown_drafter", "prompt_too_long", "too_many_requests", "duplicate_id", "unknown_id",
                 "overloaded", "chat_template"}
NULL_ID_CODES = {"bad_json", "bad_message", "duplicate_id", "message_too_large"}

SENTINEL_ID = "~sentinel~"  # never drawn: the pool ids are short, the schema's draws random
SENTINEL = json.dumps({"type": "cancel", "id": SENTINEL_ID})

COVERAGE: collections.Counter = collections.Counter()  # what the frames got, printed at the end (-s)
HEALTH_CHECKS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                 HealthCheck.large_base_example]


@dataclass
class Live:
    """The running server, as the examples see it."""

    url: str
    expected: list[int]  # the plain greedy tokens of CHECK_PROMPT
    broken_by: list | None = None  # the example after which the server no longer served them


@dataclass
class Exchange:
    """One connection's frames in and out, and what the test has learnt of its requests."""

    ws: object
    frames: list = field(default_factory=list)  # (direction, frame) for the failure report
    open: set = field(default_factory=set)  # ids accepted and without their final frame
    candidate: str | None = None  # the id of the frame just sent, while it may yet prove to be an accepted generate
    accepted: bool = False  # whether the frame just sent proved to be an accepted generate
    sent: str | bytes = ""  # the frame just sent
    fid: str | None = None  # its id as the protocol reads it
    answers: list = field(default_factory=list)  # its immediate answers so far
    open_at_answer: set = field(default_factory=set)

    def fail(self, why: str):
        log = "\n".join(f"{d} {f!r}"[:400] for d, f in self.frames[-40:])
        pytest.fail(f"{why}\n--- last frames:\n{log}")

    async def send(self, frame: str | bytes) -> None:
        self.frames.append(("->", frame))
        await self.ws.send(frame)

    async def recv(self) -> dict:
        try:
            text = await self.ws.recv()
        except ConnectionClosed as exc:
            self.fail(f"the server closed the connection: {exc!r}")
        self.frames.append(("<-", text))
        if not isinstance(text, str):
            self.fail("a binary frame from the server")
        try:
            msg = json.loads(text)
            SERVER_DECODER.decode(text)
        except (ValueError, msgspec.DecodeError) as exc:
            self.fail(f"a server frame that is not a server message: {exc}")
        errors = sorted(SERVER_VALIDATOR.iter_errors(msg), key=str)
        if errors:
            self.fail(f"a server frame the schema rejects: {errors[0].message}")
        if msg["type"] == "error" and msg["code"] == "internal":
            self.fail("an internal error")
        if msg["type"] == "done" and msg["finish_reason"] == "error":
            self.fail(f"a request failed in the server: {msg.get('error')}")
        return msg

    def note_accepted(self) -> None:
        try:
            value = json.loads(self.sent)
            prompt = next(k for k in ("prompt", "prompt_ids", "messages") if value.get(k) is not None)
        except (ValueError, RecursionError, StopIteration, AttributeError, TypeError):
            prompt = "(undecoded)"
        COVERAGE[f"accepted {prompt}"] += 1

    def on_request_frame(self, msg: dict) -> bool:
        """A tokens / done / error frame of a request in flight (or of the frame just sent, which is then known to
        have been accepted); True when it was one."""
        rid = msg.get("id")
        if msg["type"] == "stats" or rid is None:
            return False
        if rid not in self.open and rid == self.candidate and msg["type"] in ("tokens", "done"):
            self.accepted, self.candidate = True, None
            self.open.add(rid)
            self.note_accepted()
        if rid not in self.open:
            return False
        if msg["type"] in ("done", "error"):
            self.open.discard(rid)
            COVERAGE[f"final {msg['type']} {msg.get('finish_reason') or msg.get('code')}"] += 1
            if rid == self.fid and not self.answers and not self.accepted:
                self.candidate = rid  # the frame just sent reuses the id, which it found free if it came after this
        return True

    async def stats(self) -> dict:
        """Send a stats frame and read up to its answer, every frame on the way being a request's."""
        await self.send('{"type": "stats"}')
        while True:
            msg = await self.recv()
            if msg["type"] == "stats":
                return msg
            if not self.on_request_frame(msg):
                if msg["type"] == "error" and msg["id"] is not None and msg["id"] == self.candidate:
                    # after the sentinel, an error with the frame's id is the final frame of an accepted request
                    self.accepted, self.candidate = True, None
                    self.note_accepted()
                    COVERAGE[f"final error {msg['code']}"] += 1
                    continue
                self.fail(f"a frame for no request in flight: {msg}")

    async def one(self, frame: str | bytes) -> None:
        """Send one frame, then a sentinel (a cancel of an id never used, answered unknown_id), then a stats
        frame; check the frame's answer (see the module's docstring)."""
        size = len(frame) if isinstance(frame, bytes) else len(frame.encode())
        kind, fid = verdict(frame)
        opened_before = set(self.open)
        self.accepted, self.candidate, self.fid, self.answers = False, fid if fid not in self.open else None, fid, []
        # nested past what the test's parsers follow (Python's recursion limit, which Hypothesis raises while a test
        # runs): the server may still read its id; it can be no valid message, so no request starts
        unread_id = kind == "open" and fid is None
        self.sent = frame
        await self.send(frame)
        await self.send(SENTINEL)
        answers = self.answers
        while True:
            msg = await self.recv()
            if self.on_request_frame(msg):
                continue
            rid = msg.get("id")
            if msg["type"] == "error" and rid == SENTINEL_ID:
                if msg["code"] != "unknown_id":
                    self.fail(f"the sentinel got {msg}")
                break
            its_id = rid is None or rid == self.candidate or (unread_id and rid not in self.open)
            if msg["type"] == "stats" or (msg["type"] == "error" and its_id):
                answers.append(msg)  # an error with the frame's id: refused, or accepted and ended at once
                self.open_at_answer = set(self.open)  # the ids in flight when the server answered
                self.candidate = None
                continue
            self.fail(f"a frame for no request in flight, and not the answer of the frame sent: {msg}")
        if answers:
            self.candidate = None
        in_flight = (await self.stats())["requests_in_flight"]
        if in_flight == len(self.open) + 1 and self.candidate is not None:
            self.accepted = True  # accepted, nothing sent for it yet
            self.open.add(self.candidate)
            self.note_accepted()
        elif in_flight != len(self.open):
            self.fail(f"the server counts {in_flight} requests in flight, the client {len(self.open)} "
                      f"({sorted(self.open)})")
        self.candidate = None
        self.check_answer(frame, kind, fid, size, answers, self.accepted, opened_before)

    def check_answer(self, frame, kind, fid, size, answers, accepted, opened_before) -> None:
        if len(answers) > 1 or (answers and accepted):
            self.fail(f"{len(answers) + accepted} answers to one frame: {answers}")
        if not answers and not accepted:
            try:
                value = json.loads(frame)
            except (ValueError, RecursionError, TypeError):
                value = None
            if not (isinstance(value, dict) and value.get("type") == "cancel" and value.get("id") in opened_before):
                self.fail(f"no answer to {frame!r}"[:400])
            COVERAGE["cancel of a request in flight"] += 1
            if kind == "invalid" or kind == "not_json":
                self.fail(f"a frame the schema rejects was taken as a cancel: {frame!r}")
            return
        if accepted:
            if kind in ("invalid", "not_json"):
                self.fail(f"a frame the schema rejects was served: {frame!r}"[:400])
            return
        answer = answers[0]
        if answer["type"] == "stats":
            COVERAGE["stats"] += 1
            if kind in ("invalid", "not_json"):
                self.fail(f"a frame the schema rejects got stats: {frame!r}"[:400])
            return
        code, rid = answer["code"], answer["id"]
        COVERAGE[f"error {code}"] += 1
        if (code == "message_too_large") != (size > MAX_MESSAGE_BYTES):
            self.fail(f"{code} for a frame of {size} bytes (the limit is {MAX_MESSAGE_BYTES})")
        if code == "bad_json" and kind not in ("not_json", "open"):
            self.fail(f"bad_json for a frame that is JSON ({kind}): {frame!r}"[:400])
        # a frame that is not JSON may be answered bad_message: the decoder validates as it parses, and the first
        # fault it meets (a field the schema rejects, before the text breaks off) is the one it reports
        if code == "bad_message" and isinstance(frame, str) and kind not in ("invalid", "not_json", "open"):
            self.fail(f"bad_message for a frame the schema calls {kind}: {frame!r}; {answer['message']}"[:600])
        if code in DECODED_CODES and kind not in ("valid", "open"):
            self.fail(f"{code} (after decoding) for a frame the schema calls {kind}: {frame!r}"[:400])
        if code in ("bad_json", "duplicate_id") or isinstance(frame, bytes):
            expected = None
        elif code in ("bad_message", "message_too_large"):
            expected = fid if fid is not None and fid not in self.open_at_answer else None
        else:
            expected = fid
        if rid != expected and kind != "open":
            self.fail(f"{code} with id {rid!r}; the frame's id as the protocol reads it is {expected!r}")
        if rid is None and code not in NULL_ID_CODES:
            self.fail(f"{code} with a null id")

    async def drain(self) -> None:
        """Read until every accepted request has had its final frame."""
        while self.open:
            msg = await self.recv()
            if not self.on_request_frame(msg):
                self.fail(f"a frame for no request in flight: {msg}")


async def run_example(live: Live, frames: list) -> None:
    """Send `frames` on a new connection, each checked as it is answered; then check that the server lives."""
    with anyio.fail_after(EXAMPLE_TIMEOUT_S):
        async with connect(live.url, max_size=None) as ws:
            ex = Exchange(ws)
            for frame in frames:
                await ex.one(frame)
            await ex.drain()
            if (await ex.stats())["requests_in_flight"] != 0:
                ex.fail("requests in flight after every final frame")
            await check_the_server_lives(ex, live, frames)


async def check_the_server_lives(ex: Exchange, live: Live, frames: list) -> None:
    """A plain greedy request gets its exact tokens, and the pools are full again. A server that fails this stays
    broken: `live.broken_by` keeps the example that broke it, for every later example's report."""
    await ex.send(json.dumps({"type": "generate", "id": "check", "prompt_ids": CHECK_PROMPT,
                              "max_tokens": CHECK_TOKENS, "temperature": 0, "speculative": None}))
    tokens = []
    while True:
        msg = await ex.recv()
        if msg.get("id") != "check":
            ex.fail(f"a frame for no request in flight: {msg}")
        if msg["type"] == "tokens":
            tokens += msg["token_ids"]
        elif msg["type"] == "done":
            break
        else:
            live.broken_by = frames
            ex.fail(f"the plain request was refused: {msg}")
    if tokens != live.expected:
        live.broken_by = frames
        ex.fail(f"after these frames the plain request {CHECK_PROMPT} got {tokens}, not {live.expected}")
    deadline = time.monotonic() + 5
    while True:
        s = await ex.stats()
        if (s["pages_free"], s["planes_free"], s["requests_in_flight"], s["requests_running"],
                s["requests_waiting"]) == (s["pages_total"], s["planes_total"], 0, 0, 0):  # fmt: skip
            break
        if time.monotonic() > deadline:
            live.broken_by = frames
            ex.fail(f"the pools did not come back: {s}")
        await anyio.sleep(0.01)


# ---------------------------------------------------------------------------------------------------------------
# The live server, started once for the module in a thread of its own


@pytest.fixture(scope="module")
def live(model, tokenizer):
    engine = Engine(model, tokenizer=tokenizer, **ENGINE)
    server = Server(engine, tokenizer, SETTINGS)
    started, stop, box = threading.Event(), threading.Event(), {}

    async def serve():
        async with engine, listening(server) as (url, _):
            box["url"] = url
            started.set()
            await anyio.to_thread.run_sync(stop.wait)

    def main():
        try:
            anyio.run(serve)
        except BaseException as exc:  # noqa: BLE001  reported by the fixture
            box["error"] = exc
            started.set()

    thread = threading.Thread(target=main, name="fuzz-server", daemon=True)
    thread.start()
    assert started.wait(300), "the server did not start"
    if "error" in box:
        raise box["error"]
    expected = plain_greedy(model, CHECK_PROMPT, CHECK_TOKENS, tokenizer.eog_ids)
    warm_up = [json.dumps({"type": "generate", "id": f"w{i}", "prompt": "def f(x):\n    return x", **extra})
               for i, extra in enumerate([{"speculative": None}, {"speculative": {"drafters": ["ngram"]}},
                                          {"speculative": {"drafters": ["mtp"]}},
                                          {"speculative": {"drafters": ["mtp", "ngram"], "rollback": "snapshot"}}])]
    start = time.perf_counter()
    live = Live(box["url"], expected)
    anyio.run(run_example, live, warm_up)  # compiles the step shapes outside the examples' time
    print(f"\nfuzz server warm in {time.perf_counter() - start:.1f} s")
    yield live
    stop.set()
    thread.join(60)
    if "error" in box:
        raise box["error"]
    print(f"\nfuzz coverage: {dict(sorted(COVERAGE.items()))}")


def test_schema_draws_are_messages_the_server_decodes():
    """The drawing itself: what it calls valid the schema and the typed decoder both accept."""
    from api.protocol import ClientMessage

    decoder = msgspec.json.Decoder(ClientMessage)

    @settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=HEALTH_CHECKS)
    @given(valid_messages)
    def check(message):
        text = dump(message)
        assert CLIENT_VALIDATOR.is_valid(json.loads(text)), text
        decoder.decode(text)

    check()


FUZZ_SETTINGS = settings(
    max_examples=LONG_EXAMPLES or CI_EXAMPLES,
    derandomize=not LONG_EXAMPLES,  # the suite's run is the same every time; the long form explores
    deadline=None,
    database=None,
    suppress_health_check=HEALTH_CHECKS,
)


# A prompt of one token that decodes three or more: the first fuzzing run found that it left the server broken
# (the engine's looping call wrote the shared null GDN plane), so it is always tried.
ONE_TOKEN_PROMPT = json.dumps({"type": "generate", "id": "one", "prompt_ids": [15], "max_tokens": 8,
                               "speculative": None})


@FUZZ_SETTINGS
@example(frames=[ONE_TOKEN_PROMPT])
@given(frames=st.lists(frame_strategy, min_size=1, max_size=8))
def test_every_frame_gets_a_well_formed_answer_and_the_server_lives(live, frames):
    if live.broken_by is not None:
        pytest.fail(f"the server is broken since the example {live.broken_by!r} (see its failure); later examples "
                    "cannot be judged")
    anyio.run(run_example, live, frames)
