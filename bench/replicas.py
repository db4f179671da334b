"""Decoding throughput of one runtime of R rows against N runtimes of R / N rows each whose calls run side by side,
one Python thread each (data parallelism over the cores instead of splitting each operation over them), then the
same for whole engines: one `Engine` against `Replicas` of N serving R streams. On a 2-core CPU a 16-row
iteration's XLA operations run on one core while the other waits ("A 16-row iteration's serial work" in
docs/performance.md); two 8-row runtimes keep both cores on their own work.

The runtimes loop calls of plain decoding from the prompts' ends (`bench.decoding_rows`); the engines serve R
requests of the code prompts at once. Forms alternate round by round, in one process, and each row's (first call)
and each request's tokens are checked equal between them. Writes JSON.

    gdnspec bench replicas --rows 16 --replicas 2 --rounds 5 --engine-rounds 7 --out bench/results/replicas-cpu.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import threading
import time

import jax

from jaxmodel import load_model
from jaxmodel.executor import Runtime, Shapes, share_buckets
from jaxmodel.tokenizer import load_tokenizer
from scheduler import Engine, GenerationRequest, Replicas

from . import run_and_save
from .decoding_rows import PAGE_SIZE, PLANES_PER_ROW, committed_tokens, prefilled_loops, sequences
from .prompts import load_prompt_set
from .speculation import _run, model_arguments


class Replica:
    """A runtime and its decoding rows, prefilled from `prompts`: `call()` runs one looping call over all of them
    from the prompts' ends and returns each row's tokens. Only the first call's tokens follow the prefill exactly (a
    loop writes its read plane again; `prefilled_loops`); later calls decode the same positions in the same shapes,
    which is what the timing needs."""

    def __init__(self, model, prompts: list[list[int]], iterations: int, row_buckets: tuple[int, ...] = ()):
        n_rows = len(prompts)
        per_row = -(-(max(len(p) for p in prompts) + iterations + 8) // PAGE_SIZE)
        self.runtime = Runtime(model, n_pages=n_rows * per_row + 2, n_planes=n_rows * PLANES_PER_ROW + 2,
                               page_size=PAGE_SIZE, max_iterations=iterations,
                               shapes=Shapes(max_rows=n_rows, max_tokens=256, max_logit_rows=1, pages_per_row=per_row,
                                             row_buckets=row_buckets))  # fmt: skip
        self.iterations = iterations
        self.rows = prefilled_loops(self.runtime, sequences(prompts, per_row))

    def call(self) -> list[list[int]]:
        return committed_tokens(self.runtime.step(self.rows, iterations=self.iterations))


def row_iterations_per_second(replicas: list[Replica], seconds: float) -> float:
    """Row-iterations a second of `replicas` looping their calls side by side, a thread each, for `seconds`."""
    calls = [0] * len(replicas)
    stop = time.perf_counter() + seconds

    def loop(i: int) -> None:
        while time.perf_counter() < stop:
            replicas[i].call()
            calls[i] += 1

    start = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(replicas))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    return sum(n * len(r.rows) * r.iterations for n, r in zip(calls, replicas)) / elapsed


def run(args) -> dict:
    if args.rows % args.replicas:
        raise SystemExit(f"--rows {args.rows} is not a multiple of --replicas {args.replicas}")
    model = load_model(args.model)
    tokenizer = load_tokenizer(args.model)
    texts = load_prompt_set(args.prompts)
    prompts = [list(tokenizer.encode(texts[i % len(texts)])) for i in range(args.rows)]
    per_replica = args.rows // args.replicas
    whole = Replica(model, prompts, args.iterations)
    parts = [Replica(model, prompts[i * per_replica:(i + 1) * per_replica], args.iterations,
                     share_buckets(per_replica)) for i in range(args.replicas)]  # fmt: skip
    tokens_whole = whole.call()
    tokens_parts = [tokens for part in parts for tokens in part.call()]
    out = {"model": os.path.basename(args.model), "backend": jax.default_backend(),
           "machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(), "rows": args.rows,
           "replicas": args.replicas, "iterations": args.iterations, "seconds": args.seconds,
           "tokens_equal": tokens_whole == tokens_parts, "rounds": []}  # fmt: skip
    for round_ in range(args.rounds):
        one = row_iterations_per_second([whole], args.seconds)
        side_by_side = row_iterations_per_second(parts, args.seconds)
        out["rounds"].append({"one": one, "replicas": side_by_side, "ratio": side_by_side / one})
        print(f"round {round_}: one runtime of {args.rows} rows {one:.0f} row-iterations/s, {args.replicas} of "
              f"{per_replica} side by side {side_by_side:.0f} ({side_by_side / one:.2f}x)", flush=True)
    out["ratio"] = statistics.median(r["ratio"] for r in out["rounds"])
    print(f"median {out['ratio']:.2f}x; each row's tokens equal in both forms: {out['tokens_equal']}")
    if args.engine_rounds:
        out["engines"] = engines(args, model, tokenizer, [tuple(p) for p in prompts])
    return out


def engines(args, model, tokenizer, prompts: list[tuple[int, ...]]) -> dict:
    """Tokens a second of one engine and of `Replicas`, `args.rows` requests of args.max_tokens at once, rounds
    alternating (the first of each untimed)."""
    import anyio

    engine_args = dict(tokenizer=tokenizer, budget_bytes=256 << 20, max_running=args.rows, max_model_len=2048,
                       n_max=3)  # fmt: skip
    forms = {"one": Engine(model, **engine_args), "replicas": Replicas.build(model, args.replicas, **engine_args)}
    for form in forms.values():
        form.warmup()
    requests = [GenerationRequest(p, args.max_tokens) for p in prompts]
    rates: dict[str, list[float]] = {name: [] for name in forms}
    tokens: dict[str, list] = {}

    async def main():
        async with forms["one"], forms["replicas"]:
            for round_ in range(args.engine_rounds + 1):
                for name, form in forms.items():
                    result = await _run(form, requests, len(requests))
                    tokens[name] = result["tokens"]
                    if round_:
                        rates[name].append(result["tokens_per_s"])
                if round_:
                    print(f"engine round {round_}: one engine {rates['one'][-1]:.0f} tokens/s, replicas "
                          f"{rates['replicas'][-1]:.0f} ({rates['replicas'][-1] / rates['one'][-1]:.2f}x)", flush=True)

    anyio.run(main)
    ratios = [r / o for o, r in zip(rates["one"], rates["replicas"])]
    result = {"streams": len(requests), "max_tokens": args.max_tokens, "one": rates["one"],
              "replicas": rates["replicas"], "ratios": ratios, "ratio": statistics.median(ratios),
              "tokens_equal": tokens["one"] == tokens["replicas"]}  # fmt: skip
    print(f"engines: median {result['ratio']:.2f}x; every request's tokens equal: {result['tokens_equal']}")
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="gdnspec bench replicas", description=__doc__.split("\n\n")[0])
    model_arguments(parser)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=32, help="iterations per call")
    parser.add_argument("--seconds", type=float, default=5.0, help="of looping calls per form and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine-rounds", type=int, default=5, help="of the engine comparison (0: none)")
    parser.add_argument("--max-tokens", type=int, default=128, help="of each request in the engine comparison")
    return run_and_save(run, parser.parse_args(argv))


if __name__ == "__main__":
    main()
