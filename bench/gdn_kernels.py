"""Speed of the gated-delta-rule implementations at Qwen3-Next-80B's GDN shapes (Hk=16, Hv=32, Dk=Dv=128).

    python -m bench.gdn_kernels bench/out/gdn-kernels-gpu.json            # on a GPU
    python -m bench.gdn_kernels bench/out/gdn-kernels-small.json --small  # anywhere: tiny shapes, a smoke run

Three sections, each a list of JSON rows:
- decode: the verify/decode step (T = 1, 4, 8 tokens per row, snapshot mode: the state after every token is
  written to its own plane) at batch 1, 8, 32. Achieved bandwidth counts the state bytes the step must move:
  each row's input plane read once and T planes written (float32), and its share of a plain copy's bandwidth
  (`bench.copy_bandwidth`, measured first on the same device).
- prefill: one prefill chunk per row (T = 1024, 4096; final_only: the final state written to one plane).
  Reports tokens/s over all rows.
- tune: the recurrent kernel's block_v (Dv columns per program) and num_warps at batch 1 and 32.
- crossover: recurrent against chunked implementations on final_only calls of 16..512 tokens at batch 1 and 8,
  to place `jaxmodel.delta_rule.GPU_CHUNKED_MIN_TOKENS`.
Times are medians over repeats of warm (compiled) calls; decode steps run `--inner` times inside one jitted
loop so that dispatch overhead is not counted. Off GPU the Pallas kernels run interpreted, so their times
there only show that the script works.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import jax
import jax.numpy as jnp

from bench import copy_bandwidth, median_seconds
from jaxmodel.delta_rule import gated_delta_rule
from jaxmodel.kernels.gdn_recurrent import gdn_recurrent


@dataclass(frozen=True)
class Shapes:
    """GDN head layout of one model."""

    n_key_heads: int
    n_value_heads: int
    dk: int
    dv: int

    @property
    def state_bytes(self) -> int:
        """Bytes of one row's float32 state (one plane of one layer)."""
        return self.n_value_heads * self.dk * self.dv * 4


QWEN3_NEXT_80B = Shapes(n_key_heads=16, n_value_heads=32, dk=128, dv=128)
TINY = Shapes(n_key_heads=2, n_value_heads=4, dk=16, dv=16)


@dataclass(frozen=True)
class Plan:
    """What to measure."""

    shapes: Shapes
    batches: tuple[int, ...]
    decode_tokens: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    crossover_tokens: tuple[int, ...]
    crossover_batches: tuple[int, ...]
    decode_impls: tuple[str, ...]
    prefill_impls: tuple[str, ...]
    crossover_impls: tuple[str, ...]
    tune_batches: tuple[int, ...]
    tune_tokens: tuple[int, ...]
    tune_block_v: tuple[int, ...]
    tune_warps: tuple[int, ...]
    dtype: str
    repeats: int
    inner: int


def make_inputs(key, shapes: Shapes, n_rows: int, n_tokens: int, final_only: bool, dtype):
    """Random `gated_delta_rule` arguments built on device.

    Each row reads a plane of its own and writes the planes after it: one per token (snapshot), or with
    final_only one plane after the last token. Plane 0 is the null plane.
    returns (q, k, v, g, beta, ssm_pool, read_plane, write_planes).
    """
    kq, kk, kv, kg, kb, ks = jax.random.split(key, 6)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(jax.random.normal(kq, (n_rows, n_tokens, shapes.n_key_heads, shapes.dk))).astype(dtype)
    k = unit(jax.random.normal(kk, (n_rows, n_tokens, shapes.n_key_heads, shapes.dk))).astype(dtype)
    v = jax.random.normal(kv, (n_rows, n_tokens, shapes.n_value_heads, shapes.dv)).astype(dtype)
    g = -jax.random.exponential(kg, (n_rows, n_tokens, shapes.n_value_heads)) * 0.5
    beta = jax.random.uniform(kb, (n_rows, n_tokens, shapes.n_value_heads))
    if final_only:
        read_plane = 1 + 2 * jnp.arange(n_rows, dtype=jnp.int32)
        write_planes = jnp.full((n_rows, n_tokens), -1, jnp.int32).at[:, -1].set(read_plane + 1)
        n_planes = 1 + 2 * n_rows
    else:
        read_plane = 1 + (n_tokens + 1) * jnp.arange(n_rows, dtype=jnp.int32)
        write_planes = read_plane[:, None] + 1 + jnp.arange(n_tokens, dtype=jnp.int32)[None, :]
        n_planes = 1 + (n_tokens + 1) * n_rows
    pool = 0.1 * jax.random.normal(ks, (n_planes, shapes.n_value_heads, shapes.dk, shapes.dv), jnp.float32)
    return q, k, v, g, beta, pool.at[0].set(0.0), read_plane, write_planes


