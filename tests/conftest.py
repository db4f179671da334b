from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

DATA = Path(__file__).parent / "data"


def fixture(name: str) -> dict[str, np.ndarray]:
    with np.load(DATA / f"{name}.npz") as f:
        return dict(f)


@pytest.fixture(scope="session")
def tiny_model():
    from jaxmodel import load_model

    return load_model(DATA / "tiny-qwen35-mtp.gguf")


@pytest.fixture(scope="session")
def tiny_path() -> Path:
    return DATA / "tiny-qwen35-mtp.gguf"


def plain_greedy(model, prompt_ids, n: int, stop_ids=frozenset()) -> list[int]:
    """The reference every speculative path must reproduce: greedy decoding by rescoring the whole sequence,
    stopping before an end-of-generation id."""
    tokens = list(prompt_ids)
    for _ in range(n):
        logits, _ = model.score(tokens)
        token = int(logits[-1].argmax())
        if token in stop_ids:
            break
        tokens.append(token)
    return tokens[len(prompt_ids) :]
