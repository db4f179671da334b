"""The engine benchmark's comparison of auto with the forced modes, and the markdown table it writes."""

from bench.engine import compare_auto, markdown_table


def _run(mode, rates, steps, planes=8):
    return {"concurrency": 4, "budget_mb": 3.0, "budget_mb_per_seq": 0.75, "mode": mode, "planes": planes,
            "alpha": None if mode == "plain" else 0.9, "d": 0 if mode == "plain" else 3,
            "tokens_per_s": sorted(rates)[len(rates) // 2], "rates": rates, "rollback_steps": steps,
            "drafts_per_step": 3.0}  # fmt: skip


def test_auto_is_compared_with_the_best_forced_mode_that_rolled_back_and_tabled():
    runs = [
        _run("plain", [100.0, 100.0, 100.0], {}),
        _run("snapshot", [300.0, 300.0, 300.0], {"snapshot": 0}),  # no plane to borrow: decoded plainly
        _run("checkpoint", [150.0, 160.0, 170.0], {"checkpoint": 30}),
        _run("replay", [200.0, 180.0, 220.0], {"replay": 30}),
        _run("auto", [190.0, 190.0, 200.0], {"replay": 28, "checkpoint": 2}),
    ]
    [cell] = compare_auto(runs)
    assert cell["best_forced"] == "replay" and cell["not_rolled_back"] == ["snapshot"]
    assert cell["auto_vs_best"] == 190.0 / 200.0
    assert cell["auto_vs_best_paired"] == 190.0 / 200.0  # the median of 0.95, 1.056 and 0.909
    table = markdown_table({"runs": runs, "cells": [cell], "per_sequence": True})
    assert table.splitlines()[2] == ("| 4 | 0.75 MB | 8 | 0.9 | 3 | 100.0 | 300.0 (none) | 160.0 | **200.0** | "
                                     "190.0 | 0 / 2 / 28 | 0.95 (0.95) |")  # fmt: skip
