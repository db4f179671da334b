"""The CPU causal-conv kernel against its jnp specification: shapes with partial groups of channels, one tap to
nine, many token counts; a channel's value the same bits alone, in a subset of channels (replay's rebuild
convolves the key and value channels alone), in any batch and step length; the GDN mixer's conv (XLA's form at one
token, the kernel at more) the same bits token by token as in one step; its gradient is the reference's; malformed
shapes are refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmodel.gdn import causal_conv
from jaxmodel.kernels import cpu_matmul
from jaxmodel.kernels.cpu_conv import causal_conv_cpu, causal_conv_reference

needs_kernel = pytest.mark.skipif(not cpu_matmul.available(), reason="the CPU kernel needs the CPU backend and g++")
run = jax.jit(causal_conv_cpu)


def full(B, T):
    return jnp.full((B,), T, jnp.int32)


def _inputs(B, T, C, Kc, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s) * 2, jnp.float32)  # noqa: E731
    return f(B, C, Kc - 1), f(B, T, C), f(C, Kc)  # prev [B, C, Kc-1], as the conv pools hold them


@needs_kernel
@pytest.mark.parametrize("B,T,C,Kc", [(1, 1, 256, 4), (3, 5, 13, 4), (2, 40, 64, 4), (1, 1, 7, 1), (16, 1, 24, 4),
                                      (2, 3, 20, 2), (1, 2, 9, 9), (1, 70, 260, 4)])
def test_kernel_matches_the_reference(B, T, C, Kc):
    prev, x, w = _inputs(B, T, C, Kc, seed=B * 1000 + T * 10 + C)
    np.testing.assert_allclose(np.asarray(run(prev, x, w)), np.asarray(causal_conv_reference(prev, x, w)),
                               rtol=2e-6, atol=2e-6)


@needs_kernel
def test_large_and_negative_sums_stay_finite():
    prev, x, w = _inputs(2, 6, 17, 4)
    x = x.at[0].multiply(100.0)
    out = np.asarray(run(prev, x, w * 10))
    ref = np.asarray(causal_conv_reference(prev, x, w * 10))
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=1e-5)


@needs_kernel
def test_a_channels_value_does_not_depend_on_its_neighbours_batch_or_step():
    prev, x, w = _inputs(3, 9, 45, 4, seed=7)
    full = np.asarray(run(prev, x, w))
    for lo in (1, 8, 13, 40):  # subsets that shift channels across lanes and into partial groups
        part = np.asarray(run(prev[:, lo:], x[..., lo:], w[lo:]))
        np.testing.assert_array_equal(part, full[..., lo:])
    for b in range(3):  # a row alone
        np.testing.assert_array_equal(np.asarray(run(prev[b : b + 1], x[b : b + 1], w)), full[b : b + 1])
    # token by token, each step's plane the last Kc-1 inputs: what decoding computes
    plane = prev
    for t in range(9):
        one = np.asarray(run(plane, x[:, t : t + 1], w))
        np.testing.assert_array_equal(one, full[:, t : t + 1])
        plane = jnp.concatenate([plane, jnp.swapaxes(x[:, t : t + 1], 1, 2)], axis=2)[..., 1:]


@needs_kernel
def test_padding_tokens_come_out_zero_and_leave_the_others_alone():
    """A row's tokens from n_tokens on are padding (a verify step feeding fewer drafts than its width, a prompt
    chunk shorter than its bucket, a row of a padded batch): 0, in the kernel, the reference and the mixer's conv
    at one token, and the row's real tokens are the bits they are unpadded."""
    prev, x, w = _inputs(3, 8, 20, 4, seed=9)
    n_tokens = jnp.asarray([8, 3, 0], jnp.int32)
    out = np.asarray(run(prev, x, w, n_tokens))
    np.testing.assert_array_equal(out[1, 3:], 0.0)
    np.testing.assert_array_equal(out[2], 0.0)
    np.testing.assert_array_equal(out[1, :3], np.asarray(run(prev[1:2], x[1:2, :3], w))[0])
    np.testing.assert_allclose(out, np.asarray(causal_conv_reference(prev, x, w, n_tokens)), rtol=2e-6, atol=2e-6)
    one = np.asarray(jax.jit(causal_conv)(prev, x[:, :1], w, jnp.asarray([1, 0, 1], jnp.int32)))
    np.testing.assert_array_equal(one[1], 0.0)
    assert np.all(one[0] != 0.0)


