"""Offline draft acceptance of the bundled models on held-out code: MTP (chained), the draft model and n-gram.

    python -m bench.acceptance --out bench/results/acceptance.json

For each held-out prompt the target continues greedily; then, at every decode point j of that continuation
(the target has just produced token j), each drafter proposes up to `depth` tokens, and draft k counts as
accepted when it equals the target's greedy token j+k and drafts 1..k-1 were accepted. Position k's acceptance
is P(draft k accepted | drafts 1..k-1 accepted): with greedy verification this is exactly what the engine would
accept, computed teacher-forced along the greedy continuation:

- MTP: the block's own KV cache holds (token p, target hidden p-1) for every committed position, as llama.cpp's
  catch-up writes it; each draft point then chains the block on its own hidden (docs/model.md §6.2), one batched step per
  draft position, each point on a private copy of the pages.
- draft model: its greedy token after the committed prefix (one `score` over the whole sequence).
- n-gram: `drafters.ngram.ngram_draft` (prompt lookup, longest suffix match) over the committed tokens.

Tokens/s with each drafter needs the engine and is measured by its benchmark, not here.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from drafters.ngram import ngram_draft
from jaxmodel import load_model
from jaxmodel.assets import default_draft_path, default_model_path
from jaxmodel.model import Model
from jaxmodel.state import ModelState, Row, bucket, pack_batch
from jaxmodel.tokenizer import load_tokenizer
from train.data import fixed_windows, load_corpus

PAGE_SIZE = 16


def held_out_prompts(encode, n_prompts: int, prompt_tokens: int) -> list[list[int]]:
    """One prompt per held-out file (in path order, files long enough only): `prompt_tokens` tokens starting at
    the first line that begins after a third of the file."""
    prompts = []
    for f in load_corpus().held_out:
        start = f.text.find("\n", len(f.text) // 3) + 1
        ids = encode(f.text[start:])
        if start > 0 and len(ids) >= prompt_tokens + 64:
            prompts.append(ids[:prompt_tokens])
        if len(prompts) == n_prompts:
            break
    return prompts


def greedy_continuation(model: Model, prompt: list[int], n_new: int, stop_ids: frozenset[int]) -> list[int]:
    """Plain greedy decoding through the jitted step: prefill, then one token per step, the GDN state
    ping-ponging between planes 1 and 2. Returns prompt + up to n_new tokens (stopping after a stop id)."""
    total = len(prompt) + n_new
    pages = list(range(1, bucket(-(-total // PAGE_SIZE)) + 1))
    state = model.new_state(n_pages=len(pages) + 1, n_planes=3, page_size=PAGE_SIZE)
    tokens = list(prompt)
    row = Row(tokens, 0, pages, 0, [-1] * (len(tokens) - 1) + [1], [len(tokens) - 1])
    read = 1
    for _ in range(n_new):
        out, state = model.step(model.weights, batch=pack_batch([row], B=1), state=state)
        tokens.append(int(np.argmax(np.asarray(out.logits[0, 0]))))
        if tokens[-1] in stop_ids:
            break
        write = 3 - read
        row = Row([tokens[-1]], len(tokens) - 1, pages, read, [write], [0])
        read = write
    return tokens


def mtp_chain_drafts(model: Model, seq: list[int], hidden: np.ndarray, points: list[int], depth: int) -> np.ndarray:
    """The MTP block's greedy drafts at each decode point j (`seq[j]` just produced; seq[:j+1] committed),
    chained `depth` deep with teacher forcing: draft k feeds seq[j+k-1] (the accepted draft k-1) and the block's
    own hidden. hidden [L, E]: the target's post-norm hidden of seq. Returns [len(points), depth] token ids."""
    L, n = len(seq), len(points)
    P = bucket(-(-(L + depth) // PAGE_SIZE))
    state = model.new_state(n_pages=1 + P * (n + 1), n_planes=1, page_size=PAGE_SIZE)
    base = list(range(1, P + 1))
    shifted = np.zeros((1, bucket(L), model.cfg.n_embd), np.float32)
    shifted[0, 1:L] = hidden[: L - 1]
    batch = pack_batch([Row(seq, 0, base, 0, [-1] * L)], B=1, T=bucket(L), P=P)
    _, state = model.mtp_step(model.weights, batch=batch, hidden_in=shifted, state=state)  # catch-up

    def private(pages):  # [N, ...]: the catch-up pages copied once per decode point
        return pages.at[1 + P :].set(jnp.tile(pages[1 : 1 + P], (n,) + (1,) * (pages.ndim - 1)))

    state = ModelState(
        k_pages=state.k_pages[:-1] + (private(state.k_pages[-1]),),
        v_pages=state.v_pages[:-1] + (private(state.v_pages[-1]),),
        conv=state.conv, ssm=state.ssm, hidden=state.hidden, replay=state.replay, backlog=state.backlog,
    )  # fmt: skip
    B = bucket(n)
    h_in = np.zeros((B, 1, model.cfg.n_embd), np.float32)
    h_in[:n, 0] = hidden[np.asarray(points) - 1]
    drafts = np.zeros((n, depth), np.int64)
    for k in range(depth):
        rows = []
        for b, j in enumerate(points):
            pos = min(j + k, L - 1)  # beyond the sequence nothing is checked; keep the row in bounds
            rows.append(Row([seq[pos]], pos, range(1 + P * (b + 1), 1 + P * (b + 2)), 0, [-1], [0]))
        out, state = model.mtp_step(model.weights, batch=pack_batch(rows, B=B, P=P), hidden_in=h_in, state=state)
        drafts[:, k] = np.argmax(np.asarray(out.logits[:n, 0]), axis=-1)
        h_in = np.asarray(out.hidden)
    return drafts


def acceptance(drafts: list[list[int]], truths: list[list[int]], depth: int) -> dict:
    """Per position k = 1..depth: attempted (drafts 1..k-1 accepted and a k-th draft and truth exist) and
    accepted counts, their ratio, and the mean accepted length of a `depth`-token draft."""
    attempted, accepted = np.zeros(depth, np.int64), np.zeros(depth, np.int64)
    accepted_lengths = []
    for draft, truth in zip(drafts, truths):
        run = 0
        for k in range(min(depth, len(draft), len(truth))):
            attempted[k] += 1
            if draft[k] != truth[k]:
                break
            accepted[k] += 1
            run += 1
        if len(truth) >= depth:
            accepted_lengths.append(run)
    rate = [round(float(a / t), 4) if t else None for a, t in zip(accepted, attempted)]
    return {
        "acceptance_per_position": rate,
        "attempted": attempted.tolist(),
        "accepted": accepted.tolist(),
        "mean_accepted_of_depth": round(float(np.mean(accepted_lengths)), 4) if accepted_lengths else None,
    }


def held_out_loss(model: Model, windows: np.ndarray) -> dict:
    """Mean next-token cross-entropy (nats) and perplexity over held-out windows [N, T]; with an MTP block also
    the MTP's loss (two tokens past the target's hidden)."""
    lm, mtp = [], []
    for w in windows:
        logits, hidden = model.score(w)
        logp = jax.nn.log_softmax(logits[:-1], axis=-1)
        lm.append(-np.mean(np.take_along_axis(np.asarray(logp), w[1:, None], axis=1)))
        if model.has_mtp:
            shifted = np.concatenate([np.zeros_like(hidden[:1]), hidden[:-1]])
            mtp_logits, _ = model.score_mtp(w, shifted)
            logq = jax.nn.log_softmax(mtp_logits[1:-1], axis=-1)
            mtp.append(-np.mean(np.take_along_axis(np.asarray(logq), w[2:, None], axis=1)))
    out = {"loss": round(float(np.mean(lm)), 4), "perplexity": round(float(np.exp(np.mean(lm))), 3)}
    if mtp:
        out["mtp_loss"] = round(float(np.mean(mtp)), 4)
    return out


def run(model_path: Path, draft_path: Path, n_prompts: int, prompt_tokens: int, n_new: int, depth: int,
        loss_windows: int) -> dict:  # fmt: skip
    """The whole benchmark; returns the JSON-ready results."""
    started = time.perf_counter()
    target, draft = load_model(model_path), load_model(draft_path)
    tok = load_tokenizer(model_path)
    prompts = held_out_prompts(tok.encode, n_prompts, prompt_tokens)
    sequences, mtp_d, model_d, ngram_d, truths, samples = [], [], [], [], [], []
    mismatches = 0
    for prompt in prompts:
        seq = greedy_continuation(target, prompt, n_new, tok.eog_ids)
        sequences.append(seq)
        logits, hidden = target.score(seq)
        mismatches += int(np.sum(np.argmax(logits[len(prompt) - 1 : -1], -1) != np.asarray(seq[len(prompt) :])))
        points = list(range(len(prompt) - 1, len(seq) - 1))
        truths += [seq[j + 1 : j + 1 + depth] for j in points]
        mtp_d += mtp_chain_drafts(target, seq, hidden, points, depth).tolist()
        draft_greedy = np.argmax(draft.score(seq)[0], axis=-1)
        model_d += [draft_greedy[j : j + depth].tolist() for j in points]
        ngram_d += [ngram_draft(seq[: j + 1], depth) for j in points]
        if len(samples) < 3:
            samples.append({"prompt": tok.decode(prompt), "continuation": tok.decode(seq[len(prompt) :])})
    ngram = acceptance(ngram_d, truths, depth)
    ngram["draft_coverage"] = round(sum(1 for d in ngram_d if d) / len(ngram_d), 4)
    windows = fixed_windows(np.concatenate([np.asarray(tok.encode(f.text)) for f in load_corpus().held_out]),
                            loss_windows, 256)  # fmt: skip
    return {
        "what": "offline top-1 acceptance along the target's greedy continuations of held-out stdlib code",
        "models": {
            "target": {"path": model_path.name, "bytes": model_path.stat().st_size},
            "draft": {"path": draft_path.name, "bytes": draft_path.stat().st_size},
        },
        "prompts": len(prompts), "prompt_tokens": prompt_tokens, "new_tokens": n_new, "depth": depth,
        "decode_points": len(truths),
        "greedy_vs_score_argmax_mismatches": mismatches,
        "mtp": acceptance(mtp_d, truths, depth),
        "draft_model": acceptance(model_d, truths, depth),
        "ngram": ngram,
        "held_out": {"windows": loss_windows, "window_tokens": 256,
                     "target": held_out_loss(target, windows), "draft": held_out_loss(draft, windows)},  # fmt: skip
        "tokens_per_second": "not measured here: needs the engine (scheduler/engine.py)",
        "samples": samples,
        "platform": {"machine": platform.machine(), "jax": jax.__version__, "backend": jax.default_backend()},
        "elapsed_s": round(time.perf_counter() - started, 1),
    }  # fmt: skip


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--draft", type=Path, default=default_draft_path())
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--loss-windows", type=int, default=16)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    results = run(args.model, args.draft, args.prompts, args.prompt_tokens, args.new_tokens, args.depth,
                  args.loss_windows)  # fmt: skip
    text = json.dumps(results, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return results


if __name__ == "__main__":
    main()
