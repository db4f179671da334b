"""Engine throughput with the synthetic drafter: tokens/s per sequence and aggregate for plain decoding and for
drafts of d tokens accepted at rate alpha, per rollback mode, concurrency and memory budget. Writes JSON, PNG
plots and a markdown table (docs/performance.md, "Rollback under memory pressure").

    gdnspec bench engine --model bench/out/qwen35-0.8b-f32.gguf --out bench/results/engine-cpu.json
    gdnspec bench engine --model ... --budgets-mb 8,64,1024 --concurrency 16 --out ...   # a budget sweep
    gdnspec bench engine --model ... --budgets-mb 0.4,1 --per-sequence --concurrency 1,4,16 --out ...

One engine per (concurrency, budget) serves every cell of it: it compiles all its step shapes first
(`Engine.warmup`, which also calibrates the costs `auto` weighs), so no cell pays a compilation, then runs plain
decoding (after one untimed batch) and each (alpha, d) `--repeats` times, every mode once per repeat in turn,
starting with another each time (so that a slow spell on a shared machine falls on all modes alike), reporting the
median with the range and the rollback steps each mode took. Every speculative run is checked against the plain
run's tokens (the lossless invariant) before it is reported. `cells` compares, per (concurrency, budget, alpha, d),
auto with the best forced mode, by their medians and (`auto_vs_best_paired`) by the median of the ratios of runs
from the same repeat, which cancels the slow drift of a shared machine. The synthetic drafter corrupts the same
positions of a sequence in every run (`drafters.synthetic`), so every mode and repeat meets the same acceptances.
With `--per-sequence` each budget is per concurrent sequence (the engine gets it times the concurrency), so one
budget means the same planes per sequence at every concurrency.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from collections import Counter

import anyio
import numpy as np

from drafters.synthetic import SyntheticDrafter
from jaxmodel import load_model
from scheduler import DoneEvent, Engine, GenerationRequest, TokensEvent
from scheduler.assembly import DEFAULT_ITERATIONS
from bench import save_json
from jaxmodel.requests import SpeculativeConfig


async def _run_batch(engine: Engine, requests: list[GenerationRequest]) -> dict:
    """All requests at once; returns tokens per request and timings."""
    results: dict[int, dict] = {}
    rollback_steps: Counter[str] = Counter()
    drafted = 0

    async def one(i: int, request: GenerationRequest):
        nonlocal drafted
        tokens, first, start = [], None, time.perf_counter()
        async for event in engine.generate(request):
            if isinstance(event, TokensEvent):
                first = first or time.perf_counter()
                tokens += event.token_ids
            elif isinstance(event, DoneEvent):
                rollback_steps.update(event.rollback_steps)
                drafted += sum(stats.drafted for stats in event.drafters.values())
        results[i] = {"tokens": tokens, "start": start, "first": first, "end": time.perf_counter()}

    start, cpu_start = time.perf_counter(), time.process_time()
    async with anyio.create_task_group() as tg:
        for i, request in enumerate(requests):
            tg.start_soon(one, i, request)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    total = sum(len(r["tokens"]) for r in results.values())
    per_seq = [len(r["tokens"]) / (r["end"] - r["start"]) for r in results.values()]
    return {"tokens": [results[i]["tokens"] for i in range(len(requests))], "wall_s": wall, "cpu_s": cpu,
            "tokens_per_s": total / wall, "tokens_per_cpu_s": total / cpu,
            "per_seq_tokens_per_s": float(np.mean(per_seq)), "rollback_steps": dict(rollback_steps),
            "drafted": drafted}  # fmt: skip


def _cell(runs: list[dict]) -> dict:
    rates = [r["tokens_per_s"] for r in runs]
    steps: Counter[str] = Counter()
    for r in runs:
        steps.update(r["rollback_steps"])
    drafted = sum(r["drafted"] for r in runs)
    return {"tokens_per_s": statistics.median(rates), "min": min(rates), "max": max(rates), "rates": rates,
            "tokens_per_cpu_s": statistics.median(r["tokens_per_cpu_s"] for r in runs),
            "per_seq_tokens_per_s": statistics.median(r["per_seq_tokens_per_s"] for r in runs),
            "rollback_steps": dict(steps), "drafts_per_step": drafted / max(sum(steps.values()), 1)}  # fmt: skip


def compare_auto(runs: list[dict], key: str = "tokens_per_s") -> list[dict]:
    """Per (concurrency, budget, alpha, d): auto's tokens/s (or `key`) against the best forced mode's.

    A forced mode that never rolled back in its own mode is left out (`not_rolled_back`): forced snapshot without
    a free plane drafts nothing, so its figure is plain decoding's, not a rollback mode's. `shorter_drafts` names
    the forced modes that verified under 0.9x auto's drafts per step (forced snapshot shortens drafts to the free
    planes), which compares draft lengths as much as rollback modes."""
    cells = []
    keys = sorted({(r["concurrency"], r["budget_mb"], r["alpha"], r["d"]) for r in runs if r["mode"] == "auto"})
    for cell in keys:
        same = {r["mode"]: r for r in runs if (r["concurrency"], r["budget_mb"], r["alpha"], r["d"]) == cell}
        forced = {m: r for m, r in same.items() if m not in ("auto", "plain") and r["rollback_steps"].get(m, 0)}
        idle = sorted(m for m in same if m not in ("auto", "plain") and m not in forced)
        if not forced:
            continue
        best = max(forced, key=lambda m: forced[m][key])
        auto = same["auto"][key]
        paired = None
        if key == "tokens_per_s" and "rates" in same["auto"]:  # run i of every mode comes from the same repeat
            paired = statistics.median(a / b for a, b in zip(same["auto"]["rates"], forced[best]["rates"]))
        cells.append({"concurrency": cell[0], "budget_mb": cell[1], "alpha": cell[2], "d": cell[3], "by": key,
                      "auto": auto, "best_forced": best, "best_forced_rate": forced[best][key],
                      "auto_vs_best": auto / forced[best][key], "auto_vs_best_paired": paired,
                      "auto_rollback_steps": same["auto"]["rollback_steps"], "not_rolled_back": idle,
                      "shorter_drafts": sorted(m for m, r in forced.items() if "drafts_per_step" in r and
                                               r["drafts_per_step"] < 0.9 * same["auto"]["drafts_per_step"])})  # fmt: skip
    return cells


def run(args) -> dict:
    model = load_model(args.model, load_mtp=not args.no_mtp)
    rng = np.random.default_rng(0)
    alphas = [float(a) for a in args.alpha.split(",")]
    lengths = [int(d) for d in args.d.split(",")]
    modes = args.modes.split(",")
    out = {"model": os.path.basename(args.model), "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens,
           "repeats": args.repeats, "chunk_size": args.chunk_size, "iterations": args.iterations,
           "per_sequence": args.per_sequence, "runs": []}  # fmt: skip
    for concurrency, budget_arg in itertools.product(map(int, args.concurrency.split(",")),
                                                     map(float, args.budgets_mb.split(","))):  # fmt: skip
        budget_mb = budget_arg * concurrency if args.per_sequence else budget_arg
        prompts = [tuple(int(t) for t in rng.integers(0, model.cfg.n_vocab, args.prompt_tokens))
                   for _ in range(concurrency)]  # fmt: skip
        drafters = {a: SyntheticDrafter([], alpha=a, vocab=model.cfg.n_vocab, seed=1) for a in alphas}
        for a, drafter in drafters.items():
            drafter.name = f"synthetic{int(round(a * 100))}"
        engine = Engine(model, extra_drafters=list(drafters.values()), budget_bytes=int(budget_mb * 2**20),
                        max_running=concurrency, n_max=max(lengths), adaptive=False, chunk_size=args.chunk_size,
                        iterations=args.iterations, max_model_len=args.prompt_tokens + args.max_tokens + 16)  # fmt: skip
        start = time.perf_counter()
        n_shapes = engine.warmup()
        sizes = engine.memory.sizes
        rebuild_seconds, rebuild_rows = engine.runtime.costs.rebuild_cost(concurrency) or (None, None)
        calibrated = {"concurrency": concurrency, "budget_mb": budget_mb,
                      "plane_write_seconds": engine.runtime.costs.plane_write_cost(concurrency),
                      "rebuild_seconds": rebuild_seconds, "rebuild_rows": rebuild_rows,
                      "step_seconds": engine.runtime.costs.step_costs(concurrency)}  # what auto weighs
        out.setdefault("calibrated", []).append(calibrated)
        print(f"B={concurrency:2d} budget {budget_mb:g} MB: {n_shapes} shapes compiled in "
              f"{time.perf_counter() - start:.0f} s; {sizes.n_planes - 1} planes, {sizes.n_pages - 1} pages, "
              f"replay pool {sizes.replay_tokens} tokens per row; calibrated {calibrated}", flush=True)  # fmt: skip

        async def cells():
            async with engine:
                await _run_batch(engine, [GenerationRequest(p, args.max_tokens) for p in prompts])  # warm-up
                plain = [await _run_batch(engine, [GenerationRequest(p, args.max_tokens) for p in prompts])
                         for _ in range(args.repeats)]  # fmt: skip
                base = _cell(plain)
                out["runs"].append({"concurrency": concurrency, "budget_mb": budget_mb, "mode": "plain",
                                    "alpha": None, "d": 0, "planes": sizes.n_planes - 1,
                                    "budget_mb_per_seq": budget_mb / concurrency, **base})  # fmt: skip
                print(f"B={concurrency:2d} {budget_mb:g} MB plain: {base['tokens_per_s']:.1f} tokens/s, "
                      f"{base['tokens_per_cpu_s']:.1f} per CPU s", flush=True)  # fmt: skip
                for drafter in drafters.values():
                    drafter.references[:] = [list(p) + t for p, t in zip(prompts, plain[0]["tokens"])]
                for alpha, d in itertools.product(alphas, lengths):
                    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
                    for repeat in range(args.repeats):
                        for mode in modes[repeat % len(modes):] + modes[: repeat % len(modes)]:  # each one first
                            spec = SpeculativeConfig((drafters[alpha].name,), n_max=d, rollback=mode)
                            requests = [GenerationRequest(p, args.max_tokens, speculative=spec) for p in prompts]
                            result = await _run_batch(engine, requests)
                            if result["tokens"] != plain[0]["tokens"]:
                                raise AssertionError(f"speculative output differs from plain (alpha {alpha}, d {d}, "
                                                     f"{mode})")  # fmt: skip
                            runs[mode].append(result)
                    for mode in modes:
                        cell = _cell(runs[mode])
                        cell["speedup_vs_plain"] = cell["tokens_per_s"] / base["tokens_per_s"]
                        out["runs"].append({"concurrency": concurrency, "budget_mb": budget_mb, "mode": mode,
                                            "alpha": alpha, "d": d, "planes": sizes.n_planes - 1,
                                            "budget_mb_per_seq": budget_mb / concurrency, **cell})  # fmt: skip
                        print(f"B={concurrency:2d} {budget_mb:g} MB alpha={alpha} d={d} {mode:10s}: "
                              f"{cell['tokens_per_s']:.1f} tokens/s [{cell['min']:.1f}, {cell['max']:.1f}] "
                              f"({cell['speedup_vs_plain']:.2f}x plain), {cell['tokens_per_cpu_s']:.1f} per CPU s, "
                              f"steps {cell['rollback_steps']}, {cell['drafts_per_step']:.2f} drafts per step",
                              flush=True)  # fmt: skip
                    out["cells"] = compare_auto(out["runs"]) + compare_auto(out["runs"], "tokens_per_cpu_s")
                    save_json(out, args.out)  # a partial run still leaves its results

        anyio.run(cells)
    out["cells"] = compare_auto(out["runs"]) + compare_auto(out["runs"], "tokens_per_cpu_s")
    for c in out["cells"]:
        print(f"B={c['concurrency']:2d} {c['budget_mb']:g} MB alpha={c['alpha']} d={c['d']} ({c['by']}): auto "
              f"{c['auto']:.1f}, best forced {c['best_forced']} {c['best_forced_rate']:.1f}: "
              f"{c['auto_vs_best']:.2f}x" + (f" (paired {c['auto_vs_best_paired']:.2f}x)" if c.get("auto_vs_best_paired")
                                              else ""), flush=True)  # fmt: skip
    return out


def plot(results: dict, path: str) -> None:
    """Aggregate tokens/s per mode, one panel per (concurrency, alpha, d): against the budget when the run swept
    budgets (per sequence with --per-sequence), else against concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    per_seq = results.get("per_sequence", False)
    budget_key = "budget_mb_per_seq" if per_seq else "budget_mb"
    sweeps_budget = len({r[budget_key] for r in runs}) > 1
    if sweeps_budget:
        x_key, x_label = budget_key, "budget per sequence (MB)" if per_seq else "budget (MB)"
        panel_rows = sorted({r["concurrency"] for r in runs})
    else:
        x_key, x_label, panel_rows = "concurrency", "concurrent sequences", [None]
    configs = sorted({(r["alpha"], r["d"]) for r in runs if r["mode"] != "plain"})
    fig, axes = plt.subplots(len(panel_rows), len(configs), figsize=(4 * len(configs), 3.2 * len(panel_rows)),
                             squeeze=False, sharey="row")  # fmt: skip
    for row_axes, concurrency in zip(axes, panel_rows):
        chosen = [r for r in runs if concurrency is None or r["concurrency"] == concurrency]
        for ax, (alpha, d) in zip(row_axes, configs):
            for mode in ("plain", "snapshot", "checkpoint", "replay", "auto"):
                pts = sorted((r[x_key], r["tokens_per_s"]) for r in chosen
                             if r["mode"] == mode and (mode == "plain" or (r["alpha"], r["d"]) == (alpha, d)))
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=mode)
            title = f"alpha={alpha}, d={d}"
            ax.set_title(title if concurrency is None else f"{concurrency} sequences, {title}", fontsize="medium")
            ax.set_xscale("log", base=2)
            xs = sorted({r[x_key] for r in chosen})
            ax.set_xticks(xs, [f"{x:g}" for x in xs])
            ax.minorticks_off()
        row_axes[0].set_ylabel("aggregate tokens/s")
    for ax in axes[-1]:
        ax.set_xlabel(x_label)
    axes[0][-1].legend(fontsize="small", loc="lower right")
    fig.suptitle(f"{results['model']}: synthetic drafter (median of {results['repeats']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def markdown_table(results: dict) -> str:
    """The markdown table of a run: one line per (concurrency, budget, alpha, d), aggregate tokens/s per mode
    (bold: the best forced mode; "(none)": a forced mode that never rolled back in its own mode), auto's rollback
    steps, and auto over the best forced mode by medians and (in brackets) paired."""
    runs = results["runs"]
    per_seq = results.get("per_sequence", False)
    cells = {(c["concurrency"], c["budget_mb"], c["alpha"], c["d"]): c for c in results["cells"]
             if c["by"] == "tokens_per_s"}  # fmt: skip
    lines = ["| seqs | budget" + (" / seq" if per_seq else "") + " | planes | alpha | d | plain | snapshot | "
             "checkpoint | replay | auto | auto's steps (s / c / r) | auto / best (paired) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    plain = {(r["concurrency"], r["budget_mb"]): r for r in runs if r["mode"] == "plain"}
    for key, cell in sorted(cells.items()):
        same = {r["mode"]: r for r in runs if (r["concurrency"], r["budget_mb"], r["alpha"], r["d"]) == key}
        base = plain[key[:2]]
        rates = []
        for mode in ("snapshot", "checkpoint", "replay", "auto"):
            rate = f"{same[mode]['tokens_per_s']:.1f}" if mode in same else "-"
            if mode == cell["best_forced"]:
                rate = f"**{rate}**"
            elif mode in cell["not_rolled_back"]:
                rate += " (none)"
            rates.append(rate)
        steps = cell["auto_rollback_steps"]
        budget = base["budget_mb_per_seq"] if per_seq else key[1]
        paired = cell.get("auto_vs_best_paired")
        lines.append(f"| {key[0]} | {budget:g} MB | {base['planes']} | {key[2]} | {key[3]} | "
                     f"{base['tokens_per_s']:.1f} | " + " | ".join(rates) + " | "
                     f"{steps.get('snapshot', 0)} / {steps.get('checkpoint', 0)} / {steps.get('replay', 0)} | "
                     f"{cell['auto_vs_best']:.2f}" + (f" ({paired:.2f})" if paired is not None else "") + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True, help="JSON results; the plot goes beside it as .png, the markdown "
                        "table as .md")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--alpha", default="0.6,0.9")
    parser.add_argument("--d", default="3,8")
    parser.add_argument("--modes", default="snapshot,checkpoint,replay,auto")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--budgets-mb", default="1024", help="memory budgets to sweep, comma-separated")
    parser.add_argument("--per-sequence", action="store_true", help="--budgets-mb are per concurrent sequence")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-size", type=int, default=128, help="the engine's prompt chunk (fewer shapes when "
                        "no larger than the prompts)")
    parser.add_argument("--iterations", type=int, default=DEFAULT_ITERATIONS,
                        help="iterations per device call while the host has nothing to decide (plain decoding and "
                        "rows drafted on device only; the synthetic drafter drafts on the host)")
    parser.add_argument("--no-mtp", action="store_true", help="load the target without its MTP head (the synthetic "
                        "drafter does not use it; its branch then does not compile)")
    args = parser.parse_args(argv)
    results = run(args)
    save_json(results, args.out)
    plot(results, os.path.splitext(args.out)[0] + ".png")
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(markdown_table(results))
    return results


if __name__ == "__main__":
    main()
