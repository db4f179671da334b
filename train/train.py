"""Train one bundled model (target with MTP, or the draft model) on the stdlib corpus; deterministic per seed.

    python -m train.train target --work-dir train/runs        # tokenizer (once), then the model
    python -m train.train draft --work-dir train/runs
    python -m train.export --work-dir train/runs              # both checkpoints -> jaxmodel/assets/*.gguf

Logs are JSON lines on stdout; the final checkpoint is <work-dir>/<model>.npz with <model>.json beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tokenizers import Tokenizer

from jaxmodel.config import ModelConfig
from jaxmodel.weights import Weights

from .checkpoint import save_checkpoint
from .configs import MODELS, RECIPES, VOCAB_SIZE, Recipe
from .data import fixed_windows, load_corpus, sample_windows, token_stream
from .objective import losses, total_loss
from .params import count, decay_mask, init_params
from .tokenizer import ENDOFTEXT, encode_batch, train_tokenizer


@dataclasses.dataclass(frozen=True)
class Dataset:
    tokenizer: Tokenizer
    train: np.ndarray  # [N] int32 token stream, files separated by <|endoftext|>
    held_out: np.ndarray  # [M] int32


def prepare_data(work_dir: Path, vocab_size: int = VOCAB_SIZE) -> Dataset:
    """Train (or reuse <work_dir>/tokenizer-<vocab>.json) the BPE on the training files and tokenize both splits
    (cached in <work_dir>/tokens-<vocab>.npz next to it)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    tok_path, cache = work_dir / f"tokenizer-{vocab_size}.json", work_dir / f"tokens-{vocab_size}.npz"
    corpus = None
    if tok_path.exists():
        tok = Tokenizer.from_file(str(tok_path))
    else:
        corpus = load_corpus()
        tok = train_tokenizer((f.text for f in corpus.train), vocab_size)
        tok.save(str(tok_path))
        cache.unlink(missing_ok=True)
    if cache.exists() and cache.stat().st_mtime >= tok_path.stat().st_mtime:
        with np.load(cache) as f:
            return Dataset(tok, f["train"], f["held_out"])
    corpus = corpus or load_corpus()
    eot = tok.token_to_id(ENDOFTEXT)
    encode = functools.partial(encode_batch, tok)
    data = Dataset(tok, token_stream(corpus.train, encode, eot), token_stream(corpus.held_out, encode, eot))
    np.savez(cache, train=data.train, held_out=data.held_out)
    return data


def make_optimizer(recipe: Recipe, params: Weights) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW (decay on matrices only) with linear warmup and cosine decay."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=recipe.lr, warmup_steps=recipe.warmup, decay_steps=recipe.steps,
        end_value=recipe.lr * recipe.final_lr_fraction,
    )  # fmt: skip
    return optax.chain(
        optax.clip_by_global_norm(recipe.clip_norm),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=recipe.weight_decay, mask=decay_mask(params)),
    )


def make_train_step(cfg: ModelConfig, recipe: Recipe, optimizer: optax.GradientTransformation):
    """A jitted (params, opt_state, tokens [B, T]) -> (params, opt_state, loss parts, grad norm)."""

    def step(params, opt_state, tokens):
        loss_fn = functools.partial(total_loss, cfg=cfg, mtp_weight=recipe.mtp_weight, mtp_chain=recipe.mtp_chain)
        (_, parts), grads = jax.value_and_grad(lambda p: loss_fn(p, tokens=tokens), has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        grad_norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree_util.tree_leaves(grads)))
        return optax.apply_updates(params, updates), opt_state, parts, grad_norm

    return jax.jit(step, donate_argnums=(0, 1))


