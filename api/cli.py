"""`gdnspec` command line: make-random, bench."""

from __future__ import annotations

import argparse
import sys


def _make_random(args) -> int:
    from jaxmodel.gguf_io import write_gguf
    from jaxmodel.random_model import PRESETS, random_weights

    cfg = PRESETS[args.preset]
    write_gguf(args.out, cfg, random_weights(cfg, seed=args.seed), dtype=args.dtype, name=f"random-{args.preset}")
    print(f"wrote {args.out} ({args.preset}, {args.dtype})")
    return 0


def _bench(args) -> int:
    if args.what == "step":
        from bench.step import main as bench_step

        bench_step(args.rest)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from jaxmodel.random_model import PRESETS

    parser = argparse.ArgumentParser(prog="gdnspec", description="Speculative decoding for hybrid GDN models")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-random", help="write a random-weight qwen35 GGUF with real layer shapes")
    p.add_argument("--preset", choices=sorted(PRESETS), required=True)
    p.add_argument("--dtype", choices=["f32", "f16", "bf16", "q8_0"], default="f32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("out")
    p.set_defaults(func=_make_random)

    p = sub.add_parser("bench", help="benchmarks (bench step --model M [--out JSON])")
    p.add_argument("what", choices=["step"])
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_bench)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
