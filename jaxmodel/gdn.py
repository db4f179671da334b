"""The Gated DeltaNet mixer (docs/model.md §4.2) over the conv and SSM plane pools, and the replay rebuild
(docs/design.md "Rollback"): the state after the accepted drafts, rebuilt from recorded per-token inputs."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from .config import ModelConfig
from .delta_rule import gated_delta_rule, rebuild_states
from .kernels import cpu_matmul
from .kernels.cpu_conv import causal_conv_cpu, causal_conv_planes_cpu, causal_conv_reference
from .kernels.gdn_decode import gdn_decode
from .layers import Prologued, l2_norm, linear, project
from .state import read_planes, scatter_planes
from .weights import GatedDeltaNet


# Steps of at most this many tokens (decode and verify) take the fused kernel on GPU (`fused_decode`).
FUSED_MAX_TOKENS = 16
# Tests and benchmarks set this to force the fused kernel on (interpreted off GPU) or off; read when a step is traced.
FORCE_FUSED: bool | None = None


def fused_decode(n_tokens: int) -> bool:
    """Whether a step of n_tokens per row runs its GDN layers' work between the projections as one kernel
    (`kernels.gdn_decode`): on GPU for decode and verify steps, unless GDNSPEC_GDN_FUSED=0. On a GPU XLA's form is a
    dozen launches per layer, and a decode step is bound by launches (docs/performance.md, "On a GPU"); on CPU the
    CPU kernels take these steps."""
    if FORCE_FUSED is not None:
        return FORCE_FUSED
    enabled = os.environ.get("GDNSPEC_GDN_FUSED", "1") != "0"
    return enabled and jax.default_backend() == "gpu" and n_tokens <= FUSED_MAX_TOKENS


def causal_conv(prev: jax.Array, x: jax.Array, w_conv: jax.Array, n_tokens: jax.Array) -> jax.Array:
    """silu of the causal depthwise conv over each row's window [prev | x].

    prev:     [B, C, Kc-1]  a conv plane: the row's Kc-1 earlier raw inputs, oldest first
    x:        [B, T, C]     this step's raw inputs
    w_conv:   [C, Kc]       taps, oldest first
    n_tokens: [B] int32     the row's tokens; the rest are padding, which comes out 0
    returns   [B, T, C]

    On CPU a step of more than one token, or of more than one row, takes the kernel (`kernels.cpu_conv`): XLA's form
    (`causal_conv_reference`) is a batched dot there, with copies around it, and sums one row of two tokens in
    another order. At one row of one token XLA fuses it into a multiply-and-reduce, cheaper than the call (where the
    kernel wins at 4 and 16 rows and breaks even at 64; docs/performance.md, "A 16-row iteration's serial work"),
    that sums as the kernel does at the batch buckets the runtime compiles (1, 4, 16, 64; XLA's dot picks its order
    by shape, and at 2 rows sums otherwise): one FMA per tap from the oldest. So a token's conv is the same bits in a
    step of any length and batch (tests/test_cpu_conv.py, tests/test_step_invariance.py).
    (`cpu_matmul.TARGET_CONV` None: a kernel library without it, as `bench.kernels` builds from older revisions.)
    """
    if _conv_kernel(x, cpu_matmul.TARGET_CONV):
        return causal_conv_cpu(prev, x, w_conv, n_tokens)
    return causal_conv_reference(prev, x, w_conv, n_tokens)


def _conv_kernel(x: jax.Array, target: str | None) -> bool:
    """Whether the conv of x [B, T, C] takes the CPU kernel (`causal_conv`); target: the kernel's FFI target."""
    kernel = jax.default_backend() == "cpu" and cpu_matmul.available() and target is not None
    return kernel and (x.shape[0] > 1 or x.shape[1] > 1)


