"""What keeping freed heap memory (`jaxmodel.host_memory`) is worth: `bench.step` in pairs of processes, one with
glibc's defaults (GDNSPEC_SYSTEM_MALLOC=1) and one without, alternating which goes first.

    python -m bench.host_memory --model bench/out/qwen35-0.8b-f32.gguf --pairs 4 \\
        --out bench/results/host-memory-0.8b-cpu.json

The malloc settings hold for a whole process, so the two sides cannot share one; on a shared machine whose speed
drifts, the per-pair ratios (system over retained step time) are the figures to read, not the medians alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench import save_json

SIDES = {"retained": "0", "system": "1"}


def _step_run(model: str, side: str, step_args: list[str], out: str) -> dict:
    env = {**os.environ, "GDNSPEC_SYSTEM_MALLOC": SIDES[side]}
    subprocess.run([sys.executable, "-m", "bench.step", "--model", model, "--out", out, *step_args], env=env,
                   check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        result = json.load(f)
    if result["retain_freed_memory"] != (side == "retained"):
        raise RuntimeError(f"the {side} run reported retain_freed_memory={result['retain_freed_memory']}")
    cells = {f"decode B={c['batch']}": c for c in result["decode"]}
    cells.update({f"verify T={c['T']}": c for c in result["verify"]})
    return {name: {"step_ms": c["step_ms"], "page_faults_per_step": c["page_faults_per_step"]}
            for name, c in cells.items()}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--verify-t", default="1,4,8")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    step_args = ["--batches", args.batches, "--verify-t", args.verify_t, "--steps", str(args.steps)]
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            order = ("retained", "system") if pair % 2 == 0 else ("system", "retained")
            runs.append({side: _step_run(args.model, side, step_args, os.path.join(tmp, f"{side}.json"))
                         for side in order})
            print(f"pair {pair + 1}: " + "  ".join(
                f"{name} {runs[-1]['system'][name]['step_ms'] / runs[-1]['retained'][name]['step_ms']:.3f}"
                for name in runs[-1]["retained"]), flush=True)
    summary = {}
    for name in runs[0]["retained"]:
        ratios = [run["system"][name]["step_ms"] / run["retained"][name]["step_ms"] for run in runs]
        summary[name] = {
            side: {"median_step_ms": statistics.median(run[side][name]["step_ms"] for run in runs),
                   "page_faults_per_step": statistics.median(run[side][name]["page_faults_per_step"] for run in runs)}
            for side in SIDES
        } | {"system_over_retained": ratios, "median_ratio": statistics.median(ratios)}
        print(f"{name:12s} retained {summary[name]['retained']['median_step_ms']:7.1f} ms "
              f"({summary[name]['retained']['page_faults_per_step']:6.0f} faults)  system "
              f"{summary[name]['system']['median_step_ms']:7.1f} ms "
              f"({summary[name]['system']['page_faults_per_step']:6.0f} faults)  "
              f"system/retained {summary[name]['median_ratio']:.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f})", flush=True)
    results = {"model": os.path.basename(args.model), "pairs": args.pairs, "step_args": step_args,
               "cells": summary, "runs": runs}
    if args.out:
        save_json(results, args.out)
    return results


if __name__ == "__main__":
    main()