@needs_kernel
def test_gradient_is_the_references():
    prev, x, w = _inputs(2, 4, 12, 4, seed=3)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    got = jax.grad(loss(causal_conv_cpu), argnums=(0, 1, 2))(prev, x, w)
    want = jax.grad(loss(causal_conv_reference), argnums=(0, 1, 2))(prev, x, w)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_malformed_shapes_are_refused():
    prev, x, w = _inputs(2, 3, 8, 4)
    with pytest.raises(ValueError, match="prev"):
        causal_conv_cpu(prev[..., :2], x, w)
    with pytest.raises(ValueError, match="disagree"):
        causal_conv_cpu(prev, x, w[:7])
    with pytest.raises(ValueError, match="n_tokens"):
        causal_conv_cpu(prev, x, w, jnp.asarray([3], jnp.int32))
    with pytest.raises(ValueError, match="takes prev"):
        causal_conv_cpu(prev[0], x, w)


@needs_kernel
@pytest.mark.parametrize("B,C", [(1, 256), (3, 40), (16, 24)])
def test_the_mixers_conv_is_the_same_bits_token_by_token_as_in_one_step(B, C):
    """What decoding computes (one token a step: XLA's form at one row, the kernel at more; the plane sliding by one
    input) against verify steps and prompt chunks (several tokens at once: the kernel), for the step lengths the
    model compiles."""
    prev, x, w = _inputs(B, 16, C, 4, seed=11 + B)
    planes = prev
    one_by_one = []
    for t in range(16):
        one_by_one.append(np.asarray(jax.jit(causal_conv)(planes, x[:, t : t + 1], w, full(B, 1))))
        planes = jnp.concatenate([planes, jnp.swapaxes(x[:, t : t + 1], 1, 2)], axis=2)[..., 1:]
    one_by_one = np.concatenate(one_by_one, axis=1)
    np.testing.assert_array_equal(np.asarray(jax.jit(causal_conv_reference)(prev, x[:, :1], w)), one_by_one[:, :1])
    for T in (2, 4, 8, 16):
        steps = []
        planes = prev
        for t in range(0, 16, T):
            steps.append(np.asarray(jax.jit(causal_conv)(planes, x[:, t : t + T], w, full(B, T))))
            planes = jnp.concatenate([prev, jnp.swapaxes(x[:, : t + T], 1, 2)], axis=2)[..., -3:]
        np.testing.assert_array_equal(np.concatenate(steps, axis=1), one_by_one, err_msg=f"steps of {T} tokens")


@needs_kernel
@pytest.mark.parametrize("B", [1, 4, 16, 64])
@pytest.mark.parametrize("C", [256, 6144, 10240])
def test_xlas_one_token_form_sums_as_the_kernel_at_the_runtimes_batch_sizes(B, C):
    """Decoding one row keeps XLA's one-token form (more rows take the kernel), which must sum in the kernel's
    order, so that a row's bits do not depend on its batch; pinned at every batch bucket the runtime compiles
    (powers of 4) and at real models' channel counts (the bundled model's 256, Qwen3.5-0.8B's 6144, a larger
    model's 10240). XLA's dot picks its order by shape: at 2 rows of one token it sums otherwise."""
    prev, x, w = _inputs(B, 1, C, 4, seed=B + C)
    one_token = np.asarray(jax.jit(causal_conv_reference)(prev, x, w, full(B, 1)))
    np.testing.assert_array_equal(one_token, np.asarray(run(prev, x, w)))


