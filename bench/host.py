"""The host's share of a looping device call: `Scheduler.update` over the rows of a call that ran many iterations
(advancing each row's planes, appending and detokenizing its tokens, one tokens event per row), with the bundled
model's tokenizer and no model. A call of 64 iterations of 16 rows returns 1024 iterations for the host to walk
while the device waits for the next call. Writes JSON.

    gdnspec bench host --rows 16 --iterations 64 --rounds 30 --out bench/results/host-update.json
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time

from jaxmodel.tokenizer import load_tokenizer
from scheduler.core import Scheduler
from scheduler.memory import MemoryManager, PoolSizes
from scheduler.types import Committed, Continued, Request, TokensEvent

from . import run_and_save
from .speculation import DEFAULT_MODEL


def update_seconds(tokenizer, n_rows: int, n_iterations: int, seed: int) -> float:
    """Seconds `Scheduler.update` takes for one step of `n_rows` decoding rows (snapshot mode, no drafts) that ran
    `n_iterations` iterations each, tokens drawn from the vocabulary (so the detokenizer meets new tokens too)."""
    rng = random.Random(seed)
    n_vocab = len(tokenizer.vocab.tokens)
    memory = MemoryManager(PoolSizes(n_pages=64 * n_rows, n_planes=4 * n_rows + 2, page_size=16, replay_tokens=4))
    scheduler = Scheduler(memory, tokenizer.detokenizer, max_model_len=1024, token_budget=64 * n_rows,
                          max_running=n_rows)  # fmt: skip
    for i in range(n_rows):
        scheduler.add(Request(i, tuple(rng.randrange(n_vocab) for _ in range(16)), max_tokens=n_iterations + 2))
    plan = scheduler.schedule()  # the prompts
    scheduler.update(plan, {row.seq_id: Committed((rng.randrange(n_vocab),), 0) for row in plan.rows})
    plan = scheduler.schedule()
    committed = {row.seq_id: Committed((rng.randrange(n_vocab),), 0) for row in plan.rows}
    continued = {row.seq_id: [Continued((), Committed((rng.randrange(n_vocab),), 0)) for _ in range(n_iterations - 1)]
                 for row in plan.rows}  # fmt: skip
    start = time.perf_counter()
    events = scheduler.update(plan, committed, continued)
    seconds = time.perf_counter() - start
    n_tokens = sum(len(e.token_ids) for e in events if isinstance(e, TokensEvent))
    if n_tokens != n_rows * n_iterations:
        raise AssertionError(f"{n_tokens} tokens emitted for {n_rows} rows x {n_iterations} iterations")
    return seconds


def run(args) -> dict:
    tokenizer = load_tokenizer(args.model)
    for round_ in range(3):  # warm the tokenizer's byte table and the interpreter
        update_seconds(tokenizer, args.rows, args.iterations, seed=round_)
    times = [update_seconds(tokenizer, args.rows, args.iterations, seed=round_) for round_ in range(args.rounds)]
    out = {"model": os.path.basename(args.model), "machine": platform.processor() or platform.machine(),
           "rows": args.rows, "iterations": args.iterations, "rounds": args.rounds,
           "update_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times), "max_ms": 1e3 * max(times),
           "us_per_iteration": 1e6 * statistics.median(times) / (args.rows * args.iterations)}  # fmt: skip
    print(f"Scheduler.update, {args.rows} rows x {args.iterations} iterations: {out['update_ms']:.2f} ms "
          f"(median of {args.rounds}; {out['us_per_iteration']:.2f} us a row's iteration)")
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the GGUF whose tokenizer detokenizes")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", default=None, help="write JSON results here")
    return run_and_save(run, parser.parse_args(argv))


if __name__ == "__main__":
    main()
