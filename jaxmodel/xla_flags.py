"""XLA flags the model needs, set before JAX starts its backends (`jaxmodel` imports this module first).

Batch invariance on CPU. XLA's CPU compiler hands some reductions (attention's softmax sums among them) to YNNPACK,
whose summation order follows the shape of the whole batch: a sequence's logits then differ by up to 0.06 between
a step of one row and a step of sixteen (bundled model), and greedy decoding picks another token at a near-tie. A
request's tokens would then depend on which other requests shared its steps, and a speculative run (whose rows
finish at other times, so run in other batch sizes) could differ from a plain one. Without YNNPACK's reductions
a row's logits are the same bits in a batch of any size (`tests/test_batch_invariance.py`); the products stay
with YNNPACK or the project's own kernels, which never mix rows. A user's own `--xla_cpu_experimental_ynn_fusion_type`
in XLA_FLAGS is kept, and GDNSPEC_BATCH_INVARIANT=0 leaves XLA's defaults.
"""

from __future__ import annotations

import logging
import os

YNN_FUSION_FLAG = "--xla_cpu_experimental_ynn_fusion_type"
BATCH_INVARIANT_FLAGS = f"{YNN_FUSION_FLAG}=-reduce"

log = logging.getLogger(__name__)


def set_batch_invariant_flags(environ=os.environ) -> bool:
    """Add BATCH_INVARIANT_FLAGS to environ's XLA_FLAGS unless the user set the YNNPACK flag or opted out
    (GDNSPEC_BATCH_INVARIANT=0). Returns whether it added them."""
    flags = environ.get("XLA_FLAGS", "")
    if YNN_FUSION_FLAG in flags or environ.get("GDNSPEC_BATCH_INVARIANT", "1") == "0":
        return False
    environ["XLA_FLAGS"] = f"{flags} {BATCH_INVARIANT_FLAGS}".strip()
    return True


def warn_if_started() -> None:
    """Log a warning when JAX's backends started before the flags were set: they then have no effect."""
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        log.warning("JAX started before jaxmodel set %s; a row's CPU logits may depend on its batch",
                    BATCH_INVARIANT_FLAGS)


def step_invariant(environ=os.environ) -> bool:
    """Whether the model computes a token the same bits in a step of 1, 4 or 8 tokens (read when a step is traced):
    the token-serial GDN loop then runs with a trip count XLA cannot see (`delta_rule.recurrent_scan`'s n_steps)
    and CPU attention sums per query (`kernels.paged_attention.query_scores`), so a verify step reproduces decoding steps and
    greedy speculative output equals plain output also where activations are quantized to Q8_0
    (`tests/test_step_invariance.py`). It costs some speed on CPU (docs/performance.md, "A token's logits do not
    depend on its step's length"); GDNSPEC_STEP_INVARIANT=0 trades the exact equality for it."""
    return environ.get("GDNSPEC_STEP_INVARIANT", "1") != "0"
