"""bench/trace.py: a profiler trace summarized as a device's busy time, kernels per call and the costliest kernels."""

import gzip
import json

import jax
import jax.numpy as jnp

from bench.trace import Trace, traced_calls


def write_trace(folder, events):
    (folder / "plugins").mkdir()
    with gzip.open(folder / "plugins" / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_summary_counts_the_device_streams_kernels_per_call(tmp_path):
    """Two calls of three kernels on a GPU stream; the trace's derived "XLA Ops" line and the host's events are left
    out of the busy time."""
    events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
              {"ph": "M", "pid": 1, "tid": 9, "name": "thread_name", "args": {"name": "XLA Ops"}},
              {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}}]
    for call in range(2):
        for k, dur in enumerate((10, 20, 30)):
            name = "gdn_decode" if k == 2 else f"loop_add_fusion_{k}"
            events.append({"ph": "X", "pid": 1, "tid": 7, "ts": 200 * call + 40 * k, "dur": dur, "name": name})
            events.append({"ph": "X", "pid": 1, "tid": 9, "ts": 200 * call + 40 * k, "dur": dur, "name": f"f.{k}"})
        events.append({"ph": "X", "pid": 2, "tid": 1, "ts": 200 * call, "dur": 150, "name": "PjitFunction(f)"})
    write_trace(tmp_path, events)
    summary = Trace(str(tmp_path)).summary(2)
    assert summary["device"] == ["/device:GPU:0"]
    assert summary["busy_us_per_call"] == 60 and summary["events_per_call"] == 3
    assert summary["wall_us_per_call"] == (200 + 80 + 30) / 2
    assert summary["device_lines_us_per_call"] == {"Stream #7(Compute)": 60, "XLA Ops": 60}
    assert summary["kinds_us_per_call"] == {"loop_add_fusion": 30, "gdn_decode": 30}
    assert summary["kinds_count_per_call"] == {"loop_add_fusion": 2, "gdn_decode": 1}


def test_a_real_trace_of_jitted_calls():
    """On CPU XLA's runtime records no device, so the summary gives the call count alone."""
    f = jax.jit(lambda x: jnp.tanh(x) + 1)
    x = jnp.ones(64)
    f(x).block_until_ready()
    with traced_calls() as trace:
        for _ in range(3):
            y = f(x)
        y.block_until_ready()
    if jax.default_backend() == "cpu":
        assert trace.summary(3) == {"calls": 3, "device": [], "device_lines_us_per_call": {}}
    else:
        assert trace.summary(3)["busy_us_per_call"] > 0
