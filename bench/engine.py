"""Engine throughput with the synthetic drafter: tokens/s per sequence and aggregate for plain decoding and for
drafts of d tokens accepted at rate alpha, per rollback mode and concurrency. Writes JSON and a PNG plot.

    gdnspec bench engine --model bench/out/qwen35-0.8b-f32.gguf --out bench/results/engine-cpu.json

Every speculative run is checked against the plain run's tokens (the lossless invariant) before it is reported.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

import anyio
import numpy as np

from drafters.policy import SpeculativeConfig
from drafters.synthetic import SyntheticDrafter
from jaxmodel import load_model
from scheduler.engine import Engine, GenerationRequest
from scheduler.types import TokensEvent
from bench import save_json


async def _run_batch(engine: Engine, requests: list[GenerationRequest]) -> dict:
    """All requests at once; returns tokens per request and timings."""
    results: dict[int, dict] = {}

    async def one(i: int, request: GenerationRequest):
        tokens, first, start = [], None, time.perf_counter()
        async for event in engine.generate(request):
            if isinstance(event, TokensEvent):
                first = first or time.perf_counter()
                tokens += event.token_ids
        results[i] = {"tokens": tokens, "start": start, "first": first, "end": time.perf_counter()}

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i, request in enumerate(requests):
            tg.start_soon(one, i, request)
    wall = time.perf_counter() - start
    total = sum(len(r["tokens"]) for r in results.values())
    per_seq = [len(r["tokens"]) / (r["end"] - r["start"]) for r in results.values()]
    return {"tokens": [results[i]["tokens"] for i in range(len(requests))], "wall_s": wall,
            "tokens_per_s": total / wall, "per_seq_tokens_per_s": float(np.mean(per_seq))}  # fmt: skip


def run(args) -> dict:
    model = load_model(args.model)
    rng = np.random.default_rng(0)
    out = {"model": os.path.basename(args.model), "max_tokens": args.max_tokens, "budget_mb": args.budget_mb,
           "prompt_tokens": args.prompt_tokens, "runs": []}  # fmt: skip
    for concurrency in map(int, args.concurrency.split(",")):
        prompts = [tuple(int(t) for t in rng.integers(0, model.cfg.n_vocab, args.prompt_tokens))
                   for _ in range(concurrency)]  # fmt: skip
        plain = [GenerationRequest(p, args.max_tokens) for p in prompts]

        async def plain_runs():
            async with Engine(model, budget_bytes=int(args.budget_mb * 2**20), max_running=concurrency,
                              max_model_len=args.prompt_tokens + args.max_tokens + 16) as engine:  # fmt: skip
                await _run_batch(engine, [GenerationRequest(p, 4) for p in prompts])  # compile
                return await _run_batch(engine, plain)

        base = anyio.run(plain_runs)
        print(f"B={concurrency:2d} plain: {base['tokens_per_s']:.2f} tokens/s aggregate", flush=True)
        out["runs"].append({"concurrency": concurrency, "mode": "plain", "alpha": None, "d": 0,
                            "tokens_per_s": base["tokens_per_s"],
                            "per_seq_tokens_per_s": base["per_seq_tokens_per_s"]})  # fmt: skip
        references = [list(p) + t for p, t in zip(prompts, base["tokens"])]
        for alpha, d in itertools.product(map(float, args.alpha.split(",")), map(int, args.d.split(","))):
            for mode in args.modes.split(","):
                drafter = SyntheticDrafter(references, alpha=alpha, vocab=model.cfg.n_vocab, seed=1)
                spec = SpeculativeConfig(("synthetic",), n_max=d)
                requests = [GenerationRequest(p, args.max_tokens, speculative=spec, rollback=mode) for p in prompts]

                async def spec_runs():
                    async with Engine(model, extra_drafters=[drafter], budget_bytes=int(args.budget_mb * 2**20),
                                      max_running=concurrency, n_max=d, adaptive=False,
                                      max_model_len=args.prompt_tokens + args.max_tokens + 16) as engine:
                        await _run_batch(engine, [GenerationRequest(p, 4, speculative=spec, rollback=mode)
                                                  for p in prompts])  # fmt: skip
                        return await _run_batch(engine, requests)

                result = anyio.run(spec_runs)
                if result["tokens"] != base["tokens"]:
                    raise AssertionError(f"speculative output differs from plain (alpha {alpha}, d {d}, {mode})")
                speedup = result["tokens_per_s"] / base["tokens_per_s"]
                print(f"B={concurrency:2d} alpha={alpha} d={d} {mode:10s}: {result['tokens_per_s']:.2f} tokens/s "
                      f"({speedup:.2f}x plain)", flush=True)  # fmt: skip
                out["runs"].append({"concurrency": concurrency, "mode": mode, "alpha": alpha, "d": d,
                                    "tokens_per_s": result["tokens_per_s"],
                                    "per_seq_tokens_per_s": result["per_seq_tokens_per_s"],
                                    "speedup_vs_plain": speedup})  # fmt: skip
                save_json(out, args.out)  # a partial run still leaves its results
    return out


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    configs = sorted({(r["alpha"], r["d"]) for r in runs if r["mode"] != "plain"})
    fig, axes = plt.subplots(1, len(configs), figsize=(4 * len(configs), 3.5), squeeze=False, sharey=True)
    for ax, (alpha, d) in zip(axes[0], configs):
        for mode in ("plain", "snapshot", "checkpoint", "auto"):
            pts = sorted((r["concurrency"], r["tokens_per_s"]) for r in runs
                         if r["mode"] == mode and (mode == "plain" or (r["alpha"], r["d"]) == (alpha, d)))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=mode)
        ax.set_title(f"alpha={alpha}, d={d}")
        ax.set_xlabel("concurrent sequences")
        ax.set_xscale("log", base=2)
    axes[0][0].set_ylabel("aggregate tokens/s")
    axes[0][-1].legend()
    fig.suptitle(f"{results['model']}: synthetic drafter")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True, help="JSON results; the plot goes beside it as .png")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--alpha", default="0.6,0.9")
    parser.add_argument("--d", default="3,8")
    parser.add_argument("--modes", default="snapshot,checkpoint,auto")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--budget-mb", type=float, default=1024)
    args = parser.parse_args(argv)
    results = run(args)
    save_json(results, args.out)
    plot(results, os.path.splitext(args.out)[0] + ".png")
    return results


if __name__ == "__main__":
    main()
