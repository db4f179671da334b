"""Paths of the bundled models (trained by `train/`, shipped as package data in `jaxmodel/assets/`)."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).parent / "assets"
DEFAULT_MODEL = "gdnspec-stdlib-target-q8_0.gguf"  # qwen35, 6 layers + MTP block
DEFAULT_DRAFT = "gdnspec-stdlib-draft-q8_0.gguf"  # qwen35, 3 layers, same vocabulary


def default_model_path() -> Path:
    """The bundled target model: the server's default when no model is given."""
    return ASSETS / DEFAULT_MODEL


def default_draft_path() -> Path:
    """The bundled draft model for the `draft_model` drafter (same tokenizer as the target)."""
    return ASSETS / DEFAULT_DRAFT
