"""MoE cost against the number of experts: the routed forms (`jaxmodel.moe.moe_ffn`) and the dense reference.

    python -m bench.moe --out bench/results/moe-cpu.json

For each `make-random` MoE preset (64 experts / 4 used, 256 / 8, 512 / 10; the same E=512 layer shapes
otherwise), built in memory:
- `step`: a warm decode step (`Model.step`, T = 1) of --batch rows after a short prefill, with the model's MoE
  layers traced as routed (the default) or dense (every expert evaluated, the unselected weighted 0).
- `layer`: one MoE FFN alone on N tokens: `routed` (each token's experts read by index for N <= 4, else the
  grouped matmul over expert-sorted pairs), `dense`, and, for N <= 64, `ragged_dot` (`jax.lax.ragged_dot` over
  the expert-sorted pairs, the library's grouped matmul; on CPU XLA lowers it to a product masked over every
  expert, so it costs more than dense there).
Times are medians of --repeats calls after a warm-up, in milliseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import platform
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from bench import median_seconds, save_json
from jaxmodel import Model, moe
from jaxmodel.random_model import PRESETS, random_weights
from jaxmodel.state import Row, pack_batch

MOE_PRESETS = ["qwen35moe-mini-64x4", "qwen35moe-mini-256x8", "qwen3next-mini-512x10"]
PAGE_SIZE = 16


def decode_step_ms(cfg, weights, *, dense: bool, batch: int, context: int, repeats: int) -> float:
    """A decode step (T = 1) of `batch` rows each holding `context` tokens; a fresh model so that its step is
    traced with the chosen MoE form."""
    with mock.patch.object(moe, "moe_ffn", moe.moe_ffn_dense) if dense else contextlib.nullcontext():
        model = Model(cfg, weights)
        pages_per_seq = -(-(context + 1) // PAGE_SIZE)
        state = model.new_state(n_pages=1 + batch * pages_per_seq, n_planes=1 + 2 * batch, page_size=PAGE_SIZE)
        pages = [list(range(1 + s * pages_per_seq, 1 + (s + 1) * pages_per_seq)) for s in range(batch)]
        rng = np.random.default_rng(0)
        prompt = [Row(list(rng.integers(0, cfg.n_vocab, context)), 0, pages[s], 0,
                      [-1] * (context - 1) + [1 + 2 * s]) for s in range(batch)]  # fmt: skip
        _, state = model.step(model.weights, batch=pack_batch(prompt, R=1), state=state, final_only=True)
        rows = [Row([int(rng.integers(0, cfg.n_vocab))], context, pages[s], 1 + 2 * s, [2 + 2 * s], [0])
                for s in range(batch)]  # fmt: skip
        step_batch = pack_batch(rows, T=1, R=1)
        holder = {"state": state}

        def one():
            out, holder["state"] = model.step(model.weights, batch=step_batch, state=holder["state"])
            out.logits.block_until_ready()

        return median_seconds(one, repeats) * 1e3


def ragged_dot_moe(w, cfg, x: jax.Array) -> jax.Array:
    """Routed experts through `jax.lax.ragged_dot` on the (token, expert) pairs sorted by expert. x [N, E]."""
    top_i, top_w = moe.route(w, cfg, x)
    N, k = top_i.shape
    expert = top_i.reshape(N * k)
    order = jnp.argsort(expert, stable=True)
    sizes = jnp.bincount(expert, length=cfg.n_expert).astype(jnp.int32)
    xs = x[order // k]  # [N k, E]
    hidden = jax.nn.silu(jax.lax.ragged_dot(xs, w.gate, sizes)) * jax.lax.ragged_dot(xs, w.up, sizes)
    ys = jax.lax.ragged_dot(hidden, w.down, sizes) * top_w.reshape(N * k)[order][:, None]
    return jnp.zeros_like(x).at[order // k].add(ys) + moe.shared_expert(w, x)


def layer_ms(cfg, w, n_tokens: int, form: str, repeats: int) -> float:
    fn = {"routed": moe.moe_ffn, "dense": moe.moe_ffn_dense, "ragged_dot": ragged_dot_moe}[form]
    step = jax.jit(functools.partial(fn, cfg=cfg))
    x = jax.random.normal(jax.random.key(n_tokens), (n_tokens, cfg.n_embd))
    return median_seconds(lambda: step(w, x=x).block_until_ready(), repeats) * 1e3


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=MOE_PRESETS, choices=sorted(PRESETS))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench/results/moe-cpu.json")
    args = parser.parse_args(argv)

    results = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__,
                           "backend": jax.default_backend()},
               "args": vars(args), "step": [], "layer": []}  # fmt: skip
    for preset in args.presets:
        cfg = PRESETS[preset]
        weights = random_weights(cfg, seed=0)
        shape = {"preset": preset, "n_expert": cfg.n_expert, "n_expert_used": cfg.n_expert_used}
        for batch in args.batch:
            for form in ("routed", "dense"):
                ms = decode_step_ms(cfg, weights, dense=form == "dense", batch=batch, context=args.context,
                                    repeats=args.repeats)  # fmt: skip
                results["step"].append(shape | {"batch": batch, "form": form, "ms": ms})
                print(f"step  {preset:24} batch {batch:3} {form:10} {ms:9.2f} ms", flush=True)
                gc.collect()
        w = jax.tree_util.tree_map(jnp.asarray, weights.layers[0].ffn)
        for n_tokens in args.tokens:
            for form in ("routed", "dense", "ragged_dot") if n_tokens <= 64 else ("routed", "dense"):
                ms = layer_ms(cfg, w, n_tokens, form, args.repeats)
                results["layer"].append(shape | {"tokens": n_tokens, "form": form, "ms": ms})
                print(f"layer {preset:24} N {n_tokens:5} {form:10} {ms:9.2f} ms", flush=True)
        del weights, w
        gc.collect()
        save_json(results, args.out)
    return results


if __name__ == "__main__":
    main()
