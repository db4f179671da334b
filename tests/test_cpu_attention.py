"""The CPU attention kernel against the full-table reference: shapes, padding, the pages it reads, a query's
independence of its step's length, its gradient, its errors, and `attend`'s choice of it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmodel import attention
from jaxmodel.attention import (CPU_KERNEL_MAX_SCORE_BYTES, CPU_KERNEL_TILE, choose_implementation,
                                kernel_score_bytes)
from jaxmodel.kernels import cpu_matmul
from jaxmodel.kernels.cpu_attention import paged_attention_cpu
from jaxmodel.kernels.paged_attention import paged_attention_reference
from test_paged_attention import CASES, check_valid_tokens, poison_unread, random_case

needs_kernel = pytest.mark.skipif(not cpu_matmul.available(), reason="the CPU kernel needs the CPU backend and g++")
run = jax.jit(paged_attention_cpu)


@needs_kernel
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_matches_reference(name):
    starts, n_tokens, T, P, H, Hkv, D = CASES[name]
    case = random_case(len(name), starts=starts, n_tokens=n_tokens, T=T, P=P, H=H, Hkv=Hkv, D=D)
    out = np.asarray(run(*case.args))
    check_valid_tokens(out, case)
    np.testing.assert_array_equal(out[~case.valid], 0.0)


@needs_kernel
@pytest.mark.parametrize("H,Hkv,D", [(6, 3, 20), (8, 2, 256), (2, 1, 7)])
def test_kernel_matches_reference_at_other_head_shapes(H, Hkv, D):
    """Three query heads per KV head, the 0.8B's heads, a head size that is not a whole number of vector lanes."""
    case = random_case(3, starts=[0, 33, 70], n_tokens=[1, 4, 3], T=4, P=8, H=H, Hkv=Hkv, D=D)
    check_valid_tokens(run(*case.args), case)


@needs_kernel
def test_kernel_matches_reference_at_a_long_context():
    """The 0.8B's heads over about 700 positions, where a row's keys and values pass 1 MB and its queries walk them
    in tiles of 16 (two full tiles and a part here), beside a row of one live token and a short one."""
    case = random_case(6, starts=[700, 520, 30], n_tokens=[9, 1, 3], T=9, P=48, H=8, Hkv=2, D=256)
    out = np.asarray(run(*case.args))
    check_valid_tokens(out, case)
    np.testing.assert_array_equal(out[~case.valid], 0.0)


