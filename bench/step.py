"""Step-level speed of the jitted forward: plain decode tokens/s per batch size and verify-step time per T.

    python -m bench.step --model bench/out/qwen35-0.8b-f32.gguf --out bench/results/step-cpu.json

Each measurement runs warm (compiled beforehand) steps over sequences holding `--context` tokens. The JSON also
gives the weights' bytes and the decode roofline at batch 1: those bytes over the device's copy bandwidth
(`bench.copy_bandwidth`), the least time a step that reads every weight once can take.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import time

import jax
import numpy as np

from jaxmodel import gdn, load_model
from jaxmodel.host_memory import retain_freed_memory
from jaxmodel.precision import default_weight_dtype
from jaxmodel.state import KV_DTYPES, Row, bucket, pack_batch
from bench import copy_bandwidth, save_json
from bench.trace import traced_calls


def _prefilled(model, n_seqs: int, context: int, page_size: int = 16, room: int = 64, kv_dtype: str = "float32"):
    """A state holding n_seqs sequences of `context` random tokens, each with pages for `room` more; and the pages."""
    pages_per_seq = bucket(-(-(context + room) // page_size))
    state = model.new_state(n_pages=1 + n_seqs * pages_per_seq, n_planes=1 + 2 * n_seqs, page_size=page_size,
                            kv_dtype=kv_dtype)  # fmt: skip
    pages = [list(range(1 + s * pages_per_seq, 1 + (s + 1) * pages_per_seq)) for s in range(n_seqs)]
    rng = np.random.default_rng(0)
    rows = [
        Row(list(rng.integers(0, model.cfg.n_vocab, context)), 0, pages[s], 0, [-1] * (context - 1) + [1 + 2 * s])
        for s in range(n_seqs)
    ]
    _, state = model.step(model.weights, batch=pack_batch(rows, R=1), state=state, final_only=True)
    return state, pages


def _steps(model, n_seqs: int, T: int, context: int, kv_dtype: str):
    """A prefilled state and batch(i): step i's rows, n_seqs of T random tokens each, reading and writing snapshot
    planes in turn (ping-pong)."""
    state, pages = _prefilled(model, n_seqs, context, room=max(64, T), kv_dtype=kv_dtype)
    rng = np.random.default_rng(1)

    def batch(i):
        rows = []
        for s in range(n_seqs):
            read = 1 + 2 * s + (i % 2)
            write = 1 + 2 * s + ((i + 1) % 2)
            rows.append(Row(list(rng.integers(0, model.cfg.n_vocab, T)), context, pages[s], read,
                            [-1] * (T - 1) + [write], range(T)))  # fmt: skip
        return pack_batch(rows)

    return state, batch


def time_steps(model, n_seqs: int, T: int, context: int, steps: int, hlo_path: str | None = None,
               kv_dtype: str = "float32") -> tuple[float, float, float]:
    """Seconds per step of n_seqs rows feeding T tokens each (snapshot planes, ping-pong): the host's view
    (packing each batch on the host and reading the logits back every step) and the device's (the same packed
    batch dispatched `steps` times, read back once); and the process's minor page faults per step in the
    host's view. hlo_path: write the compiled step's HLO there."""
    state, batch = _steps(model, n_seqs, T, context, kv_dtype)
    out, state = model.step(model.weights, batch=batch(0), state=state)  # compile
    jax.block_until_ready(out.logits)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    for i in range(steps):
        out, state = model.step(model.weights, batch=batch(i + 1), state=state)
        np.asarray(out.logits)  # the host needs the logits every step
    host = (time.perf_counter() - start) / steps
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps
    fixed = jax.device_put(batch(1))
    if hlo_path:
        text = model.step.lower(model.weights, batch=fixed, state=state).compile().as_text()
        with open(hlo_path, "w") as f:
            f.write(text)
        print(f"compiled step B={n_seqs} T={T}: {compiled_kinds(text)} (HLO in {hlo_path})", flush=True)
    start = time.perf_counter()
    for _ in range(steps):
        out, state = model.step(model.weights, batch=fixed, state=state)
    jax.block_until_ready(out.logits)
    return host, (time.perf_counter() - start) / steps, faults


def profile_steps(model, n_seqs: int, T: int, context: int, steps: int, kv_dtype: str = "float32") -> dict:
    """Where `steps` warm steps' device time goes (`bench.trace`): busy time against wall time per step, and the
    kernels that take it."""
    state, batch = _steps(model, n_seqs, T, context, kv_dtype)
    fixed = jax.device_put(batch(1))
    out, state = model.step(model.weights, batch=fixed, state=state)  # compiled by the timing before
    jax.block_until_ready(out.logits)
    with traced_calls() as trace:
        for _ in range(steps):
            out, state = model.step(model.weights, batch=fixed, state=state)
        jax.block_until_ready(out.logits)
    return {"batch": n_seqs, "T": T, **trace.summary(steps)}


def compiled_kinds(hlo_text: str) -> dict[str, int]:
    """How many of each launching instruction a compiled step's HLO holds: on a GPU each fusion and custom call (a
    library product, a Pallas kernel) is a kernel launch, and a while loop or conditional reads its predicate on the
    host each trip unless it runs in a command buffer."""
    kinds = ("fusion", "custom-call", "while", "conditional", "copy", "dynamic-update-slice", "all-reduce")
    return {kind: hlo_text.count(f" {kind}(") for kind in kinds}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", default=None, help="write JSON results here")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--verify-t", default="1,2,4,8")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1, help="verify rounds, alternating the T values")
    parser.add_argument("--hlo", default=None, help="write the compiled batch-1 decode step's HLO text here")
    parser.add_argument("--profile", action="store_true",
                        help="trace the batch-1 decode step's device time by kernel (bench/trace.py) into the JSON")
    parser.add_argument("--kv-dtype", default="float32", choices=KV_DTYPES, help="the KV pages")
    parser.add_argument("--weight-dtype", default=None, choices=("float32", "bfloat16"),
                        help="matmul weights (default: the backend's, see jaxmodel/precision.py)")
    parser.add_argument("--dequantize-at-load", action="store_true",
                        help="block-quantized weights as float copies (default: the backend's choice, "
                             "jaxmodel.model.kept_block_types)")
    args = parser.parse_args(argv)
    model = load_model(args.model, weight_dtype=args.weight_dtype,
                       quantized=False if args.dequantize_at_load else None)
    weight_bytes = model.weights_bytes
    copy_bytes_per_s = copy_bandwidth(1 << (30 if jax.default_backend() == "gpu" else 26))
    roofline_ms = weight_bytes / copy_bytes_per_s * 1e3
    print(f"weights {weight_bytes / 1e9:.2f} GB, copy {copy_bytes_per_s / 1e9:.0f} GB/s: roofline "
          f"{roofline_ms:.2f} ms/token at batch 1", flush=True)
    results = {
        "model": os.path.basename(args.model),
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0]),
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "context": args.context,
        "weight_dtype": args.weight_dtype or default_weight_dtype(),
        "kv_dtype": args.kv_dtype,
        "dequantize_at_load": args.dequantize_at_load,
        "weight_bytes": weight_bytes,
        "retain_freed_memory": retain_freed_memory(),
        "copy_gb_per_s": copy_bytes_per_s / 1e9,
        "roofline_ms": roofline_ms,
        "gdn_fused": gdn.fused_decode(1),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "decode": [],
        "verify": [],
    }
    for b in map(int, args.batches.split(",")):
        sec, device, faults = time_steps(model, b, 1, args.context, args.steps, args.hlo if b == 1 else None,
                                         kv_dtype=args.kv_dtype)  # fmt: skip
        if b == 1 and args.hlo:
            with open(args.hlo) as f:
                results["compiled_decode_step"] = compiled_kinds(f.read())
        results["decode"].append({"batch": b, "step_ms": sec * 1e3, "device_step_ms": device * 1e3,
                                  "page_faults_per_step": faults,
                                  "tokens_per_s": b / sec, "over_roofline": sec * 1e3 / roofline_ms,
                                  "device_over_roofline": device * 1e3 / roofline_ms})
        print(f"decode  batch {b:3d}: {sec * 1e3:8.2f} ms/step  {b / sec:8.2f} tokens/s  "
              f"{sec * 1e3 / roofline_ms:5.2f}x roofline; device alone {device * 1e3:8.2f} ms  "
              f"{device * 1e3 / roofline_ms:5.2f}x", flush=True)
    if args.profile:
        results["profile"] = profile_steps(model, 1, 1, args.context, args.steps, kv_dtype=args.kv_dtype)
        profile = results["profile"]
        print(f"profile decode batch 1: device busy {profile.get('busy_us_per_call')} us of "
              f"{profile.get('wall_us_per_call')} us a step, {profile.get('events_per_call')} device events a step",
              flush=True)
    # Rounds alternate the T values, so that a slower spell of a shared machine falls on all of them; each T's
    # figures are the medians over rounds, its ratio the median of the per-round ratios to the first T.
    ts = list(map(int, args.verify_t.split(",")))
    rounds = {t: [] for t in ts}
    for r in range(args.rounds):
        for t in ts:
            rounds[t].append(time_steps(model, 1, t, args.context, args.steps, kv_dtype=args.kv_dtype))
    base = rounds[ts[0]]
    for t in ts:
        sec, device, faults = (statistics.median(column) for column in zip(*rounds[t]))
        ratio = statistics.median(mine[0] / first[0] for mine, first in zip(rounds[t], base))
        device_ratio = statistics.median(mine[1] / first[1] for mine, first in zip(rounds[t], base))
        results["verify"].append({"T": t, "step_ms": sec * 1e3, "ratio_to_T1": ratio,
                                  "page_faults_per_step": faults, "device_step_ms": device * 1e3,
                                  "device_ratio_to_T1": device_ratio,
                                  "rounds_step_ms": [round(one[0] * 1e3, 3) for one in rounds[t]]})
        print(f"verify  T {t:3d}: {sec * 1e3:8.2f} ms/step  {ratio:5.2f}x T={ts[0]}; device alone "
              f"{device * 1e3:8.2f} ms  {device_ratio:5.2f}x  ({args.rounds} rounds)", flush=True)
    if args.out:
        save_json(results, args.out)
    return results


if __name__ == "__main__":
    main()
