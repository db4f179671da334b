"""llama.cpp as a peer on the same GGUF: greedy decode tokens/s, the cost of a T-token verify batch, and (with
`--server-bin`) llama-server's own speculative modes.

    gdnspec bench peer --model jaxmodel/assets/gdnspec-stdlib-target-q8_0.gguf --out bench/results/peer-cpu.json

Needs the `[peer]` extra (llama-cpp-python; see the README's Benchmarks section). Through llama.cpp's C API
(`llama_cpp.llama_cpp`, ctypes), on CPU with `--threads` threads:

- decode: for each prompt of `--prompts` (default `code`, `bench/prompts.py`), tokenized by llama.cpp's own
  tokenizer, prefill, then greedy decoding by argmax over the logits, one `llama_decode` of one token per step,
  up to `--max-tokens` tokens (stopping after an end-of-generation token). Tokens/s counts the one-token decode
  calls only (prefill excluded, as llama-bench's `tg`); the prompt and generated token ids are recorded, and with
  `--check-ours` our model (`jaxmodel`) rescoring llama.cpp's sequence says where its argmax differs.
- verify: one sequence holding `--context` tokens, then one `llama_decode` of T tokens with logits for all T
  (a speculative verify step), per T in `--verify-t`: ms per call (median of `--steps`) and the ratio to T = 1.
  The memory is cleared and the context prefilled again before every timed call (a hybrid model's recurrent
  state cannot be rolled back by position), untimed.
- ours (only with `--ours-rounds N`): N rounds, each llama.cpp's greedy decode of every prompt (C API, as above)
  and then our engine's (`scheduler.Engine`, one stream, the prompts one after another, the same prompt ids, each
  of `--ours-drafters` in turn), so that both run on the same machine in the same minutes; end-to-end tokens/s
  (prefill included) per round for both, and the median of the per-round ratios, which cancels a shared machine's
  drift.
- server (only with `--server-bin PATH`): llama-server on a loopback port, once per `--server-modes` entry
  (`none`, `draft-mtp`, `ngram-simple`, `ngram-mod`, ..., `draft-simple` with `--draft-model`), each prompt
  sent to `/completion` (n_predict `--max-tokens`, temperature 0, cache_prompt false); tokens/s and
  draft_n / draft_n_accepted come from the response's `timings`.
"""

from __future__ import annotations

import argparse
import ctypes
import http.client
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.prompts import load_prompt_set
from bench import free_port, save_json

INSTALL_HINT = (
    "    pip install -e '.[peer]'            # builds llama.cpp from source (slow), or\n"
    "    CMAKE_ARGS=\"-DLLAMA_BUILD=OFF\" pip install 'llama-cpp-python>=0.3.30,<0.4'\n"
    "    export LLAMA_CPP_LIB_PATH=/path/to/llama.cpp/build/bin   # the folder holding libllama.so\n"
    "(`make peer` does the first; see README.md, Benchmarks)"
)


_LOG_ERROR, _LOG_CONT = 4, 5  # ggml_log_level in this llama.cpp (llama-cpp-python's own logger maps older values)
_log_callback = None  # the installed ctypes callback, kept alive


def _quiet_log(lib, verbose: bool) -> None:
    """Route llama.cpp's log to stderr: everything with verbose, otherwise errors only."""
    global _log_callback
    last = [0]

    @lib.llama_log_callback
    def callback(level, text, _user_data):
        if level != _LOG_CONT:
            last[0] = level
        if verbose or last[0] == _LOG_ERROR:
            sys.stderr.write(text.decode("utf-8", errors="replace"))

    _log_callback = callback
    lib.llama_log_set(callback, ctypes.c_void_p(0))


def import_llama_cpp():
    """The `llama_cpp` package and its `llama_cpp.llama_cpp` ctypes module, or SystemExit saying how to install."""
    try:
        import llama_cpp
        import llama_cpp.llama_cpp as lib
    except ImportError as exc:
        raise SystemExit(f"llama_cpp (llama-cpp-python) is not importable ({exc}); `gdnspec bench peer` needs "
                         f"the [peer] extra:\n{INSTALL_HINT}") from None  # fmt: skip
    except (OSError, RuntimeError) as exc:  # the package is there, its shared library is not
        raise SystemExit(f"llama_cpp is installed but its shared library did not load ({exc}); set "
                         f"LLAMA_CPP_LIB_PATH to the folder holding libllama.so, or install the [peer] extra "
                         f"with its own build:\n{INSTALL_HINT}") from None  # fmt: skip
    return llama_cpp, lib