def test_dispatch_matches_the_reference_on_any_backend():
    prev, x, w = _inputs(2, 3, 10, 4, seed=5)
    np.testing.assert_allclose(np.asarray(causal_conv(prev, x, w, full(2, 3))),
                               np.asarray(causal_conv_reference(prev, x, w)), rtol=2e-6, atol=2e-6)


@needs_kernel
@pytest.mark.parametrize("B,T,C,Kc", [(4, 1, 256, 4), (3, 5, 13, 4), (2, 3, 20, 2), (16, 1, 24, 4), (1, 2, 9, 5)])
def test_the_planes_kernel_reads_and_writes_states_as_the_reference(B, T, C, Kc):
    """The conv with its state in planes: each row's history read from its plane (one out of range, clamped), the
    sums as `causal_conv_cpu` computes them from that history (the same bits), and the state after each token
    written where write_planes says (-1 and planes past the pool: nowhere), bit for bit the reference's. A row
    writing the plane another row reads still reads it as it was."""
    N = 2 * B * T + 3
    rng = np.random.default_rng(B * 100 + T)
    planes = jnp.asarray(rng.standard_normal((N, C, Kc - 1)), jnp.float32)
    _, x, w = _inputs(B, T, C, Kc, seed=B + C)
    n_tokens = jnp.asarray(rng.integers(0, T + 1, B), jnp.int32).at[0].set(T)
    read_plane = jnp.asarray(rng.integers(0, N, B), jnp.int32).at[-1].set(N + 5)
    write_planes = rng.permutation(N)[: B * T].reshape(B, T).astype(np.int32)
    write_planes[0, -1] = -1
    write_planes[-1, 0] = N + 1
    if B > 1:
        write_planes[1, 0] = int(read_plane[0])  # row 1 writes what row 0 reads
    write_planes = jnp.asarray(write_planes)
    from jaxmodel.kernels.cpu_conv import causal_conv_planes_cpu, causal_conv_planes_reference

    out, written = jax.jit(causal_conv_planes_cpu)(planes, x, w, n_tokens, read_plane, write_planes)
    ref_out, ref_written = causal_conv_planes_reference(planes, x, w, n_tokens, read_plane, write_planes)
    np.testing.assert_array_equal(np.asarray(written), np.asarray(ref_written))
    prev = planes[jnp.clip(read_plane, 0, N - 1)]
    np.testing.assert_array_equal(np.asarray(out), np.asarray(run(prev, x, w, n_tokens)))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=2e-6, atol=2e-6)


@needs_kernel
def test_the_planes_kernels_gradient_is_the_references():
    from jaxmodel.kernels.cpu_conv import causal_conv_planes_cpu, causal_conv_planes_reference

    planes = jnp.asarray(np.random.default_rng(3).standard_normal((5, 12, 3)), jnp.float32)
    _, x, w = _inputs(2, 4, 12, 4, seed=9)
    n, read, write = full(2, 4).at[1].set(3), jnp.asarray([1, 4]), jnp.asarray([[0, -1, 2, -1], [-1, 3, -1, -1]])

    def loss(f):
        def value(planes, x, w):
            out, written = f(planes, x, w, n, read, write)
            return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(written))
        return jax.grad(value, argnums=(0, 1, 2))(planes, x, w)

    for got, want in zip(loss(causal_conv_planes_cpu), loss(causal_conv_planes_reference), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_the_planes_kernel_refuses_malformed_shapes():
    from jaxmodel.kernels.cpu_conv import causal_conv_planes_cpu

    planes, x, w = jnp.zeros((4, 8, 3)), jnp.zeros((2, 1, 8)), jnp.zeros((8, 4))
    with pytest.raises(ValueError, match="disagree"):
        causal_conv_planes_cpu(planes[:, :, :2], x, w, full(2, 1), jnp.zeros(2, jnp.int32), jnp.zeros((2, 1), jnp.int32))
    with pytest.raises(ValueError, match="are not"):
        causal_conv_planes_cpu(planes, x, w, full(2, 1), jnp.zeros(3, jnp.int32), jnp.zeros((2, 1), jnp.int32))
