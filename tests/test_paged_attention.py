"""Attention over the paged KV cache: the jnp block loop and the Pallas kernel (compiled on a GPU, interpreted
elsewhere) against the full-table reference, the loop bound, the dispatch, and the kernel's lowering to Triton."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import INTERPRET
from jaxmodel import attention
from jaxmodel.attention import attend, attention_blocked, choose_implementation
from jaxmodel.kernels import cpu_matmul
from jaxmodel.kernels.paged_attention import live_pages, paged_attention_kernel, paged_attention_reference
from jaxmodel.layers import paged_attention

PAGE = 16
TOL = 1e-5


@dataclass(frozen=True)
class Case:
    """One attention call, as numpy arrays."""

    q: np.ndarray  # [B, T, H, D]
    k_pages: np.ndarray  # [N, S, Hkv, D]
    v_pages: np.ndarray  # [N, S, Hkv, D]
    page_table: np.ndarray  # [B, P]
    positions: np.ndarray  # [B, T]
    valid: np.ndarray  # [B, T]

    @property
    def args(self) -> tuple:
        return (self.q, self.k_pages, self.v_pages, self.page_table, self.positions, self.valid)


def random_case(seed: int, *, starts, n_tokens, T: int, P: int, H: int = 4, Hkv: int = 2, D: int = 32,
                n_spare: int = 0) -> Case:
    """Row b feeds n_tokens[b] tokens at positions starts[b].. on its own shuffled pages; rows with
    n_tokens = 0 are padding rows, given a far position to check that it does not extend any loop.
    Table column p past a row's pages names stale page p (as a reused page table could): distinct per
    column, so that reading past a bound shows (see `poison_unread`). n_spare pages more sit unreferenced."""
    rng = np.random.default_rng(seed)
    B = len(starts)
    needs = [-(-(s + n) // PAGE) if n else 0 for s, n in zip(starts, n_tokens)]
    n_pool = 1 + sum(needs) + P + n_spare
    order = rng.permutation(np.arange(1, n_pool))
    table = np.tile(order[sum(needs) : sum(needs) + P], (B, 1)).astype(np.int32)  # [B, P] stale pages
    for b, need in enumerate(needs):
        table[b, :need] = order[sum(needs[:b]) : sum(needs[: b + 1])]
    positions = np.full((B, T), 10 * P * PAGE, np.int32)
    valid = np.zeros((B, T), bool)
    for b, (s, n) in enumerate(zip(starts, n_tokens)):
        positions[b, :n] = np.arange(s, s + n)
        valid[b, :n] = True
    pool = (n_pool, PAGE, Hkv, D)
    return Case(q=rng.normal(size=(B, T, H, D)).astype(np.float32),
                k_pages=rng.normal(size=pool).astype(np.float32), v_pages=rng.normal(size=pool).astype(np.float32),
                page_table=table, positions=positions, valid=valid)  # fmt: skip


def poison_unread(case: Case, pages_per_block: int, *, per_row: bool) -> Case:
    """NaN in every pool page that no loop may read: those past the last block of live pages, counted per
    row (the kernel) or over the batch's longest valid row (the jnp loop). A page read with NaN in it poisons
    the output even where masked (0 * nan)."""
    live = np.asarray(live_pages(case.positions, case.valid, PAGE))
    live = live if per_row else np.full_like(live, live.max())
    read = -(-live // pages_per_block) * pages_per_block
    keep = np.unique(np.concatenate([row[:n] for row, n in zip(case.page_table, read)]))
    k_pages, v_pages = case.k_pages.copy(), case.v_pages.copy()
    poisoned = np.setdiff1d(np.arange(len(k_pages)), keep)
    assert len(poisoned), "nothing to poison: the case reads every page"
    k_pages[poisoned] = np.nan
    v_pages[poisoned] = np.nan
    return Case(case.q, k_pages, v_pages, case.page_table, case.positions, case.valid)


def check_valid_tokens(out, case: Case, tol: float = TOL):
    ref = np.asarray(paged_attention_reference(*case.args[:5]))
    out = np.asarray(out)
    assert out.shape == ref.shape
    np.testing.assert_allclose(out[case.valid], ref[case.valid], atol=tol, rtol=tol)
    assert np.isfinite(out).all()


CASES = {
    # name: (starts, n_tokens, T, P, H, Hkv, D)
    "decode": ([100, 37, 5, 250], [1, 1, 1, 1], 1, 32, 4, 2, 32),
    "decode-padding-rows": ([100, 0, 63, 0], [1, 0, 1, 0], 1, 16, 4, 2, 32),
    "verify-ragged": ([90, 17, 0, 130], [4, 1, 0, 3], 4, 16, 4, 2, 32),
    "verify-16": ([200, 3], [16, 9], 16, 32, 8, 2, 64),
    "prefill": ([0, 40, 0], [33, 20, 0], 33, 8, 4, 2, 32),
    "mha": ([15, 16, 47], [2, 1, 2], 2, 8, 2, 2, 16),
    "wide-table": ([100, 70, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0], 1, 512, 4, 2, 32),
    "all-padding": ([0, 0], [0, 0], 1, 4, 4, 2, 32),
}


@pytest.mark.parametrize("pages_per_block", [1, 2, 8])
@pytest.mark.parametrize("name", sorted(CASES))
def test_blocked_matches_reference(name, pages_per_block):
    starts, n_tokens, T, P, H, Hkv, D = CASES[name]
    case = random_case(len(name), starts=starts, n_tokens=n_tokens, T=T, P=P, H=H, Hkv=Hkv, D=D)
    run = jax.jit(attention_blocked, static_argnames="pages_per_block")
    check_valid_tokens(run(*case.args, pages_per_block=pages_per_block), case)


@pytest.mark.parametrize("name", ["decode", "verify-ragged", "wide-table", "decode-padding-rows"])
def test_blocked_reads_only_pages_up_to_the_last_live_one(name):
    """Pages past the longest valid row's last block hold NaN (padding rows sit at far positions): untouched."""
    starts, n_tokens, T, P, H, Hkv, D = CASES[name]
    case = random_case(7, starts=starts, n_tokens=n_tokens, T=T, P=P, H=H, Hkv=Hkv, D=D)
    poisoned = poison_unread(case, 2, per_row=False)
    assert np.isnan(paged_attention_reference(*poisoned.args[:5])).any()  # reading them would show
    run = jax.jit(attention_blocked, static_argnames="pages_per_block")
    check_valid_tokens(run(*poisoned.args, pages_per_block=2), case)


