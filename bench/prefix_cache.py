"""Multi-turn conversations through the server: time to first token and prompt tokens per turn.

N conversations of K turns run at once, each turn after the last one's answer, all sharing a system prompt of S
tokens: turn 1 sends the system prompt and a first user message; turn k sends everything before it (the earlier
turns' prompts and the answers the server gave) and a new user message, as a chat client resends the whole
conversation. What a prefix cache saves shows here: without one every turn prefills its whole prompt, so the time
to a turn's first token grows with the conversation. Prompts travel as token ids (the model's own tokenizer cuts the
text into them), so every turn's prompt extends the last one's exactly.

    gdnspec bench prefix-cache --conversations 8 --turns 6 --system-tokens 1024 \\
        --out bench/results/prefix-cache-cpu.json --plot bench/results/prefix-cache-cpu.png
    gdnspec bench prefix-cache --url ws://127.0.0.1:8000 --model M    # a running server (M: its tokenizer)
    gdnspec bench prefix-cache --llama-server http://127.0.0.1:8080 --model M    # llama.cpp's, on the same file

In-process (no --url) it serves the model itself over loopback with the settings below (`--no-prefix-cache` turns
the engine's prefix cache off). Per turn the JSON holds the client's and the server's time to first token, the
prompt's tokens and those the server took from its prefix cache (the done frame's `usage.cached_tokens`), so
prefilled = prompt - cached. Against llama-server the turns go to its `/completion` endpoint with `cache_prompt`
(its slots keep their last prompt's state, and its context checkpoints and host prompt cache keep more), and the
cached and prefilled tokens are its own count (`timings.cache_n`, `timings.prompt_n`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import anyio
import jax

from api.client import Client
from api.protocol import Speculative, Tokens
from jaxmodel.assets import default_draft_path, default_model_path
from jaxmodel.tokenizer import load_tokenizer

from . import save_json
from .prompts import CODE

# The text the system prompt and the user messages are cut from: the code prompts, repeated (the bundled models know
# this style, so their answers stay ordinary text).
CORPUS = "\n".join(CODE)


def corpus_ids(tokenizer, n: int, offset: int) -> list[int]:
    """n token ids of the corpus, starting `offset` ids into its endless repetition."""
    ids = tokenizer.encode(CORPUS)
    reps = (offset + n) // len(ids) + 1
    return (ids * reps)[offset : offset + n]


async def converse(client: Client, system: list[int], users: list[list[int]], max_tokens: int,
                   speculative: Speculative | None = None) -> list[dict]:
    """One conversation: a turn per user message, each sending the whole conversation so far (drafting with
    `speculative`; None: plain decoding). Returns each turn's record."""
    history = list(system)
    turns = []
    for k, user in enumerate(users):
        prompt = history + user
        start = time.perf_counter()
        stream = await client.generate(prompt_ids=prompt, max_tokens=max_tokens, temperature=0.0,
                                       speculative=speculative)
        first = None
        answer: list[int] = []
        async for frame in stream:
            if isinstance(frame, Tokens):
                first = first if first is not None else time.perf_counter() - start
                answer.extend(frame.token_ids)
        done = stream.done
        turns.append({"turn": k + 1, "prompt_tokens": done.usage.prompt_tokens,
                      "cached_tokens": done.usage.cached_tokens,
                      "prefilled_tokens": done.usage.prompt_tokens - done.usage.cached_tokens,
                      "answer_tokens": len(answer),
                      "ttft_ms": None if first is None else first * 1e3, "server_ttft_ms": done.timings.ttft_ms,
                      "total_ms": (time.perf_counter() - start) * 1e3})  # fmt: skip
        history = prompt + answer
    return turns


