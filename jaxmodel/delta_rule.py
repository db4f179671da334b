"""The gated delta rule over snapshot planes (docs/model.md §4.2 step 6).

This module is the one place that chooses how the recurrence runs; the GDN mixer calls
`gated_delta_rule` and never an implementation directly. The specification all implementations are tested
against is `jaxmodel.kernels.reference`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmodel.kernels import cpu_matmul
from jaxmodel.kernels.cpu_gdn import gdn_recurrent_cpu
from jaxmodel.kernels.gdn_chunked import gdn_chunked
from jaxmodel.kernels.gdn_recurrent import gdn_recurrent
from jaxmodel.state import read_planes, scatter_planes
from jaxmodel.xla_flags import step_invariant

# Implementations `gated_delta_rule(impl=...)` accepts; the chunked ones require final_only.
IMPLEMENTATIONS = ("scan", "chunked", "pallas_recurrent", "pallas_chunked", "cpu")
# On CPU the jnp chunked form beats `recurrent_scan` from about this many tokens at real model shapes
# (measured, see `choose_implementation`).
CPU_CHUNKED_MIN_TOKENS = 64
# On GPU the chunked kernel takes prefill chunks from this many tokens; an estimate until measured
# with bench/gdn_kernels.py (its crossover section).
GPU_CHUNKED_MIN_TOKENS = 256
# Up to this many tokens `recurrent_scan` returns every token's state and scatters once (no pool copy);
# longer non-final steps carry the pool through the loop instead of holding T states.
SCAN_STATES_MAX_TOKENS = 16
# Chunk of the jnp chunked form; on CPU 32 beat 16 and 64 at Dk = Dv = 128.
CHUNK_SIZE = 32
# Tests and benchmarks set this to force an implementation in a model step; read when a step is traced.
FORCE_IMPL: str | None = None

_HIGHEST = jax.lax.Precision.HIGHEST


def tile_key_heads(x: jax.Array, n_value_heads: int) -> jax.Array:
    """[..., Hk, D] -> [..., Hv, D]: value head h uses key head h % Hk (GGUF's tiled order)."""
    n_key_heads = x.shape[-2]
    return jnp.tile(x, (1,) * (x.ndim - 2) + (n_value_heads // n_key_heads, 1))


def advance_state(state, k_t, v_t, g_t, beta_t):
    """One token of the gated delta rule: state [B, Hv, Dk, Dv], k_t [B, Hv, Dk], v_t [B, Hv, Dv], g_t and beta_t
    [B, Hv] -> the state after it. A token with g = beta = 0 leaves the state alone, bit for bit."""
    state = state * jnp.exp(g_t)[..., None, None]
    recalled = jnp.einsum("bhkv,bhk->bhv", state, k_t, precision=_HIGHEST)
    delta = beta_t[..., None] * (v_t - recalled)
    return state + k_t[..., :, None] * delta[..., None, :]


def recurrent_scan(q, k, v, g, beta, ssm_pool, read_plane, write_planes, final_only: bool = False,
                   n_steps: jax.Array | None = None):
    """Token-serial gated delta rule reading and writing state planes.

    q, k:          [B, T, Hk, Dk]  L2-normalised queries and keys
    v:             [B, T, Hv, Dv]
    g, beta:       [B, T, Hv]      log-decay (<= 0) and write strength; padding tokens carry g = beta = 0
    ssm_pool:      [N, Hv, Dk, Dv] float32 state planes
    read_plane:    [B]             plane holding each row's input state
    write_planes:  [B, T]          plane that receives the state after token t, -1 for none
    final_only:    each row writes only its final state, to the one plane >= 0 of its write_planes row (if any):
                   the scan then carries the state alone and scatters once
    n_steps:       []  (not final_only, T <= SCAN_STATES_MAX_TOKENS) a traced count of leading tokens to run, at
                   least every row's real tokens (the rest are padding: zero output, no state written). The loop
                   then runs with a trip count XLA cannot see, so every T compiles the same loop body, and a token's
                   state is the same bits in a decoding step (T = 1) as in a verify step: with a static count, XLA
                   removes a loop of one trip and fuses the token's update into the read and scatter around it,
                   which changed the last bits of the state (and, where activations are quantized to Q8_0, later
                   tokens' logits). None: all T, in a scan.
    returns o [B, T, Hv, Dv] (scaled by 1/sqrt(Dk)) and the updated pool.
    """
    n_planes, n_value_heads, dk, _ = ssm_pool.shape
    B, T = write_planes.shape
    q = tile_key_heads(q, n_value_heads) * (dk**-0.5)
    k = tile_key_heads(k, n_value_heads)
    # Rows that write nothing at a token scatter past the end of the pool, where the update is dropped.
    targets = jnp.where(write_planes < 0, n_planes, write_planes)  # [B, T]
    state = read_planes(ssm_pool, read_plane).astype(jnp.float32)  # [B, Hv, Dk, Dv]

    def advance(state, q_t, k_t, v_t, g_t, beta_t):  # [B, Hv, Dk, Dv], [B, Hv, Dk] x2, [B, Hv, Dv], [B, Hv] x2
        state = advance_state(state, k_t, v_t, g_t, beta_t)
        return state, jnp.einsum("bhkv,bhk->bhv", state, q_t, precision=_HIGHEST)

    time_major = lambda x: jnp.moveaxis(x, 1, 0)
    xs = tuple(map(time_major, (q, k, v, g, beta)))
    if final_only:
        final, out = jax.lax.scan(lambda state, xs_t: advance(state, *xs_t), state, xs)
        target = jnp.max(write_planes, axis=1)  # [B]
        target = jnp.where(target < 0, n_planes, target)  # rows writing nothing scatter past the end of the pool
        return time_major(out), ssm_pool.at[target].set(final.astype(ssm_pool.dtype), mode="drop")
    if T <= SCAN_STATES_MAX_TOKENS:
        # Emit every token's state and scatter once: XLA copies a pool carried through a loop (twice per
        # layer and step), which for a server-sized pool costs far more than T states.
        def emit(state, xs_t):
            state, out = advance(state, *xs_t)
            return state, (out, state)

        if n_steps is None:
            _, (out, states) = jax.lax.scan(emit, state, xs)  # states [T, B, Hv, Dk, Dv]
        else:
            def step(t, carry):
                state, out, states = carry
                state, out_t = advance(state, *(jax.lax.dynamic_index_in_dim(x, t, keepdims=False) for x in xs))
                return state, out.at[t].set(out_t), states.at[t].set(state)

            empty = (jnp.zeros((T, B, n_value_heads, v.shape[-1]), jnp.float32), jnp.zeros((T,) + state.shape))
            _, out, states = jax.lax.fori_loop(0, jnp.minimum(n_steps, T), step, (state, *empty))
        flat_states = jnp.swapaxes(states, 0, 1).reshape((B * T,) + states.shape[2:])
        pool = ssm_pool.at[targets.reshape(B * T)].set(flat_states.astype(ssm_pool.dtype), mode="drop")
        return time_major(out), pool

    def step(carry, xs_t):
        state, pool = carry
        *inputs, target_t = xs_t
        state, out = advance(state, *inputs)
        pool = pool.at[target_t].set(state.astype(pool.dtype), mode="drop")
        return (state, pool), out

    (_, pool), out = jax.lax.scan(step, (state, ssm_pool), xs + (time_major(targets),))
    return time_major(out), pool


def invert_unit_lower(a: jax.Array) -> jax.Array:
    """(I + a)^-1 for strictly lower-triangular a [..., C, C], C a power of two.

    Doubles the width of the inverted diagonal blocks with matmuls only:
    inv([[X, 0], [Y, Z]]) = [[X^-1, 0], [-Z^-1 Y X^-1, Z^-1]]. (LAPACK's batched trsm, which
    `triangular_solve` calls on CPU, is slow at these sizes and stalls on busy machines.)
    """
    size, batch = a.shape[-1], a.shape[:-2]
    if size & (size - 1):
        raise ValueError(f"chunk size {size} is not a power of two")
    inverse = jnp.ones(batch + (size, 1, 1), a.dtype)  # inverted diagonal blocks [..., C / s, s, s]
    width = 1
    while width < size:
        n_blocks = size // (2 * width)
        blocks = a.reshape(batch + (n_blocks, 2 * width, n_blocks, 2 * width))
        blocks = jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)  # [..., m, 2s, 2s]
        pairs = inverse.reshape(batch + (n_blocks, 2, width, width))
        upper, lower = pairs[..., 0, :, :], pairs[..., 1, :, :]
        corner = -jnp.matmul(lower, jnp.matmul(blocks[..., width:, :width], upper, precision=_HIGHEST),
                             precision=_HIGHEST)
        inverse = jnp.concatenate([jnp.concatenate([upper, jnp.zeros_like(upper)], axis=-1),
                                   jnp.concatenate([corner, lower], axis=-1)], axis=-2)
        width *= 2
    return inverse.reshape(batch + (size, size))


def _wy_terms(k, v, g, beta):
    """The WY terms of chunks of C tokens (C a power of two), per head: k [..., C, Dk], v [..., C, Dv], g, beta
    [..., C]. A chunk from state S leaves exp(G_C) S + k_to_end^T (u - w S), its per-token deltas being u - w S.

    Returns G (the cumulative log-decay) [..., C], the causal decay exp(G_i - G_j) [..., C, C], u [..., C, Dv],
    w [..., C, Dk], k_to_end [..., C, Dk] (k_j decayed to the chunk's end) and exp(G_C) [..., 1, 1]."""
    size = g.shape[-1]
    causal = jnp.tril(jnp.ones((size, size), bool))
    strict = jnp.tril(jnp.ones((size, size), bool), -1)
    g_cum = jnp.cumsum(g, axis=-1)
    # Masked before exp: above the diagonal G_i - G_j is positive and may overflow.
    gaps = jnp.where(causal, g_cum[..., :, None] - g_cum[..., None, :], 0.0)
    decay = jnp.where(causal, jnp.exp(gaps), 0.0)
    kk = jnp.einsum("...id,...jd->...ij", k, k, precision=_HIGHEST)
    a = jnp.where(strict, beta[..., :, None] * kk * decay, 0.0)
    inverse = invert_unit_lower(a)
    u = jnp.matmul(inverse, beta[..., None] * v, precision=_HIGHEST)
    w = jnp.matmul(inverse, (beta * jnp.exp(g_cum))[..., None] * k, precision=_HIGHEST)
    k_to_end = k * jnp.exp(g_cum[..., -1:] - g_cum)[..., None]
    return g_cum, decay, u, w, k_to_end, jnp.exp(g_cum[..., -1])[..., None, None]


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state, *, chunk_size: int = CHUNK_SIZE):
    """Chunked (WY / UT-transform) gated delta rule from an initial state, in plain JAX.

    q, k:           [B, T, Hk, Dk]  L2-normalised; value head h uses key head h % Hk
    v:              [B, T, Hv, Dv]
    g, beta:        [B, T, Hv]
    initial_state:  [B, Hv, Dk, Dv]
    returns o [B, T, Hv, Dv] float32 (scaled by 1/sqrt(Dk)) and the final state [B, Hv, Dk, Dv] float32.

    Within a chunk of C tokens, with G the cumulative log-decay and A[i, j] = beta_i (k_i . k_j) exp(G_i - G_j)
    for j < i, the per-token deltas are v_new = (I + A)^-1 (beta v) - (I + A)^-1 (beta exp(G) k) S; outputs and
    the next state are matmuls against S and v_new. A serial scan carries S across chunks. T is padded to a
    multiple of C (a power of two) with identity tokens (g = beta = 0).
    """
    n_rows, n_tokens, _, dk = q.shape
    n_value_heads, dv = v.shape[2], v.shape[3]
    size = chunk_size
    pad = -n_tokens % size
    n_chunks = (n_tokens + pad) // size

    def chunked(x):  # [B, T, Hv, ...] -> [n, B, Hv, C, ...]
        x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(n_rows, n_chunks, size, *x.shape[2:])
        return jnp.moveaxis(x, (1, 2), (0, 3))

    q = chunked(tile_key_heads(q, n_value_heads)) * (dk**-0.5)  # [n, B, H, C, Dk]
    k = chunked(tile_key_heads(k, n_value_heads))  # [n, B, H, C, Dk]
    v, g, beta = chunked(v), chunked(g), chunked(beta)  # [n, B, H, C, Dv], [n, B, H, C] x2

    causal = jnp.tril(jnp.ones((size, size), bool))
    g_cum, decay, u, w, k_to_end, chunk_decay = _wy_terms(k, v, g, beta)
    scores = jnp.where(causal, jnp.einsum("...id,...jd->...ij", q, k, precision=_HIGHEST) * decay, 0.0)
    q_decayed = q * jnp.exp(g_cum)[..., None]

    def step(state, xs):  # state [B, H, Dk, Dv]
        u, w, scores, q_decayed, k_to_end, chunk_decay = xs
        v_new = u - jnp.einsum("bhck,bhkv->bhcv", w, state, precision=_HIGHEST)
        out = (jnp.einsum("bhck,bhkv->bhcv", q_decayed, state, precision=_HIGHEST)
               + jnp.einsum("bhij,bhjv->bhiv", scores, v_new, precision=_HIGHEST))
        state = chunk_decay * state + jnp.einsum("bhck,bhcv->bhkv", k_to_end, v_new, precision=_HIGHEST)
        return state, out

    state, out = jax.lax.scan(step, initial_state.astype(jnp.float32),
                              (u, w, scores, q_decayed, k_to_end, chunk_decay))
    out = jnp.moveaxis(out, (0, 3), (1, 2)).reshape(n_rows, n_chunks * size, n_value_heads, dv)
    return out[:, :n_tokens], state


def chunked_scan(q, k, v, g, beta, ssm_pool, read_plane, write_planes, *, chunk_size: int = CHUNK_SIZE):
    """`chunk_gated_delta_rule` over state planes under the final_only contract.

    Shapes as `recurrent_scan`; each row writes the state after all T tokens to the one plane >= 0 in its
    write_planes row, if any.
    """
    n_planes = ssm_pool.shape[0]
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, ssm_pool[read_plane], chunk_size=chunk_size)
    target = jnp.max(write_planes, axis=1)  # [B]
    target = jnp.where(target < 0, n_planes, target)
    return out, ssm_pool.at[target].set(final.astype(ssm_pool.dtype), mode="drop")