def test_blocked_compiles_once_for_any_context():
    """The bound is a value, not a shape: one compiled function serves short and long contexts alike."""
    traces = []
    run = jax.jit(lambda *args: (traces.append(1), attention_blocked(*args))[1])
    for seed, start in enumerate([3, 100, 400]):
        needs = start // PAGE + 1
        case = random_case(seed, starts=[start, 0], n_tokens=[1, 0], T=1, P=32, n_spare=40 - needs)
        check_valid_tokens(run(*case.args), case)
    assert len(traces) == 1


KERNEL_CASES = ["decode", "decode-padding-rows", "verify-ragged", "verify-16", "mha", "all-padding"]


@pytest.mark.parametrize("pages_per_block", [1, 4])
@pytest.mark.parametrize("name", KERNEL_CASES)
def test_kernel_matches_reference(name, pages_per_block):
    starts, n_tokens, T, P, H, Hkv, D = CASES[name]
    case = random_case(len(name), starts=starts, n_tokens=n_tokens, T=T, P=P, H=H, Hkv=Hkv, D=D)
    out = np.asarray(paged_attention_kernel(*case.args, pages_per_block=pages_per_block, interpret=INTERPRET))
    check_valid_tokens(out, case)
    np.testing.assert_array_equal(out[~case.valid], 0.0)


def test_kernel_reads_only_each_rows_own_live_pages():
    """Each row stops at its own last block: NaN in every page past it (a longer row's range included)."""
    case = random_case(8, starts=[95, 20, 0], n_tokens=[1, 2, 0], T=2, P=32)
    poisoned = poison_unread(case, 2, per_row=True)
    assert np.isnan(attention_blocked(*poisoned.args, pages_per_block=2)[1]).any()  # the batch-wide bound reads them
    out = np.asarray(paged_attention_kernel(*poisoned.args, pages_per_block=2, interpret=INTERPRET))
    check_valid_tokens(out, case)


def _kernel_shapes(B, T, H, Hkv, D, n_pool, P):
    spec = jax.ShapeDtypeStruct
    pool = spec((n_pool, PAGE, Hkv, D), jnp.float32)
    return (spec((B, T, H, D), jnp.float32), pool, pool, spec((B, P), jnp.int32), spec((B, T), jnp.int32),
            spec((B, T), jnp.bool_))


@pytest.mark.parametrize("shape", [(16, 1, 8, 2, 256, 300, 512), (4, 16, 8, 2, 256, 300, 32),
                                   (16, 4, 4, 2, 32, 113, 128)])