async def converse_llama(http, url: str, system: list[int], users: list[list[int]], max_tokens: int) -> list[dict]:
    """`converse` against llama-server: its `/completion` endpoint, streamed, greedy, with `cache_prompt`."""
    history = list(system)
    turns = []
    for k, user in enumerate(users):
        prompt = history + user
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "cache_prompt": True, "stream": True,
                "return_tokens": True}
        start = time.perf_counter()
        first, answer, final = None, [], {}
        async with http.stream("POST", f"{url}/completion", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[len("data: "):])
                if chunk.get("tokens"):
                    first = first if first is not None else time.perf_counter() - start
                    answer.extend(chunk["tokens"])
                if chunk.get("stop"):
                    final = chunk
        timings = final.get("timings", {})
        cached, prefilled = timings.get("cache_n", 0), timings.get("prompt_n", len(prompt))
        turns.append({"turn": k + 1, "prompt_tokens": len(prompt), "cached_tokens": cached,
                      "prefilled_tokens": prefilled, "answer_tokens": len(answer),
                      "ttft_ms": None if first is None else first * 1e3, "server_ttft_ms": timings.get("prompt_ms"),
                      "total_ms": (time.perf_counter() - start) * 1e3})  # fmt: skip
        history = prompt + answer
    return turns


async def run_conversations(url: str, tokenizer, *, conversations: int, turns: int, system_tokens: int,
                            user_tokens: int, max_tokens: int, llama_server: bool = False,
                            drafters: tuple[str, ...] = ()) -> list[list[dict]]:
    """Every conversation's turns, run at once over one connection (llama_server: `url` is llama-server's), drafting
    with `drafters` (none: plain decoding)."""
    system = corpus_ids(tokenizer, system_tokens, 0)
    results: list[list[dict]] = [[] for _ in range(conversations)]
    if llama_server:
        import httpx2

        # A new connection per request: llama-server may close one kept alive as the client reuses it.
        client = httpx2.AsyncClient(timeout=httpx2.Timeout(600.0), limits=httpx2.Limits(max_keepalive_connections=0))
    else:
        client = Client(url)
    async with client:
        async def one(c: int) -> None:
            users = [corpus_ids(tokenizer, user_tokens, 7919 * (c * turns + k + 1)) for k in range(turns)]
            if llama_server:
                results[c] = await converse_llama(client, url.rstrip("/"), system, users, max_tokens)
            else:
                speculative = Speculative(drafters=list(drafters)) if drafters else None
                results[c] = await converse(client, system, users, max_tokens, speculative)

        async with anyio.create_task_group() as tg:
            for c in range(conversations):
                tg.start_soon(one, c)
    return results


def summarize(results: list[list[dict]]) -> list[dict]:
    """Per turn, over the conversations: the median client and server time to first token and to the turn's last
    token, and the prompt, cached and prefilled tokens summed."""
    per_turn = []
    for k in range(len(results[0])):
        turn = [conversation[k] for conversation in results]
        ttfts = [t["ttft_ms"] for t in turn if t["ttft_ms"] is not None]
        server = [t["server_ttft_ms"] for t in turn if t["server_ttft_ms"] is not None]
        per_turn.append({"turn": k + 1, "median_ttft_ms": statistics.median(ttfts) if ttfts else None,
                         "median_total_ms": statistics.median(t["total_ms"] for t in turn),
                         "median_server_ttft_ms": statistics.median(server) if server else None,
                         "prompt_tokens": sum(t["prompt_tokens"] for t in turn),
                         "cached_tokens": sum(t["cached_tokens"] for t in turn),
                         "prefilled_tokens": sum(t["prefilled_tokens"] for t in turn)})  # fmt: skip
    return per_turn