def advance_states(k, v, g, beta, state, n_steps):
    """Advance each row's state by a few tokens of the delta rule (replay's rebuild).

    k:       [B, n, Hk, Dk]  L2-normalised keys
    v:       [B, n, Hv, Dv]
    g, beta: [B, n, Hv]      a token with g = beta = 0 leaves the state alone
    state:   [B, Hv, Dk, Dv]
    n_steps: []              a traced count of leading tokens to run, at least every row's kept tokens
    returns the advanced states [B, Hv, Dk, Dv] float32.

    Token by token, as `recurrent_scan` runs in a decoding step (`advance_state`, in a loop whose trip count XLA
    cannot see): the rebuilt state is then the bits decoding would have written, so a sequence rolled back by
    replay goes on exactly as a plain one. The chunked form's one product against the state (S_n = exp(G_n) S +
    k_to_end^T (u - w S)) was cheaper but differed in the last bits from the token-serial state, which Q8_0's
    activation rounding can turn into another token (tests/test_step_invariance.py)."""
    k = tile_key_heads(k, state.shape[1])
    xs = tuple(jnp.moveaxis(x.astype(jnp.float32), 1, 0) for x in (k, v, g, beta))  # [n, B, ...]

    def step(t, state):
        return advance_state(state, *(jax.lax.dynamic_index_in_dim(x, t, keepdims=False) for x in xs))

    return jax.lax.fori_loop(0, jnp.minimum(n_steps, k.shape[1]), step, state.astype(jnp.float32))