class LlamaCpp:
    """One llama.cpp model and context (one sequence) on CPU, driven token by token through the C API."""

    def __init__(self, model_path: str | os.PathLike, *, threads: int = 2, n_ctx: int = 1024, n_batch: int = 512,
                 verbose: bool = False):  # fmt: skip
        self.package, self.lib = import_llama_cpp()
        L = self.lib
        _quiet_log(L, verbose)
        L.llama_backend_init()
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self.model = L.llama_model_load_from_file(os.fsencode(model_path), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path} (run with --verbose for its log)")
        cparams = L.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_ubatch, cparams.n_seq_max = n_ctx, n_batch, n_batch, 1
        cparams.n_threads = cparams.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            L.llama_model_free(self.model)
            raise RuntimeError(f"llama.cpp could not create a context for {model_path}")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.n_batch, self.threads = n_batch, threads
        self.batch = L.llama_batch_init(n_batch, 0, 1)

    def close(self) -> None:
        if self.ctx:
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.lib.llama_model_free(self.model)
            self.ctx = self.model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --------------------------------------------------------------------------------------------------------

    def describe(self) -> dict:
        L = self.lib
        buf = ctypes.create_string_buffer(256)
        L.llama_model_desc(self.model, buf, len(buf))
        return {"desc": buf.value.decode(), "n_params": int(L.llama_model_n_params(self.model)),
                "size_bytes": int(L.llama_model_size(self.model)), "n_vocab": self.n_vocab}  # fmt: skip

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        out = (self.lib.llama_token * (len(data) + 8))()
        n = self.lib.llama_tokenize(self.vocab, data, len(data), out, len(out), add_special, False)
        if n < 0:
            raise RuntimeError(f"llama_tokenize failed ({n})")
        return list(out[:n])

    def is_eog(self, token: int) -> bool:
        return bool(self.lib.llama_vocab_is_eog(self.vocab, token))

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def decode(self, tokens, pos0: int, all_logits: bool = False) -> None:
        """One llama_decode of `tokens` at positions pos0.. (sequence 0); logits for every token or the last."""
        if len(tokens) > self.n_batch:
            raise ValueError(f"{len(tokens)} tokens exceed n_batch {self.n_batch}")
        b = self.batch
        n = len(tokens)
        b.n_tokens = n
        for i, t in enumerate(tokens):
            b.token[i] = t
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = all_logits or i == n - 1
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def logits(self, i: int = -1) -> np.ndarray:
        """Logits of output row i (-1: the last), a view valid until the next decode."""
        return np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))

    def prefill(self, prompt_ids) -> None:
        self.clear()
        for start in range(0, len(prompt_ids), self.n_batch):
            self.decode(prompt_ids[start : start + self.n_batch], start)

    def greedy(self, prompt_ids, max_tokens: int, stop_at_eog: bool = True) -> dict:
        """Greedy continuation of a fresh sequence: generated ids, prefill seconds, and the seconds of each
        one-token decode call (argmax included; the last token needs no decode of its own)."""
        prompt_ids = list(prompt_ids)
        start = time.perf_counter()
        self.prefill(prompt_ids)
        token = int(np.argmax(self.logits()))
        prefill_s = time.perf_counter() - start
        tokens, pos, call_s = [token], len(prompt_ids), []
        while len(tokens) < max_tokens and not (stop_at_eog and self.is_eog(token)):
            start = time.perf_counter()
            self.decode([token], pos)
            token = int(np.argmax(self.logits()))
            call_s.append(time.perf_counter() - start)
            tokens.append(token)
            pos += 1
        return {"tokens": tokens, "prefill_s": prefill_s, "call_s": call_s}

    def time_verify(self, context_ids, T: int, steps: int, rng: np.random.Generator) -> list[float]:
        """Seconds of one T-token llama_decode (logits for all T) after `context_ids`, `steps` times."""
        times = []
        for _ in range(steps):
            self.prefill(context_ids)
            draft = [int(t) for t in rng.integers(0, self.n_vocab, T)]
            start = time.perf_counter()
            self.decode(draft, len(context_ids), all_logits=True)
            self.lib.llama_synchronize(self.ctx)
            np.asarray(self.logits(T - 1)).sum()  # the host reads the verify logits
            times.append(time.perf_counter() - start)
        return times