def gdn_mixer(
    w: GatedDeltaNet,
    cfg: ModelConfig,
    x: jax.Array | Prologued,  # [B, T, E] normed input
    valid: jax.Array,  # [B, T] bool
    n_tokens: jax.Array,  # [B]
    conv_pool: jax.Array,  # [N, C, Kc-1]
    ssm_pool: jax.Array,  # [N, Hv, Dk, Dv]
    read_plane: jax.Array,  # [B]
    write_planes: jax.Array,  # [B, T]
    final_only: bool,
    replay_pool: jax.Array | None = None,  # [S, n, C + 2 Hv]
    record_slot: jax.Array | None = None,  # [B] the replay slot receiving the row's records, -1 for none
    record_from: jax.Array | None = None,  # [B] the row's first recorded token (its first draft, or `last`)
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """Returns y [B, T, E], both pools with the states after each written token stored, and the replay pool with
    each recording row's raw conv inputs, g and beta of tokens record_from.. (n of them) in its slot."""
    B, T, _ = x.shape
    Hk, Hv, Dk, Kc = cfg.ssm_groups, cfg.ssm_heads, cfg.ssm_state, cfg.conv_kernel
    # [B, T, C], [B, T, Hv Dk], [B, T, Hv] x2
    qkv, z, beta_raw, alpha = project(x, (w.qkv, w.gate, w.beta, w.alpha), live=valid)
    beta = jnp.where(valid[..., None], jax.nn.sigmoid(beta_raw), 0.0)  # [B, T, Hv]
    g = jnp.where(valid[..., None], jax.nn.softplus(alpha + w.dt_bias) * w.a, 0.0)
    if replay_pool is not None and record_slot is not None:
        n = replay_pool.shape[1]
        index = jnp.minimum(record_from[:, None] + jnp.arange(n)[None, :], T - 1)  # [B, n]; past the row: unused
        records = jnp.take_along_axis(jnp.concatenate([qkv, g, beta], axis=-1), index[..., None], axis=1)
        replay_pool = scatter_planes(replay_pool, record_slot, records)
    last = n_tokens - 1  # [B]
    # final_only: only each row's last token writes its states, to the row's last write plane.
    final_writes = lambda: jnp.where(jnp.arange(T)[None, :] == last[:, None], jnp.max(write_planes, axis=1)[:, None],
                                     -1)

    if fused_decode(T):
        o, conv_pool, ssm_pool = gdn_decode(
            qkv, z, beta_raw, alpha, w.conv, w.dt_bias, w.a, w.norm, conv_pool, ssm_pool, read_plane,
            final_writes() if final_only else write_planes, n_tokens, n_key_heads=Hk, eps=cfg.norm_eps,
            interpret=jax.default_backend() != "gpu")
        if w.out_heads is not None:  # out's inputs in the file's head order
            o = o.reshape(B, T, Hv, Dk)[:, :, jnp.asarray(w.out_heads)].reshape(B, T, Hv * Dk)
        return linear(o, w.out, live=valid), conv_pool, ssm_pool, replay_pool

    # Causal depthwise conv over [previous Kc-1 raw inputs | this step's inputs], oldest first; the conv state after
    # token t is the Kc-1 raw inputs ending at t. On CPU the kernel also reads and writes the planes (XLA's gather,
    # concatenation and scatter around it lengthened a decoding iteration; docs/performance.md, "A 16-row
    # iteration's serial work").
    if _conv_kernel(qkv, cpu_matmul.TARGET_CONV_PLANES) and conv_pool.dtype == jnp.float32:
        writes = final_writes() if final_only else write_planes
        conv, conv_pool = causal_conv_planes_cpu(conv_pool, qkv, w.conv, n_tokens, read_plane, writes)
    else:
        prev = read_planes(conv_pool, read_plane)  # [B, C, Kc-1]
        conv = causal_conv(prev, qkv, w.conv, n_tokens)  # [B, T, C]
        window = jnp.concatenate([prev, jnp.swapaxes(qkv, 1, 2)], axis=2)  # [B, C, Kc-1+T]
        if final_only:
            after = jax.vmap(lambda wnd, t: jax.lax.dynamic_slice_in_dim(wnd, t + 1, Kc - 1, axis=1))(window, last)
            conv_pool = scatter_planes(conv_pool, jnp.max(write_planes, axis=1), after)
        else:
            after = jnp.stack([window[:, :, j + 1 : j + 1 + T] for j in range(Kc - 1)], axis=-1)  # [B, C, T, Kc-1]
            after = jnp.swapaxes(after, 1, 2).reshape(B * T, -1, Kc - 1)
            conv_pool = scatter_planes(conv_pool, write_planes.reshape(B * T), after)

    q = l2_norm(conv[..., : Hk * Dk].reshape(B, T, Hk, Dk), cfg.norm_eps)
    k = l2_norm(conv[..., Hk * Dk : 2 * Hk * Dk].reshape(B, T, Hk, Dk), cfg.norm_eps)
    v = conv[..., 2 * Hk * Dk :].reshape(B, T, Hv, Dk)
    o, ssm_pool = gated_delta_rule(q, k, v, g, beta, ssm_pool, read_plane, write_planes, final_only=final_only,
                                   n_tokens=n_tokens)

    if w.out_heads is not None:  # out's inputs in the file's head order; the per-head gated norm commutes
        heads = jnp.asarray(w.out_heads)
        o, z = o[:, :, heads], z.reshape(B, T, Hv, Dk)[:, :, heads].reshape(B, T, Hv * Dk)
    o = Prologued("gated_rms_norm", o.reshape(B, T, Hv * Dk), w.norm, z, cfg.norm_eps)
    return linear(o, w.out, live=valid), conv_pool, ssm_pool, replay_pool


def gdn_rebuild(
    ws: list[GatedDeltaNet],
    cfg: ModelConfig,
    conv_pools: list[jax.Array],  # per GDN layer [N, C, Kc-1]
    ssm_pools: list[jax.Array],  # per GDN layer [N, Hv, Dk, Dv]
    replay_pools: list[jax.Array],  # per GDN layer [S, n, C + 2 Hv]
    source: jax.Array,  # [B] the plane holding the state the records follow
    target: jax.Array,  # [B] the plane receiving the rebuilt state, -1 for none
    slot: jax.Array,  # [B] the row's replay slot
    n_keep: jax.Array,  # [B] recorded tokens to apply, 0..n
) -> tuple[list[jax.Array], list[jax.Array]]:
    """Advance the state in `source` (the state before the row's first recorded token) by the first n_keep[b]
    recorded tokens of slot[b], in every GDN layer, and write it to `target`: the conv over the recorded raw
    inputs gives k and v again (the projections are not recomputed), then the delta rule, with g = beta = 0 past
    n_keep (which leaves the state alone), advances each state token by token as decoding does
    (`delta_rule.rebuild_states`), so the rebuilt state is the bits decoding would have written. The conv runs
    layer by layer, as the forward computes it. Returns both pools of every layer."""
    L, B = len(ws), target.shape[0]
    n = replay_pools[0].shape[1]
    Hk, Hv, Dk, Kc = cfg.ssm_groups, cfg.ssm_heads, cfg.ssm_state, cfg.conv_kernel
    C = cfg.conv_channels
    source = jnp.where(target < 0, 0, source)  # rows rebuilding nothing read the null plane
    records = jnp.stack([read_planes(pool, jnp.maximum(slot, 0)) for pool in replay_pools])  # [L, B, n, C + 2 Hv]
    keep = (jnp.arange(n)[None, :] < n_keep[:, None])[None, ..., None]  # [1, B, n, 1]
    g = jnp.where(keep, records[..., C : C + Hv], 0.0)  # [L, B, n, Hv]
    beta = jnp.where(keep, records[..., C + Hv :], 0.0)
    prev = [read_planes(pool, source) for pool in conv_pools]  # L x [B, C, Kc-1]
    kv = jnp.stack([causal_conv(p[:, Hk * Dk :], records[j, ..., Hk * Dk : C], w.conv[Hk * Dk :], n_keep)
                    for j, (p, w) in enumerate(zip(prev, ws, strict=True))])  # [L, B, n, C - Hk Dk]: k, v channels
    window = jnp.concatenate([jnp.stack(prev), jnp.swapaxes(records[..., :C], 2, 3)], axis=3)  # [L, B, C, Kc-1+n]
    k = l2_norm(kv[..., : Hk * Dk].reshape(L, B, n, Hk, Dk), cfg.norm_eps)
    v = kv[..., Hk * Dk :].reshape(L, B, n, Hv, Dk)
    ssm_pools = rebuild_states(k, v, g, beta, ssm_pools, source, target, n_keep)
    after = jax.vmap(jax.vmap(lambda wnd, t: jax.lax.dynamic_slice_in_dim(wnd, t, Kc - 1, axis=1), (0, 0)),
                     (0, None))(window, n_keep)  # [L, B, C, Kc-1]
    return [scatter_planes(pool, target, after[j]) for j, pool in enumerate(conv_pools)], ssm_pools
