"""Does speculation pay? The engine on a real GGUF (default: the bundled model), greedy, code prompts: tokens/s of
plain decoding and of each drafter set, one stream and many, every speculative run checked token for token against
the plain run. Writes JSON.

    gdnspec bench speculation --out bench/results/speculation-cpu.json
    gdnspec bench speculation --max-model-len 8192 --streams 16 --out bench/results/speculation-8k.json

Every cell is compiled before it is timed (the engine's warm-up). The cells of a stream count then run in
`--repeats` rounds, each round running every cell once in turn (after one untimed round, in which the drafter
policy's estimates settle), so that a shared machine's drift falls on all cells alike; each cell reports the median
and spread of its rounds and `vs_plain_paired`, the median of its per-round ratios to the plain cell: the ratio
to quote. Also each stream's decoding speed after its first token (`decoding_tokens_per_s_per_stream`: tokens after
the first over the time from the first to the last, summed over requests) and its paired ratio: what drafting does
to generation, without the prompt's prefill, which it leaves as it is. `--rollback snapshot,checkpoint` runs every drafter set under each forced
rollback mode; `--synthetic-alpha A` adds the `synthetic` drafter (the plain run's own tokens, each corrupted with
probability 1 - A), for a known acceptance rate on models whose own drafters have none (random weights).

    gdnspec bench speculation --model M.gguf --drafters "plain;mtp;synthetic" --synthetic-alpha 0.7 \
        --rollback snapshot,checkpoint --streams 1,8

`--max-seqs` below the streams measures an overloaded engine: the requests beyond its rows wait for one.

    gdnspec bench speculation --streams 16,32 --max-seqs 16 --drafters plain --out bench/results/overload.json

The matrix that says whether asking for drafters ever costs a user (every cell should be at least 0.95x plain):
`--plot` draws it as a heat map of each cell's paired ratio, drafter sets by stream counts. A set that names
`draft_model` loads `--draft-model` (default: the bundled draft model, which shares the bundled target's vocabulary).

    gdnspec bench speculation --streams 1,4,16,32 --drafters "plain;ngram;mtp;mtp,ngram;draft_model" \
        --out bench/results/speculation-matrix-cpu.json --plot bench/results/speculation-matrix-cpu.png
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import platform
import statistics
import time

import anyio
import jax

from drafters.draft_model import check_same_vocab
from drafters.synthetic import SyntheticDrafter
from jaxmodel import load_model
from jaxmodel.assets import default_draft_path
from jaxmodel.executor.executables import keep_beside_jax_cache
from jaxmodel.state import KV_DTYPES
from jaxmodel.tokenizer import load_tokenizer
from scheduler import DoneEvent, Engine, GenerationRequest, Replicas, TokensEvent
from scheduler.assembly import DEFAULT_DRAFT_VOCAB, DEFAULT_ITERATIONS

from .prompts import load_prompt_set
from bench import run_and_save, save_json
from jaxmodel.requests import SpeculativeConfig

ASSETS = os.path.join(os.path.dirname(__file__), "..", "jaxmodel", "assets")
DEFAULT_MODEL = os.path.join(ASSETS, "gdnspec-stdlib-target-q8_0.gguf")


async def _stream(engine: Engine | Replicas, request: GenerationRequest) -> dict:
    tokens, drafted, accepted, rollback_steps = [], 0, 0, {}
    first = last = None  # when the first and the last tokens arrived
    async for event in engine.generate(request):
        if isinstance(event, TokensEvent):
            last = time.perf_counter()
            first = first or last
            tokens += event.token_ids
        elif isinstance(event, DoneEvent):
            drafted = sum(s.drafted for s in event.drafters.values())
            accepted = sum(s.accepted for s in event.drafters.values())
            rollback_steps = dict(event.rollback_steps)
    return {"tokens": tokens, "drafted": drafted, "accepted": accepted, "rollback_steps": rollback_steps,
            "decoding_s": last - first if first is not None else 0.0}


async def _run(engine: Engine | Replicas, requests: list[GenerationRequest], streams: int) -> dict:
    """`requests` with at most `streams` in flight; returns tokens per request, wall time and draft counts."""
    results: list[dict | None] = [None] * len(requests)
    limiter = anyio.Semaphore(streams)

    async def one(i: int) -> None:
        async with limiter:
            results[i] = await _stream(engine, requests[i])

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(len(requests)):
            tg.start_soon(one, i)
    wall = time.perf_counter() - start
    n = sum(len(r["tokens"]) for r in results)
    steps = {}
    for r in results:
        for mode, count in r["rollback_steps"].items():
            steps[mode] = steps.get(mode, 0) + count
    decoding = sum(r["decoding_s"] for r in results)
    return {"tokens": [r["tokens"] for r in results], "wall_s": wall, "tokens_per_s": n / wall,
            "decoding_tokens_per_s": sum(len(r["tokens"]) - 1 for r in results) / decoding if decoding else 0.0,
            "drafted": sum(r["drafted"] for r in results), "accepted": sum(r["accepted"] for r in results),
            "rollback_steps": steps}


# JAX's events for its persistent compilation cache (hits, misses, requests); the warm-up counts them.
CACHE_EVENTS = "/jax/compilation_cache/"


def run(args) -> dict:
    steps = keep_beside_jax_cache()  # with JAX_COMPILATION_CACHE_DIR set, as a server keeps them
    model = load_model(args.model)
    tokenizer = load_tokenizer(args.model)
    draft = None
    if any("draft_model" in p.split(",") for p in args.drafters.split(";")):
        draft_path = args.draft_model or str(default_draft_path())
        check_same_vocab(args.model, draft_path)
        draft = load_model(draft_path, load_mtp=False)
    prompts = [tuple(tokenizer.encode(p)) for p in load_prompt_set(args.prompts)]
    streams = [int(s) for s in args.streams.split(",")]
    max_seqs = args.max_seqs or max(streams)
    policies = [p for p in args.drafters.split(";")]
    modes = args.rollback.split(",")
    synthetic = None
    if args.synthetic_alpha is not None:
        synthetic = SyntheticDrafter([], alpha=args.synthetic_alpha, vocab=model.cfg.n_vocab, seed=0)
    out = {"model": os.path.basename(args.model), "backend": jax.default_backend(),
           "machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
           "max_tokens": args.max_tokens, "max_model_len": args.max_model_len, "n_max": args.n_max,
           "p_min": args.p_min, "adaptive": not args.fixed_policy, "iterations": args.iterations, "draft_vocab": args.draft_vocab, "repeats": args.repeats, "synthetic_alpha": args.synthetic_alpha,
           "kv_dtype": args.kv_dtype, "replicas": args.replicas, "max_seqs": max_seqs,
           "draft_model": None if draft is None else os.path.basename(draft.path), "cells": []}  # fmt: skip

    async def main():
        engine_args = dict(tokenizer=tokenizer, budget_bytes=int(args.budget_mb * 2**20), max_running=max_seqs,
                           max_model_len=args.max_model_len, n_max=args.n_max, adaptive=not args.fixed_policy,
                           iterations=args.iterations, draft_vocab=args.draft_vocab,
                           extra_drafters=[synthetic] if synthetic else [], kv_dtype=args.kv_dtype,
                           draft_model=draft)  # fmt: skip
        engine = (Replicas.build(model, args.replicas, **engine_args) if args.replicas > 1
                  else Engine(model, **engine_args))
        start = time.perf_counter()
        cache_events = collections.Counter()
        jax.monitoring.register_event_listener(
            lambda event, **_: cache_events.update([event.removeprefix(CACHE_EVENTS)])
            if event.startswith(CACHE_EVENTS) else None)
        shapes = engine.warmup()
        out["warmup"] = {"shapes": shapes, "seconds": time.perf_counter() - start,
                         "compilation_cache": dict(cache_events),
                         "step_store": None if steps is None else dataclasses.asdict(steps.counts)}
        async with engine:
            for n_streams in streams:
                plain_tokens = None
                cells = [(p, m) for p in policies for m in (modes if p != "plain" else ["auto"])]
                runs: dict[tuple[str, str], list[dict]] = {cell: [] for cell in cells}
                for round_ in range(args.repeats + 1):  # round 0 lets the policy's estimates settle, untimed
                    for policy, mode in cells:
                        drafters = tuple(d for d in policy.split(",") if d and d != "plain")
                        spec = (SpeculativeConfig(drafters, n_max=args.n_max, p_min=args.p_min, rollback=mode)
                                if drafters else None)
                        requests = [GenerationRequest(p, args.max_tokens, speculative=spec) for p in prompts]
                        if n_streams > len(requests):
                            requests = [requests[i % len(requests)] for i in range(n_streams)]
                        if synthetic is not None and "synthetic" in drafters:
                            if plain_tokens is None:
                                raise SystemExit("the synthetic drafter needs the plain run first "
                                                 "(--drafters 'plain;...')")
                            synthetic.references = [list(r.prompt_ids) + list(t)
                                                    for r, t in zip(requests, plain_tokens)]  # fmt: skip
                        result = await _run(engine, requests, n_streams)
                        if plain_tokens is None and not drafters:
                            plain_tokens = result["tokens"]
                        if plain_tokens is not None and result["tokens"] != plain_tokens:
                            raise AssertionError(f"{policy} at {n_streams} streams: output differs from plain")
                        if round_:
                            runs[policy, mode].append(result)
                plain_rates = next(([r["tokens_per_s"] for r in cell_runs] for (policy, _), cell_runs
                                    in runs.items() if policy == "plain"), None)  # fmt: skip
                plain_decoding = next(([r["decoding_tokens_per_s"] for r in cell_runs] for (policy, _), cell_runs
                                       in runs.items() if policy == "plain"), None)  # fmt: skip
                for (policy, mode), cell_runs in runs.items():
                    drafters = tuple(d for d in policy.split(",") if d and d != "plain")
                    rates = [r["tokens_per_s"] for r in cell_runs]
                    last = cell_runs[-1]
                    cell = {"streams": n_streams, "drafters": list(drafters) or ["plain"], "rollback": mode,
                            "tokens_per_s": statistics.median(rates), "min": min(rates), "max": max(rates),
                            "rounds": rates, "drafted": last["drafted"], "accepted": last["accepted"],
                            "rollback_steps": last["rollback_steps"],
                            "generated": sum(len(t) for t in last["tokens"])}  # fmt: skip
                    decoding = [r["decoding_tokens_per_s"] for r in cell_runs]
                    cell["decoding_tokens_per_s_per_stream"] = statistics.median(decoding)
                    if plain_rates:
                        cell["vs_plain_paired"] = statistics.median(r / p for r, p in zip(rates, plain_rates))
                        cell["decoding_vs_plain_paired"] = statistics.median(
                            d / p for d, p in zip(decoding, plain_decoding))
                    out["cells"].append(cell)
                    if args.out:
                        save_json(out, args.out)  # a run cut short keeps the cells it finished
                    paired = (f", {cell['vs_plain_paired']:.3f}x plain (paired; decoding after the first token "
                              f"{cell['decoding_vs_plain_paired']:.3f}x)") if plain_rates else ""
                    print(f"{n_streams:3d} streams {policy:12s} {mode:10s}: {cell['tokens_per_s']:8.1f} tokens/s "
                          f"[{cell['min']:.1f}, {cell['max']:.1f}]{paired}  drafted {cell['drafted']}, accepted "
                          f"{cell['accepted']} of {cell['generated']} tokens (last round), rollback steps "
                          f"{cell['rollback_steps']}", flush=True)  # fmt: skip
        base = {c["streams"]: c["tokens_per_s"] for c in out["cells"] if c["drafters"] == ["plain"]}
        for cell in out["cells"]:
            if cell["streams"] in base:
                cell["vs_plain"] = cell["tokens_per_s"] / base[cell["streams"]]

    anyio.run(main)
    if args.plot:
        plot(out, args.plot)
    return out


def plot(results: dict, path: str) -> None:
    """A heat map of the paired ratio to plain per (drafter set, rollback mode) and stream count: red below 1
    (asking for drafters cost the user), blue above, each cell annotated with its ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cells = [c for c in results["cells"] if c["drafters"] != ["plain"] and "vs_plain_paired" in c]
    rows = list(dict.fromkeys((",".join(c["drafters"]), c["rollback"]) for c in cells))
    streams = sorted({c["streams"] for c in cells})
    ratio = np.full((len(rows), len(streams)), np.nan)
    for c in cells:
        ratio[rows.index((",".join(c["drafters"]), c["rollback"])), streams.index(c["streams"])] = c["vs_plain_paired"]
    spread = max(0.25, float(np.nanmax(np.abs(np.log2(ratio))))) if cells else 1.0
    fig, ax = plt.subplots(figsize=(max(1.3 * len(streams) + 2.5, 6), 0.5 * len(rows) + 1.8))
    ax.imshow(np.log2(ratio), cmap="RdBu", vmin=-spread, vmax=spread, aspect="auto")
    for i in range(len(rows)):
        for j in range(len(streams)):
            if not np.isnan(ratio[i, j]):
                dark = abs(np.log2(ratio[i, j])) > 0.6 * spread
                ax.text(j, i, f"{ratio[i, j]:.2f}x", ha="center", va="center", fontsize="small",
                        color="white" if dark else "black")
    ax.set_xticks(range(len(streams)), [str(s) for s in streams])
    ax.set_yticks(range(len(rows)), [d if m == "auto" else f"{d} ({m})" for d, m in rows])
    ax.set_xlabel("concurrent streams")
    ax.set_title(f"{results['model']}\ntokens/s against plain (paired median of {results['repeats']} rounds)",
                 fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def model_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of every engine benchmark over a prompt set (this one, `bench.iterations`, `bench.mixed`):
    model, output, prompts."""
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--out", default=None, help="write JSON results here")
    parser.add_argument("--prompts", default="code", help="a named prompt set or a file (see bench/prompts.py)")


def workload_arguments(parser: argparse.ArgumentParser, drafters: str) -> None:
    """The options this benchmark shares with `bench.iterations`: `model_arguments`, streams, drafters."""
    model_arguments(parser)
    parser.add_argument("--streams", default="1,16", help="concurrent streams, comma-separated")
    parser.add_argument("--drafters", default=drafters, help="drafter sets separated by ';' (plain: none)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--n-max", type=int, default=3)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    workload_arguments(parser, drafters="plain;mtp;ngram;mtp,ngram")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-dtype", default="float32", choices=KV_DTYPES, help="the target's KV cache")
    parser.add_argument("--budget-mb", type=float, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=DEFAULT_ITERATIONS,
                        help="most iterations per device call (1: one per host round trip)")
    parser.add_argument("--draft-vocab", type=int, default=DEFAULT_DRAFT_VOCAB,
                        help="the MTP head drafts among token ids below this")
    parser.add_argument("--fixed-policy", action="store_true", help="draft n_max with the first drafter always")
    parser.add_argument("--rollback", default="auto", help="rollback modes to force, comma-separated "
                        "(auto, snapshot, checkpoint); each speculative drafter set runs under each")
    parser.add_argument("--synthetic-alpha", type=float, default=None,
                        help="add the `synthetic` drafter with this acceptance rate")
    parser.add_argument("--p-min", type=float, default=0.0,
                        help="draft probability below which a chain stops (the request's p_min)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="engines serving side by side, each with its share of the rows and the budget")
    parser.add_argument("--draft-model", default=None,
                        help="the draft model of a drafter set naming draft_model (default: the bundled one)")
    parser.add_argument("--plot", default=None, help="write a heat map of the cells' ratios to plain here (PNG)")
    parser.add_argument("--max-seqs", type=int, default=None,
                        help="sequences running at once (default: the most streams); fewer than the streams: the "
                        "others wait for a row")
    return run_and_save(run, parser.parse_args(argv))


if __name__ == "__main__":
    main()
