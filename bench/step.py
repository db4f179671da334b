"""Step-level speed of the jitted forward: plain decode tokens/s per batch size and verify-step time per T.

    python -m bench.step --model bench/out/qwen35-0.8b-f32.gguf --out bench/results/step-cpu.json

Each measurement runs warm (compiled beforehand) steps over sequences holding `--context` tokens.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import jax
import numpy as np

from jaxmodel import load_model
from jaxmodel.state import Row, bucket, pack_batch
from bench import save_json


def _prefilled(model, n_seqs: int, context: int, page_size: int = 16):
    pages_per_seq = bucket(-(-(context + 64) // page_size))
    state = model.new_state(n_pages=1 + n_seqs * pages_per_seq, n_planes=1 + 2 * n_seqs, page_size=page_size)
    pages = [list(range(1 + s * pages_per_seq, 1 + (s + 1) * pages_per_seq)) for s in range(n_seqs)]
    rng = np.random.default_rng(0)
    rows = [
        Row(list(rng.integers(0, model.cfg.n_vocab, context)), 0, pages[s], 0, [-1] * (context - 1) + [1 + 2 * s])
        for s in range(n_seqs)
    ]
    _, state = model.step(model.weights, batch=pack_batch(rows, R=1), state=state, final_only=True)
    return state, pages


def time_steps(model, n_seqs: int, T: int, context: int, steps: int) -> float:
    """Seconds per step of n_seqs rows feeding T tokens each (writing T snapshot planes... ping-pong)."""
    state, pages = _prefilled(model, n_seqs, context)
    rng = np.random.default_rng(1)

    def batch(i):
        rows = []
        for s in range(n_seqs):
            read = 1 + 2 * s + (i % 2)
            write = 1 + 2 * s + ((i + 1) % 2)
            rows.append(Row(list(rng.integers(0, model.cfg.n_vocab, T)), context, pages[s], read,
                            [-1] * (T - 1) + [write], range(T)))  # fmt: skip
        return pack_batch(rows)

    out, state = model.step(model.weights, batch=batch(0), state=state)  # compile
    jax.block_until_ready(out.logits)
    start = time.perf_counter()
    for i in range(steps):
        out, state = model.step(model.weights, batch=batch(i + 1), state=state)
        np.asarray(out.logits)  # the host needs the logits every step
    return (time.perf_counter() - start) / steps


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", default=None, help="write JSON results here")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--verify-t", default="1,2,4,8")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    model = load_model(args.model)
    results = {
        "model": os.path.basename(args.model),
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0]),
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "context": args.context,
        "decode": [],
        "verify": [],
    }
    for b in map(int, args.batches.split(",")):
        sec = time_steps(model, b, 1, args.context, args.steps)
        results["decode"].append({"batch": b, "step_ms": sec * 1e3, "tokens_per_s": b / sec})
        print(f"decode  batch {b:3d}: {sec * 1e3:8.1f} ms/step  {b / sec:8.2f} tokens/s", flush=True)
    base = None
    for t in map(int, args.verify_t.split(",")):
        sec = time_steps(model, 1, t, args.context, args.steps)
        base = base or sec
        results["verify"].append({"T": t, "step_ms": sec * 1e3, "ratio_to_T1": sec / base})
        print(f"verify  T {t:3d}: {sec * 1e3:8.1f} ms/step  {sec / base:5.2f}x T=1", flush=True)
    if args.out:
        save_json(results, args.out)
    return results


if __name__ == "__main__":
    main()
