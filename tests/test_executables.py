"""Compiled steps kept on disk (`jaxmodel.executor.executables`): a later engine loads them instead of tracing and
compiling, decodes what plain greedy decodes, and the store's key, files and limits behave."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DATA, generate_all, plain_greedy

from jaxmodel import load_model
from jaxmodel.executor import executables, runtime
from jaxmodel.executor.host_io import PackedCall
from jaxmodel.requests import SpeculativeConfig
from scheduler.engine import Engine, GenerationRequest


@pytest.fixture
def store(tmp_path):
    kept = executables.keep_executables(tmp_path / "steps")
    yield kept
    executables.keep_executables(None)


def _total(weights, state, tokens, *, scale):
    return {"total": jnp.sum(tokens, axis=-1) * scale + weights["bias"]}, state + 1


def _call(name="total") -> PackedCall:
    return PackedCall(_total, static_argnames=("scale",), name=name)


WEIGHTS = {"bias": jnp.int32(1)}
FOUR = {"tokens": np.arange(4, dtype=np.int32)}


def test_a_stored_call_is_loaded_by_the_next_caller_and_still_donates_its_state(store):
    held = {}
    state = jnp.zeros((2,), jnp.float32)
    out, state = _call()(WEIGHTS, state, FOUR, held=held, scale=2)
    assert int(out["total"]) == 13 and store.counts.saved == 1 and store.counts.hits == 0
    second = _call()  # a new call: nothing in memory, the executable comes from disk
    before = state
    out, state = second(WEIGHTS, state, FOUR, held={}, scale=2)
    assert int(out["total"]) == 13 and store.counts.hits == 1 and second.traced
    assert before.is_deleted()  # donated, as the jitted call donates it
    assert state.tolist() == [2.0, 2.0]
    out, state = second(WEIGHTS, state, FOUR, held={}, scale=3)  # another static value: another executable
    assert int(out["total"]) == 19 and store.counts.saved == 2


def test_a_call_without_a_store_or_a_name_or_a_holder_uses_jit_alone(tmp_path):
    state = jnp.zeros((2,), jnp.float32)
    out, state = _call()(WEIGHTS, state, FOUR, held={}, scale=2)  # no store kept
    kept = executables.keep_executables(tmp_path)
    try:
        out, state = _call(name=None)(WEIGHTS, state, FOUR, held={}, scale=2)
        out, state = _call()(WEIGHTS, state, FOUR, scale=2)
        assert int(out["total"]) == 13 and kept.counts == executables.StoreCounts()
        assert not list(tmp_path.iterdir())
    finally:
        executables.keep_executables(None)


def test_an_unreadable_file_is_removed_and_its_shape_compiled_again(store):
    state = jnp.zeros((2,), jnp.float32)
    _, state = _call()(WEIGHTS, state, FOUR, held={}, scale=2)
    (path,) = store.directory.glob(f"*{executables.SUFFIX}")
    path.write_bytes(path.read_bytes()[:1000])  # truncated, as by a full disk
    out, state = _call()(WEIGHTS, state, FOUR, held={}, scale=2)
    assert int(out["total"]) == 13
    assert store.counts.unreadable == 1 and store.counts.saved == 2 and path.stat().st_size > 1000
    out, state = _call()(WEIGHTS, state, FOUR, held={}, scale=2)
    assert int(out["total"]) == 13 and store.counts.hits == 1


def test_a_store_that_cannot_be_written_or_made_leaves_the_steps_running(store, tmp_path):
    """A folder gone (or a full disk) when a shape is saved: the step runs unsaved, and the next start compiles it
    again; a cache folder that cannot be made: the server keeps no store."""
    store.directory.rmdir()
    store.directory.write_bytes(b"")  # a file where the folder was: every write fails
    state = jnp.zeros((2,), jnp.float32)
    out, state = _call()(WEIGHTS, state, FOUR, held={}, scale=2)
    assert int(out["total"]) == 13 and store.counts.not_saved == 1 and store.counts.saved == 0
    out, state = _call()(WEIGHTS, state, FOUR, held={}, scale=2)
    assert int(out["total"]) == 13 and store.counts.hits == 0
    (tmp_path / "cache").write_bytes(b"")
    assert executables.keep_beside_jax_cache(tmp_path / "cache") is None and executables.store() is None


def test_the_key_follows_what_changes_a_compiled_step(store, monkeypatch):
    args = (WEIGHTS, jnp.zeros((2,), jnp.float32), np.zeros((4,), np.int32))
    key = store.key("step", args, ("layout", 2))
    assert store.key("step", args, ("layout", 2)) == key
    assert store.key("chain", args, ("layout", 2)) != key  # another function or model config
    assert store.key("step", args, ("layout", 3)) != key  # another static argument
    assert store.key("step", (WEIGHTS, jnp.zeros((3,), jnp.float32), args[2]), ("layout", 2)) != key  # shape
    assert store.key("step", (WEIGHTS, jnp.zeros((2,), jnp.bfloat16), args[2]), ("layout", 2)) != key  # dtype
    if len(jax.devices()) > 1:  # placement
        moved = jax.device_put(args[1], jax.devices()[1])
        assert store.key("step", (WEIGHTS, moved, args[2]), ("layout", 2)) != key
    monkeypatch.setenv("GDNSPEC_API_KEY", "secret")  # changes no step
    assert store.key("step", args, ("layout", 2)) == key
    monkeypatch.setenv("GDNSPEC_STEP_INVARIANT", "0")  # changes what is traced
    assert store.key("step", args, ("layout", 2)) != key
    monkeypatch.delenv("GDNSPEC_STEP_INVARIANT")
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    assert store.key("step", args, ("layout", 2)) != key


def test_saving_past_the_limit_removes_the_files_used_longest_ago(tmp_path):
    kept = executables.keep_executables(tmp_path, max_bytes=1)
    try:
        state = jnp.zeros((2,), jnp.float32)
        for scale in (2, 3):
            _, state = _call()(WEIGHTS, state, FOUR, held={}, scale=scale)
        files = list(tmp_path.glob(f"*{executables.SUFFIX}"))
        assert kept.counts.saved == 2 and len(files) <= 1  # the last one may stay alone over the limit
    finally:
        executables.keep_executables(None)


MAX_TOKENS = 12


def _serve(model, prompts, specs) -> tuple[list[list[int]], int]:
    """Greedy tokens of each prompt under its SpeculativeConfig (None: plain), all at once on one engine; and how
    many step shapes it ran. Few shapes, since each is a compile: one iteration per call (the loops' shapes take
    seconds more), prompts fed a token a step (one length for them and decoding, one for verification); an
    executable is saved and loaded the same whatever it computes."""
    engine = Engine(model, adaptive=False, budget_bytes=2 << 20, max_running=4, row_buckets=(4,), max_model_len=64,
                    chunk_size=1, token_budget=48, n_max=3, iterations=1)
    results = generate_all(engine, [GenerationRequest(p, MAX_TOKENS, speculative=s) for p, s in zip(prompts, specs)])
    return results, len(engine.runtime._executables)


def _forget_compiled_calls(monkeypatch) -> None:
    """As a new process: no jitted call of any config in memory (and none of this test's kept after it)."""
    monkeypatch.setattr(runtime, "_compiled", functools.lru_cache(maxsize=None)(runtime._compiled.__wrapped__))


def test_a_later_engine_loads_every_stored_step_and_decodes_plain_greedy(store, monkeypatch):
    """An engine serves plain, n-gram and MTP rows, saving each step shape it compiles; a second engine on a model
    loaded again, in a process that has forgotten the first's calls, loads every shape it runs from the store,
    compiles none, and both decode each prompt's plain greedy tokens."""
    model = load_model(DATA / "tiny-qwen35-mtp.gguf")
    rng = np.random.default_rng(3)
    prompts = [tuple(int(t) for t in rng.integers(3, 200, n)) for n in (5, 11)] + [(7, 8, 9) * 4, (5, 6) * 5]
    specs = [None, SpeculativeConfig(("mtp",), n_max=3, rollback="snapshot"),
             SpeculativeConfig(("ngram",), n_max=3, rollback="replay"),
             SpeculativeConfig(("ngram", "mtp"), n_max=3, rollback="checkpoint")]
    references = [plain_greedy(model, p, MAX_TOKENS) for p in prompts]

    _forget_compiled_calls(monkeypatch)
    first, shapes = _serve(model, prompts, specs)
    assert first == references
    assert shapes >= 2 and store.counts.saved == shapes and store.counts.hits == 0

    _forget_compiled_calls(monkeypatch)
    again = load_model(DATA / "tiny-qwen35-mtp.gguf")
    second, shapes_again = _serve(again, prompts, specs)
    assert second == references
    assert store.counts.hits == shapes_again and store.counts.saved == shapes  # loaded, none compiled
    assert store.counts.misses == shapes  # the first engine's, none since
