"""A row's logits are the same bits whatever else shares its step (jaxmodel.xla_flags): the lossless invariant at
many concurrent sequences rests on it, since a speculative run's rows finish at other times than a plain run's and
so decode in batches of other sizes."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from jaxmodel import load_model
from jaxmodel.assets import default_model_path
from jaxmodel.state import Row, pack_batch
from jaxmodel.xla_flags import BATCH_INVARIANT_FLAGS, YNN_FUSION_FLAG, set_batch_invariant_flags

PROMPT_TOKENS = 160


def _first_rows_logits(model, n_rows: int) -> np.ndarray:
    """The logits of row 0 (the same prompt every time) over a prefill step and 4 decoding steps, its batch
    filled with n_rows - 1 other random prompts: [5 steps, V] (the prefill's last position, then each step's)."""
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, model.cfg.n_vocab, PROMPT_TOKENS)] for _ in range(n_rows)]
    pages = [list(range(1 + 16 * b, 17 + 16 * b)) for b in range(n_rows)]
    state = model.new_state(n_pages=1 + 16 * n_rows, n_planes=1 + 2 * n_rows)
    rows = [Row(p, 0, pages[b], 0, [-1] * (PROMPT_TOKENS - 1) + [1 + 2 * b], [PROMPT_TOKENS - 1])
            for b, p in enumerate(prompts)]  # fmt: skip
    out, state = model.step(model.weights, batch=pack_batch(rows), state=state)
    logits = [np.asarray(out.logits)[0, 0]]
    tokens = np.asarray(out.logits)[:, 0].argmax(-1)
    for k in range(4):
        read, write = (1, 2) if k % 2 == 0 else (2, 1)
        rows = [Row([int(tokens[b])], PROMPT_TOKENS + k, pages[b], read + 2 * b, [write + 2 * b], [0])
                for b in range(n_rows)]  # fmt: skip
        out, state = model.step(model.weights, batch=pack_batch(rows), state=state)
        logits.append(np.asarray(out.logits)[0, 0])
        tokens = np.asarray(out.logits)[:, 0].argmax(-1)
    return np.stack(logits)


def test_a_rows_logits_do_not_depend_on_its_batch():
    """At the runtime's batch buckets (1, 4, 16) and at 8 rows, the bucket of a runtime serving half of 16 rows
    beside another (`Shapes.row_buckets`, `bench/replicas.py`)."""
    model = load_model(default_model_path())
    alone = _first_rows_logits(model, 1)
    for n_rows in (4, 8, 16):
        np.testing.assert_array_equal(_first_rows_logits(model, n_rows), alone, err_msg=f"{n_rows} rows")


@pytest.mark.skipif(BATCH_INVARIANT_FLAGS not in os.environ.get("XLA_FLAGS", ""), reason="flags not in effect")
def test_without_the_flags_the_batch_shows():
    """The check above can fail: with XLA's default CPU reductions the same row's logits differ with its batch."""
    code = ("import sys; sys.path.insert(0, 'tests'); import test_batch_invariance as t; from jaxmodel import "
            "load_model; from jaxmodel.assets import default_model_path; m = load_model(default_model_path()); "
            "print(abs(t._first_rows_logits(m, 16) - t._first_rows_logits(m, 1)).max())")
    env = {**os.environ, "GDNSPEC_BATCH_INVARIANT": "0", "XLA_FLAGS": ""}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) > 0.0


def test_flags_are_added_once_and_never_over_a_users_own():
    environ = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    assert set_batch_invariant_flags(environ)
    assert environ["XLA_FLAGS"] == f"--xla_dump_to=/tmp/x {BATCH_INVARIANT_FLAGS}"
    assert not set_batch_invariant_flags(environ)  # already there
    mine = {"XLA_FLAGS": f"{YNN_FUSION_FLAG}="}
    assert not set_batch_invariant_flags(mine) and mine["XLA_FLAGS"] == f"{YNN_FUSION_FLAG}="
    opted_out = {"GDNSPEC_BATCH_INVARIANT": "0"}
    assert not set_batch_invariant_flags(opted_out) and "XLA_FLAGS" not in opted_out
