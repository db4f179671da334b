"""bench/gpu_quick.sh, the GPU measurements within a time budget: where JAX has no GPU it stops after its device check,
and steps that the budget leaves no time for are skipped, not started (each step's run is the benchmarks' own)."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_quick.sh"
STEPS = ("fused-kernel", "kernels", "model-0.8b", "step-0.8b", "step-0.8b-paired-rows", "row-kernel",
         "step-0.8b-xla-gdn", "speculation", "warm-start", "step-q4_k_m", "iteration-cost")


def run_script(out: Path, budget: int, **env) -> tuple[int, str]:
    environ = {k: v for k, v in os.environ.items() if k != "GDNSPEC_GPU_QUICK_ANY_BACKEND"}
    result = subprocess.run([str(SCRIPT), str(out), str(budget)], env={**environ, "GPU_PYTHON": sys.executable, **env},
                            capture_output=True, text=True, timeout=300)
    return result.returncode, (out / "gpu-quick.log").read_text()


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the device check passes on a GPU")
def test_stops_after_the_device_check_without_a_gpu(tmp_path):
    rc, log = run_script(tmp_path, 600)
    assert rc == 1
    assert "no GPU backend: stopping" in log
    assert not any(f"== {step}" in log for step in STEPS)


def test_steps_past_the_budget_are_skipped(tmp_path):
    rc, log = run_script(tmp_path, 1, GDNSPEC_GPU_QUICK_ANY_BACKEND="1")
    assert rc == 0, log
    for step in STEPS:
        assert f"== {step}: skipped" in log
    assert not list(tmp_path.glob("*.json"))
