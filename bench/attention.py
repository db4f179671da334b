"""Attention cost against --max-model-len: one jitted model step, and attention alone, per page-table width.

    python -m bench.attention --out bench/results/attention-cpu.json

Every row of a step carries the page table of a full-length sequence (max_model_len / page_size pages), so an
attention that reads the whole table costs the maximum length rather than the context. `step` times
`Model.step` of the bundled target at --batch rows of ~--context tokens, T = 1, for each width and each
implementation (`reference`: the full table; `blocked:N`: the jnp loop over N pages at a time; `cpu`: the CPU
kernel); `layer` times `jaxmodel.attention.attend` alone at the bundled model's head shape and at Qwen3.5-0.8B's,
for steps of each of --tokens tokens per row, the last quarter of the rows being padding rows.

    python -m bench.attention --impls blocked:8,cpu --tokens 1,4,8 --out bench/results/attention-cpu-kernel.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import time
from collections.abc import Callable
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from jaxmodel import attention, load_model
from jaxmodel.assets import default_model_path
from jaxmodel.state import Row, pack_batch
from jaxmodel.xla_flags import step_invariant
from bench import save_json

PAGE_SIZE = 16
# (name, n_head, n_head_kv, head_dim)
LAYER_SHAPES = [("bundled", 4, 2, 32), ("qwen3.5-0.8b", 8, 2, 256)]


def _forced(impl: str) -> contextlib.ExitStack:
    """Patch `jaxmodel.attention` so that steps traced inside use `impl` ("reference", "blocked:8", ...)."""
    name, _, pages = impl.partition(":")
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(attention, "FORCE_IMPL", name))
    if pages:
        stack.enter_context(mock.patch.object(attention, "PAGES_PER_BLOCK", int(pages)))
    return stack


def step_runner(model_path: str, impl: str, n_seqs: int, context: int, max_model_len: int) -> Callable[[], float]:
    """A warm decode step (T = 1) of n_seqs rows holding ~context tokens with page tables of
    max_model_len / PAGE_SIZE pages: each call runs one and returns its seconds, logits on the host.
    A fresh model per runner, so that its step is traced under `impl`."""
    with _forced(impl):
        model = load_model(model_path)
        width = max_model_len // PAGE_SIZE
        pages_per_seq = -(-(context + 1) // PAGE_SIZE)
        state = model.new_state(n_pages=1 + n_seqs * pages_per_seq, n_planes=1 + 2 * n_seqs, page_size=PAGE_SIZE)
        pages = [list(range(1 + s * pages_per_seq, 1 + (s + 1) * pages_per_seq)) for s in range(n_seqs)]
        rng = np.random.default_rng(0)
        prompt = [Row(list(rng.integers(0, model.cfg.n_vocab, context)), 0, pages[s], 0,
                      [-1] * (context - 1) + [1 + 2 * s]) for s in range(n_seqs)]  # fmt: skip
        _, state = model.step(model.weights, batch=pack_batch(prompt, R=1), state=state, final_only=True)
        calls = 0

        def batch(i):
            # Every step feeds position `context` again (reading and writing the same planes in turn), so the
            # context stays fixed however many steps run.
            rows = [Row([int(rng.integers(0, model.cfg.n_vocab))], context, pages[s], 1 + 2 * s + i % 2,
                        [1 + 2 * s + (i + 1) % 2], [0]) for s in range(n_seqs)]  # fmt: skip
            return pack_batch(rows, P=width)

        def run() -> float:
            nonlocal state, calls
            b = batch(calls)
            start = time.perf_counter()
            out, state = model.step(model.weights, batch=b, state=state)
            np.asarray(out.logits)  # the host needs the logits every step
            calls += 1
            return time.perf_counter() - start

        run()  # compile
    return run


def layer_runner(impl: str, n_head: int, n_head_kv: int, head_dim: int, n_rows: int, context: int,
                 max_model_len: int, n_tokens: int = 1) -> Callable[[], float]:
    """`attend` alone at T = n_tokens (positions context..), the last quarter of the rows padding rows: each call
    returns its seconds."""
    width = max_model_len // PAGE_SIZE
    pages_per_seq = -(-(context + n_tokens) // PAGE_SIZE)
    rng = np.random.default_rng(1)
    pool = (1 + n_rows * pages_per_seq, PAGE_SIZE, n_head_kv, head_dim)
    k_pages, v_pages = (jnp.asarray(rng.normal(size=pool), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(n_rows, n_tokens, n_head, head_dim)), jnp.float32)
    live = n_rows - n_rows // 4
    table = np.zeros((n_rows, width), np.int32)
    for b in range(live):
        table[b, :pages_per_seq] = np.arange(1 + b * pages_per_seq, 1 + (b + 1) * pages_per_seq)
    positions = (np.where(np.arange(n_rows) < live, context, 0)[:, None] + np.arange(n_tokens)).astype(np.int32)
    valid = np.repeat((np.arange(n_rows) < live)[:, None], n_tokens, axis=1)
    args = (q, k_pages, v_pages, jnp.asarray(table), jnp.asarray(positions), jnp.asarray(valid))
    with _forced(impl):
        fn = jax.jit(lambda *a: attention.attend(*a)).trace(*args).lower().compile()  # a fresh trace

    def run() -> float:
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        return time.perf_counter() - start

    run()
    return run


def median_ms(runners: dict, rounds: int, per_round: int) -> dict:
    """Median ms per runner, timed round-robin (`per_round` calls each per round) so that the load of a shared
    machine falls on all of them alike."""
    times = {key: [] for key in runners}
    for _ in range(rounds):
        for key, run in runners.items():
            times[key].extend(run() for _ in range(per_round))
    return {key: float(np.median(t) * 1e3) for key, t in times.items()}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(default_model_path()))
    parser.add_argument("--out", default=None, help="write JSON results here")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--max-model-lens", default="512,2048,8192")
    parser.add_argument("--impls", default="reference,blocked:4,blocked:8,blocked:16")
    parser.add_argument("--tokens", default="1", help="tokens per row of the attention-alone steps")
    parser.add_argument("--steps", type=int, default=5, help="timed calls per configuration and round")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--no-layer", action="store_true", help="skip the attention-alone section")
    args = parser.parse_args(argv)
    lens = [int(n) for n in args.max_model_lens.split(",")]
    impls = args.impls.split(",")
    results = {
        "model": os.path.basename(args.model),
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0]),
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "batch": args.batch,
        "context": args.context,
        "page_size": PAGE_SIZE,
        "default_pages_per_block": attention.PAGES_PER_BLOCK,
        "step_invariant": step_invariant(),
        "step": [],
        "layer": [],
    }
    steps = {(impl, n): step_runner(args.model, impl, args.batch, args.context, n) for impl in impls for n in lens}
    for (impl, n), ms in median_ms(steps, args.rounds, args.steps).items():
        results["step"].append({"impl": impl, "max_model_len": n, "step_ms": ms})
        print(f"step   {impl:12s} max_model_len {n:5d}: {ms:8.2f} ms", flush=True)
    del steps
    for shape, n_head, n_head_kv, head_dim in [] if args.no_layer else LAYER_SHAPES:
        layers = {(impl, n, T): layer_runner(impl, n_head, n_head_kv, head_dim, args.batch, args.context, n, T)
                  for impl in impls for n in lens for T in map(int, args.tokens.split(","))}  # fmt: skip
        for (impl, n, T), ms in median_ms(layers, args.rounds, args.steps).items():
            results["layer"].append({"shape": shape, "n_head": n_head, "n_head_kv": n_head_kv,
                                     "head_dim": head_dim, "impl": impl, "max_model_len": n, "tokens": T, "ms": ms})
            print(f"layer  {shape:12s} {impl:12s} max_model_len {n:5d} T {T:2d}: {ms:8.3f} ms", flush=True)
    if args.out:
        save_json(results, args.out)
    return results


if __name__ == "__main__":
    main()
