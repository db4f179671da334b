"""Tensor parallelism on CPU host devices: the 0.8B preset's decode step on 1, 2 and 4 devices, and where it goes.

    python -m bench.sharding --out bench/results/sharding-cpu.json

Random weights of the qwen35-0.8b preset's shapes (`jaxmodel.random_model`, no MTP block; float32, matmul weights
transposed for the CPU few-row kernel as `load_model` stores them), decode steps (T = 1) of B rows over `--context`
tokens each. One device is the unsharded model; 2 and 4 are `Model.sharded` on host devices that this process forces
(--xla_force_host_platform_device_count). Per layout: the median step time, the collectives of the compiled step
(counted in its HLO, with their bytes), and their time measured alone: a jitted chain of as many psums of the same
size on the same mesh. Compute is the step time less that. Host devices share this machine's cores and memory, so
this measures the overhead of the SPMD program and its collectives, not a speed-up.
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):  # before JAX starts
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=4".strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import median_seconds, run_and_save  # noqa: E402
from bench.step import _steps  # noqa: E402
from jaxmodel.kernels import cpu_matmul  # noqa: E402
from jaxmodel.model import Model  # noqa: E402
from jaxmodel.precision import transpose_matmul_weights  # noqa: E402
from jaxmodel.random_model import PRESETS, random_weights  # noqa: E402
from jaxmodel.sharding import AXIS, COLLECTIVES, count_collectives  # noqa: E402

_SHAPE = re.compile(r"= (f32|s32|bf16)\[([\d,]*)\]")


def collective_bytes(hlo_text: str) -> int:
    """Bytes of the results of the collectives in a compiled module's HLO text."""
    total = 0
    for line in hlo_text.splitlines():
        if not any(f" {name}(" in line or f" {name}-start(" in line for name in COLLECTIVES):
            continue
        match = _SHAPE.search(line)
        if match:
            size = int(np.prod([int(d) for d in match.group(2).split(",") if d]))
            total += size * (2 if match.group(1) == "bf16" else 4)
    return total


def psum_chain_seconds(mesh, shape, count: int, repeats: int) -> float:
    """Median time of `count` psums of a float32 array of `shape`, one after the other (each feeding the next)."""

    def chain(x):
        for _ in range(count):
            x = jax.lax.psum(x, AXIS) * 0.5
        return x

    run = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=jax.sharding.PartitionSpec(),
                                out_specs=jax.sharding.PartitionSpec(), check_vma=False))
    x = jnp.ones(shape, jnp.float32)
    return median_seconds(lambda: run(x).block_until_ready(), repeats)


# On paper (README, "Tensor parallelism"): published configs and Q4_K_M file sizes (the and the README's
# figures), the project's byte formulas, and stated hardware assumptions. E, L, H, Hkv, D, Hk, Hv, Dk, X, k, Fe, Fs,
# V, total and active parameters (billions), Q4_K_M file GB.
REAL_MODELS = {
    "Qwen3-Next-80B-A3B": ("qwen3next", 2048, 48, 16, 2, 256, 16, 32, 128, 512, 10, 512, 512, 151936, 80, 3, 48),
    "Qwen3.5-122B-A10B": ("qwen35moe", 3072, 48, 32, 2, 256, 16, 64, 128, 256, 8, 1024, 1024, 248320, 122, 10, 70),
    "Qwen3.5-397B-A17B": ("qwen35moe", 4096, 60, 32, 2, 256, 16, 64, 128, 512, 10, 1024, 1024, 248320, 397, 17, 220),
}
HBM_BYTES_PER_S = 4.8e12  # an H200's
NVLINK_BYTES_PER_S = 450e9  # one direction, per GPU (NVLink 4)
ALL_REDUCE_LATENCY_S = 10e-6  # per all-reduce of a few rows, assumed