def plot(summary: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [t["turn"] for t in summary]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(turns, [t["median_ttft_ms"] for t in summary], marker="o", label="time to first token (median, ms)")
    ax.set_xlabel("turn")
    ax.set_ylabel("ms")
    twin = ax.twinx()
    twin.bar(turns, [t["prefilled_tokens"] for t in summary], alpha=0.25, color="tab:orange",
             label="tokens prefilled (all conversations)")
    twin.set_ylabel("tokens prefilled")
    ax.set_title(title)
    fig.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="a running server (default: serve --model in-process)")
    parser.add_argument("--llama-server", default=None, metavar="URL",
                        help="a running llama-server (http://host:port) serving --model, in place of this server")
    parser.add_argument("--model", default=None, help="the GGUF served (its tokenizer cuts the prompts)")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--user-tokens", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=48, help="each answer's tokens at most")
    parser.add_argument("--budget-mb", type=float, default=256, help="in-process: the engine's memory budget")
    parser.add_argument("--max-model-len", type=int, default=4096, help="in-process: positions per sequence")
    parser.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                        help="in-process: the engine's prefix cache (`scheduler.prefix_cache`)")
    parser.add_argument("--drafters", default="", help="comma-separated drafters every turn asks for (default: none, "
                        "plain decoding); in-process, draft_model loads the bundled draft model")
    parser.add_argument("--out", default=None, help="write JSON results here")
    parser.add_argument("--plot", default=None, help="write a PNG of time to first token per turn here")
    args = parser.parse_args(argv)
    model_path = args.model or str(default_model_path())
    tokenizer = load_tokenizer(model_path)
    drafters = tuple(name for name in args.drafters.split(",") if name)
    settings = dict(conversations=args.conversations, turns=args.turns, system_tokens=args.system_tokens,
                    user_tokens=args.user_tokens, max_tokens=args.max_tokens, drafters=drafters)  # fmt: skip
    longest = args.system_tokens + args.turns * (args.user_tokens + args.max_tokens)
    if longest > args.max_model_len:
        raise SystemExit(f"a conversation reaches {longest} tokens, past --max-model-len {args.max_model_len}")

    async def in_process() -> tuple[list[list[dict]], float]:
        from api.protocol import Defaults, Limits, ServerSettings
        from api.server import Server, listening
        from jaxmodel import load_model
        from scheduler import Engine

        draft = load_model(default_draft_path()) if "draft_model" in drafters else None
        engine = Engine(load_model(model_path), tokenizer=tokenizer, draft_model=draft,
                        budget_bytes=int(args.budget_mb * 2**20),
                        max_running=args.conversations, max_model_len=args.max_model_len,
                        prefix_cache=args.prefix_cache)
        warmup = time.perf_counter()
        engine.warmup()
        warmup = time.perf_counter() - warmup
        # The server holds its limits to what the engine serves (`api.server.limited_to`).
        server_settings = ServerSettings(defaults=Defaults(drafters=(), max_tokens=args.max_tokens),
                                         limits=Limits(known_drafters=tuple(engine.drafters)))
        server = Server(engine, tokenizer, server_settings)
        async with engine, listening(server) as (url, _):
            return await run_conversations(url, tokenizer, **settings), warmup

    start = time.perf_counter()
    if args.llama_server:
        results = anyio.run(lambda: run_conversations(args.llama_server, tokenizer, llama_server=True, **settings))
        warmup = None
    elif args.url:
        results, warmup = anyio.run(lambda: run_conversations(args.url, tokenizer, **settings)), None
    else:
        results, warmup = anyio.run(in_process)
    summary = summarize(results)
    out = {"model": os.path.basename(model_path), "url": args.url, "llama_server": args.llama_server,
           "prefix_cache": None if args.url or args.llama_server else args.prefix_cache,
           "backend": jax.default_backend(),
           "machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(), **settings,
           "warmup_seconds": warmup, "wall_seconds": time.perf_counter() - start, "turns_summary": summary,
           "conversations_turns": results}  # fmt: skip
    second = summary[1]["median_ttft_ms"] if len(summary) > 1 else None
    for t in summary:
        ratio = f"{t['median_ttft_ms'] / second:5.2f}x turn 2" if second and t["median_ttft_ms"] else ""
        print(f"turn {t['turn']}: median time to first token {t['median_ttft_ms']:8.1f} ms {ratio}, to the last "
              f"{t['median_total_ms']:8.1f} ms  prompt "
              f"{t['prompt_tokens']:6d} tokens, {t['cached_tokens']:6d} from the cache, {t['prefilled_tokens']:6d} "
              f"prefilled", flush=True)
    print(f"prefilled {sum(t['prefilled_tokens'] for t in summary)} of {sum(t['prompt_tokens'] for t in summary)} "
          f"prompt tokens", flush=True)
    if args.out:
        save_json(out, args.out)
    if args.plot:
        plot(summary, args.plot, f"{out['model']}: {args.conversations} conversations, system prompt "
                                 f"{args.system_tokens} tokens")
    return out


if __name__ == "__main__":
    main()
