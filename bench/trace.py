"""Where a jitted call's time goes on the device: a `jax.profiler` trace of a few calls, summarized as the device's
busy time per call against the wall time, the kernels per call, and the kernels that take the most time.

    with traced_calls() as trace:
        for _ in range(n):
            out = step(...)
        jax.block_until_ready(out)
    summary = trace.summary(n)

A device that is busy for most of a call's wall time is bound by its kernels' own time (their count and their
work); one that is mostly idle waits on launches or the host.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import gzip
import json
import os
import re
import tempfile
from dataclasses import dataclass

import jax


@dataclass
class Trace:
    """A finished trace's folder; `summary` reads it."""

    folder: str

    def events(self) -> tuple[dict[int, str], dict[tuple[int, int], str], list[dict]]:
        """The trace's process names by pid, thread names by (pid, tid), and its complete ("X") events."""
        paths = glob.glob(os.path.join(self.folder, "**", "*.trace.json.gz"), recursive=True)
        if not paths:
            raise FileNotFoundError(f"no trace under {self.folder}")
        with gzip.open(paths[0]) as f:
            trace = json.load(f)
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        meta = [e for e in events if e.get("ph") == "M"]
        processes = {e["pid"]: e["args"]["name"] for e in meta if e.get("name") == "process_name"}
        threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e.get("name") == "thread_name"}
        return processes, threads, [e for e in events if e.get("ph") == "X" and "dur" in e]

    def summary(self, n_calls: int, top: int = 25) -> dict:
        """Per call: the wall time from the first device event to the last, the device's busy time (its streams'
        kernels and copies, summed; the trace's derived lines, "XLA Ops" and the like, left out), the number of
        those events (every device line's where no line is a stream), each device line's total; and the `top`
        kernels by total time, by name and by kind (the name without its instance number: `loop_add_fusion_3` is a
        `loop_add_fusion`). A trace without a device (XLA's CPU runtime) gives the call count alone."""
        processes, threads, events = self.events()
        device = {pid for pid, name in processes.items() if "/device:" in name}
        lines: dict[str, float] = collections.Counter()
        for e in events:
            if e["pid"] in device:
                lines[threads.get((e["pid"], e["tid"]), str(e["tid"]))] += e["dur"]
        streams = {key for key, name in threads.items() if key[0] in device and name.startswith("Stream")}
        on_device = [e for e in events if (e["pid"], e["tid"]) in streams or not streams and e["pid"] in device]
        per_call = lambda us: round(us / n_calls, 2)
        if not on_device:
            return {"calls": n_calls, "device": sorted(processes[pid] for pid in device),
                    "device_lines_us_per_call": {name: per_call(us) for name, us in lines.items()}}
        start = min(e["ts"] for e in on_device)
        end = max(e["ts"] + e["dur"] for e in on_device)
        busy = sum(e["dur"] for e in on_device)
        by_name: dict[str, float] = collections.Counter()
        by_kind: dict[str, float] = collections.Counter()
        kind_count: dict[str, int] = collections.Counter()
        for e in on_device:
            by_name[e["name"]] += e["dur"]
            kind = re.sub(r"[._]?\d+$", "", e["name"])
            by_kind[kind] += e["dur"]
            kind_count[kind] += 1
        return {
            "calls": n_calls,
            "device": sorted(processes[pid] for pid in device),
            "device_lines_us_per_call": {name: per_call(us) for name, us in lines.items()},
            "wall_us_per_call": per_call(end - start),
            "busy_us_per_call": per_call(busy),
            "busy_fraction": round(busy / (end - start), 3) if end > start else None,
            "events_per_call": round(len(on_device) / n_calls, 1),
            "top_kernels_us_per_call": {name: per_call(us) for name, us in by_name.most_common(top)},
            "kinds_us_per_call": {kind: per_call(us) for kind, us in by_kind.most_common(top)},
            "kinds_count_per_call": {kind: round(kind_count[kind] / n_calls, 1)
                                     for kind, _ in by_kind.most_common(top)},
        }


@contextlib.contextmanager
def traced_calls(folder: str | None = None):
    """Trace what runs inside the block (`jax.profiler`, with its Perfetto JSON) into folder (a temporary one by
    default); yields the `Trace`, readable once the block has ended."""
    folder = folder or tempfile.mkdtemp(prefix="gdnspec-trace-")
    trace = Trace(folder)
    with jax.profiler.trace(folder, create_perfetto_trace=True):
        yield trace
