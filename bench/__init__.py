"""Benchmarks; each writes its results as JSON (see the README's Benchmarks section)."""

from __future__ import annotations

import json
import os


def save_json(results: dict, path: str, indent: int = 2) -> None:
    """Write `results` to `path`, creating its folder."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=indent)
        f.write("\n")
