"""Time to a first token when `gdnspec serve` starts: from an empty cache (cold), then again from the cache the
first start filled (warm), with and without the stored step executables (`jaxmodel.executor.executables`).

Each start is a new server process on loopback with its own cache folder (GDNSPEC_CACHE); a client connects as
soon as the port accepts and asks for a few greedy tokens. Per start the JSON holds the seconds from the process's
spawn until the port accepted, until the first token and until the last, and with `--warmup-first` the warm-up's
own figure from the server's log (every step shape compiled or loaded, and the drafter policy's calibration).

    gdnspec bench warm-start --starts 3 --out bench/results/warm-start-cpu.json
    gdnspec bench warm-start --store on --warmup-first --model M     # one condition, a real model
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

from api.client import Client
from api.protocol import Tokens

from . import free_port, save_json, wait_listening

ROOT = Path(__file__).resolve().parent.parent
WARMUP_LINE = re.compile(r"warm-up: (\d+) step shapes ready in ([\d.]+) s")


async def _first_tokens(port: int, prompt: str, max_tokens: int, spawned: float) -> tuple[float, float, int]:
    """(seconds since spawn to the first token, to the last, tokens) of one greedy request."""
    first = None
    n = 0
    async with Client(f"ws://127.0.0.1:{port}") as client:
        stream = await client.generate(prompt, max_tokens=max_tokens, temperature=0.0)
        async for frame in stream:
            if isinstance(frame, Tokens) and frame.token_ids:
                first = first or time.perf_counter() - spawned
                n += len(frame.token_ids)
    return first, time.perf_counter() - spawned, n


def one_start(args, cache: str, store: bool) -> dict:
    port = free_port()
    env = {**os.environ, "GDNSPEC_CACHE": cache, "GDNSPEC_STEP_STORE": "1" if store else "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "api.cli", "serve", "--port", str(port), "--max-seqs", str(args.max_seqs),
               "--max-model-len", str(args.max_model_len), "--default-drafters", args.drafters]
    if args.model:
        command += ["--model", args.model]
    if args.warmup_first:
        command.append("--warmup-first")
    spawned = time.perf_counter()
    process = subprocess.Popen(command, env=env, cwd=ROOT, text=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    try:
        wait_listening(port, [process], time.monotonic() + args.timeout)
        listening = time.perf_counter() - spawned
        first, last, n = anyio.run(_first_tokens, port, args.prompt, args.max_tokens, spawned)
    finally:
        process.terminate()
        try:
            _, log = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            _, log = process.communicate()
    warmup = WARMUP_LINE.search(log or "")
    return {"listening_s": listening, "first_token_s": first, "last_token_s": last, "tokens": n,
            "warmup_shapes": int(warmup[1]) if warmup else None,
            "warmup_s": float(warmup[2]) if warmup else None}


def run(args) -> dict:
    out = {"model": os.path.basename(args.model) if args.model else "bundled", "machine": platform.processor() or
           platform.machine(), "cpu_count": os.cpu_count(), "warmup_first": args.warmup_first,
           "max_seqs": args.max_seqs, "max_model_len": args.max_model_len, "drafters": args.drafters,
           "conditions": []}  # fmt: skip
    for store in {"on": [True], "off": [False], "both": [False, True]}[args.store]:
        with tempfile.TemporaryDirectory(prefix="gdnspec-warm-start-") as cache:
            starts = []
            for i in range(args.starts):
                result = one_start(args, cache, store)
                starts.append(result)
                print(f"store {'on ' if store else 'off'} start {i} ({'cold' if i == 0 else 'warm'}): listening "
                      f"{result['listening_s']:.1f} s, first token {result['first_token_s']:.1f} s"
                      + (f", warm-up {result['warmup_s']:.1f} s" if result["warmup_s"] is not None else ""),
                      flush=True)  # fmt: skip
        out["conditions"].append({"step_store": store, "starts": starts})
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the bundled model)")
    parser.add_argument("--starts", type=int, default=2, help="per condition: the first cold, the rest warm")
    parser.add_argument("--store", choices=("on", "off", "both"), default="both",
                        help="serve with the stored step executables, without them, or each in turn")
    parser.add_argument("--warmup-first", action="store_true", help="serve with --warmup-first")
    parser.add_argument("--max-seqs", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--drafters", default="ngram,mtp", help="the server's --default-drafters")
    parser.add_argument("--prompt", default="def fibonacci(n):")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=900, help="seconds a start may take to listen")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    results = run(args)
    if args.out:
        save_json(results, args.out)
    return results


if __name__ == "__main__":
    main()