def rebuild_states(k, v, g, beta, ssm_pools, source, target, n_keep):
    """Replay's rebuild of every GDN layer's state: each row's `source` plane advanced by its first n_keep tokens,
    written to its `target` plane (-1: none), the way the step's own implementation advances a state, so that the
    rebuilt state is the bits decoding writes (the CPU kernel where the steps take it, else `advance_states`).

    k:          [L, B, n, Hk, Dk]  L2-normalised keys of the recorded tokens, per layer
    v:          [L, B, n, Hv, Dv]
    g, beta:    [L, B, n, Hv]      0 past n_keep
    ssm_pools:  L pools [N, Hv, Dk, Dv]
    source, target, n_keep: [B]
    returns the L pools."""
    L, B, n = k.shape[:3]
    if jax.default_backend() == "cpu" and cpu_matmul.available():
        # A row keeping nothing runs its first token, which g = beta = 0 makes leave the state alone (bit for bit),
        # and writes the source state so.
        last = jnp.maximum(n_keep, 1)  # [B]
        writes = jnp.where(jnp.arange(n)[None, :] == last[:, None] - 1, target[:, None], -1)  # [B, n]
        return [gdn_recurrent_cpu(jnp.zeros_like(k[j]), k[j], v[j], g[j], beta[j], pool, source, writes, last)[1]
                for j, pool in enumerate(ssm_pools)]
    # Every layer's states advance as one batch of L x B rows: a few large operations rather than a few per layer
    # (at a rebuild's sizes XLA's CPU runtime spends more on launching operations than on them).
    flat = lambda x: x.reshape((L * B,) + x.shape[2:])
    states = jnp.stack([read_planes(pool, source) for pool in ssm_pools])  # [L, B, Hv, Dk, Dv]
    states = advance_states(flat(k), flat(v), flat(g), flat(beta), flat(states), jnp.max(n_keep)).reshape(states.shape)
    return [scatter_planes(pool, target, states[j]) for j, pool in enumerate(ssm_pools)]


