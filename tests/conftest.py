from __future__ import annotations

import contextlib
import gc
import os
import tempfile
import tracemalloc
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxmodel  # noqa: F401  sets its XLA flags (jaxmodel.xla_flags) before the line below starts JAX

DATA = Path(__file__).parent / "data"

# Pallas kernels run compiled on a GPU and interpreted elsewhere (CPU CI checks them that way).
INTERPRET = jax.default_backend() != "gpu"
# The suite checks float32 semantics on every backend: float32 weights (a GPU's default is bf16; the bf16 path has
# its own parity test) and IEEE float32 products (a GPU's default for float32 dots is TF32).
os.environ.setdefault("GDNSPEC_WEIGHT_DTYPE", "float32")
if jax.default_backend() == "gpu":
    jax.config.update("jax_default_matmul_precision", "highest")

# Modules drop their executables (below), but several serve engines of the same shapes: a compilation cache on disk,
# new for each run, lets a later module load a step another compiled instead of compiling it again.
_COMPILATION_CACHE = tempfile.TemporaryDirectory(prefix="gdnspec-tests-jax-")
jax.config.update("jax_compilation_cache_dir", _COMPILATION_CACHE.name)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

# The tiny model's engines in test_engine.py, test_reliability.py and test_server.py (but those a test's point sets
# apart) share these shapes and pools, so that XLA compiles each step shape once for the suite: a shape takes
# seconds to compile and milliseconds to run.
# Tests that take minutes here (real shapes, a second model's own compilations, several processes) run only with
# GDNSPEC_LONG_TESTS=1 (`make test-long`), so that `make test` stays within 15 minutes on 2 cores.
long_test = pytest.mark.skipif(not os.environ.get("GDNSPEC_LONG_TESTS"),
                               reason="a long test: GDNSPEC_LONG_TESTS=1 (make test-long) runs it")

ENGINE = dict(budget_bytes=700_000, max_running=6, max_model_len=64, chunk_size=16, token_budget=48, n_max=6)


@pytest.fixture(scope="module", autouse=True)
def _drop_compiled_executables():
    """Each compiled XLA CPU executable holds some 20 memory mappings while a jit cache keeps it. The whole
    suite's executables in one process pass Linux's vm.max_map_count (65530), and the next compilation then
    segfaults in XLA's compiler; so no module inherits the executables of the ones before it."""
    yield
    jax.clear_caches()
    gc.collect()


def fixture(name: str) -> dict[str, np.ndarray]:
    with np.load(DATA / f"{name}.npz") as f:
        return dict(f)


@pytest.fixture(scope="session")
def tiny_model():
    from jaxmodel import load_model

    return load_model(DATA / "tiny-qwen35-mtp.gguf")


@pytest.fixture(scope="session")
def model(tiny_model):
    """The tiny model, shared by every module that serves it (one load, one set of compiled shapes)."""
    return tiny_model


@pytest.fixture(scope="session")
def tokenizer():
    from jaxmodel.tokenizer import load_tokenizer

    return load_tokenizer(DATA / "tiny-qwen35-mtp.gguf")


@pytest.fixture(scope="session")
def tiny_path() -> Path:
    return DATA / "tiny-qwen35-mtp.gguf"


class Allocation:
    """What `allocation_peak` measured: the most bytes Python held at once in its block."""

    peak: int = 0


@contextlib.contextmanager
def allocation_peak():
    """Trace Python's allocations over the block, however it ends; the yielded `Allocation` holds the peak after."""
    allocation = Allocation()
    tracemalloc.start()
    try:
        yield allocation
    finally:
        allocation.peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


def plain_greedy(model, prompt_ids, n: int, stop_ids=frozenset()) -> list[int]:
    """The reference every speculative path must reproduce: greedy decoding by rescoring the whole sequence,
    stopping before an end-of-generation id."""
    tokens = list(prompt_ids)
    for _ in range(n):
        logits, _ = model.score(tokens)
        token = int(logits[-1].argmax())
        if token in stop_ids:
            break
        tokens.append(token)
    return tokens[len(prompt_ids) :]


def generate_all(engine, requests) -> list[list[int]]:
    """Each request's tokens, the requests sent to `engine` all at once (the engine runs for the call)."""
    import anyio

    from scheduler import GenerationRequest, TokensEvent

    results: list[list[int]] = [[] for _ in requests]

    async def run(i: int, request: GenerationRequest) -> None:
        async for event in engine.generate(request):
            if isinstance(event, TokensEvent):
                results[i] += event.token_ids

    async def main() -> None:
        async with engine, anyio.create_task_group() as tg:
            for i, request in enumerate(requests):
                tg.start_soon(run, i, request)

    anyio.run(main)
    return results


def tolerance(n_tokens: int) -> float:
    """float32 against the float64 reference; rounding accumulates along the sequence."""
    return 2e-6 * (1 + n_tokens / 16)


def check_against_reference(problem, outputs, pool, *, final_only: bool):
    """A delta-rule implementation's result on a `jaxmodel.kernels.problems` problem against the reference:
    outputs, every written plane (the state after its token) and every other plane (untouched, bit for bit)."""
    from jaxmodel.kernels.reference import delta_rule_reference

    pool, outputs = np.asarray(pool), np.asarray(outputs)
    n_tokens = problem.q.shape[1]
    ref = delta_rule_reference(problem.q, problem.k, problem.v, problem.g, problem.beta,
                               problem.ssm_pool[problem.read_plane], keep_states=True)
    tol = tolerance(n_tokens)
    np.testing.assert_allclose(outputs, ref.outputs, atol=tol, rtol=tol)
    written = set()
    for b, t in zip(*np.nonzero(problem.write_planes >= 0)):
        plane = problem.write_planes[b, t]
        expected = ref.final_state[b] if final_only else ref.states[b, t]
        np.testing.assert_allclose(pool[plane], expected, atol=tol, rtol=tol, err_msg=f"row {b} token {t}")
        written.add(plane)
    untouched = [p for p in range(pool.shape[0]) if p not in written]
    np.testing.assert_array_equal(pool[untouched], problem.ssm_pool[untouched])
