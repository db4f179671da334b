"""The CPU block product alone (`cpu_matmul.block_rows_matmul`): ms per call and the weight bytes' rate, for each
block type, a weight that stays in cache and one read from memory, and 1-16 rows of x.

    gdnspec bench block-product --out bench/results/block-product-cpu.json
    gdnspec bench block-product --types Q4_0,Q4_0-groups    # Q4_0 as the file holds it, and in row groups

Weights are random valid blocks (`quant_blocks.random_blocks`) of 1024 inputs; each case is one jitted call, timed
as the median of `--repeats` after a warm-up, all threads of XLA's pool. The ratio `m_over_1` (an M-row call against
a one-row call) is what a verify step's products cost against a decode step's.
"""

from __future__ import annotations

import argparse
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as QT

from bench import median_seconds, run_and_save
from jaxmodel.kernels import cpu_matmul
from jaxmodel.quant_blocks import random_blocks, row_bytes

SIZES = {"cache": 28672, "memory": 172032}  # output rows of 1024 inputs: 16-30 MB, 96-180 MB of blocks
GROUPED = "-groups"  # a type name ending so: its weight in row groups (`cpu_matmul.interleave_block_rows`)


def run(args) -> dict:
    if not cpu_matmul.block_kernels():
        raise SystemExit("the block products are not built for this machine (cpu_matmul.block_kernels())")
    K = 1024
    ms = [int(m) for m in args.ms.split(",")]
    rng = np.random.default_rng(0)
    results = {"args": vars(args), "machine": platform.processor() or platform.machine(),
               "isa": cpu_matmul.block_kernel_isa(), "cpus": os.cpu_count(), "cases": []}
    product = jax.jit(cpu_matmul.block_rows_matmul, static_argnums=(2, 4))
    for name in args.types.split(","):
        qtype = QT[name.removesuffix(GROUPED)]
        row_group = cpu_matmul.ROW_GROUPS[int(qtype)] if name.endswith(GROUPED) else 1
        for where in args.sizes.split(","):
            N = SIZES[where]
            w = random_blocks(rng, qtype, (N, K))
            w = jnp.asarray(w if row_group == 1 else cpu_matmul.interleave_block_rows(w, qtype))
            n_bytes = N * row_bytes(qtype, K)
            one_row = None
            for M in ms:
                x = jnp.asarray(rng.standard_normal((M, K)).astype(np.float32))
                seconds = median_seconds(lambda: product(x, w, int(qtype), None, row_group).block_until_ready(),
                                         args.repeats)
                one_row = one_row or seconds
                case = {"type": name, "where": where, "N": N, "K": K, "M": M, "weight_mb": round(n_bytes / 2**20, 1),
                        "ms": round(seconds * 1e3, 3), "gb_per_s": round(n_bytes / seconds / 1e9, 1),
                        "m_over_1": round(seconds / one_row, 2)}
                results["cases"].append(case)
                print(f"{name:7s} {where:6s} M={M:2d}  {case['ms']:8.3f} ms  {case['gb_per_s']:6.1f} GB/s  "
                      f"{case['m_over_1']:.2f}x M=1", flush=True)
            del w
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write JSON results here")
    parser.add_argument("--types",
                        default="Q4_K,Q4_K-groups,Q5_K,Q5_K-groups,Q6_K,Q6_K-groups,Q4_0,Q4_0-groups,Q8_0,IQ4_XS")
    parser.add_argument("--sizes", default="cache,memory", help=f"comma list of: {', '.join(SIZES)}")
    parser.add_argument("--ms", default="1,2,4,8,16", help="rows of x")
    parser.add_argument("--repeats", type=int, default=15)
    return run_and_save(run, parser.parse_args(argv))


if __name__ == "__main__":
    main()