def test_kernel_lowers_to_triton(shape):
    """Lowering for CUDA runs the Pallas Triton lowering (no GPU needed): every op must have a Triton rule.
    Shapes: Qwen3.5-0.8B decode at max_model_len 8192, its verify of 16 tokens, the bundled model's."""
    lowered = paged_attention_kernel.trace(*_kernel_shapes(*shape)).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()


def test_choose_implementation():
    wide = 4 * attention.PAGES_PER_BLOCK
    assert choose_implementation("cpu", 1, wide) == "blocked"
    assert choose_implementation("cpu", 128, wide) == "blocked"
    assert choose_implementation("gpu", 1, wide) == "pallas"
    assert choose_implementation("gpu", attention.GPU_KERNEL_MAX_TOKENS, wide) == "pallas"
    assert choose_implementation("gpu", 128, wide) == "blocked"
    assert choose_implementation("cpu", 1, attention.PAGES_PER_BLOCK) == "reference"  # one block: nothing to skip


@pytest.mark.parametrize("impl", attention.IMPLEMENTATIONS)
def test_attend_runs_every_implementation(impl):
    if impl == "cpu" and not (jax.default_backend() == "cpu" and cpu_matmul.available()):
        pytest.skip("the CPU kernel needs the CPU backend and g++")
    case = random_case(9, starts=[30, 0], n_tokens=[2, 0], T=2, P=8)
    check_valid_tokens(attend(*map(jnp.asarray, case.args), impl=impl), case)


@pytest.mark.parametrize("impl", attention.IMPLEMENTATIONS)
def test_every_implementation_reads_float16_pages(impl):
    """A float16 KV cache (`--kv-dtype float16`): each form widens the pages as it reads them and matches the
    reference over the same float16 values (the Pallas kernel interpreted off a GPU)."""
    if impl == "cpu" and not (jax.default_backend() == "cpu" and cpu_matmul.available()):
        pytest.skip("the CPU kernel needs the CPU backend and g++")
    case = random_case(10, starts=[30, 0, 70], n_tokens=[2, 0, 3], T=3, P=16)
    k16, v16 = jnp.asarray(case.k_pages, jnp.float16), jnp.asarray(case.v_pages, jnp.float16)
    args = (jnp.asarray(case.q), k16, v16, *map(jnp.asarray, case.args[3:]))
    out = np.asarray(attend(*args, impl=impl))
    want = np.asarray(paged_attention_reference(*args[:5]))
    np.testing.assert_allclose(out[case.valid], want[case.valid], atol=1e-5, rtol=1e-5)


def test_attend_rejects_unknown_implementations():
    case = random_case(9, starts=[30], n_tokens=[1], T=1, P=4)
    with pytest.raises(ValueError, match="unknown implementation"):
        attend(*case.args, impl="nope")


def test_layer_matches_the_full_table_form(tiny_model, monkeypatch):
    """`layers.paged_attention` (projections, K/V write, attention, gate) as with the full-table attention."""
    cfg = tiny_model.cfg
    layer = tiny_model.weights.layers[cfg.attn_layers[0]].mixer
    rng = np.random.default_rng(10)
    B, T, P, n_pool = 3, 4, 16, 12
    x = jnp.asarray(rng.normal(size=(B, T, cfg.n_embd)), jnp.float32)
    positions = jnp.asarray([[40, 41, 42, 43], [5, 6, 0, 0], [0, 0, 0, 0]], jnp.int32)
    valid = jnp.asarray([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], bool)
    table = np.zeros((B, P), np.int32)
    table[0, :3], table[1, :1] = [4, 9, 2], [7]
    pool = (n_pool, PAGE, cfg.n_head_kv, cfg.head_dim)
    k_pages, v_pages = (jnp.asarray(rng.normal(size=pool), jnp.float32) for _ in range(2))
    step = lambda: jax.jit(lambda *a: paged_attention(layer, cfg, *a))(x, positions, valid, jnp.asarray(table),
                                                                       k_pages, v_pages)  # fmt: skip
    y, k_new, v_new = step()
    monkeypatch.setattr(attention, "FORCE_IMPL", "reference")
    y_ref, k_ref, v_ref = step()
    np.testing.assert_allclose(np.asarray(y)[np.asarray(valid)], np.asarray(y_ref)[np.asarray(valid)], atol=TOL,
                               rtol=TOL)  # fmt: skip
    # Page 0 is the trash page: which padding token's K/V lands there last is unspecified (GPU scatters differ).
    np.testing.assert_array_equal(np.asarray(k_new)[1:], np.asarray(k_ref)[1:])
    np.testing.assert_array_equal(np.asarray(v_new)[1:], np.asarray(v_ref)[1:])
