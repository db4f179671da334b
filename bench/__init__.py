"""Benchmarks; each writes its results as JSON (see the README's Benchmarks section)."""

from __future__ import annotations

import json
import os
import socket
import statistics
import time


def save_json(results: dict, path: str, indent: int = 2) -> None:
    """Write `results` to `path`, creating its folder."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=indent)
        f.write("\n")


def run_and_save(run, args) -> dict:
    """A benchmark's `run(args)`, its results written as JSON to args.out where one is given."""
    results = run(args)
    if args.out:
        save_json(results, args.out)
    return results


def median_seconds(run, repeats: int) -> float:
    """Median wall time of `run()` (which must block until its results are ready) after one warm-up call."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(n_bytes: int = 1 << 30, repeats: int = 20) -> float:
    """The default device's memory bandwidth in bytes/s, counting bytes read plus bytes written: a jitted
    elementwise pass over `n_bytes` of random float32 (the ceiling a bandwidth-bound kernel is measured against).
    The buffer is donated and passed along, so no call allocates."""
    import jax
    import jax.numpy as jnp

    state = {"x": jax.random.normal(jax.random.PRNGKey(0), (n_bytes // 4,), jnp.float32)}
    step = jax.jit(lambda x: x + 1.0, donate_argnums=0)

    def run():
        state["x"] = step(state["x"])
        state["x"].block_until_ready()

    for _ in range(3):
        run()
    return 2 * state["x"].nbytes / median_seconds(run, repeats)


def free_port() -> int:
    """A loopback port nothing listens on now (for a server a benchmark or test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, processes, deadline: float) -> None:
    """Return once something accepts on the loopback `port`; raise if one of `processes` (the servers started,
    `subprocess.Popen` with stderr piped) ends first, or at the `time.monotonic()` deadline."""
    while time.monotonic() < deadline:
        for process in processes:
            if process.poll() is not None:
                raise RuntimeError(f"a serving process ended ({process.returncode}): {process.stderr.read()[-4000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.02)
    raise TimeoutError(f"nothing listens on {port}")
