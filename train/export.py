"""Trained checkpoints -> the bundled GGUFs (through `jaxmodel.gguf_io.write_gguf`, docs/model.md layout).

    python -m train.export --work-dir train/runs --out-dir jaxmodel/assets
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer

from jaxmodel.assets import DEFAULT_DRAFT, DEFAULT_MODEL
from jaxmodel.config import ModelConfig
from jaxmodel.gguf_io import write_gguf
from jaxmodel.tokenizer import GGUFVocab, vocab_from_tokenizer
from jaxmodel.weights import Weights

from .checkpoint import load_checkpoint
from .configs import MODELS
from .params import to_numpy
from .tokenizer import CHATML_TEMPLATE, ENDOFTEXT


def gguf_vocab(tokenizer: Tokenizer, n_vocab: int) -> GGUFVocab:
    """The GGUF vocabulary of a trained tokenizer, with a ChatML template. <|endoftext|> (the separator the
    models were trained with) is bos, eos and pad; <|im_end|> also ends generation, by its text."""
    return vocab_from_tokenizer(tokenizer, pre="qwen35", vocab_size=n_vocab, bos=ENDOFTEXT, eos=ENDOFTEXT,
                                pad=ENDOFTEXT, chat_template=CHATML_TEMPLATE)  # fmt: skip


def export_model(path: Path, cfg: ModelConfig, params: Weights, tokenizer: Tokenizer, dtype: str, name: str) -> None:
    """Write trainable `params` (see train.params) as a GGUF with the tokenizer and a ChatML template."""
    write_gguf(path, cfg, to_numpy(params), vocab=gguf_vocab(tokenizer, cfg.n_vocab), dtype=dtype, name=name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path("train/runs"))
    parser.add_argument("--out-dir", type=Path, default=Path("jaxmodel/assets"))
    parser.add_argument("--dtype", default="q8_0", choices=["f32", "f16", "bf16", "q8_0"])
    parser.add_argument("--models", nargs="+", default=["target", "draft"], choices=["target", "draft"])
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    files = {"target": DEFAULT_MODEL, "draft": DEFAULT_DRAFT}
    for model in args.models:
        filename = files[model]
        cfg = MODELS[model]
        tokenizer = Tokenizer.from_file(str(args.work_dir / f"tokenizer-{cfg.n_vocab}.json"))
        params = load_checkpoint(args.work_dir / f"{model}.npz", cfg)
        out = args.out_dir / filename.replace("q8_0", args.dtype)
        export_model(out, cfg, params, tokenizer, args.dtype, name=f"gdnspec-stdlib-{model}")
        print(json.dumps({"model": model, "path": str(out), "bytes": out.stat().st_size}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