def choose_implementation(backend: str, n_tokens: int, final_only: bool, cpu_kernel: bool = False) -> str:
    """The implementation `gated_delta_rule` runs for this backend ("cpu", "gpu", ...) and shape; cpu_kernel:
    whether the CPU kernels are built here (`cpu_matmul.available()`).

    On CPU the kernel (`kernels.cpu_gdn`) takes every step, prompt chunks included (and replay's rebuild): one
    order of summation for every token whatever its step's length or batch, so a decoding row batched with a
    prompt chunk computes what it would alone, and greedy speculative output equals plain output under
    concurrency. XLA's scan (FORCE_IMPL = "scan"; tests/test_cpu_q8_matmul.py compares both with llama.cpp) costs
    several times the kernel on prompt chunks (docs/performance.md, "Prefill on CPU").

    Without the kernels, on CPU the chunked form wins from a few dozen tokens at real head sizes (the scan stays
    ahead by fractions of a millisecond at the tiny test shapes), so CPU prefill chunks of 64 tokens or more take
    it. On an H100 XLA's chunked form beats the Pallas chunked kernel many times over on prefill, and the Pallas
    recurrent kernel from 256 tokens, so GPU steps of 256 tokens or more take it (docs/performance.md, "The gated
    delta rule's forms by step length", with the measurements).
    """
    if backend == "gpu":
        return "chunked" if final_only and n_tokens >= GPU_CHUNKED_MIN_TOKENS else "pallas_recurrent"
    if backend == "cpu" and cpu_kernel:
        return "cpu"
    if final_only and n_tokens >= CPU_CHUNKED_MIN_TOKENS:
        return "chunked"
    return "scan"


