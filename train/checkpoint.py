"""Saving and loading trainable parameters as npz files (numpy only)."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from jaxmodel.config import ModelConfig
from jaxmodel.weights import Weights

from .params import init_params


def save_checkpoint(path: Path, params: Weights) -> None:
    """The parameter leaves, in tree order, as arrays leaf_0 .. leaf_n of an npz."""
    leaves = jax.tree_util.tree_leaves(params)
    np.savez(path, **{f"leaf_{i}": np.asarray(x) for i, x in enumerate(leaves)})


def load_checkpoint(path: Path, cfg: ModelConfig) -> Weights:
    """The inverse of `save_checkpoint` for a model of config `cfg` (numpy float32 leaves)."""
    treedef = jax.tree_util.tree_structure(init_params(cfg, 0))
    with np.load(path) as f:
        leaves = [f[f"leaf_{i}"] for i in range(len(f.files))]
    return jax.tree_util.tree_unflatten(treedef, leaves)