# ------------------------------------------------------------------------------------------------ versions


def _binary_version(path: str | os.PathLike) -> str | None:
    try:
        proc = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith(("version:", "built with"))]
    return "; ".join(lines) or None


def llama_cpp_versions(package, lib, server_bin: str | None) -> dict:
    """llama-cpp-python's version, the shared library's folder, llama.cpp's build (from `--version` of
    llama-server / llama-cli next to the library, or of --server-bin) and its CPU features."""
    lib_dir = os.environ.get("LLAMA_CPP_LIB_PATH") or str(Path(package.__file__).parent / "lib")
    build = None
    candidates = [server_bin] if server_bin else []
    candidates += [os.path.join(lib_dir, name) for name in ("llama-server", "llama-cli", "llama-bench")]
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            build = _binary_version(candidate)
            if build:
                break
    return {
        "llama_cpp_python": getattr(package, "__version__", None),
        "lib_path": lib_dir,
        "llama_cpp_build": build,
        "system_info": lib.llama_print_system_info().decode(errors="replace").strip(),
    }


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "system": f"{platform.system()} {platform.release()}",
            "python": platform.python_version()}  # fmt: skip


# ---------------------------------------------------------------------------------------------------- ours


def check_ours(model_path: str, results: list[dict]) -> dict:
    """Rescore each prompt + llama.cpp's continuation with our model (one `score`); count the positions where
    our argmax differs from llama.cpp's token. Zero everywhere means our greedy output is identical."""
    from jaxmodel import load_model
    from jaxmodel.tokenizer import load_tokenizer

    model, tok = load_model(model_path), load_tokenizer(model_path)
    per_prompt, total, differ = [], 0, 0
    for r in results:
        prompt, gen = r["prompt_ids"], r["tokens"]
        logits, _ = model.score(prompt + gen[:-1])
        ours = np.argmax(logits[len(prompt) - 1 :], axis=-1)
        rows = logits[len(prompt) - 1 :]
        diff = np.nonzero(ours != np.asarray(gen))[0]
        top2 = np.sort(rows, axis=-1)[:, -2:]
        per_prompt.append({
            "prompt_ids_equal": tok.encode(r["prompt"]) == prompt,
            "argmax_differs_at": diff.tolist(),
            # our logit of our argmax minus our logit of llama.cpp's token, where they differ
            "margin_at_differences": [round(float(rows[i].max() - rows[i, gen[i]]), 5) for i in diff],
            "min_top2_margin": round(float(np.min(top2[:, 1] - top2[:, 0])), 5),
        })  # fmt: skip
        total += len(gen)
        differ += len(diff)
    return {"positions": total, "argmax_differs": differ, "per_prompt": per_prompt}


# -------------------------------------------------------------------------------------------------- server


def _http(port: int, method: str, path: str, body: dict | None = None, timeout: float = 600) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, json.loads(raw or b"{}")
        except json.JSONDecodeError:
            return resp.status, {"raw": raw.decode(errors="replace")}
    finally:
        conn.close()


