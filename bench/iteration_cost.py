"""What one iteration of a looping device call costs, by kind, on one row: plain decoding (one token), plain decoding
whose MTP head catches up in every iteration (`catch-up`: a request naming `mtp` while the policy declines to draft,
without a backlog slot) or holds its catch-up in its backlog slot (`held`: the same with the engine's slot), a
4-token verify whose n-gram drafts are all accepted (`lookup`, drafts found on device; `lookup-catch-up` with the MTP
head catching up, as in a request naming `mtp,ngram`), and an MTP iteration (4-token verify, the head's catch-up and
its chained drafts). Each is timed as a call of N iterations less a call of one, divided by the N - 1 later
iterations, so the call's fixed cost (dispatch, first iteration, reading back) drops out. Kinds and rounds alternate,
so a shared machine's drift falls on all alike; the figures are medians over rounds. Every call's tokens are checked
against plain greedy decoding. Writes JSON.

    gdnspec bench iteration-cost --rounds 7 --out bench/results/iteration-cost-cpu.json
    gdnspec bench iteration-cost --n-draft 1 --kinds plain,lookup,mtp   # verify 2 tokens, chain one draft
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import jax
import numpy as np

from jaxmodel import load_model
from jaxmodel.executor import RowLoop, Runtime, Shapes, StepRow
from jaxmodel.state import Row, bucket
from jaxmodel.tokenizer import load_tokenizer

from . import run_and_save
from .prompts import load_prompt_set
from .speculation import model_arguments

KINDS = ("plain", "catch-up", "held", "lookup", "lookup-catch-up", "mtp")
PAGE_SIZE = 16


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after prompt, each by rescoring the whole sequence (no cache, no speculation)."""
    tokens = list(prompt)
    for _ in range(n):
        logits, _ = model.score(tokens)
        tokens.append(int(logits[-1].argmax()))
    return tokens[len(prompt) :]


def run(args) -> dict:
    model = load_model(args.model)
    prompt = list(load_tokenizer(args.model).encode(load_prompt_set(args.prompts)[args.prompt]))
    K, n_draft = args.iterations, args.n_draft
    if n_draft < 1:
        raise SystemExit(f"--n-draft must be at least 1; got {n_draft}")
    n_reference = K * (n_draft + 1) + 8
    reference = greedy_reference(model, prompt, n_reference)
    n_pages = -(-(len(prompt) + n_reference + n_draft + 1) // PAGE_SIZE)
    runtime = Runtime(model, n_pages=n_pages + 2, n_planes=n_draft + 5, page_size=PAGE_SIZE, max_iterations=K,
                      n_chain_max=n_draft, lookup_drafts=n_draft,
                      shapes=Shapes(max_rows=1, max_tokens=16, max_logit_rows=n_draft + 1, pages_per_row=n_pages),
                      backlog_slots=1, backlog_tokens=bucket(len(prompt) + K * (n_draft + 1), 16))  # fmt: skip
    pages = list(range(1, n_pages + 1))
    kinds = [k for k in args.kinds.split(",") if k]
    if unknown := set(kinds) - set(KINDS):
        raise SystemExit(f"unknown kinds {sorted(unknown)}; choose from {KINDS}")
    if {"mtp", "catch-up", "held", "lookup-catch-up"} & set(kinds) and not model.has_mtp:
        raise SystemExit(f"{args.model} has no MTP head")

    def call(kind: str, iterations: int) -> tuple[float, list[int], int]:
        mtp = kind == "mtp"
        # The MTP chain asked for (-1: the head left alone, 0: it only catches up).
        head = {"mtp": n_draft, "catch-up": 0, "held": 0, "lookup-catch-up": 0}.get(kind, -1)
        slot = 0 if kind == "held" else -1  # the slot is emptied for every call, so that none flushes
        runtime.release_backlog(0)
        prefill = StepRow(Row(prompt, 0, pages, 0, [-1] * (len(prompt) - 1) + [1], [len(prompt) - 1]),
                          n_chain=head, backlog_slot=slot)  # fmt: skip
        first = runtime.step([prefill])[0]
        drafts = first.next_drafts if mtp else []
        planes = tuple(range(1, n_draft + 3))  # the read plane and one per token verified
        if kind in ("plain", "catch-up", "held"):
            loop = RowLoop(0, planes, budget=10**6)
        elif kind == "mtp":
            loop = RowLoop(n_draft, planes, budget=10**6)
        else:  # the continuation follows the prompt's last tokens earlier in the history: every draft matches
            history = prompt[-6:] + reference + [7] + prompt + first.committed
            loop = RowLoop(n_draft, planes, budget=10**6, lookup=(2, 8), history=history)
        row = StepRow(Row([first.committed[0]] + drafts, len(prompt), pages, 1, list(range(2, 3 + len(drafts))),
                          list(range(1 + len(drafts)))), drafts=drafts, loop=loop,
                      n_chain=head, backlog_slot=slot)  # fmt: skip
        start = time.perf_counter()
        result = runtime.step([row], iterations=iterations)[0]
        seconds = time.perf_counter() - start
        tokens = first.committed + result.committed + [t for it in result.more for t in it.committed]
        if tokens != reference[: len(tokens)]:
            raise AssertionError(f"{kind}: the call's tokens differ from plain greedy decoding")
        return seconds, tokens, 1 + len(result.more)

    for kind in kinds:  # compile
        call(kind, 1), call(kind, K)
    samples: dict[str, list[tuple[float, float, float]]] = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            one, _, _ = call(kind, 1)
            many, tokens, ran = call(kind, K)
            samples[kind].append(((many - one) / (ran - 1), many, (len(tokens) - 1) / ran))
    out = {"model": os.path.basename(args.model), "backend": jax.default_backend(),
           "machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
           "prompt_tokens": len(prompt), "iterations": K, "n_draft": n_draft, "rounds": args.rounds,
           "kinds": {}}  # fmt: skip
    plain = statistics.median(s[0] for s in samples["plain"]) if "plain" in samples else None
    for kind, rows in samples.items():
        per_iteration = statistics.median(r[0] for r in rows)
        cell = {"ms_per_later_iteration": per_iteration * 1e3,
                "ms_per_later_iteration_range": [min(r[0] for r in rows) * 1e3, max(r[0] for r in rows) * 1e3],
                "ms_per_call": statistics.median(r[1] for r in rows) * 1e3,
                "tokens_per_iteration": rows[0][2]}  # fmt: skip
        if plain:
            cell["cost_vs_plain"] = per_iteration / plain
            cell["tokens_per_s_vs_plain"] = cell["tokens_per_iteration"] / cell["cost_vs_plain"]
        out["kinds"][kind] = cell
        print(f"{kind:7s} {cell['ms_per_later_iteration']:.3f} ms a later iteration, "
              f"{cell['tokens_per_iteration']:.2f} tokens an iteration"
              + (f", {cell['cost_vs_plain']:.2f}x plain's cost, {cell['tokens_per_s_vs_plain']:.2f}x its tokens/s"
                 if plain else ""), flush=True)  # fmt: skip
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser)
    parser.add_argument("--prompt", type=int, default=0, help="which prompt of the set")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("--iterations", type=int, default=32, help="iterations of the longer call")
    parser.add_argument("--n-draft", type=int, default=3, help="drafts a verifying iteration feeds (lookup, mtp)")
    parser.add_argument("--rounds", type=int, default=7)
    return run_and_save(run, parser.parse_args(argv))


if __name__ == "__main__":
    main()
