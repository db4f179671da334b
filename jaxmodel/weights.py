"""The weights pytree. Matmul weights are [n_out, n_in] (numpy order of GGUF tensors, SPEC §0): y = x @ W.T."""

from __future__ import annotations

from dataclasses import dataclass

import jax


def pytree(cls):
    """A frozen dataclass whose fields are all pytree children."""
    return jax.tree_util.register_dataclass(dataclass(frozen=True)(cls))


@pytree
class DenseFfn:
    gate: jax.Array  # [F, E]
    up: jax.Array  # [F, E]
    down: jax.Array  # [E, F]


@pytree
class MoeFfn:
    router: jax.Array  # [X, E]
    gate: jax.Array  # [X, Fe, E]
    up: jax.Array  # [X, Fe, E]
    down: jax.Array  # [X, E, Fe]
    shared_router: jax.Array  # [E]  sigmoid gate of the shared expert
    shared_gate: jax.Array  # [Fs, E]
    shared_up: jax.Array  # [Fs, E]
    shared_down: jax.Array  # [E, Fs]


@pytree
class Attention:
    q: jax.Array  # [2 H D, E]  per head [q (D) | gate (D)]
    k: jax.Array  # [Hkv D, E]
    v: jax.Array  # [Hkv D, E]
    o: jax.Array  # [E, H D]
    q_norm: jax.Array  # [D]
    k_norm: jax.Array  # [D]
    q_bias: jax.Array | None = None  # [2 H D]
    k_bias: jax.Array | None = None  # [Hkv D]
    v_bias: jax.Array | None = None  # [Hkv D]


@pytree
class GatedDeltaNet:
    qkv: jax.Array  # [C, E]  output [q: Hk Dk | k: Hk Dk | v: Hv Dv]
    gate: jax.Array  # [Hv Dv, E]  z
    conv: jax.Array  # [C, Kc]
    dt_bias: jax.Array  # [Hv]
    a: jax.Array  # [Hv]  = -exp(A_log)
    beta: jax.Array  # [Hv, E]
    alpha: jax.Array  # [Hv, E]
    norm: jax.Array  # [Dv]
    out: jax.Array  # [E, Hv Dv]


@pytree
class Layer:
    attn_norm: jax.Array  # [E]
    post_norm: jax.Array  # [E]
    mixer: Attention | GatedDeltaNet
    ffn: DenseFfn | MoeFfn


@pytree
class Mtp:
    eh_proj: jax.Array  # [E, 2E]  input [enorm(embedding) | hnorm(hidden)]
    enorm: jax.Array  # [E]
    hnorm: jax.Array  # [E]
    head_norm: jax.Array  # [E]
    embed: jax.Array  # [V, E]
    head: jax.Array  # [V, E]
    layer: Layer  # attention mixer


@pytree
class Weights:
    embed: jax.Array  # [V, E]
    output_norm: jax.Array  # [E]
    output: jax.Array  # [V, E]  (the embedding itself when tied)
    layers: tuple[Layer, ...]
    mtp: Mtp | None = None