def time_steps(args, impl: str, final_only: bool, repeats: int, inner: int, rule=None) -> float:
    """Seconds per call of `gated_delta_rule` (or `rule`, same arguments), `inner` calls chained through the
    pool inside one jit."""
    q, k, v, g, beta, pool, read_plane, write_planes = args
    rule = rule or functools.partial(gated_delta_rule, final_only=final_only, impl=impl)

    @functools.partial(jax.jit, donate_argnums=0)
    def loop(pool):
        def body(_, carry):
            pool, checksum = carry
            out, pool = rule(q, k, v, g, beta, pool, read_plane, write_planes)
            return pool, checksum + jnp.sum(out)

        return jax.lax.fori_loop(0, inner, body, (pool, jnp.float32(0)))

    state = {"pool": jnp.copy(pool)}  # the loop donates it

    def run():
        state["pool"], checksum = loop(state["pool"])
        checksum.block_until_ready()

    return median_seconds(run, repeats) / inner


def snapshot_cases(plan: Plan, key, batches, tokens):
    """(batch, T, inputs, state bytes moved) of snapshot steps (every token's state written), one case at a time:
    a caller that drops `inputs` before asking for the next case keeps one case's inputs alive, not two."""
    for n_rows in batches:
        for n_tokens in tokens:
            args = make_inputs(key, plan.shapes, n_rows, n_tokens, False, plan.dtype)
            yield n_rows, n_tokens, args, n_rows * (1 + n_tokens) * plan.shapes.state_bytes
            del args


def bench_decode(plan: Plan, key, copy_bytes_per_s: float) -> list[dict]:
    """Verify/decode steps: time, state bytes moved, achieved bandwidth and its share of a plain copy's, per
    (impl, batch, T)."""
    rows = []
    for n_rows, n_tokens, args, state_bytes in snapshot_cases(plan, key, plan.batches, plan.decode_tokens):
        for impl in plan.decode_impls:
            seconds = time_steps(args, impl, False, plan.repeats, plan.inner)
            share = state_bytes / seconds / copy_bytes_per_s
            rows.append(dict(impl=impl, batch=n_rows, tokens=n_tokens, seconds=seconds, state_bytes=state_bytes,
                             state_gb_per_s=state_bytes / seconds / 1e9, share_of_copy=share))
            print(f"decode  {impl:17s} B={n_rows:3d} T={n_tokens:2d}  {seconds * 1e6:9.1f} us  "
                  f"{state_bytes / seconds / 1e9:8.1f} GB/s  {share:6.1%} of copy", flush=True)
        del args
    return rows


def bench_tune(plan: Plan, key, copy_bytes_per_s: float) -> list[dict]:
    """The recurrent kernel's launch parameters (Dv columns per program, warps per program) on snapshot steps."""
    rows = []
    for n_rows, n_tokens, args, state_bytes in snapshot_cases(plan, key, plan.tune_batches, plan.tune_tokens):
        for block_v, num_warps in itertools.product(plan.tune_block_v, plan.tune_warps):
            rule = functools.partial(gdn_recurrent, block_v=block_v, num_warps=num_warps,
                                     interpret=jax.default_backend() != "gpu")
            seconds = time_steps(args, "pallas_recurrent", False, plan.repeats, plan.inner, rule=rule)
            share = state_bytes / seconds / copy_bytes_per_s
            rows.append(dict(batch=n_rows, tokens=n_tokens, block_v=block_v, num_warps=num_warps,
                             seconds=seconds, share_of_copy=share))
            print(f"tune    B={n_rows:3d} T={n_tokens:2d} block_v={block_v:3d} warps={num_warps}  "
                  f"{seconds * 1e6:9.1f} us  {share:6.1%} of copy", flush=True)
        del args
    return rows


