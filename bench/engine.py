"""Engine throughput with the synthetic drafter: tokens/s per sequence and aggregate for plain decoding and for
drafts of d tokens accepted at rate alpha, per rollback mode, concurrency and memory budget. Writes JSON and PNG
plots.

    gdnspec bench engine --model bench/out/qwen35-0.8b-f32.gguf --out bench/results/engine-cpu.json
    gdnspec bench engine --model ... --budgets-mb 8,64,1024 --concurrency 16 --out ...   # a budget sweep

One engine per (concurrency, budget) serves every cell of it: it compiles all its step shapes first
(`Engine.warmup`), so no cell pays a compilation, then runs plain decoding and each (alpha, d, mode) `--repeats`
times, reporting the median with the range. Every speculative run is checked against the plain run's tokens (the
lossless invariant) before it is reported.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time

import anyio
import numpy as np

from drafters.policy import SpeculativeConfig
from drafters.synthetic import SyntheticDrafter
from jaxmodel import load_model
from scheduler import Engine, GenerationRequest, TokensEvent
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


def _cell(runs: list[dict]) -> dict:
    rates = [r["tokens_per_s"] for r in runs]
    return {"tokens_per_s": statistics.median(rates), "min": min(rates), "max": max(rates),
            "per_seq_tokens_per_s": statistics.median(r["per_seq_tokens_per_s"] for r in runs)}  # fmt: skip


def run(args) -> dict:
    model = load_model(args.model)
    rng = np.random.default_rng(0)
    alphas = [float(a) for a in args.alpha.split(",")]
    lengths = [int(d) for d in args.d.split(",")]
    modes = args.modes.split(",")
    out = {"model": os.path.basename(args.model), "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens,
           "repeats": args.repeats, "runs": []}  # fmt: skip
    for concurrency, budget_mb in itertools.product(map(int, args.concurrency.split(",")),
                                                    map(float, args.budgets_mb.split(","))):  # fmt: skip
        prompts = [tuple(int(t) for t in rng.integers(0, model.cfg.n_vocab, args.prompt_tokens))
                   for _ in range(concurrency)]  # fmt: skip
        drafters = {a: SyntheticDrafter([], alpha=a, vocab=model.cfg.n_vocab, seed=1) for a in alphas}
        for a, drafter in drafters.items():
            drafter.name = f"synthetic{int(round(a * 100))}"
        engine = Engine(model, extra_drafters=list(drafters.values()), budget_bytes=int(budget_mb * 2**20),
                        max_running=concurrency, n_max=max(lengths), adaptive=False,
                        max_model_len=args.prompt_tokens + args.max_tokens + 16)  # fmt: skip
        start = time.perf_counter()
        n_shapes = engine.warmup()
        print(f"B={concurrency:2d} budget {budget_mb:g} MB: {n_shapes} shapes compiled in "
              f"{time.perf_counter() - start:.0f} s", flush=True)  # fmt: skip

        async def cells():
            async with engine:
                plain = [await _run_batch(engine, [GenerationRequest(p, args.max_tokens) for p in prompts])
                         for _ in range(args.repeats)]  # fmt: skip
                base = _cell(plain)
                out["runs"].append({"concurrency": concurrency, "budget_mb": budget_mb, "mode": "plain",
                                    "alpha": None, "d": 0, **base})  # fmt: skip
                print(f"B={concurrency:2d} {budget_mb:g} MB plain: {base['tokens_per_s']:.1f} tokens/s", flush=True)
                for drafter in drafters.values():
                    drafter.references[:] = [list(p) + t for p, t in zip(prompts, plain[0]["tokens"])]
                for alpha, d, mode in itertools.product(alphas, lengths, modes):
                    spec = SpeculativeConfig((drafters[alpha].name,), n_max=d, rollback=mode)
                    requests = [GenerationRequest(p, args.max_tokens, speculative=spec) for p in prompts]
                    runs = [await _run_batch(engine, requests) for _ in range(args.repeats)]
                    if any(r["tokens"] != plain[0]["tokens"] for r in runs):
                        raise AssertionError(f"speculative output differs from plain (alpha {alpha}, d {d}, {mode})")
                    cell = _cell(runs)
                    cell["speedup_vs_plain"] = cell["tokens_per_s"] / base["tokens_per_s"]
                    out["runs"].append({"concurrency": concurrency, "budget_mb": budget_mb, "mode": mode,
                                        "alpha": alpha, "d": d, **cell})  # fmt: skip
                    print(f"B={concurrency:2d} {budget_mb:g} MB alpha={alpha} d={d} {mode:10s}: "
                          f"{cell['tokens_per_s']:.1f} tokens/s [{cell['min']:.1f}, {cell['max']:.1f}] "
                          f"({cell['speedup_vs_plain']:.2f}x plain)", flush=True)  # fmt: skip
                    save_json(out, args.out)  # a partial run still leaves its results

        anyio.run(cells)
    return out


def plot(results: dict, path: str) -> None:
    """Aggregate tokens/s per mode, one panel per (alpha, d): against concurrency at each budget, or against the
    budget when the run swept budgets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    budgets = sorted({r["budget_mb"] for r in runs})
    x_key, x_label = ("budget_mb", "budget (MB)") if len(budgets) > 1 else ("concurrency", "concurrent sequences")
    configs = sorted({(r["alpha"], r["d"]) for r in runs if r["mode"] != "plain"})
    fig, axes = plt.subplots(1, len(configs), figsize=(4 * len(configs), 3.5), squeeze=False, sharey=True)
    for ax, (alpha, d) in zip(axes[0], configs):
        for mode in ("plain", "snapshot", "checkpoint", "auto"):
            pts = sorted((r[x_key], r["tokens_per_s"]) for r in runs
                         if r["mode"] == mode and (mode == "plain" or (r["alpha"], r["d"]) == (alpha, d)))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=mode)
        ax.set_title(f"alpha={alpha}, d={d}")
        ax.set_xlabel(x_label)
        ax.set_xscale("log", base=2)
    axes[0][0].set_ylabel("aggregate tokens/s")
    axes[0][-1].legend()
    fig.suptitle(f"{results['model']}: synthetic drafter (median of {results['repeats']})")
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
    parser.add_argument("--budgets-mb", default="1024", help="memory budgets to sweep, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    results = run(args)
    save_json(results, args.out)
    plot(results, os.path.splitext(args.out)[0] + ".png")
    return results


if __name__ == "__main__":
    main()