def gated_delta_rule(q, k, v, g, beta, ssm_pool, read_plane, write_planes, *, final_only: bool = False,
                     impl: str | None = None, n_tokens: jax.Array | None = None):
    """Shapes as `recurrent_scan`; dispatches to the implementation for this backend and shape.

    n_tokens: [B] each row's real tokens (None: all T). The CPU kernel skips the padding after them; the scan, when
    `step_invariant()`, runs up to the most of them (`recurrent_scan`'s n_steps); the other forms take all T.
    final_only: the caller promises each row writes at most one plane, at or after its last real token
    (a prefill chunk), which lets long inputs take the chunked form.
    impl: force one of IMPLEMENTATIONS (tests and benchmarks); Pallas kernels run interpreted off GPU.
    """
    backend = jax.default_backend()
    impl = impl or FORCE_IMPL or choose_implementation(backend, q.shape[1], final_only,
                                                       backend == "cpu" and cpu_matmul.available())
    if impl in ("chunked", "pallas_chunked") and not final_only:
        raise ValueError(f"{impl!r} writes only the final state; it needs final_only=True")
    interpret = backend != "gpu"
    if impl == "scan":
        n_steps = jnp.max(n_tokens) if n_tokens is not None and step_invariant() else None
        return recurrent_scan(q, k, v, g, beta, ssm_pool, read_plane, write_planes, final_only=final_only,
                              n_steps=n_steps)
    if impl == "chunked":
        return chunked_scan(q, k, v, g, beta, ssm_pool, read_plane, write_planes)
    if impl == "pallas_recurrent":
        return gdn_recurrent(q, k, v, g, beta, ssm_pool, read_plane, write_planes, interpret=interpret)
    if impl == "cpu":
        # final_only rows may name their plane at a padding token (after their last real one): run every token,
        # padding ones leaving the state alone (g = beta = 0).
        everything = n_tokens is None or final_only
        return gdn_recurrent_cpu(q, k, v, g, beta, ssm_pool, read_plane, write_planes,
                                 jnp.full(read_plane.shape, q.shape[1], jnp.int32) if everything else n_tokens)
    if impl == "pallas_chunked":
        return gdn_chunked(q, k, v, g, beta, ssm_pool, read_plane, write_planes, interpret=interpret)
    raise ValueError(f"unknown implementation {impl!r}; expected one of {IMPLEMENTATIONS}")
