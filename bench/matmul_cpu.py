"""Small-row matmuls on CPU: the formulations XLA offers for x [M, K] times a weight, at the model's layer shapes.

    .venv/bin/python -m bench.matmul_cpu --out bench/results/matmul-cpu.json
    # subsets, other row counts, XLA flag / thread configurations (each config runs in its own process):
    .venv/bin/python -m bench.matmul_cpu --models qwen35-0.8b --ms 1,2,3,4,8,16 --forms dot,dot_eigen,rows,linear
    .venv/bin/python -m bench.matmul_cpu --shapes ffn.gate_up,lm_head --ms 1,4,16 --configs default,1thread,ynn_off
    # merge runs into one file; print the tables and the per-step summary of a file:
    .venv/bin/python -m bench.matmul_cpu --merge a.json b.json --out bench/results/matmul-cpu.json
    .venv/bin/python -m bench.matmul_cpu --summarize bench/results/matmul-cpu.json

Why: a speculative verify step (T tokens) cost 2.5-3.3x a decode step on CPU, and XLA's dot for 2-16 rows costs
several times a 1-row product although both stream the same weights once. This measures, for M rows and every
distinct (K, N) of the `qwen35-0.8b` preset and of the bundled target model (f32 weights):

  dot            the einsum `linear` used before (preferred_element_type=f32), weights [K, N]; jaxlib 0.10 runs it
                 with XLA's own matrix-vector kernel at M = 1 and as a YNNPACK fusion from M = 2
  dot_highest    the same with precision=HIGHEST;  dot_nopref: jnp.dot without preferred_element_type
  dot_eigen      dot_general(x^T, w) contracting dim 0, x^T behind an optimization barrier: YNNPACK declines a
                 column-major lhs, so XLA runs its own dot (Eigen)
  dot_eigen_t    the same product as w^T x^T -> [N, M] (w as the column-major lhs), then transposed
  dot_nk         weights stored transposed [N, K], dot_general contracting the last dims -> [M, N]
  dot_nk_t       the same computed as W x^T -> [N, M], then transposed
  mulred_nk      (x[:, None, :] * w[None]).sum(-1), w [N, K]  (output [M, N])
  mulred_nk_t    (w[:, None, :] * x[None]).sum(-1).T, w [N, K]  (output [N, M]: llama.cpp's loop order)
  mulred_kn      (x[:, :, None] * w[None]).sum(1), w [K, N];  mulred_kn_t: (w[:, :, None] * x.T[:, None]).sum(0).T
  chunk_n        N split into 4 column blocks, one dot each, concatenated
  chunk_k        K split into 256-row blocks (contiguous in [K, N]), partial dots summed
  rows           M separate 1-row products (unrolled), stacked;  rows_nk: the same with w [N, K]
  vmap_rows      jax.vmap of the 1-row product (XLA sees one dot again);  map_rows: lax.map over rows (a loop)
  map_blocks2    lax.map over 2-row blocks
  linear         jaxmodel.layers.linear as it is now (its small-row rule picks one of the above)

Each case runs inside one jit as a chain over `ncopy` distinct weight copies (>= --pool-mb in all, so the large
shapes stream from DRAM as the real 2.3 GB model does; each op's input depends on the previous op's output, so
they run one after another), timed with block_until_ready over interleaved rounds; ms is per op. GB/s counts the
weight bytes (K N 4) only. `rel_err` is the max error against a float64 product, over max |product|. XLA flags and
thread counts need a fresh process: every --configs entry runs in a subprocess (`--worker`). The machine may be
shared: the JSON keeps the minimum beside the median, and the cores other processes kept busy during each shape's
rounds (`others_busy_cores`). The summary sums uses-per-step x ms over a model's shapes: one step's matmul time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from bench import save_json

# XLA flag sets; each runs in its own process. jaxlib 0.10 aborts on flags it does not know ("Unknown flags in
# XLA_FLAGS"), e.g. --xla_cpu_enable_custom_matmul_tiling; --xla_cpu_use_thunk_runtime=false is accepted but ignored.
CONFIGS = {
    "default": {"flags": "", "cpus": None},
    "1thread": {"flags": "", "cpus": 1},
    "ynn_off": {"flags": "--xla_cpu_experimental_ynn_fusion_type=", "cpus": None},
    "ynn_off_xnnpack": {
        "flags": "--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_use_xnnpack=true "
        "--xla_cpu_experimental_xnn_fusion_type=dot,individual_dot,reduce",
        "cpus": None,
    },
    "ynn_off_onednn": {"flags": "--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_use_onednn=true", "cpus": None},
    "eigen_1thread": {"flags": "--xla_cpu_multi_thread_eigen=false", "cpus": None},
    "fast_math": {"flags": "--xla_cpu_enable_fast_math=true", "cpus": None},
    "ynn_off_fast_math": {
        "flags": "--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_enable_fast_math=true",
        "cpus": None,
    },
}

ALL_FORMS = (
    "dot dot_highest dot_nopref dot_eigen dot_eigen_t dot_nk dot_nk_t mulred_nk mulred_nk_t mulred_kn mulred_kn_t "
    "chunk_n chunk_k rows rows_nk vmap_rows map_rows map_blocks2 linear"
).split()
# Non-default configs run these by default.
CONFIG_FORMS = "dot dot_eigen dot_nk mulred_nk_t mulred_kn rows".split()
# Forms that keep today's [K, N] storage (the others need the weights stored [N, K]).
KN_FORMS = set(ALL_FORMS) - {"dot_nk", "dot_nk_t", "mulred_nk", "mulred_nk_t", "rows_nk"}


def model_shapes() -> list[dict]:
    """Every distinct (K, N) of the 0.8B preset and of the bundled target, with how often one step uses it."""
    from jaxmodel.assets import default_model_path
    from jaxmodel.config import from_gguf
    from jaxmodel.gguf_io import open_gguf
    from jaxmodel.random_model import PRESETS

    bundled = from_gguf(open_gguf(str(default_model_path())))
    out = []
    for model, cfg in (("qwen35-0.8b", PRESETS["qwen35-0.8b"]), ("bundled", bundled)):
        E, F, V = cfg.n_embd, cfg.n_ff, cfg.n_vocab
        H, Hkv, D, Hv, Dk = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.ssm_heads, cfg.ssm_state
        g, a = len(cfg.gdn_layers), len(cfg.attn_layers)
        uses = [
            ("gdn.qkv", E, cfg.conv_channels, g), ("gdn.gate", E, Hv * Dk, g), ("gdn.beta_alpha", E, Hv, 2 * g),
            ("gdn.out", Hv * Dk, E, g), ("attn.q", E, 2 * H * D, a), ("attn.k_v", E, Hkv * D, 2 * a),
            ("attn.o", H * D, E, a), ("ffn.gate_up", E, F, 2 * cfg.n_layer), ("ffn.down", F, E, cfg.n_layer),
            ("lm_head", E, V, 1),
        ]  # fmt: skip
        merged: dict[tuple[int, int], dict] = {}
        for name, K, N, count in uses:
            if count == 0:
                continue
            d = merged.setdefault((K, N), {"model": model, "names": [], "K": K, "N": N, "uses_per_step": 0})
            d["names"].append(name)
            d["uses_per_step"] += count
        for d in merged.values():
            d["name"] = "/".join(d.pop("names"))
            out.append(d)
    return out


def _forms():
    import jax
    import jax.numpy as jnp
    from jax import lax

    from jaxmodel.layers import linear

    f32 = jnp.float32
    nk = (((1,), (1,)), ((), ()))
    c0 = (((0,), (0,)), ((), ()))

    def dot(x, w):
        return jnp.dot(x, w, preferred_element_type=f32)

    def chunk_n(x, w, parts=4):
        step = -(-w.shape[1] // parts)
        return jnp.concatenate([dot(x, w[:, i : i + step]) for i in range(0, w.shape[1], step)], 1)

    def chunk_k(x, w, block=256):
        parts = [dot(x[:, i : i + block], w[i : i + block]) for i in range(0, w.shape[0], block)]
        return sum(parts[1:], parts[0])

    def dot_eigen(x, w):
        return lax.dot_general(lax.optimization_barrier(x.T), w, c0, preferred_element_type=f32)

    def dot_eigen_t(x, w):
        return lax.dot_general(w, lax.optimization_barrier(x.T), c0, preferred_element_type=f32).T

    def map_blocks2(x, w):
        m = x.shape[0]
        if m % 2:
            return dot(x, w)
        return lax.map(lambda b: dot(b, w), x.reshape(m // 2, 2, -1)).reshape(m, -1)

    # name -> (weights transposed to [N, K]?, fn(x [M, K], w) -> [M, N])
    return {
        "dot": (False, lambda x, w: jnp.einsum("...i,io->...o", x, w, preferred_element_type=f32)),
        "dot_highest": (
            False,
            lambda x, w: jnp.einsum("...i,io->...o", x, w, preferred_element_type=f32, precision="highest"),
        ),
        "dot_nopref": (False, lambda x, w: jnp.dot(x, w)),
        "dot_eigen": (False, dot_eigen),
        "dot_eigen_t": (False, dot_eigen_t),
        "dot_nk": (True, lambda x, w: lax.dot_general(x, w, nk, preferred_element_type=f32)),
        "dot_nk_t": (True, lambda x, w: lax.dot_general(w, x, nk, preferred_element_type=f32).T),
        "mulred_nk": (True, lambda x, w: (x[:, None, :] * w[None]).sum(-1)),
        "mulred_nk_t": (True, lambda x, w: (w[:, None, :] * x[None]).sum(-1).T),
        "mulred_kn": (False, lambda x, w: (x[:, :, None] * w[None]).sum(1)),
        "mulred_kn_t": (False, lambda x, w: (w[:, :, None] * x.T[:, None, :]).sum(0).T),
        "chunk_n": (False, chunk_n),
        "chunk_k": (False, chunk_k),
        "rows": (False, lambda x, w: jnp.stack([dot(x[i], w) for i in range(x.shape[0])])),
        "rows_nk": (True, lambda x, w: jnp.stack([dot(w, x[i]) for i in range(x.shape[0])])),
        "vmap_rows": (False, lambda x, w: jax.vmap(lambda r: dot(r, w))(x)),
        "map_rows": (False, lambda x, w: lax.map(lambda r: dot(r, w), x)),
        "map_blocks2": (False, map_blocks2),
        "linear": (False, linear),
    }


def _cpu_busy() -> tuple[float, float]:
    """(all CPUs' busy seconds, this process's CPU seconds) so far."""
    with open("/proc/stat") as f:
        vals = list(map(int, f.readline().split()[1:]))
    busy = sum(vals) - vals[3] - (vals[4] if len(vals) > 4 else 0)  # minus idle, iowait
    t = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), t.user + t.system


def worker(spec: dict) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    forms = _forms()
    rng = np.random.default_rng(0)
    rows = []
    for shape in spec["shapes"]:
        K, N = shape["K"], shape["N"]
        wbytes = K * N * 4
        ncopy = int(min(spec["max_copies"], max(4, -(-spec["pool_mb"] * 2**20 // wbytes))))
        base = rng.standard_normal((ncopy, K, N), np.float32) * 0.02
        w_kn = [jnp.asarray(base[i]) for i in range(ncopy)]
        w_nk = [jnp.asarray(np.ascontiguousarray(base[i].T)) for i in range(ncopy)]
        del base
        cases = []
        for M in spec["ms"]:
            x = jnp.asarray(rng.standard_normal((M, K), np.float32))
            ref = np.asarray(x, np.float64) @ np.asarray(w_kn[0], np.float64)
            for name in spec["forms"]:
                transposed, fn = forms[name]

                def chain(x, ws, fn=fn):
                    ys = []
                    for w in ws:
                        y = fn(x, w)
                        ys.append(y)
                        x = x + 1e-30 * y[:, :1]  # serialise the ops, as the model's layers are
                    return ys

                f = jax.jit(chain)
                ws = w_nk if transposed else w_kn
                t0 = time.perf_counter()
                ys = jax.block_until_ready(f(x, ws))
                compile_s = time.perf_counter() - t0
                err = float(np.max(np.abs(np.asarray(ys[0], np.float64) - ref)) / (np.max(np.abs(ref)) + 1e-30))
                t0 = time.perf_counter()
                jax.block_until_ready(f(x, ws))
                first = time.perf_counter() - t0
                rounds = int(max(spec["min_rounds"], min(spec["rounds"], spec["case_budget_s"] / max(first, 1e-6))))
                cases.append(dict(M=M, form=name, f=f, x=x, ws=ws, times=[], rounds=rounds, compile_s=compile_s,
                                  err=err))  # fmt: skip
        busy0, own0 = _cpu_busy()
        wall0 = time.perf_counter()
        load0 = os.getloadavg()[0]
        for r in range(max(c["rounds"] for c in cases)):
            for c in cases:
                if r < c["rounds"]:
                    t0 = time.perf_counter()
                    jax.block_until_ready(c["f"](c["x"], c["ws"]))
                    c["times"].append((time.perf_counter() - t0) / ncopy)
        busy1, own1 = _cpu_busy()
        wall = time.perf_counter() - wall0
        others = max(0.0, (busy1 - busy0) - (own1 - own0)) / wall
        for c in cases:
            med, mn = float(np.median(c["times"])), float(np.min(c["times"]))
            rows.append({
                "config": spec["config"], "model": shape["model"], "shape": shape["name"], "K": K, "N": N,
                "uses_per_step": shape["uses_per_step"], "M": c["M"], "form": c["form"], "ncopy": ncopy,
                "rounds": len(c["times"]), "ms_median": med * 1e3, "ms_min": mn * 1e3,
                "gbps_median": wbytes / med / 1e9, "gbps_min": wbytes / mn / 1e9, "rel_err": c["err"],
                "compile_s": c["compile_s"], "others_busy_cores": others, "loadavg": [load0, os.getloadavg()[0]],
            })  # fmt: skip
        print(f"# {spec['config']}: {shape['model']} {shape['name']} [{K}x{N}] x{ncopy} done "
              f"(others busy {others:.2f} cores)", file=sys.stderr, flush=True)  # fmt: skip
        del cases, w_kn, w_nk
    return rows


def run_config(config: str, spec: dict) -> list[dict]:
    cfg = CONFIGS[config]
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + cfg["flags"]).strip()
    cmd = [sys.executable, "-m", "bench.matmul_cpu", "--worker", json.dumps(dict(spec, config=config))]
    if cfg["cpus"]:
        cpus = sorted(os.sched_getaffinity(0))[: cfg["cpus"]]
        cmd = ["taskset", "-c", ",".join(map(str, cpus))] + cmd
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def print_table(rows: list[dict], key: str = "ms_median") -> None:
    by: dict[tuple, dict] = {}
    for r in rows:
        group = (r.get("run", 0), r["config"], r["model"], r["shape"], r["K"], r["N"])
        by.setdefault(group, {}).setdefault(r["form"], {})[r["M"]] = r
    for (run, config, model, shape, K, N), forms in by.items():
        print(f"\n[run {run}, {config}] {model} {shape} K={K} N={N}  ({key}: ms per op, GB/s)")
        ms = sorted({m for f in forms.values() for m in f})
        print(f"{'form':>12} " + " ".join(f"{'M=' + str(m):>15}" for m in ms))
        for form, per_m in forms.items():
            gbps = key.replace("ms", "gbps")
            cells = [f"{per_m[m][key]:7.3f} {per_m[m][gbps]:6.1f}" if m in per_m else "" for m in ms]
            print(f"{form:>12} " + " ".join(f"{c:>15}" for c in cells))


def summarize(rows: list[dict], key: str = "ms_median") -> list[dict]:
    """Per run, config, model and M: one step's matmul time (sum over shapes of uses x ms) for each form measured
    at every shape, for the best [K, N]-storage form per shape, and for the best form of either layout."""
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault((r.get("run", 0), r["config"], r["model"], r["M"]), []).append(r)
    out = []
    for (run, config, model, M), rs in sorted(groups.items()):
        per_shape: dict[str, dict] = {}
        for r in rs:
            per_shape.setdefault(r["shape"], {})[r["form"]] = r
        rec = {"run": run, "config": config, "model": model, "M": M, "step_ms": {}}
        for form in sorted({r["form"] for r in rs}):
            if all(form in f for f in per_shape.values()):
                rec["step_ms"][form] = sum(f[form]["uses_per_step"] * f[form][key] for f in per_shape.values())
        for label, allowed in (("best_kn", KN_FORMS), ("best_any", None)):
            total, picks = 0.0, {}
            for shape, f in per_shape.items():
                cands = {k: v for k, v in f.items() if allowed is None or k in allowed}
                if not cands:
                    continue
                best = min(cands, key=lambda k: cands[k][key])
                picks[shape] = best
                total += cands[best]["uses_per_step"] * cands[best][key]
            rec["step_ms"][label] = total
            rec[label] = picks
        out.append(rec)
    return out


def print_summary(summary: list[dict]) -> None:
    print("\none step's matmul ms (sum over shapes of uses x median ms), and speed-up over dot:")
    for rec in summary:
        dot = rec["step_ms"].get("dot")
        order = sorted(rec["step_ms"].items(), key=lambda kv: kv[1])
        cells = ", ".join(f"{k} {v:.1f}" + (f" ({dot / v:.2f}x)" if dot else "") for k, v in order)
        print(f"[run {rec['run']}, {rec['config']}] {rec['model']} M={rec['M']}: {cells}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write JSON results here")
    parser.add_argument("--ms", default="1,2,4,8,16", help="row counts M")
    parser.add_argument("--forms", default=",".join(ALL_FORMS), help="formulations for the default config")
    parser.add_argument("--config-forms", default=",".join(CONFIG_FORMS), help="formulations for other configs")
    parser.add_argument("--configs", default="default", help=f"comma list of: {', '.join(CONFIGS)}")
    parser.add_argument("--shapes", default="", help="comma list of shape names (default: all)")
    parser.add_argument("--config-shapes", default="", help="shape names for non-default configs (default: --shapes)")
    parser.add_argument("--models", default="qwen35-0.8b,bundled")
    parser.add_argument("--rounds", type=int, default=40, help="timed rounds per case, at most")
    parser.add_argument("--min-rounds", type=int, default=5, help="timed rounds per case, at least")
    parser.add_argument("--case-budget-s", type=float, default=1.0, help="rounds per case: this over one run's time")
    parser.add_argument("--pool-mb", type=int, default=256, help="weight bytes per chain (to defeat the caches)")
    parser.add_argument("--max-copies", type=int, default=32)
    parser.add_argument("--summarize", default=None, help="print the tables and summary of an existing JSON")
    parser.add_argument("--merge", nargs="+", default=None, help="merge these JSON results into --out")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return {}
    if args.summarize:
        with open(args.summarize) as f:
            results = json.load(f)
        print_table(results["rows"])
        print_summary(summarize(results["rows"]))
        return results
    if args.merge:
        results = {"runs": [], "rows": []}
        for path in args.merge:
            with open(path) as f:
                part = json.load(f)
            for run in part.get("runs") or [{k: v for k, v in part.items() if k not in ("rows", "summary")}]:
                results["runs"].append(run)
                i = len(results["runs"]) - 1
                old = run.get("index", 0)
                results["rows"] += [dict(r, run=i) for r in part["rows"] if r.get("run", 0) == old]
                run["index"] = i
    else:
        import jax

        shapes = [s for s in model_shapes() if s["model"] in args.models.split(",")]

        def pick(names: str) -> list[dict]:
            wanted = set(names.split(",")) if names else None
            return [s for s in shapes if not wanted or wanted & ({s["name"]} | set(s["name"].split("/")))]

        base = dict(ms=[int(m) for m in args.ms.split(",")], rounds=args.rounds, min_rounds=args.min_rounds,
                    case_budget_s=args.case_budget_s, pool_mb=args.pool_mb, max_copies=args.max_copies)  # fmt: skip
        run = {
            "index": 0, "command": " ".join(["python -m bench.matmul_cpu"] + (argv or sys.argv[1:])),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "jax": jax.__version__,
            "machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "xla_flags_env": os.environ.get("XLA_FLAGS", ""),
            "configs": {c: CONFIGS[c] for c in args.configs.split(",")},
        }  # fmt: skip
        results = {"runs": [run], "rows": []}
        for config in args.configs.split(","):
            default = config == "default"
            spec = dict(base, forms=(args.forms if default else args.config_forms).split(","),
                        shapes=pick(args.shapes if default else (args.config_shapes or args.shapes)))  # fmt: skip
            rows = run_config(config, spec)
            results["rows"] += [dict(r, run=0) for r in rows]
            print_table(rows)
            if args.out:  # keep what is done so far
                save_json(results, args.out, indent=1)
    results["summary"] = summarize(results["rows"])
    if args.out:
        save_json(results, args.out, indent=1)
    print_summary(results["summary"])
    return results


if __name__ == "__main__":
    main()