def run_server_mode(server_bin: str, model: str, mode: str, prompts, *, threads: int, max_tokens: int,
                    n_max: int, draft_model: str | None, extra: list[str], log_dir: str,
                    startup_s: float = 300) -> dict:  # fmt: skip
    """Start llama-server with one speculative mode, send every prompt to /completion, stop it."""
    port = free_port()
    cmd = [server_bin, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "-c", "2048", "-np", "1", "--no-webui"]  # fmt: skip
    if mode != "none":
        cmd += ["--spec-type", mode]
        if mode.startswith("draft-"):
            cmd += ["--spec-draft-n-max", str(n_max)]
        if mode == "draft-simple":
            if not draft_model:
                raise SystemExit("server mode draft-simple needs --draft-model")
            cmd += ["-md", draft_model]
    cmd += extra
    log_path = os.path.join(log_dir, f"llama-server-{mode}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None:
                tail = Path(log_path).read_text(errors="replace").splitlines()[-15:]
                return {"mode": mode, "command": shlex.join(cmd), "error": f"exited with {proc.returncode}",
                        "log_tail": tail}  # fmt: skip
            try:
                if _http(port, "GET", "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                return {"mode": mode, "command": shlex.join(cmd), "error": f"not healthy after {startup_s} s"}
            time.sleep(0.25)
        body = {"n_predict": max_tokens, "temperature": 0.0, "cache_prompt": False, "return_tokens": True,
                "seed": 0}  # fmt: skip
        _http(port, "POST", "/completion", body | {"prompt": prompts[0], "n_predict": 8})  # warm-up
        per_prompt = []
        for text in prompts:
            status, res = _http(port, "POST", "/completion", body | {"prompt": text})
            if status != 200:
                return {"mode": mode, "command": shlex.join(cmd), "error": f"HTTP {status}: {res}"}
            t = res.get("timings", {})
            per_prompt.append({
                "predicted_n": t.get("predicted_n"), "predicted_ms": t.get("predicted_ms"),
                "predicted_per_second": t.get("predicted_per_second"), "prompt_n": t.get("prompt_n"),
                "draft_n": t.get("draft_n", 0), "draft_n_accepted": t.get("draft_n_accepted", 0),
                "tokens": res.get("tokens"),
            })  # fmt: skip
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    n = sum(p["predicted_n"] or 0 for p in per_prompt)
    ms = sum(p["predicted_ms"] or 0 for p in per_prompt)
    drafted = sum(p["draft_n"] for p in per_prompt)
    accepted = sum(p["draft_n_accepted"] for p in per_prompt)
    return {
        "mode": mode, "command": shlex.join(cmd),
        "tokens_per_s": n / (ms / 1e3) if ms else None,
        "mean_predicted_per_second": statistics.fmean(p["predicted_per_second"] or 0 for p in per_prompt),
        "draft_n": drafted, "draft_n_accepted": accepted,
        "acceptance": accepted / drafted if drafted else None,
        "per_prompt": per_prompt,
    }  # fmt: skip


def interleave_ours(peer: LlamaCpp, model_path: str, tokenized: list[list[int]], *, rounds: int, max_tokens: int,
                    stop_at_eog: bool, policies: list[str], n_ctx: int) -> dict:
    """`rounds` rounds of llama.cpp's greedy decode of every prompt, then our engine's with each drafter policy
    ("plain", or drafters joined by commas); end-to-end tokens/s per round and the median per-round ratio."""
    import anyio

    from bench.speculation import _stream
    from jaxmodel.requests import SpeculativeConfig
    from jaxmodel import load_model
    from jaxmodel.tokenizer import load_tokenizer
    from scheduler import Engine, GenerationRequest

    engine = Engine(load_model(model_path), tokenizer=load_tokenizer(model_path), max_running=1, max_model_len=n_ctx,
                    n_max=3, stop_token_ids=None if stop_at_eog else ())  # fmt: skip
    engine.warmup()
    rates: dict[str, list[float]] = {"llama.cpp": [], **{p: [] for p in policies}}
    equal: dict[str, list[int]] = {p: [] for p in policies}

    async def ours(policy: str) -> tuple[float, list[list[int]]]:
        drafters = tuple(d for d in policy.split(",") if d and d != "plain")
        spec = SpeculativeConfig(drafters, n_max=3) if drafters else None
        out, start = [], time.perf_counter()
        for ids in tokenized:
            out.append((await _stream(engine, GenerationRequest(tuple(ids), max_tokens, speculative=spec)))["tokens"])
        return sum(map(len, out)) / (time.perf_counter() - start), out

    async def run_rounds():
        async with engine:
            for policy in policies:  # warm-up: every shape the prompts need is compiled before the first round
                await ours(policy)
            for r in range(rounds):
                start, theirs = time.perf_counter(), []
                for ids in tokenized:
                    theirs.append(peer.greedy(ids, max_tokens, stop_at_eog=stop_at_eog)["tokens"])
                rates["llama.cpp"].append(sum(map(len, theirs)) / (time.perf_counter() - start))
                for policy in policies:
                    rate, tokens = await ours(policy)
                    rates[policy].append(rate)
                    equal[policy].append(sum(a == b for a, b in zip(tokens, theirs)))
                print(f"ours    round {r + 1}: llama.cpp {rates['llama.cpp'][-1]:8.1f} tokens/s, " + ", ".join(
                    f"{p} {rates[p][-1]:8.1f}" for p in policies), flush=True)  # fmt: skip

    anyio.run(run_rounds)
    peer_rates = rates["llama.cpp"]
    return {
        "rounds": rounds, "engine": {"max_running": 1, "n_max": 3, "iterations": engine.iterations},
        "llama_cpp_tokens_per_s": peer_rates, "llama_cpp_median": statistics.median(peer_rates),
        "ours": {p: {"tokens_per_s": rates[p], "median": statistics.median(rates[p]),
                     "ratio_to_llama_cpp_paired": statistics.median(a / b for a, b in zip(rates[p], peer_rates)),
                     "prompts_equal_to_llama_cpp": equal[p]} for p in policies},
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------------- main


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="gdnspec bench peer", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF (default: the bundled target model)")
    parser.add_argument("--out", help="write JSON results here")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", default="code", help="a set in bench/prompts.py, or a file ('---' between)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--verify-t", default="1,2,4,8")
    parser.add_argument("--context", type=int, default=64, help="tokens in the sequence before a verify step")
    parser.add_argument("--steps", type=int, default=8, help="timed verify calls per T")
    parser.add_argument("--no-stop", action="store_true", help="decode max-tokens even past end-of-generation")
    parser.add_argument("--check-ours", action="store_true",
                        help="also rescore llama.cpp's sequences with our model and count argmax differences")
    parser.add_argument("--ours-rounds", type=int, default=0,
                        help="also time our engine against llama.cpp's decode, in this many alternating rounds")
    parser.add_argument("--ours-drafters", default="plain",
                        help="our drafter policies for --ours-rounds, ';'-separated (e.g. 'plain;ngram;mtp')")
    parser.add_argument("--server-bin", help="llama-server binary: also measure its speculative modes")
    parser.add_argument("--server-modes", default="none,draft-mtp,ngram-simple",
                        help="comma-separated: none or a --spec-type value (draft-simple needs --draft-model)")
    parser.add_argument("--draft-model", help="draft GGUF for the server's draft-simple mode")
    parser.add_argument("--spec-n-max", type=int, default=4, help="--spec-draft-n-max for draft-* modes")
    parser.add_argument("--server-args", default="", help="extra llama-server arguments (one shell string)")
    parser.add_argument("--verbose", action="store_true", help="show llama.cpp's own log")
    args = parser.parse_args(argv)
    if args.model is None:
        from jaxmodel.assets import default_model_path

        args.model = str(default_model_path())
    prompts = load_prompt_set(args.prompts)
    package, lib = import_llama_cpp()
    started = time.perf_counter()
    results: dict = {
        "what": "llama.cpp on the same GGUF: greedy decode of one stream and the cost of a T-token verify batch",
        "model": os.path.basename(args.model),
        "model_bytes": os.path.getsize(args.model),
        "threads": args.threads,
        "llama_cpp": llama_cpp_versions(package, lib, args.server_bin),
        "machine": machine_info(),
        "load_average_at_start": os.getloadavg(),
        "args": vars(args),
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "stop_at_eog": not args.no_stop,
    }
    n_ctx = max(1024, max(len(p) for p in prompts) + args.max_tokens + 64, args.context + 64)
    with LlamaCpp(args.model, threads=args.threads, n_ctx=n_ctx, verbose=args.verbose) as peer:
        results["model_info"] = peer.describe()
        tokenized = [peer.tokenize(text) for text in prompts]
        peer.greedy(tokenized[0], 16, stop_at_eog=False)  # warm-up
        per_prompt, all_calls = [], []
        for text, ids in zip(prompts, tokenized):
            g = peer.greedy(ids, args.max_tokens, stop_at_eog=not args.no_stop)
            all_calls += g["call_s"]
            seconds = sum(g["call_s"])
            per_prompt.append({
                "prompt": text, "prompt_ids": ids, "tokens": g["tokens"], "prefill_ms": g["prefill_s"] * 1e3,
                "decode_calls": len(g["call_s"]), "decode_s": seconds,
                "decode_tokens_per_s": len(g["call_s"]) / seconds if seconds else None,
            })  # fmt: skip
            print(f"decode  prompt {len(per_prompt)}: {len(ids):3d} prompt tokens, {len(g['tokens']):3d} generated, "
                  f"{per_prompt[-1]['decode_tokens_per_s'] or 0:8.1f} tokens/s", flush=True)  # fmt: skip
        seconds = sum(all_calls)
        median_ms = statistics.median(all_calls) * 1e3 if all_calls else None
        results["decode"] = {
            "tokens_per_s": len(all_calls) / seconds if seconds else None,
            "ms_per_token": seconds / len(all_calls) * 1e3 if all_calls else None,
            "median_ms_per_token": median_ms,
            "tokens_per_s_at_median": 1e3 / median_ms if median_ms else None,
            "decode_calls": len(all_calls),
            "per_prompt": per_prompt,
        }  # fmt: skip
        print(f"decode  all: {results['decode']['tokens_per_s'] or 0:.1f} tokens/s over {len(all_calls)} calls "
              f"(median call {median_ms or 0:.2f} ms)", flush=True)  # fmt: skip

        rng = np.random.default_rng(0)
        context_ids = [int(t) for t in rng.integers(0, peer.n_vocab, args.context)]
        peer.time_verify(context_ids, 1, 2, rng)  # warm-up
        verify, base, base_min = [], None, None
        for T in map(int, args.verify_t.split(",")):
            times = peer.time_verify(context_ids, T, args.steps, rng)
            ms = statistics.median(times) * 1e3
            base, base_min = base or ms, base_min or min(times) * 1e3
            verify.append({"T": T, "step_ms": ms, "mean_ms": statistics.fmean(times) * 1e3,
                           "min_ms": min(times) * 1e3, "ratio_to_T1": ms / base,
                           "ratio_to_T1_of_min": min(times) * 1e3 / base_min})  # fmt: skip
            print(f"verify  T {T:3d}: {ms:8.2f} ms/call  {ms / base:5.2f}x T=1 (median); min {min(times) * 1e3:8.2f} "
                  f"ms/call  {min(times) * 1e3 / base_min:5.2f}x T=1", flush=True)  # fmt: skip
        results["verify"] = {"context": args.context, "steps": args.steps, "rows": verify}

        if args.ours_rounds > 0:
            policies = [p for p in args.ours_drafters.split(";") if p]
            results["interleaved"] = interleave_ours(peer, args.model, tokenized, rounds=args.ours_rounds,
                                                     max_tokens=args.max_tokens, stop_at_eog=not args.no_stop,
                                                     policies=policies, n_ctx=n_ctx)  # fmt: skip
            for p, r in results["interleaved"]["ours"].items():
                print(f"ours    {p}: median {r['median']:.1f} tokens/s, "
                      f"{r['ratio_to_llama_cpp_paired']:.2f}x llama.cpp (median of per-round ratios)", flush=True)

    if args.check_ours:
        results["ours_vs_peer"] = check_ours(args.model, per_prompt)
        print(f"ours    argmax differs at {results['ours_vs_peer']['argmax_differs']} of "
              f"{results['ours_vs_peer']['positions']} positions", flush=True)  # fmt: skip

    if args.server_bin:
        if not (os.path.isfile(args.server_bin) or shutil.which(args.server_bin)):
            raise SystemExit(f"--server-bin {args.server_bin}: not found")
        server = []
        plain = [p["tokens"] for p in per_prompt]
        with tempfile.TemporaryDirectory(prefix="gdnspec-peer-") as log_dir:
            for mode in [m for m in args.server_modes.split(",") if m]:
                r = run_server_mode(shutil.which(args.server_bin) or args.server_bin, args.model, mode, prompts,
                                    threads=args.threads, max_tokens=args.max_tokens, n_max=args.spec_n_max,
                                    draft_model=args.draft_model, extra=shlex.split(args.server_args),
                                    log_dir=log_dir)  # fmt: skip
                if "per_prompt" in r:
                    r["tokens_equal_plain_decode"] = [p["tokens"] == want for p, want in zip(r["per_prompt"], plain)]
                    print(f"server  {mode:14s}: {r['tokens_per_s'] or 0:8.1f} tokens/s, drafted {r['draft_n']}, "
                          f"accepted {r['draft_n_accepted']}, equal to plain decode "
                          f"{sum(r['tokens_equal_plain_decode'])}/{len(plain)}", flush=True)  # fmt: skip
                else:
                    print(f"server  {mode:14s}: {r['error']}", flush=True)
                server.append(r)
        results["server"] = {"n_max": args.spec_n_max, "modes": server}

    results["load_average_at_end"] = os.getloadavg()
    results["elapsed_s"] = round(time.perf_counter() - started, 1)
    if args.out:
        save_json(results, args.out, indent=1)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
