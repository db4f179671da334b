"""Pallas kernel: a few rows times a matrix, x [M, K] @ w [K, N] -> [M, N] float32, for decode steps on a GPU.

XLA's GPU compiler rewrites a product of one row by a matrix of fewer than 10 M elements (every layer's weight of
the 0.8B shape) into a multiply and a reduce, which read the weights at 0.6-1.4 TB/s of the H200's 4.8, and for
the FFN's down and the GDN's out projections first write the float32 products and then reduce them; those kernels
were two thirds of a batch-1 decode step's device time (docs/performance.md, "On a GPU"). Here each program reads
its tile of the weight once and keeps the sums in registers.

Grid (N / block_n, S): program (j, s) takes the weight's columns j block_n ... (j + 1) block_n and its rows
s K/S ... (s + 1) K/S, walks them block_k rows at a time (x's matching columns times the tile, in float32), and
writes its partial sums [Mp, block_n] to partial[s]; XLA adds the S partial sums after. S splits K so that about
`target_programs` programs run (a one-row product of [1024, 1024] has only 1024 / block_n column blocks, too few to
keep a GPU's memory busy). x's rows are padded to a power of two, M <= MAX_ROWS.

Written for the Triton backend of Pallas; runs under `interpret=True` on CPU. `row_product_reference` below is its
specification (tests/test_row_product.py holds the kernel to it). Block sizes are chosen by `plan`, not tuned on a
GPU yet.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MAX_ROWS = 8  # decode and short verify steps; longer steps are XLA's matrix products
MAX_BLOCK_N = 128
MAX_BLOCK_K = 128
TARGET_PROGRAMS = 512  # about four per SM of an H100 / H200 (132)
# XLA's GPU compiler keeps a one-row product with a matrix of this many elements or more a matrix product (a GEMM,
# which read the 0.8B shape's LM head at 2.8 TB/s on the H200), so `layers.linear` leaves those to it.
XLA_GEMM_MIN_ELEMENTS = 10_000_000


def row_product_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] @ w [K, N] -> [M, N] float32, both read as float32 (exact products, float32 sums)."""
    return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32)


def _largest_power_of_two_dividing(n: int, cap: int) -> int:
    p = 1
    while p * 2 <= cap and n % (p * 2) == 0:
        p *= 2
    return p


@dataclass(frozen=True)
class Plan:
    """How `row_product` splits a [K, N] weight: column blocks of block_n, K in `splits` runs of `run` rows (a power
    of two), each walked block_k rows at a time."""

    block_n: int
    block_k: int
    splits: int

    def run(self, k: int) -> int:
        return k // self.splits


def plan(k: int, n: int, target_programs: int = TARGET_PROGRAMS) -> Plan | None:
    """The split of a [k, n] weight, or None where the kernel does not take it (no power-of-two column block of 16
    or more divides n, or no power-of-two run of 16 or more rows divides k)."""
    block_n = _largest_power_of_two_dividing(n, MAX_BLOCK_N)
    longest_run = _largest_power_of_two_dividing(k, k)
    if block_n < 16 or longest_run < 16:
        return None
    run = longest_run
    while run > 16 and (n // block_n) * (k // run) < target_programs:
        run //= 2
    return Plan(block_n, min(MAX_BLOCK_K, run), k // run)


def _row_product_kernel(x_ref, w_ref, partial_ref, *, block_k: int):
    """x_ref [Mp, run], w_ref [run, block_n] -> partial_ref [1, Mp, block_n] (float32 sums over the run). Each
    weight tile is loaded once and multiplied into every row in turn ([block_k, block_n] live at a time)."""
    n_rows, run = x_ref.shape
    block_n = w_ref.shape[1]

    def tile(i, sums):
        start = pl.multiple_of(i * block_k, block_k)
        w = w_ref[pl.ds(start, block_k), :].astype(jnp.float32)  # [block_k, block_n]
        return tuple(acc + jnp.sum(x_ref[r, pl.ds(start, block_k)].astype(jnp.float32)[:, None] * w, axis=0)
                     for r, acc in enumerate(sums))

    zeros = tuple(jnp.zeros((block_n,), jnp.float32) for _ in range(n_rows))
    sums = jax.lax.fori_loop(0, run // block_k, tile, zeros)
    for r, acc in enumerate(sums):
        partial_ref[0, r, :] = acc


@functools.partial(jax.jit, static_argnames=("target_programs", "num_warps", "num_stages", "interpret"))
def row_product(x: jax.Array, w: jax.Array, *, target_programs: int = TARGET_PROGRAMS, num_warps: int | None = None,
                num_stages: int = 2, interpret: bool = False) -> jax.Array:
    """x [M, K] @ w [K, N] -> [M, N] float32, M <= MAX_ROWS, w's shape one `plan` takes (ValueError otherwise).

    x:  [M, K]  any float dtype; read as float32 (round it to w's dtype first for that dtype's products)
    w:  [K, N]  bf16, f16 or float32
    """
    m, k = x.shape
    n = w.shape[1]
    layout = plan(k, n, target_programs)
    if layout is None or m > MAX_ROWS or w.shape[0] != k:
        raise ValueError(f"row_product: x {x.shape} @ w {w.shape} is not a shape it takes")
    padded = 1 << max(m - 1, 0).bit_length()
    x = jnp.pad(x, ((0, padded - m), (0, 0)))
    run = layout.run(k)
    partial = pl.pallas_call(
        functools.partial(_row_product_kernel, block_k=layout.block_k),
        grid=(n // layout.block_n, layout.splits),
        in_specs=[pl.BlockSpec((padded, run), lambda j, s: (0, s)),
                  pl.BlockSpec((run, layout.block_n), lambda j, s: (s, j))],
        out_specs=pl.BlockSpec((1, padded, layout.block_n), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((layout.splits, padded, n), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="row_product",
    )(x, w)
    return jnp.sum(partial, axis=0)[:m]
