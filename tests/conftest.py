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
