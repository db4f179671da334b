"""Benchmarks; each writes its results as JSON (see the README's Benchmarks section)."""

from __future__ import annotations

import json
import os
import statistics
import time


def save_json(results: dict, path: str, indent: int = 2) -> None:
    """Write `results` to `path`, creating its folder."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=indent)
        f.write("\n")


def median_seconds(run, repeats: int) -> float:
    """Median wall time of `run()` (which must block until its results are ready) after one warm-up call."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
