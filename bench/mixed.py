"""Staggered arrivals: do steps that mix prompt chunks with decoding rows cost what their tokens cost? Requests
with max_tokens drawn between --min-tokens and --max-tokens keep --streams in flight, so new requests' prompt
chunks share steps with running ones. The same engine serves the load with `Runtime.split_chunks` on and off in
turn, round after round (a shared machine's drift falls on both alike); the ratio to quote is the median of the
per-round ratios. Every run's tokens are checked against the first run's. Writes JSON.

    gdnspec bench mixed --streams 16 --requests 64 --rounds 3 --out bench/results/mixed-cpu.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics

import anyio
import jax
import numpy as np

from jaxmodel import load_model
from jaxmodel.tokenizer import load_tokenizer
from scheduler import Engine, GenerationRequest

from . import run_and_save
from .prompts import load_prompt_set
from .speculation import _run, model_arguments


def run(args) -> dict:
    model = load_model(args.model)
    tokenizer = load_tokenizer(args.model)
    prompts = [tuple(tokenizer.encode(p)) for p in load_prompt_set(args.prompts)]
    lengths = np.random.default_rng(args.seed).integers(args.min_tokens, args.max_tokens + 1, args.requests)
    requests = [GenerationRequest(prompts[i % len(prompts)], int(n)) for i, n in enumerate(lengths)]
    out = {"model": os.path.basename(args.model), "backend": jax.default_backend(),
           "machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
           "streams": args.streams, "requests": args.requests, "max_tokens": [args.min_tokens, args.max_tokens],
           "prompt_tokens": sorted({len(p) for p in prompts}), "rounds": args.rounds}  # fmt: skip
    rates: dict[str, list[float]] = {"split": [], "joined": []}

    async def main():
        engine = Engine(model, tokenizer=tokenizer, max_running=args.streams)
        async with engine:
            reference = None
            for round_ in range(args.rounds + 1):  # round 0 compiles the shapes the load reaches, untimed
                for name in rates:
                    engine.runtime.split_chunks = name == "split"
                    result = await _run(engine, requests, args.streams)
                    reference = reference or result["tokens"]
                    if result["tokens"] != reference:
                        raise AssertionError(f"{name} calls changed the output")
                    if round_:
                        rates[name].append(result["tokens_per_s"])
                        print(f"round {round_} {name:6s}: {result['tokens_per_s']:7.1f} tokens/s", flush=True)

    anyio.run(main)
    out["tokens_per_s"] = {name: statistics.median(r) for name, r in rates.items()}
    out["rounds_tokens_per_s"] = rates
    out["split_vs_joined"] = statistics.median(s / j for s, j in zip(rates["split"], rates["joined"]))
    print(f"split calls {out['split_vs_joined']:.2f}x joined (median of the per-round ratios)")
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    return run_and_save(run, parser.parse_args(argv))


if __name__ == "__main__":
    main()
