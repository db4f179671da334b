"""The CPU kernels of another revision against this tree's, in one process: each kernel alone at the bundled model's
shapes, then looping device calls of plain decoding on the bundled model at 1 and 16 rows.

    gdnspec bench kernels --against f2a04fe --out bench/results/kernels-cpu.json
    gdnspec bench kernels --against 5fa9cfa --kinds attention --step-model bench/out/qwen35-0.8b-q8_0.gguf

With `--step-model`, one row's model step of that GGUF at `--step-context` positions (its KV pages random, its GDN
state zero) is timed too, at 1 and 4 tokens: what a decoding step and a verify step cost at a long context.

The other revision's kernel sources (`git show REV:jaxmodel/kernels/...`) are built into a second library with the
library's flags and registered under other target names (`base_...`). A kernel alone runs in a jitted loop of
`--reps` calls; the model is traced once with each library (the runtime's compiled step is shared per config, so it
is rebuilt for the second), and a later iteration is timed as in `bench.iteration_cost`: a call of N iterations less
a call of one, over N - 1. Rounds alternate the two libraries, so the machine's drift falls on both alike; a ratio is
the median of the rounds' ratios (this tree's time over the other's). Each kernel's outputs and each call's tokens
are compared between the two: a change meant to keep results bit for bit shows `same: true`.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import functools
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench import run_and_save
from jaxmodel.kernels import cpu_argmax, cpu_attention, cpu_gdn, cpu_matmul

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = "jaxmodel/assets/gdnspec-stdlib-target-q8_0.gguf"
TARGET_NAMES = ("TARGET", "TARGET_Q8", "TARGET_Q8_PROLOGUE", "TARGET_ATTENTION", "TARGET_ATTENTION_F16", "TARGET_GDN",
                "TARGET_ARGMAX", "TARGET_CONV", "TARGET_CONV_PLANES")
PATCHED_MODULES = (cpu_matmul, cpu_gdn, cpu_attention, cpu_argmax)
BASE = "base_"
missing_in_base: set[str] = set()  # targets the other revision's library lacks (`register_base`)

# (kind, shape): the bundled model's products (output head, FFN up/down, GDN projections), its GDN recurrence and its
# attention (Hk 2, Hv 4, Dk = Dv 32; H 4, Hkv 2, D 32 over 130 positions), at 1 and 16 rows, 1 and 4 tokens; attention at
# long contexts (4096 positions; a 128-token prompt chunk after 1024) and with the 0.8B's heads (H 8, Hkv 2, D 256)
# over 8192 positions: (rows, tokens, positions[, H, Hkv, D]).
CASES = (
    ("q8", (1, 4096, 192)), ("q8", (1, 1024, 192)), ("q8", (1, 192, 512)), ("q8", (16, 4096, 192)),
    ("q8", (16, 1024, 192)), ("q8", (16, 192, 512)), ("q8", (16, 392, 192)),
    ("gdn", (1, 1, 32)), ("gdn", (16, 1, 32)), ("gdn", (1, 4, 32)), ("gdn", (16, 4, 32)),
    ("attention", (1, 1, 130)), ("attention", (16, 1, 130)), ("attention", (1, 4, 130)), ("attention", (16, 4, 130)),
    ("attention", (1, 1, 4096)), ("attention", (1, 4, 4096)), ("attention", (1, 128, 1024)),
    ("attention", (1, 1, 8192, 8, 2, 256)), ("attention", (1, 4, 8192, 8, 2, 256)),
)


def build_base(revision: str, folder: Path) -> Path:
    """The kernel library of `revision`, built into `folder` from the sources it has (a kernel added since is
    missing there: `register_base`)."""
    sources = []
    for path in cpu_matmul.SOURCES + cpu_matmul.HEADERS:
        relative = path.relative_to(ROOT).as_posix()
        text = subprocess.run(["git", "show", f"{revision}:{relative}"], cwd=ROOT, capture_output=True)
        if text.returncode != 0:
            continue
        (folder / path.name).write_bytes(text.stdout)
        if path in cpu_matmul.SOURCES:
            sources.append(str(folder / path.name))
    library = folder / "base_kernels.so"
    subprocess.run([cpu_matmul.cxx(), *cpu_matmul.FLAGS, f"-I{jax.ffi.include_dir()}", *sources, "-o", str(library)],
                   check=True, capture_output=True)  # fmt: skip
    return library


def register_base(library: Path) -> None:
    loaded = ctypes.cdll.LoadLibrary(str(library))
    for name in TARGET_NAMES:
        target = getattr(cpu_matmul, name)
        if not hasattr(loaded, target):  # a revision from before the kernel
            missing_in_base.add(target)
            continue
        jax.ffi.register_ffi_target(BASE + target, jax.ffi.pycapsule(getattr(loaded, target)), platform="cpu")


@contextlib.contextmanager
def targets(prefix: str):
    """The kernels' calls traced inside name the targets with `prefix` (BASE: the other revision's library); a
    target that library lacks is None there (the Q8_0 product's prologues, the causal conv: `linear` and
    `gdn.causal_conv` then compute them with jnp, as such a revision did)."""
    names = {name: getattr(cpu_matmul, name) for name in TARGET_NAMES}
    for module in PATCHED_MODULES:
        for name, target in names.items():
            if hasattr(module, name):
                setattr(module, name, None if prefix and target in missing_in_base else prefix + target)
    try:
        yield
    finally:
        for module in PATCHED_MODULES:
            for name, target in names.items():
                if hasattr(module, name):
                    setattr(module, name, target)


def kernel_loop(kind: str, shape: tuple, reps: int):
    """A jitted loop of `reps` calls of one kernel (the target names current at tracing), each fed the last one's
    output so none is skipped; returns a function running it once: (us per call, the final output)."""
    rng = np.random.default_rng(0)
    f32 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    if kind == "q8":
        M, N, K = shape
        quants, scales = cpu_matmul.interleave_q8_rows(*cpu_matmul.quantize_rows_q8_0(f32(N, K)))
        x0 = f32(M, K)
        width = min(N, K)

        def body(x):
            y = cpu_matmul.q8_rows_matmul(x, quants, scales)
            return x.at[:, :width].add(y[:, :width] * 1e-6)
    elif kind == "gdn":
        B, T, D = shape
        Hk, Hv = 2, 4
        q, k, v = f32(B, T, Hk, D) * 0.1, f32(B, T, Hk, D) * 0.1, f32(B, T, Hv, D)
        g, beta = jnp.full((B, T, Hv), -0.1), jnp.full((B, T, Hv), 0.5)
        read = 1 + jnp.arange(B, dtype=jnp.int32) * (T + 1)
        writes = read[:, None] + 1 + jnp.arange(T, dtype=jnp.int32)[None]
        x0 = (f32(1 + B * (T + 1), Hv, D, D) * 0.01, v)

        def body(carry):
            pool, vt = carry
            out, pool = cpu_gdn.gdn_recurrent_cpu(q, k, vt, g, beta, pool, read, writes, jnp.full((B,), T))
            return pool, vt + out * 1e-6
    else:
        B, T, context, H, Hkv, D = shape if len(shape) == 6 else (*shape, 4, 2, 32)
        page = 16
        n_pages = -(-(context + T) // page)
        k_pages, v_pages = f32(1 + B * n_pages, page, Hkv, D), f32(1 + B * n_pages, page, Hkv, D)
        table = jnp.asarray(1 + np.arange(B * n_pages).reshape(B, n_pages), jnp.int32)
        positions = jnp.asarray(np.tile(context + np.arange(T), (B, 1)), jnp.int32)
        valid = jnp.ones((B, T), bool)
        x0 = f32(B, T, H, D)

        def body(x):
            return x + cpu_attention.paged_attention_cpu(x, k_pages, v_pages, table, positions, valid) * 1e-3

    loop = jax.jit(lambda x: jax.lax.fori_loop(0, reps, lambda i, c: body(c), x))
    jax.block_until_ready(loop(x0))

    def run():
        start = time.perf_counter()
        out = jax.block_until_ready(loop(x0))
        return (time.perf_counter() - start) / reps * 1e6, out

    return run


def alternate(runs: dict, rounds: int) -> dict[str, list]:
    """Each of `runs` (name -> function returning (time, result)) once a round, the order reversed every round."""
    samples = {name: [] for name in runs}
    for r in range(rounds):
        for name in list(runs)[:: 1 if r % 2 == 0 else -1]:
            samples[name].append(runs[name]())
    return samples


def compare(samples: dict[str, list]) -> dict:
    base, this = [s[0] for s in samples["base"]], [s[0] for s in samples["this"]]
    ratios = [t / b for t, b in zip(this, base, strict=True)]
    return {"base": statistics.median(base), "this": statistics.median(this), "ratio": statistics.median(ratios),
            "ratio_range": [min(ratios), max(ratios)]}


def same_results(a, b) -> bool:
    return all(bool(jnp.array_equal(x, y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def model_calls(rows: int, iterations: int):
    """Two runtimes of the bundled model, one per library, and a function timing a later iteration of a looping
    call of plain decoding over `rows` rows (the code prompts, each its own pages and planes) on one of them."""
    from bench.decoding_rows import PAGE_SIZE, PLANES_PER_ROW, committed_tokens, prefilled_loops, sequences
    from bench.prompts import load_prompt_set
    from jaxmodel import load_model
    from jaxmodel.executor import runtime as runtime_module
    from jaxmodel.executor import Runtime, Shapes
    from jaxmodel.tokenizer import load_tokenizer

    path = str(ROOT / BUNDLED)
    model, tokenizer = load_model(path), load_tokenizer(path)
    prompts = [list(tokenizer.encode(p)) for p in load_prompt_set("code")]
    per_row = -(-(max(map(len, prompts)) + iterations + 8) // PAGE_SIZE)
    rows_of = sequences([prompts[i % len(prompts)] for i in range(rows)], per_row)

    def call(runtime, n: int):
        loops = prefilled_loops(runtime, rows_of)  # each call from the prompts again
        start = time.perf_counter()
        results = runtime.step(loops, iterations=n)
        seconds = time.perf_counter() - start
        return seconds, committed_tokens(results)

    runtimes = {}
    for name, prefix in (("base", BASE), ("this", "")):
        runtime_module._compiled.cache_clear()
        with targets(prefix):
            runtimes[name] = Runtime(model, n_pages=rows * per_row + 2, n_planes=rows * PLANES_PER_ROW + 2,
                                     page_size=PAGE_SIZE, max_iterations=iterations,
                                     shapes=Shapes(max_rows=rows, max_tokens=256, max_logit_rows=4,
                                                   pages_per_row=per_row))  # fmt: skip
            for _ in range(2):
                call(runtimes[name], 1), call(runtimes[name], iterations)

    def later_iteration(name: str):
        one, _ = call(runtimes[name], 1)
        many, tokens = call(runtimes[name], iterations)
        return (many - one) / (iterations - 1) * 1e3, tokens

    return later_iteration


def long_context_steps(path: str, context: int):
    """A model step of one row at `context` positions (KV pages filled with random values, GDN state zero), traced once
    with each library, and with this tree's over a float16 KV cache of the same values ("this-f16"); returns a
    function timing one step of T tokens (1: decoding, 4: a verify step) on one of them: (ms, the step's logits)."""
    from jaxmodel import load_model
    from jaxmodel.model import forward
    from jaxmodel.state import Row, pack_batch

    model = load_model(path, load_mtp=False)
    page = 16
    pages = list(range(1, 1 + -(-(context + 64) // page)))
    state = model.new_state(n_pages=len(pages) + 1, n_planes=3, page_size=page)
    rng = np.random.default_rng(0)
    state = dataclasses.replace(
        state, k_pages=tuple(jnp.asarray(rng.standard_normal(k.shape, np.float32)) for k in state.k_pages),
        v_pages=tuple(jnp.asarray(rng.standard_normal(v.shape, np.float32)) for v in state.v_pages))  # fmt: skip
    batches = {T: jax.device_put(pack_batch([Row(list(rng.integers(0, model.cfg.n_vocab, T)), context, pages, 1,
                                                 [-1] * (T - 1) + [2], range(T))]))
               for T in (1, 4)}  # fmt: skip
    states = {"base": state, "this": state, "this-f16": dataclasses.replace(
        state, k_pages=tuple(k.astype(jnp.float16) for k in state.k_pages),
        v_pages=tuple(v.astype(jnp.float16) for v in state.v_pages))}  # fmt: skip
    steps = {}
    for name, prefix in (("base", BASE), ("this", ""), ("this-f16", "")):
        with targets(prefix):
            steps[name] = jax.jit(functools.partial(forward, cfg=model.cfg))
            for batch in batches.values():
                jax.block_until_ready(steps[name](model.weights, batch=batch, state=states[name])[0].logits)

    def step(name: str, T: int, repeats: int = 3):
        start = time.perf_counter()
        for _ in range(repeats):
            out, _ = steps[name](model.weights, batch=batches[T], state=states[name])
        jax.block_until_ready(out.logits)
        return (time.perf_counter() - start) / repeats * 1e3, out.logits

    return step


def run(args) -> dict:
    if not cpu_matmul.available():
        raise SystemExit("the CPU kernels are not available here (CPU backend and a C++ compiler needed)")
    with tempfile.TemporaryDirectory() as folder:
        register_base(build_base(args.against, Path(folder)))
    out = {"against": args.against, "cpu_count": os.cpu_count(), "reps": args.reps, "kernels": [], "model": [],
           "steps": []}  # fmt: skip
    for kind, shape in CASES:
        if args.kinds and kind not in args.kinds.split(","):
            continue
        runs = {}
        for name, prefix in (("base", BASE), ("this", "")):
            with targets(prefix):
                runs[name] = kernel_loop(kind, shape, args.reps)
        samples = alternate(runs, args.rounds)
        cell = {"kernel": kind, "shape": list(shape), "unit": "us per call", **compare(samples),
                "same": same_results(samples["base"][-1][1], samples["this"][-1][1])}  # fmt: skip
        out["kernels"].append(cell)
        print(f"{kind:9s} {str(shape):18s} {cell['base']:8.1f} -> {cell['this']:8.1f} us  "
              f"{cell['ratio']:.2f}x  same {cell['same']}", flush=True)
    for rows in map(int, filter(None, args.rows.split(","))):
        time_one = model_calls(rows, args.iterations)
        samples = alternate({name: functools.partial(time_one, name) for name in ("base", "this")}, args.model_rounds)
        cell = {"rows": rows, "unit": "ms per later iteration", **compare(samples),
                "same": samples["base"][-1][1] == samples["this"][-1][1]}  # fmt: skip
        out["model"].append(cell)
        print(f"plain decoding, {rows} rows: {cell['base']:.3f} -> {cell['this']:.3f} ms a later iteration  "
              f"{cell['ratio']:.2f}x  tokens same {cell['same']}", flush=True)
    if args.step_model:
        step = long_context_steps(args.step_model, args.step_context)
        for T in (1, 4):
            samples = alternate({name: functools.partial(step, name, T) for name in ("base", "this", "this-f16")},
                                args.model_rounds)  # fmt: skip
            half = compare({"base": samples["this"], "this": samples["this-f16"]})
            cell = {"model": os.path.basename(args.step_model), "context": args.step_context, "tokens": T,
                    "unit": "ms per step", **compare(samples), "this-f16": half["this"],
                    "f16_ratio": half["ratio"], "f16_ratio_range": half["ratio_range"]}  # fmt: skip
            out["steps"].append(cell)
            print(f"{cell['model']}, {T} tokens at {args.step_context} positions: {cell['base']:.1f} -> "
                  f"{cell['this']:.1f} ms a step  {cell['ratio']:.2f}x; float16 KV {cell['this-f16']:.1f} ms "
                  f"({cell['f16_ratio']:.2f}x float32's)", flush=True)
        for name in ("base", "this", "this-f16"):
            one, four = (next(c[name] for c in out["steps"] if c["tokens"] == T) for T in (1, 4))
            out[f"verify_over_decode_{name}"] = four / one
            print(f"{name}: a 4-token step costs {four / one:.2f}x a one-token step", flush=True)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="the git revision whose kernels to compare")
    parser.add_argument("--kinds", default="", help="kernels to time alone, of q8,gdn,attention (default all)")
    parser.add_argument("--reps", type=int, default=100, help="calls of a kernel per timed loop")
    parser.add_argument("--rounds", type=int, default=11, help="timed loops of each kernel and library")
    parser.add_argument("--rows", default="1,16", help="rows of the model's looping calls ('' for none)")
    parser.add_argument("--iterations", type=int, default=32, help="iterations of the longer call")
    parser.add_argument("--model-rounds", type=int, default=16)
    parser.add_argument("--step-model", default="", help="also time one row's model step (1 and 4 tokens) of this "
                        "GGUF at --step-context positions")  # fmt: skip
    parser.add_argument("--step-context", type=int, default=8192)
    parser.add_argument("--out", default=None)
    return run_and_save(run, parser.parse_args(argv))


if __name__ == "__main__":
    main()
