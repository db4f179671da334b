"""The CPU Q8_0 product alone, one thread: ns per (block of 32, row of x) at the bundled model's shapes and the 0.8B
FFN's, for 1, 2, 4 and 16 rows, for this tree's kernel and (optionally) another revision's, alternating.

    python -m bench.q8_product --against 171ee34 --out bench/results/q8-product-cpu.json

Each kernel source (jaxmodel/kernels/cpu_matmul.cc, or `git show REV:` of it) is compiled into bench/q8_product.cc
with the library's flags; the weights are random, so the two revisions' layouts time alike. Rounds alternate the
binaries so the machine's drift falls on both; the JSON holds every round and the medians.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

import jax

from bench import run_and_save
from jaxmodel.kernels import cpu_matmul

ROOT = Path(__file__).resolve().parent.parent
HARNESS = Path(__file__).with_suffix(".cc")
KERNEL = "jaxmodel/kernels/cpu_matmul.cc"


def build(source: Path, binary: Path) -> None:
    flags = [f for f in cpu_matmul.FLAGS if f not in ("-shared", "-fPIC")]
    subprocess.run([cpu_matmul.cxx(), *flags, f"-I{jax.ffi.include_dir()}", f"-I{cpu_matmul.SOURCES[0].parent}",
                    f'-DKERNEL="{source}"', str(HARNESS), "-o", str(binary)], check=True)


def timings(binary: Path, seconds: float) -> dict[tuple[int, int, int], float]:
    """(N, K, M) -> ns per block and row."""
    done = subprocess.run([str(binary), str(seconds)], check=True, capture_output=True, text=True)
    return {tuple(map(int, line.split()[:3])): float(line.split()[3]) for line in done.stdout.splitlines()}


def run(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"this tree": ROOT / KERNEL}
        if args.against:
            old = Path(tmp) / "cpu_matmul_against.cc"
            old.write_text(subprocess.run(["git", "show", f"{args.against}:{KERNEL}"], cwd=ROOT, check=True,
                                          capture_output=True, text=True).stdout)
            sources = {args.against: old, **sources}
        binaries = {}
        for i, (name, source) in enumerate(sources.items()):
            binaries[name] = Path(tmp) / f"q8_product_{i}"
            build(source, binaries[name])
        runs: dict[str, list[dict]] = {name: [] for name in sources}
        for r in range(args.rounds):
            for name in (list(sources) if r % 2 == 0 else list(reversed(sources))):
                runs[name].append(timings(binaries[name], args.seconds))
    rows = []
    for key in runs[next(iter(runs))][0]:
        row = {"N": key[0], "K": key[1], "M": key[2]}
        for name, rounds in runs.items():
            row[name] = {"ns_per_block_row": statistics.median(r[key] for r in rounds),
                         "rounds": [r[key] for r in rounds]}
        if args.against:
            row["speedup"] = row[args.against]["ns_per_block_row"] / row["this tree"]["ns_per_block_row"]
        rows.append(row)
        cells = "  ".join(f"{name} {row[name]['ns_per_block_row']:.3f}" for name in runs)
        print(f"[{key[0]:5d}, {key[1]:5d}] M={key[2]:2d}: {cells}"
              + (f"  ({row['speedup']:.2f}x)" if args.against else ""), flush=True)
    return {"benchmark": "q8_product", "unit": "ns per block of 32 and row of x, one thread", "rows": rows,
            "rounds": args.rounds, "against": args.against}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default=None, help="a git revision whose kernel to time beside this tree's")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=0.3, help="per shape, row count and round")
    parser.add_argument("--out", default=None, help="write JSON results here")
    return run_and_save(run, parser.parse_args(argv))


if __name__ == "__main__":
    main()
