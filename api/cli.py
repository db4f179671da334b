"""`gdnspec` command line: serve, generate, loadtest, bench, make-random."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys
import time


def _model_paths(args) -> tuple[str, str | None]:
    """The --model/--draft-model paths, or the bundled models when --model is not given."""
    if args.model:
        return args.model, args.draft_model
    try:
        from jaxmodel.assets import default_draft_path, default_model_path
    except ImportError:
        raise SystemExit("no --model given and this installation has no bundled model; pass --model PATH") from None
    return str(default_model_path()), args.draft_model or str(default_draft_path())


def _use_compile_cache() -> None:
    """Keep compiled steps on disk so that a restarted server skips most of its warm-up: JAX's persistent cache,
    and beside it the step executables themselves (`executor.executables`), which a restart loads untraced."""
    import jax

    from jaxmodel.executor.executables import keep_beside_jax_cache

    path = os.environ.get("GDNSPEC_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "gdnspec", "jax"))
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # the small ones add up on a restart
    keep_beside_jax_cache()


def _build_engine(args):
    from drafters.draft_model import check_same_vocab
    from jaxmodel import load_model
    from jaxmodel.tokenizer import load_tokenizer
    from scheduler.assembly import DEFAULT_ITERATIONS, DEFAULT_MAX_CALL_SECONDS
    from scheduler.engine import Engine
    from scheduler.replicas import Replicas

    if args.replicas < 1:
        raise SystemExit(f"gdnspec: --replicas {args.replicas}: at least 1")
    for flag, value in (("--tensor-parallel", args.tensor_parallel), ("--expert-parallel", args.expert_parallel)):
        if value < 1 or (value > 1 and args.replicas > 1):
            raise SystemExit(f"gdnspec: {flag} {value}: at least 1, and 1 with --replicas")
    model_path, draft_path = _model_paths(args)
    try:  # a file that cannot serve is the user's to fix: one line naming it and what is wrong, no traceback
        quantized = False if args.dequantize_at_load else None
        model = load_model(model_path, weight_dtype=args.weight_dtype, quantized=quantized)
        tokenizer = load_tokenizer(model_path)
        draft = None
        if draft_path:
            check_same_vocab(model_path, draft_path)
            draft = load_model(draft_path, load_mtp=False, weight_dtype=args.weight_dtype, quantized=quantized)
    except ValueError as exc:  # ModelFormatError, or a draft model of another vocabulary
        raise SystemExit(f"gdnspec: cannot load the model: {exc}") from None
    if args.tensor_parallel > 1 or args.expert_parallel > 1:
        try:  # fewer devices than asked, heads or experts that do not split over them
            model = model.sharded(args.tensor_parallel, expert_parallel=args.expert_parallel)
        except ValueError as exc:
            raise SystemExit(f"gdnspec: cannot split the model over {args.tensor_parallel} x {args.expert_parallel} "
                             f"devices: {exc}") from None
        logging.getLogger("gdnspec").info("split over %d x %d devices: %s", args.expert_parallel,
                                          args.tensor_parallel, model.layout_report.summary())
    engine_args = dict(
        tokenizer=tokenizer, draft_model=draft, budget_bytes=int(args.budget_mb * 2**20),
        max_running=args.max_seqs, max_model_len=args.max_model_len, n_max=args.max_n_max,
        adaptive=not args.fixed_policy, iterations=args.iterations or DEFAULT_ITERATIONS, draft_vocab=args.draft_vocab,
        max_call_seconds=DEFAULT_MAX_CALL_SECONDS if args.max_call_ms is None else args.max_call_ms / 1e3 or None,
        kv_dtype=args.kv_dtype, prefix_cache=args.prefix_cache,
    )  # fmt: skip
    try:  # settings no engine can serve with (a budget too small for one sequence of --max-model-len, ...)
        if args.replicas > 1:
            return Replicas.build(model, args.replicas, **engine_args), tokenizer
        return Engine(model, **engine_args), tokenizer
    except ValueError as exc:
        raise SystemExit(f"gdnspec: cannot serve with these settings: {exc}") from None


def _engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="target GGUF (default: the bundled model)")
    p.add_argument("--draft-model", help="a small GGUF of the same vocabulary, for the draft_model drafter")
    p.add_argument("--budget-mb", type=float, default=256, help="KV pages + GDN planes of the target")
    p.add_argument("--max-seqs", type=int, default=16, help="sequences running at once")
    p.add_argument("--replicas", type=int, default=1,
                   help="engines serving side by side, each with its share of --max-seqs and --budget-mb (on a CPU "
                        "of 2 cores, 2 decode many streams faster; docs/performance.md, "
                        "\"Two engines side by side\")")
    p.add_argument("--tensor-parallel", type=int, default=1,
                   help="split the target over this many devices (jaxmodel.sharding: heads, FFN columns and the "
                        "vocabulary; --budget-mb counts all of them); on CPU, XLA_FLAGS="
                        "--xla_force_host_platform_device_count=N makes N host devices")
    p.add_argument("--expert-parallel", type=int, default=1,
                   help="split a MoE target's routed experts over this many groups of --tensor-parallel devices "
                        "(each group holds n_expert / M whole experts, and a copy of the rest as --tensor-parallel "
                        "splits it; --budget-mb counts one group)")
    p.add_argument("--max-model-len", type=int, default=2048, help="positions per sequence")
    p.add_argument("--max-n-max", type=int, default=16, help="longest draft any request may ask for")
    p.add_argument("--fixed-policy", action="store_true",
                   help="draft with each request's drafters in order at n_max instead of the adaptive policy")
    p.add_argument("--iterations", type=int, default=None,
                   help="most speculative iterations (or plain decoding steps) per device call (default: 64)")
    p.add_argument("--max-call-ms", type=float, default=None,
                   help="fewer iterations per device call where they would take longer than this, as the last "
                        "decoding call measured (0: no bound; default: 100)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="the MTP head drafts among the token ids below this (default: all); a multiple of 16 "
                        "keeps a quantized head's row groups whole (another value regroups the head's prefix in "
                        "every step)")
    p.add_argument("--weight-dtype", choices=["float32", "bfloat16"], default=None,
                   help="matmul weights (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--dequantize-at-load", action="store_true",
                   help="hold block-quantized weights (Q4_K, Q8_0, ...) as float copies in the weight dtype instead "
                        "of the file's bytes: more memory (bf16: about 3.5x a Q4_K_M file), for a backend whose "
                        "products of quantized weights measure slower")
    p.add_argument("--kv-dtype", choices=["float32", "float16"], default="float32",
                   help="the target's KV cache: float16 holds twice the positions in the same budget and reads "
                        "half the bytes at a long context")
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="keep computed states (GDN planes at block boundaries and finished turns' ends, shared KV "
                        "pages) inside --budget-mb for the requests that start with them: a conversation's next "
                        "turn, a shared system prompt; evicted least recently used first when running requests "
                        "need the memory (--no-prefix-cache: off)")


def _policy_options(p: argparse.ArgumentParser) -> None:
    from jaxmodel.requests import ROLLBACK_MODES

    p.add_argument("--drafters", help="comma-separated, in order of preference; 'none' for plain decoding")
    p.add_argument("--n-max", type=int)
    p.add_argument("--n-min", type=int)
    p.add_argument("--p-min", type=float)
    p.add_argument("--rollback", choices=ROLLBACK_MODES)


def _policy(text: str):
    """One speculative policy of --policies: 'none' (plain), 'default' (the server's), or drafters joined by ','."""
    from api.protocol import UNSET, Speculative

    if text == "none":
        return None
    if text == "default":
        return UNSET
    return Speculative(drafters=text.split(","))


def _speculative(args):
    from api.protocol import UNSET, Speculative

    if args.drafters == "none":
        return None
    fields = dict(drafters=args.drafters.split(",") if args.drafters else None, n_max=args.n_max,
                  n_min=args.n_min, p_min=args.p_min, rollback=args.rollback)  # fmt: skip
    if all(v is None for v in fields.values()):
        return UNSET
    return Speculative(**fields)


def _serve(args) -> int:
    import anyio

    from api.protocol import Defaults, Limits, ServerSettings
    from api.server import Access, Server, run_server
    from api.templates import TemplateLimits

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    several = args.num_processes > 1
    if several:
        from jaxmodel import multiprocess

        if args.coordinator is None or not 0 <= args.process_id < args.num_processes:
            raise SystemExit("gdnspec: --num-processes N needs --coordinator HOST:PORT and a --process-id below N")
        multiprocess.initialize(args.coordinator, args.num_processes, args.process_id)
        import jax

        mesh = args.tensor_parallel * args.expert_parallel
        if mesh != jax.device_count() or args.replicas > 1:
            raise SystemExit(f"gdnspec: --num-processes {args.num_processes}: --tensor-parallel x --expert-parallel "
                             f"({mesh}) must be every process's devices together ({jax.device_count()}), with no "
                             f"--replicas")
    engine, tokenizer = _build_engine(args)  # first: a file that cannot serve is refused before anything else
    known = tuple(name for name in engine.drafters if name != "synthetic")
    drafters = tuple(d for d in args.default_drafters.split(",") if d) if args.default_drafters != "none" else ()
    try:
        settings = ServerSettings(
            defaults=Defaults(drafters=drafters, max_tokens=min(args.default_max_tokens, args.max_model_len),
                              n_max=min(4, args.max_n_max)),
            limits=Limits(max_prompt_tokens=args.max_model_len - 1, max_prompt_chars=args.max_prompt_chars,
                          max_max_tokens=args.max_model_len, max_message_bytes=args.max_message_bytes,
                          max_in_flight=args.max_in_flight, max_connections=args.max_connections,
                          max_queued=args.max_queued, max_n_max=args.max_n_max, known_drafters=known),
        )  # fmt: skip
    except ValueError as exc:  # e.g. --default-drafters naming one this model lacks
        raise SystemExit(f"server settings: {exc}") from None
    access = Access.from_env(args.api_key, args.allow_origin)
    try:
        templates = TemplateLimits(seconds=args.template_seconds, memory_mb=args.template_memory_mb,
                                   max_chars=args.template_max_chars)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    _use_compile_cache()
    if args.warmup_first:
        # With several processes every one runs it, before they meet: identical engines run the same device calls
        # (each shape once, then the calibration's steps) in the same order, as the mesh's collectives need.
        start = time.perf_counter()
        n_shapes = engine.warmup(threads=args.compile_threads)
        logging.getLogger("gdnspec").info("warm-up: %d step shapes ready in %.1f s", n_shapes,
                                          time.perf_counter() - start)  # fmt: skip
    elif not several:  # a background warm-up interleaves with serving, which followers could not mirror
        engine.background_warmup = True
    leader = None
    if several:
        if args.process_id > 0:  # a follower: the same engine's runtime, driven by process 0's calls
            multiprocess.follow(engine.runtime)
            return 0
        leader = multiprocess.Leader(multiprocess.listen_host(args.coordinator))
        leader.mirror(engine.runtime)
    server = Server(engine, tokenizer, settings, access, shutdown_grace_s=args.shutdown_grace, templates=templates)
    model_name = args.served_model_name or os.path.basename(_model_paths(args)[0]).removesuffix(".gguf")

    async def main():
        shutdown = anyio.Event()
        async with engine, anyio.create_task_group() as tg:
            async def on_signal():
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for signum in signals:
                        log.info("%s: stopping", signal.Signals(signum).name)
                        stopping.append(time.perf_counter())
                        shutdown.set()
                        return

            tg.start_soon(on_signal)
            if args.http_port is not None:
                from api.http import run_http

                tg.start_soon(lambda: run_http(server, args.host, args.http_port, model_name=model_name,
                                               shutdown=shutdown))  # fmt: skip
            await run_server(server, args.host, args.port, shutdown=shutdown, compression=args.compression)
            tg.cancel_scope.cancel()
        if stopping:
            log.info("stopped in %.2f s", time.perf_counter() - stopping[0])

    log = logging.getLogger("gdnspec")
    stopping: list[float] = []
    try:
        anyio.run(main)
    finally:
        if leader is not None:
            leader.close()
    return 0


def _generate(args) -> int:
    import anyio

    from api.client import Client

    if (args.prompt is None) == (args.prompt_ids is None):
        raise SystemExit("give exactly one of --prompt or --prompt-ids")
    prompt_ids = [int(t) for t in args.prompt_ids.split(",")] if args.prompt_ids else None
    speculative = _speculative(args)

    async def over_client(url: str) -> dict:
        async with Client(url) as client:
            stream = await client.generate(args.prompt, prompt_ids=prompt_ids, max_tokens=args.max_tokens,
                                           temperature=args.temperature, seed=args.seed, speculative=speculative)
            token_ids, text, done = [], [], None
            async for frame in stream:
                if frame.__class__.__name__ == "Tokens":
                    token_ids += frame.token_ids
                    text.append(frame.text)
                    if not args.json:
                        print(frame.text, end="", flush=True)
                else:
                    done = frame
            if not args.json:
                print()
            import msgspec

            return {"token_ids": token_ids, "text": "".join(text), "finish_reason": done.finish_reason,
                    "usage": msgspec.to_builtins(done.usage), "spec": msgspec.to_builtins(done.spec),
                    "timings": msgspec.to_builtins(done.timings)}  # fmt: skip

    async def in_process() -> dict:
        from api.protocol import Defaults, Limits, ServerSettings
        from api.server import Server, listening

        engine, tokenizer = _build_engine(args)
        known = tuple(engine.drafters)
        settings = ServerSettings(defaults=Defaults(drafters=(), max_tokens=1), limits=Limits(
            max_prompt_tokens=args.max_model_len - 1, max_max_tokens=args.max_model_len, known_drafters=known,
            max_n_max=args.max_n_max))  # fmt: skip
        async with engine, listening(Server(engine, tokenizer, settings)) as (url, _):
            return await over_client(url)

    result = anyio.run(over_client, args.url) if args.url else anyio.run(in_process)
    if args.json:
        print(json.dumps(result))
    return 0


def _loadtest(args) -> int:
    import anyio

    import msgspec

    from api.loadtest import PROMPT_SETS, Chaos, format_table, load_prompts, plot_throughput, run_loadtest

    prompts = PROMPT_SETS[args.prompts] if args.prompts in PROMPT_SETS else load_prompts(args.prompts)
    if (args.requests is None) == (args.duration is None):
        args.requests = args.requests or 32
        args.duration = None

    def progress(record, finished):
        total = args.requests or "?"
        print(f"\r{finished}/{total} requests finished", end="", file=sys.stderr, flush=True)

    chaos = None
    if args.cancel_rate or args.disconnect_rate or args.policies:
        policies = tuple(_policy(p) for p in args.policies.split(";")) if args.policies else ()
        chaos = Chaos(cancel=args.cancel_rate, disconnect=args.disconnect_rate, policies=policies,
                      seed=args.seed or 0)  # fmt: skip
    api_key = args.api_key or os.environ.get("GDNSPEC_API_KEY")
    try:
        result = anyio.run(lambda: run_loadtest(
            args.url, concurrency=args.concurrency, prompts=prompts, requests=args.requests, duration=args.duration,
            max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed, speculative=_speculative(args),
            progress=progress, chaos=chaos, stats_every=args.stats_every, api_key=api_key))  # fmt: skip
    except ValueError as exc:  # options the protocol of --url does not offer
        raise SystemExit(f"gdnspec loadtest: {exc}") from None
    print(file=sys.stderr)
    summary = result.summary()
    print(format_table(summary))
    for sample in result.stats:
        st = sample.stats
        print(f"t={sample.t:7.1f}s rss {st.rss_bytes / 2**20:7.1f} MiB  pages {st.pages_free}/{st.pages_total}  "
              f"planes {st.planes_free}/{st.planes_total}  running {st.requests_running} waiting "
              f"{st.requests_waiting} in flight {st.requests_in_flight} connections {st.connections}")
    if args.json:
        report = summary.to_json(vars(args) | {"command": "loadtest"})
        report["stats"] = [{"t": s.t, **msgspec.to_builtins(s.stats)} for s in result.stats]
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    if args.plot:
        plot_throughput(result.records, args.plot)
    return 0


def _make_random(args) -> int:
    import numpy as np

    from jaxmodel.gguf_io import write_gguf
    from jaxmodel.random_model import PRESETS, random_weights

    cfg = PRESETS[args.preset]
    store = np.float16 if args.dtype == "f16" else np.float32  # the file's bytes either way, in half the memory
    write_gguf(args.out, cfg, random_weights(cfg, seed=args.seed, store=store), dtype=args.dtype,
               name=f"random-{args.preset}")
    print(f"wrote {args.out} ({args.preset}, {args.dtype})")
    return 0


BENCHMARKS = {"step": "bench.step", "engine": "bench.engine", "speculation": "bench.speculation",
              "iterations": "bench.iterations", "iteration-cost": "bench.iteration_cost", "mixed": "bench.mixed",
              "peer": "bench.peer", "attention": "bench.attention", "q8-product": "bench.q8_product",
              "block-product": "bench.block_product",
              "kernels": "bench.kernels", "host": "bench.host",
              "replicas": "bench.replicas", "prefix-cache": "bench.prefix_cache", "warm-start": "bench.warm_start"}


def _bench(args) -> int:
    importlib.import_module(BENCHMARKS[args.what]).main(args.rest)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from jaxmodel.random_model import PRESETS

    parser = argparse.ArgumentParser(prog="gdnspec", description="Speculative decoding for hybrid GDN models")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="serve a model over websockets")
    _engine_options(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--default-drafters", default="ngram,mtp", help="for requests that name none ('none': plain)")
    p.add_argument("--default-max-tokens", type=int, default=256)
    p.add_argument("--warmup-first", action="store_true",
                   help="compile every step shape before listening (default: listen at once and compile them while "
                        "idle; a request arriving meanwhile compiles what it needs first)")
    p.add_argument("--compile-threads", type=int, metavar="N",
                   help="with --warmup-first: step shapes compiled at once (default: one per core this process may "
                        "use; each compilation keeps about one core busy)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' at the handshake (default: the "
                                     "GDNSPEC_API_KEY environment variable; none when both are empty)")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="a browser origin let in (https://app.example); repeatable. Handshakes with any other "
                        "Origin header are refused; clients that send none (not browsers) are let in")
    p.add_argument("--max-connections", type=int, default=256, help="open websocket connections (more: HTTP 503)")
    p.add_argument("--max-queued", type=int, default=256,
                   help="requests waiting beyond the --max-seqs running ones, all connections (more: overloaded)")
    p.add_argument("--max-in-flight", type=int, default=64, help="requests in flight per connection")
    p.add_argument("--max-message-bytes", type=int, default=2 * 1024 * 1024, help="largest client frame")
    p.add_argument("--max-prompt-chars", type=int, default=256 * 1024,
                   help="longest prompt text (or chat content) in characters, checked before tokenizing")
    p.add_argument("--template-seconds", type=float, default=2.0,
                   help="the longest a chat template's render may run (in a worker process, killed past it)")
    p.add_argument("--template-memory-mb", type=int, default=256,
                   help="memory a chat template's render may allocate beyond its worker's own")
    p.add_argument("--template-max-chars", type=int, default=1 << 20, help="longest rendered chat prompt")
    p.add_argument("--compression", action="store_true", help="offer permessage-deflate (off by default)")
    p.add_argument("--http-port", type=int, metavar="PORT",
                   help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                        "/v1/models, /health, /metrics) on this port, from the same engine and limits")
    p.add_argument("--served-model-name", help="the model id the HTTP API lists and requests name (default: the "
                                               "model file's name without .gguf)")
    p.add_argument("--shutdown-grace", type=float, default=5.0,
                   help="seconds in-flight requests get to send their done frames on SIGINT/SIGTERM")
    p.add_argument("--num-processes", type=int, default=1,
                   help="processes that together hold the mesh (jax.distributed; each with its local devices, "
                        "--tensor-parallel x --expert-parallel counting all of them); run the same command in each "
                        "with its --process-id: process 0 serves, the others follow its steps")
    p.add_argument("--process-id", type=int, default=0, help="this process's index, with --num-processes")
    p.add_argument("--coordinator", metavar="HOST:PORT",
                   help="with --num-processes: process 0's address for jax.distributed's coordination service")
    p.set_defaults(func=_serve)

    p = sub.add_parser("generate", help="generate over a server (--url) or in-process (--model)")
    _engine_options(p)
    p.add_argument("--url", help="ws://host:port of a running server")
    p.add_argument("--prompt")
    p.add_argument("--prompt-ids", help="comma-separated token ids")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    _policy_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.set_defaults(func=_generate)

    p = sub.add_parser("loadtest", help="measure multi-sequence throughput against a server")
    p.add_argument("--url", required=True, help="ws://host:port (websocket) or http://host:port (OpenAI API)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int)
    p.add_argument("--duration", type=float)
    p.add_argument("--prompts", default="mixed", help="code, prose, mixed, or a JSONL file")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float)
    p.add_argument("--seed", type=int)
    _policy_options(p)
    p.add_argument("--json", help="write the results as JSON here")
    p.add_argument("--plot", help="write a PNG of throughput over time here")
    p.add_argument("--cancel-rate", type=float, default=0.0, help="share of requests cancelled mid-stream")
    p.add_argument("--disconnect-rate", type=float, default=0.0,
                   help="share of requests whose connection is dropped mid-stream (the worker reconnects)")
    p.add_argument("--policies", help="speculative policies drawn at random per request, ';'-separated: "
                                      "'none', 'default', or drafters joined by ',' (e.g. 'none;mtp;ngram,mtp')")
    p.add_argument("--stats-every", type=float, help="sample the server's stats (memory, pages, planes) this often")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' (default: GDNSPEC_API_KEY)")
    p.set_defaults(func=_loadtest)

    p = sub.add_parser("make-random", help="write a random-weight qwen35 / qwen35moe / qwen3next GGUF with real layer shapes")
    p.add_argument("--preset", choices=sorted(PRESETS), required=True)
    p.add_argument("--dtype", choices=["f32", "f16", "bf16", "q8_0"], default="f32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("out")
    p.set_defaults(func=_make_random)

    p = sub.add_parser("bench", help=f"benchmarks: bench {'|'.join(BENCHMARKS)} [--model M ...]")
    p.add_argument("what", choices=list(BENCHMARKS))
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_bench)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