# (tensor parallel, expert parallel) layouts on 1 to 8 devices.
PAPER_LAYOUTS = ((1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (2, 4))
Q4_K_BLOCK = 256  # inputs of a K-quant block: the unit an expert's hidden columns split in (`sharding.ffn_columns`)


def on_paper(layouts=PAPER_LAYOUTS, context: int = 32768, rows: int = 1) -> list[dict]:
    """Bytes per device and the decode step's expected time for REAL_MODELS in each (tp, ep) layout: the routed
    experts split over ep groups and their hidden columns over tp (in whole 256-input blocks for Q4_K_M, padded with
    zero blocks where they do not go evenly: `sharding.ffn_columns`), everything else over tp (the file's blocks for
    Q4_K_M at the file's bytes per parameter, 2 bytes a parameter for bf16); a sequence's KV at `context` tokens
    (float16) and its GDN plane (float32) as the sharded pools hold them (`TensorParallel.pools`); and a step of
    `rows` tokens that reads the active weights once from HBM (a token's k experts spread over the ep groups on
    average) plus 1 + 2(L + 1) all-reduces of rows x E float32 over NVLink (ring: 2 (n-1)/n of the bytes, plus
    ALL_REDUCE_LATENCY_S each)."""
    from jaxmodel.config import ModelConfig
    from jaxmodel.sharding import ffn_columns, tensor_parallel
    from jaxmodel.state import bytes_per_plane, kv_bytes_per_page

    table = []
    for name, (arch, E, L, H, Hkv, D, Hk, Hv, Dk, X, k, Fe, Fs, V, total, active, q4_gb) in REAL_MODELS.items():
        cfg = ModelConfig(arch=arch, n_vocab=V, n_embd=E, n_layer=L, n_mtp=1, n_head=H, n_head_kv=Hkv, head_dim=D,
                          rope_dim=64, rope_theta=1e7, rope_sections=None, norm_eps=1e-6, conv_kernel=4,
                          ssm_state=Dk, ssm_groups=Hk, ssm_heads=Hv,
                          recurrent=tuple((i + 1) % 4 != 0 for i in range(L)),
                          context_length=262144, n_expert=X, n_expert_used=k, n_ff_expert=Fe, n_ff_shared=Fs)
        expert_share = (L + 1) * X * 3 * E * Fe / (total * 1e9)  # routed experts' part of the parameters
        active_share = (L + 1) * k * 3 * E * Fe / (active * 1e9)  # ... of the active ones (k experts a token)
        for n, ep in layouts:
            pools = cfg if n == 1 else tensor_parallel(cfg, _AbstractMesh(n)).pools
            kv = kv_bytes_per_page(pools, context, "float16") / n
            plane = bytes_per_plane(pools) / n
            reduces = 0 if n * ep == 1 else 1 + 2 * (L + 1)
            devices = n * ep
            collective = reduces * (ALL_REDUCE_LATENCY_S + 2 * (devices - 1) / devices * rows * E * 4
                                    / NVLINK_BYTES_PER_S)
            formats = (("Q4_K_M", q4_gb * 1e9, q4_gb * 1e9 * active / total, Q4_K_BLOCK),
                       ("bf16", 2 * total * 1e9, 2 * active * 1e9, 1))
            for fmt, all_bytes, active_bytes, unit in formats:
                held = len(ffn_columns(Fe, n, unit)[0]) / Fe  # of each expert's columns, padding included
                device_bytes = all_bytes * (expert_share * held / ep + (1 - expert_share) / n)
                read = active_bytes * (active_share * held / ep + (1 - active_share) / n) / HBM_BYTES_PER_S
                table.append({"model": name, "format": fmt, "tp": n, "ep": ep, "weights_gb": device_bytes / 1e9,
                              "expert_padding": held * n - 1, "kv_gb_per_sequence": kv / 1e9,
                              "plane_mb_per_sequence": plane / 1e6, "weights_ms": 1e3 * read,
                              "all_reduces": reduces, "all_reduce_ms": 1e3 * collective,
                              "step_ms": 1e3 * (read + collective)})
    return table


class _AbstractMesh:
    """What `sharding.tensor_parallel` reads of a mesh, for sizes this process has no devices for."""

    def __init__(self, n: int):
        self.shape = {AXIS: n}


def run(args) -> dict:
    cfg = dataclasses.replace(PRESETS[args.preset], n_mtp=0)
    weights = random_weights(cfg, seed=0, scale=0.02)
    if cpu_matmul.available():
        weights = transpose_matmul_weights(weights)
    base = Model(cfg, weights)
    del weights
    results = {"preset": args.preset, "context": args.context, "machine": platform.machine(),
               "cores": os.cpu_count(), "host_devices": len(jax.devices()), "jax": jax.__version__, "layouts": {}}
    for n in args.devices:
        model = base if n == 1 else base.sharded(n)
        layout = {"weights_bytes": model.weights_bytes}
        for B in args.rows:
            state, batch = _steps(model, B, 1, args.context, "float32")
            text = model.step.lower(model.weights, batch=batch(0), state=state).compile().as_text()
            holder = {"state": state, "i": 0}

            def step():
                out, holder["state"] = model.step(model.weights, batch=batch(holder["i"]), state=holder["state"])
                holder["i"] += 1
                out.logits.block_until_ready()

            seconds = median_seconds(step, args.repeats)
            counts = {k: v for k, v in count_collectives(text).items() if v}
            row = {"step_ms": 1e3 * seconds, "collectives": counts, "collective_bytes": collective_bytes(text)}
            if n > 1:
                tp = model.cfg.tensor_parallel
                reduces = counts.get("all-reduce", 0)
                alone = psum_chain_seconds(tp.mesh, (batch(0).tokens.shape[0], 1, cfg.n_embd), reduces, args.repeats)
                row.update(all_reduces_ms=1e3 * alone, compute_ms=1e3 * (seconds - alone))
            layout[f"B{B}"] = row
            print(f"{n} device(s), B={B}: {row}", flush=True)
            del state, holder
        results["layouts"][str(n)] = layout
        del model
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen35-0.8b")
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--paper", action="store_true", help="print the on-paper table at real sizes and stop")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.paper:
        print("| model | format | TP x EP | weights GB | KV GB, 32k seq | planes MB/seq | weights ms | "
              "all-reduces (ms) | step ms |\n|---|---|---|---|---|---|---|---|---|")
        for r in on_paper():
            padded = f" (experts +{r['expert_padding']:.0%} zero blocks)" if r["expert_padding"] > 0 else ""
            print(f"| {r['model']} | {r['format']} | {r['tp']} x {r['ep']} | {r['weights_gb']:.1f}{padded} | "
                  f"{r['kv_gb_per_sequence']:.2f} | {r['plane_mb_per_sequence']:.1f} | {r['weights_ms']:.2f} | "
                  f"{r['all_reduces']} ({r['all_reduce_ms']:.2f}) | {r['step_ms']:.2f} |")
        return {}
    return run_and_save(run, args)


if __name__ == "__main__":
    main()
