"""How many iterations should one device call run? One engine compiled for the largest count serves the same
load (greedy, code prompts, default: the bundled model) with each count in turn, round after round, so that a
shared machine's drift falls on every count alike; the ratio to quote is the median of the per-round ratios to
the first count. Every run's tokens are checked against the first count's. Writes JSON.

    gdnspec bench iterations --iterations 8,16,32 --streams 1,16 --out bench/results/iterations-cpu.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import anyio
import jax

from jaxmodel import load_model
from jaxmodel.requests import SpeculativeConfig
from jaxmodel.tokenizer import load_tokenizer
from scheduler import Engine, GenerationRequest

from . import run_and_save, save_json
from .prompts import load_prompt_set
from .speculation import _run, workload_arguments


def run(args) -> dict:
    model = load_model(args.model)
    tokenizer = load_tokenizer(args.model)
    prompts = [tuple(tokenizer.encode(p)) for p in load_prompt_set(args.prompts)]
    counts = [int(k) for k in args.iterations.split(",")]
    streams = [int(s) for s in args.streams.split(",")]
    policies = args.drafters.split(";")
    out = {"model": os.path.basename(args.model), "backend": jax.default_backend(),
           "machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
           "max_tokens": args.max_tokens, "n_max": args.n_max, "iterations": counts, "rounds": args.rounds,
           "cells": []}  # fmt: skip

    async def main():
        engine = Engine(model, tokenizer=tokenizer, max_running=max(streams), n_max=args.n_max,
                        iterations=max(counts))  # fmt: skip
        start = time.perf_counter()
        out["warmup"] = {"shapes": engine.warmup(), "seconds": time.perf_counter() - start}
        async with engine:
            for n_streams in streams:
                for policy in policies:
                    drafters = tuple(d for d in policy.split(",") if d and d != "plain")
                    spec = SpeculativeConfig(drafters, n_max=args.n_max) if drafters else None
                    requests = [GenerationRequest(p, args.max_tokens, speculative=spec) for p in prompts]
                    requests = [requests[i % len(requests)] for i in range(max(n_streams, len(requests)))]
                    rates: dict[int, list[float]] = {k: [] for k in counts}
                    reference = None
                    for round_ in range(args.rounds + 1):  # round 0 warms the policy's estimates, untimed
                        for k in counts:
                            engine.iterations = k
                            result = await _run(engine, requests, n_streams)
                            reference = reference or result["tokens"]
                            if result["tokens"] != reference:
                                raise AssertionError(f"{policy}, {n_streams} streams: {k} iterations changed the "
                                                     f"output")  # fmt: skip
                            if round_:
                                rates[k].append(result["tokens_per_s"])
                    base = rates[counts[0]]
                    cell = {"streams": n_streams, "drafters": list(drafters) or ["plain"],
                            "tokens_per_s": {k: statistics.median(r) for k, r in rates.items()},
                            "rounds_tokens_per_s": rates,
                            "vs_first": {k: statistics.median(x / b for x, b in zip(r, base))
                                         for k, r in rates.items()}}  # fmt: skip
                    out["cells"].append(cell)
                    if args.out:
                        save_json(out, args.out)
                    print(f"{n_streams:3d} streams {policy:10s} " + "  ".join(
                        f"{k}: {cell['tokens_per_s'][k]:7.1f} tok/s ({cell['vs_first'][k]:.2f}x)" for k in counts),
                        flush=True)  # fmt: skip

    anyio.run(main)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    workload_arguments(parser, drafters="plain;mtp")
    parser.add_argument("--iterations", default="8,16,32", help="iteration counts per device call, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    return run_and_save(run, parser.parse_args(argv))


if __name__ == "__main__":
    main()
