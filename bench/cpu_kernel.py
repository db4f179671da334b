"""The CPU few-row kernel against XLA's products: one model loaded both ways in one process, rounds alternating.

    python -m bench.cpu_kernel --model bench/out/qwen35-0.8b-f32.gguf --out bench/results/cpu-kernel-0.8b.json

`load_model` stores the large matmul weights transposed for the kernel (`jaxmodel.precision.takes_rows_kernel`);
the other copy keeps them as XLA takes them. Each round times, for both copies in turn (the order alternating), warm
device steps of every (batch, tokens) shape (`bench.step.time_steps`), so the machine's drift falls on both alike.
"""

from __future__ import annotations

import argparse
import os
import statistics

import jax

from bench import save_json
from bench.step import time_steps
from jaxmodel import load_model
from jaxmodel.kernels import cpu_matmul


def load_both(path: str):
    """The model with the kernel's weight layout and without (the kernel must be available)."""
    if not cpu_matmul.available():
        raise SystemExit("the CPU kernel is not available here (CPU backend and a C++ compiler needed)")
    return {"xla": load_model(path, load_mtp=False, cpu_kernel=False),
            "kernel": load_model(path, load_mtp=False)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", default=None, help="write JSON results here")
    parser.add_argument("--shapes", default="1x1,1x2,1x4,1x8,4x1", help="batch x tokens per row, comma separated")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per shape per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    models = load_both(args.model)
    ms: dict[tuple[str, int, int], list[float]] = {}
    for r in range(args.rounds):
        for name in ("xla", "kernel") if r % 2 == 0 else ("kernel", "xla"):
            for B, T in shapes:
                _, device, _ = time_steps(models[name], B, T, args.context, args.steps)
                ms.setdefault((name, B, T), []).append(device * 1e3)
    median = {key: statistics.median(v) for key, v in ms.items()}
    rows = []
    for B, T in shapes:
        row = {"batch": B, "tokens": T}
        for name in models:
            row[f"{name}_ms"] = median[(name, B, T)]
            row[f"{name}_runs_ms"] = ms[(name, B, T)]
            row[f"{name}_ratio_to_1x1"] = median[(name, B, T)] / median[(name, 1, 1)] if (1, 1) in shapes else None
        row["speedup"] = row["xla_ms"] / row["kernel_ms"]
        rows.append(row)
        print(f"B={B} T={T}: XLA {row['xla_ms']:8.1f} ms  kernel {row['kernel_ms']:8.1f} ms  "
              f"speed-up {row['speedup']:.2f}x", flush=True)
    results = {"model": os.path.basename(args.model), "backend": jax.default_backend(), "cpu_count": os.cpu_count(),
               "context": args.context, "steps": args.steps, "rounds": args.rounds, "shapes": rows}
    if args.out:
        save_json(results, args.out)
    return results


if __name__ == "__main__":
    main()