@needs_kernel
@pytest.mark.parametrize("H,Hkv,D,start", [(8, 2, 256, 40), (8, 2, 256, 1100), (6, 3, 20, 40)])
def test_float16_pages_compute_what_float32_pages_of_their_values_do(H, Hkv, D, start):
    """Each float16 key and value is widened exactly as it is read, so a float16 cache gives the bits a float32 cache
    holding the same values gives (the two walk the keys in different tiles at 1100 positions: float16's 1 MB
    comes later), and matches the reference; a head size that is not whole vectors takes the scalar path, whose
    tail lanes here hold float16 subnormals and zeros."""
    case = random_case(13, starts=[start, 9], n_tokens=[8, 3], T=8, P=72, H=H, Hkv=Hkv, D=D)
    if D % 8:
        case.k_pages[..., -3:] *= 1e-6
        case.v_pages[..., -3:-1] *= 1e-6
        case.v_pages[..., -1] = 0.0
    k16, v16 = case.k_pages.astype(np.float16), case.v_pages.astype(np.float16)
    if D % 8:
        assert (np.abs(k16[..., -3:]) < np.finfo(np.float16).smallest_normal).mean() > 0.9
    half = np.asarray(run(case.q, k16, v16, case.page_table, case.positions, case.valid))
    widened = np.asarray(run(case.q, k16.astype(np.float32), v16.astype(np.float32), case.page_table,
                             case.positions, case.valid))  # fmt: skip
    np.testing.assert_array_equal(half, widened)
    reference = np.asarray(paged_attention_reference(case.q, k16, v16, case.page_table, case.positions))
    np.testing.assert_allclose(half[case.valid], reference[case.valid], atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(half[~case.valid], 0.0)


@needs_kernel
def test_kernel_reads_only_each_rows_own_live_pages():
    """NaN in every page past each row's last live page (a longer row's range and stale table entries included)."""
    case = random_case(8, starts=[95, 20, 0], n_tokens=[1, 2, 0], T=2, P=32)
    poisoned = poison_unread(case, 1, per_row=True)
    check_valid_tokens(run(*poisoned.args), case)


@needs_kernel
@pytest.mark.parametrize("H,Hkv,D,start", [(4, 2, 32, 40), (8, 2, 256, 40), (8, 2, 256, 700)])
def test_a_query_is_the_same_bits_in_a_step_of_any_length(H, Hkv, D, start):
    """Token t's output when its step feeds it alone equals its output inside a step of 8 tokens, bit for bit, and
    does not depend on the other rows: what makes a verify step reproduce decoding steps (at 700 positions the
    step's 32 queries per KV head walk the keys in two tiles of 16, a token alone in a tile of 4)."""
    case = random_case(11, starts=[start, 9], n_tokens=[8, 8], T=8, P=48, H=H, Hkv=Hkv, D=D)
    whole = np.asarray(run(*case.args))  # [B, T, H, D]
    for t in range(8):
        alone = np.asarray(run(case.q[:, t : t + 1], case.k_pages, case.v_pages, case.page_table,
                               case.positions[:, t : t + 1], case.valid[:, t : t + 1]))  # fmt: skip
        np.testing.assert_array_equal(alone[:, 0], whole[:, t])
    first_row = np.asarray(run(case.q[:1], case.k_pages, case.v_pages, case.page_table[:1], case.positions[:1],
                               case.valid[:1]))  # fmt: skip
    np.testing.assert_array_equal(first_row[0], whole[0])


@needs_kernel
def test_kernel_refuses_positions_past_the_table_and_pages_outside_the_pool():
    case = random_case(5, starts=[20], n_tokens=[1], T=1, P=4)
    past = case.positions.copy()
    past[0, 0] = 4 * 16  # the table covers positions < 64
    with pytest.raises(Exception, match="a position is past the page table"):
        np.asarray(run(case.q, case.k_pages, case.v_pages, case.page_table, past, case.valid))
    table = case.page_table.copy()
    table[0, 1] = len(case.k_pages)  # position 20 lives on page 1
    with pytest.raises(Exception, match="a live page-table entry is outside the pool"):
        np.asarray(run(case.q, case.k_pages, case.v_pages, table, case.positions, case.valid))
    with pytest.raises(ValueError, match="float32 or float16 pages"):
        paged_attention_cpu(case.q, case.k_pages.astype(np.float16), case.v_pages, case.page_table, case.positions,
                            case.valid)
    with pytest.raises(ValueError, match="float32 or float16 pages"):
        paged_attention_cpu(case.q, case.k_pages.astype(jnp.bfloat16), case.v_pages.astype(jnp.bfloat16),
                            case.page_table, case.positions, case.valid)


@needs_kernel
def test_attend_takes_the_kernel_for_every_step_on_cpu_whose_scores_fit():
    """Decode, verify and prefill steps alike (so a decoding row batched with a prompt chunk computes what it would
    alone), except where the score buffer (a tile of 16 queries by the table's keys) would pass the bound: a page
    table of about a million positions."""
    wide = 4 * attention.PAGES_PER_BLOCK
    assert choose_implementation("cpu", 1, wide, cpu_kernel=True) == "cpu"
    chunk = kernel_score_bytes((1, 128, 8, 256), (9, 16, 2, 256), wide)  # 128 tokens, the 0.8B's heads
    assert choose_implementation("cpu", 128, wide, True, chunk) == "cpu"
    too_wide = CPU_KERNEL_MAX_SCORE_BYTES // (CPU_KERNEL_TILE * 16 * 4) + 1  # pages: a tile of 16 queries
    assert kernel_score_bytes((1, 128, 8, 256), (9, 16, 2, 256), too_wide) > CPU_KERNEL_MAX_SCORE_BYTES
    assert choose_implementation("cpu", 128, too_wide, True,
                                 kernel_score_bytes((1, 128, 8, 256), (9, 16, 2, 256), too_wide)) == "blocked"
    assert choose_implementation("cpu", 128, wide, cpu_kernel=False) == "blocked"
    assert choose_implementation("gpu", 1, wide, cpu_kernel=True) == "pallas"
    case = random_case(12, starts=[30, 0], n_tokens=[2, 0], T=2, P=8)
    traced = jax.jit(attention.attend).trace(*map(jnp.asarray, case.args)).lower().as_text()
    assert cpu_matmul.TARGET_ATTENTION in traced
    np.testing.assert_allclose(np.asarray(attention.attend(*case.args))[case.valid],
                               np.asarray(paged_attention_reference(*case.args[:5]))[case.valid], atol=1e-5, rtol=1e-5)


@needs_kernel
def test_gradient_is_the_references():
    """Training differentiates through the kernel: its VJP is the reference form's; padding tokens pass none back."""
    case = random_case(4, starts=[20, 3], n_tokens=[5, 2], T=5, P=4)
    weights = jnp.asarray(np.random.default_rng(1).standard_normal(case.q.shape, np.float32))
    valid = jnp.asarray(case.valid)[:, :, None, None]

    def loss(attend_fn):
        def f(q, k_pages, v_pages):
            out = attend_fn(q, k_pages, v_pages, case.page_table, case.positions)
            return jnp.sum(jnp.where(valid, out, 0.0) * weights)
        return jax.grad(f, argnums=(0, 1, 2))(*map(jnp.asarray, (case.q, case.k_pages, case.v_pages)))

    got = loss(lambda q, k, v, table, pos: paged_attention_cpu(q, k, v, table, pos, case.valid))
    want = loss(paged_attention_reference)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