def make_evaluate(cfg: ModelConfig, recipe: Recipe, batch: int):
    """(params, windows [N, T]) -> mean loss parts over the windows, evaluated `batch` windows at a time."""
    parts_fn = jax.jit(lambda p, t: losses(p, cfg, t, recipe.mtp_chain))

    def evaluate(params, windows: np.ndarray) -> dict[str, float]:
        totals: dict[str, float] = {}
        n = 0
        for start in range(0, len(windows), batch):
            chunk = windows[start : start + batch]
            if len(chunk) < batch:
                break
            for k, v in parts_fn(params, jnp.asarray(chunk)).items():
                totals[k] = totals.get(k, 0.0) + float(v)
            n += 1
        return {k: v / n for k, v in totals.items()}

    return evaluate


def train_model(
    cfg: ModelConfig, recipe: Recipe, data: Dataset, log=print, checkpoint: Path | None = None
) -> tuple[Weights, list[dict]]:
    """Run the recipe; returns the trained parameters (device arrays) and the log records. With `checkpoint`,
    the parameters are also saved there at every evaluation."""
    params = jax.tree_util.tree_map(jnp.asarray, init_params(cfg, recipe.seed))
    optimizer = make_optimizer(recipe, params)
    opt_state = optimizer.init(params)
    step_fn = make_train_step(cfg, recipe, optimizer)
    evaluate = make_evaluate(cfg, recipe, recipe.batch)
    val_windows = fixed_windows(data.held_out, recipe.eval_windows, recipe.seq_len)
    rng = np.random.default_rng(recipe.seed)
    records: list[dict] = []

    def emit(record: dict) -> None:
        records.append(record)
        log(json.dumps(record))

    emit({"event": "start", "params": count(params), "train_tokens": int(len(data.train)),
          "held_out_tokens": int(len(data.held_out)), "recipe": dataclasses.asdict(recipe)})  # fmt: skip
    start = time.perf_counter()
    for step in range(1, recipe.steps + 1):
        tokens = jnp.asarray(sample_windows(data.train, rng, recipe.batch, recipe.seq_len))
        params, opt_state, parts, grad_norm = step_fn(params, opt_state, tokens)
        if step % 10 == 0 or step == 1:
            emit({"event": "train", "step": step, "elapsed_s": round(time.perf_counter() - start, 1),
                  "grad_norm": round(float(grad_norm), 3), **{k: round(float(v), 4) for k, v in parts.items()}})  # fmt: skip
        if step % recipe.eval_every == 0 or step == recipe.steps:
            held_out = evaluate(params, val_windows)
            emit({"event": "eval", "step": step, "elapsed_s": round(time.perf_counter() - start, 1),
                  **{f"val_{k}": round(v, 4) for k, v in held_out.items()}})  # fmt: skip
            if checkpoint is not None:
                save_checkpoint(checkpoint, params)
    train_s = time.perf_counter() - start
    final = evaluate(params, fixed_windows(data.held_out, recipe.final_eval_windows, recipe.seq_len))
    emit({"event": "final", "step": recipe.steps, "train_s": round(train_s, 1),
          "held_out_tokens_evaluated": recipe.final_eval_windows * recipe.seq_len,
          **{f"val_{k}": round(v, 4) for k, v in final.items()}})  # fmt: skip
    return params, records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("--work-dir", type=Path, default=Path("train/runs"))
    parser.add_argument("--steps", type=int, help="override the recipe's step count (quick trials)")
    parser.add_argument("--seed", type=int, help="override the recipe's seed")
    args = parser.parse_args(argv)
    cfg, recipe = MODELS[args.model], RECIPES[args.model]
    if args.steps is not None:
        recipe = dataclasses.replace(recipe, steps=args.steps, warmup=min(recipe.warmup, max(args.steps // 10, 1)))
    if args.seed is not None:
        recipe = dataclasses.replace(recipe, seed=args.seed)
    data = prepare_data(args.work_dir, cfg.n_vocab)
    params, records = train_model(cfg, recipe, data, log=lambda line: print(line, flush=True),
                                  checkpoint=args.work_dir / f"{args.model}-latest.npz")  # fmt: skip
    save_checkpoint(args.work_dir / f"{args.model}.npz", params)
    summary = {"model": args.model, "config": dataclasses.asdict(cfg), "records": records}
    (args.work_dir / f"{args.model}.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