def bench_prefill(plan: Plan, key, batches, tokens, impls, section: str) -> list[dict]:
    """final_only prefill chunks: time and tokens/s per (impl, batch, T)."""
    rows = []
    for n_rows in batches:
        for n_tokens in tokens:
            args = make_inputs(key, plan.shapes, n_rows, n_tokens, True, plan.dtype)
            for impl in impls:
                seconds = time_steps(args, impl, True, plan.repeats, 1)
                rows.append(dict(impl=impl, batch=n_rows, tokens=n_tokens, seconds=seconds,
                                 tokens_per_s=n_rows * n_tokens / seconds))
                print(f"{section:9s} {impl:17s} B={n_rows:3d} T={n_tokens:5d}  {seconds * 1e3:9.3f} ms  "
                      f"{n_rows * n_tokens / seconds:12.0f} tok/s", flush=True)
            del args
    return rows


def make_plan(small: bool, repeats: int | None, dtype: str) -> Plan:
    """Qwen3-Next shapes (for a GPU), or tiny shapes and few repeats with --small."""
    if small:
        return Plan(TINY, batches=(2,), decode_tokens=(1, 4), prefill_tokens=(64,), crossover_tokens=(48,),
                    crossover_batches=(1,), decode_impls=("pallas_recurrent", "scan"),
                    prefill_impls=("pallas_chunked", "chunked"),
                    crossover_impls=("pallas_recurrent", "pallas_chunked", "scan", "chunked"),
                    tune_batches=(1,), tune_tokens=(2,), tune_block_v=(8, 16), tune_warps=(1,), dtype=dtype,
                    repeats=repeats or 2, inner=2)
    return Plan(QWEN3_NEXT_80B, batches=(1, 8, 32), decode_tokens=(1, 4, 8), prefill_tokens=(1024, 4096),
                crossover_tokens=(16, 32, 64, 128, 256, 512), crossover_batches=(1, 8),
                decode_impls=("pallas_recurrent", "scan"), prefill_impls=("pallas_chunked", "chunked"),
                crossover_impls=("pallas_recurrent", "chunked"), tune_batches=(1, 32), tune_tokens=(1, 4),
                tune_block_v=(8, 16, 32, 64), tune_warps=(1, 2, 4), dtype=dtype, repeats=repeats or 10, inner=20)


def main(argv=None) -> None:
    """Run the plan and write the JSON results."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="where to write the JSON results")
    parser.add_argument("--small", action="store_true", help="tiny shapes (runs on CPU, Pallas interpreted)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per measurement")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="of q, k, v")
    parser.add_argument("--skip", nargs="*", default=(), choices=("decode", "tune", "prefill", "crossover"))
    args = parser.parse_args(argv)

    on_gpu = jax.default_backend() == "gpu"
    if not (on_gpu or args.small):
        parser.error("Qwen3-Next shapes need a GPU; pass --small to run tiny shapes here")
    plan = make_plan(args.small, args.repeats, args.dtype)
    key = jax.random.PRNGKey(0)
    results = dict(
        environment=dict(jax=jax.__version__, backend=jax.default_backend(), device=jax.devices()[0].device_kind,
                         python=platform.python_version(), pallas_interpreted=not on_gpu),
        plan=asdict(plan),
        copy_gb_per_s=copy_bandwidth(1 << (30 if on_gpu else 24)) / 1e9,
    )
    print(f"copy: {results['copy_gb_per_s']:.0f} GB/s (read + written)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save = lambda: args.out.write_text(json.dumps(results, indent=1))
    if "decode" not in args.skip:
        results["decode"] = bench_decode(plan, key, results["copy_gb_per_s"] * 1e9)
        save()
    if "tune" not in args.skip:
        results["tune"] = bench_tune(plan, key, results["copy_gb_per_s"] * 1e9)
        save()
    if "prefill" not in args.skip:
        results["prefill"] = bench_prefill(plan, key, plan.batches, plan.prefill_tokens, plan.prefill_impls,
                                           "prefill")
        save()
    if "crossover" not in args.skip:
        results["crossover"] = bench_prefill(plan, key, plan.crossover_batches, plan.crossover_tokens,
                                             plan.crossover_impls, "crossover")
    save()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
