"""The packed host <-> device buffers of a step (`jaxmodel.executor.host_io`): every leaf survives the round trip exactly,
through a jitted call as the runtime makes it."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmodel.executor.host_io import PackedCall, pack, pack_traced, unpack, unpack_host
from jaxmodel.sampling import SamplingParams
from jaxmodel.speculative import ChainInputs


def _tree():
    rng = np.random.default_rng(0)
    return {
        "tokens": rng.integers(-5, 1 << 20, (3, 4)).astype(np.int32),
        "sampling": SamplingParams(temperature=np.array([0.0, 0.7, np.nan], np.float32),
                                   top_p=np.array([1.0, 0.9, -0.0], np.float32), top_k=np.array([0, 5, 40], np.int32),
                                   seed=np.array([0, 1, 0xFFFFFFFF], np.uint32)),  # fmt: skip
        "commits": np.array([True, False, True]),
        "count": np.int32(7),
        "absent": None,
        "chain": ChainInputs(n_chain=np.array([-1, 0, 3], np.int32), p_min=np.array([0.0, 0.25, 1e-30], np.float32)),
    }


def _assert_same(got, want):
    got_leaves, got_def = jax.tree.flatten(got)
    want_leaves, want_def = jax.tree.flatten(want)
    assert got_def == want_def
    for g, w in zip(got_leaves, want_leaves):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g.reshape(-1).view(np.uint8), w.reshape(-1).view(np.uint8))  # NaN, -0.0 too


def test_host_round_trip_is_exact():
    buffer, layout = pack(_tree())
    assert buffer.dtype == np.int32 and buffer.shape == (layout.size,) == (12 + 12 + 3 + 1 + 6,)
    _assert_same(unpack_host(buffer, layout), _tree())


def test_round_trip_through_a_jitted_call_is_exact():
    buffer, layout = pack(_tree())
    out_layout = {}

    @jax.jit
    def echo(buffer):
        packed, out_layout["layout"] = pack_traced(unpack(buffer, layout))
        return packed

    _assert_same(unpack_host(np.asarray(echo(buffer)), out_layout["layout"]), _tree())


def test_packed_call_computes_on_the_unpacked_inputs_and_donates_state():
    def fn(weights, state, tokens, sampling, *, scale):
        total = jnp.sum(tokens, axis=1) * scale + weights["bias"]  # [B]
        return {"total": total, "hot": sampling.temperature > 0}, state + 1

    call = PackedCall(fn, static_argnames=("scale",))
    tree = _tree()
    state = jnp.zeros((2,), jnp.float32)
    inputs = {"tokens": tree["tokens"], "sampling": tree["sampling"]}
    out, state = call({"bias": jnp.int32(1)}, state, inputs, scale=2)
    np.testing.assert_array_equal(out["total"], tree["tokens"].sum(axis=1) * 2 + 1)
    assert out["hot"].tolist() == [False, True, False]
    out, state = call({"bias": jnp.int32(1)}, state, inputs, scale=3)  # another static value: its own layout
    np.testing.assert_array_equal(out["total"], tree["tokens"].sum(axis=1) * 3 + 1)
    assert state.tolist() == [2.0, 2.0]


def test_packed_call_says_when_it_traced_again_after_the_cache_let_go():
    def fn(weights, state, tokens):
        return {"total": jnp.sum(tokens) + weights}, state

    call = PackedCall(fn)
    inputs = {"tokens": np.arange(4, dtype=np.int32)}
    state = jnp.zeros((1,), jnp.float32)
    seen = []
    for evict in (False, False, True, False):
        if evict:
            jax.clear_caches()  # as jit's cache evicting the executable: the layout is known, the trace is new
        out, state = call(jnp.int32(1), state, inputs)
        assert int(out["total"]) == 7
        seen.append(call.traced)
    assert seen == [True, False, True, False]


def test_a_trace_in_one_thread_is_not_another_threads():
    """Engines side by side share one call (`Replicas`): a shape one thread traces does not mark the last call of
    another thread as traced, nor the other way round."""
    def fn(weights, state, tokens):
        return {"total": jnp.sum(tokens) + weights}, state

    call = PackedCall(fn)
    four = {"tokens": np.arange(4, dtype=np.int32)}
    state = jnp.zeros((1,), jnp.float32)
    _, state = call(jnp.int32(1), state, four)
    assert call.traced  # this thread traced the 4-token shape
    _, state = call(jnp.int32(1), state, four)
    assert not call.traced
    seen = {}

    def other():  # another thread traces the 8-token shape
        call(jnp.int32(1), jnp.zeros((1,), jnp.float32), {"tokens": np.arange(8, dtype=np.int32)})
        seen["other"] = call.traced

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen["other"] and not call.traced


@pytest.mark.parametrize("bad", [np.zeros(2, np.float64), np.zeros(2, np.int64), np.zeros(2, np.int8)])
def test_unsupported_dtypes_are_refused(bad):
    with pytest.raises(TypeError, match="int32, uint32, float32 or bool"):
        pack({"x": bad})
