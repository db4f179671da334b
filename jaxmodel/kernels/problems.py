"""Random gated-delta-rule inputs laid out the way the model calls `gated_delta_rule` (tests and benchmarks)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Problem:
    """One `gated_delta_rule` call, as float32 / int32 numpy arrays."""

    q: np.ndarray  # [B, T, Hk, Dk] L2-normalised
    k: np.ndarray  # [B, T, Hk, Dk] L2-normalised
    v: np.ndarray  # [B, T, Hv, Dv]
    g: np.ndarray  # [B, T, Hv] log-decay <= 0; 0 on padding tokens
    beta: np.ndarray  # [B, T, Hv] in (0, 1); 0 on padding tokens
    ssm_pool: np.ndarray  # [N, Hv, Dk, Dv] plane 0 all zero
    read_plane: np.ndarray  # [B]
    write_planes: np.ndarray  # [B, T] -1 where nothing is written

    @property
    def args(self) -> tuple:
        """The positional arguments of `gated_delta_rule`."""
        return (self.q, self.k, self.v, self.g, self.beta, self.ssm_pool, self.read_plane, self.write_planes)


def random_inputs(rng: np.random.Generator, n_rows: int, n_tokens: int, n_key_heads: int, n_value_heads: int,
                  dk: int, dv: int) -> tuple[np.ndarray, ...]:
    """q, k [B, T, Hk, Dk] (unit norm), v [B, T, Hv, Dv], g and beta [B, T, Hv], float32.

    g mixes slow and fast decays (mean -0.5, some below -3) so long inputs see states decay to almost nothing.
    """
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(rng.normal(size=(n_rows, n_tokens, n_key_heads, dk)))
    k = unit(rng.normal(size=(n_rows, n_tokens, n_key_heads, dk)))
    v = rng.normal(size=(n_rows, n_tokens, n_value_heads, dv))
    g = -rng.exponential(0.5, size=(n_rows, n_tokens, n_value_heads))
    beta = rng.uniform(0.05, 1.0, size=(n_rows, n_tokens, n_value_heads))
    return tuple(x.astype(np.float32) for x in (q, k, v, g, beta))


def random_problem(seed: int, *, n_tokens: int, n_key_heads: int = 2, n_value_heads: int = 4, dk: int = 16,
                   dv: int = 16, final_only: bool = False, max_writes: int = 6) -> Problem:
    """Four rows in the patterns the scheduler produces.

    row 0: reads the null plane 0 (a fresh sequence); writes after every token up to `max_writes` of them
           (snapshots), final_only: after the last token.
    row 1: reads its own plane; writes only after the last token (checkpoint), final_only: writes nothing.
    row 2: reads its own plane; its last tokens are padding (g = beta = 0, write -1) when T > 2; writes after
           some real tokens, one of them into the plane it read (a snapshot step reusing the live plane);
           final_only: writes into its read plane at the very last (padding) token.
    row 3: all padding; reads plane 0 and writes nothing.
    Two more planes are filled with random states and never named, so tests can check they stay untouched.
    """
    rng = np.random.default_rng(seed)
    n_rows = 4
    q, k, v, g, beta = random_inputs(rng, n_rows, n_tokens, n_key_heads, n_value_heads, dk, dv)
    n_padding = 2 if n_tokens > 2 else 0
    n_real = n_tokens - n_padding
    for padding_tokens in (np.s_[2, n_real:], np.s_[3, :]):
        g[padding_tokens] = 0.0
        beta[padding_tokens] = 0.0

    next_plane = iter(range(1, 10**6))
    read_plane = np.array([0, next(next_plane), next(next_plane), 0], np.int32)
    write_planes = np.full((n_rows, n_tokens), -1, np.int32)
    if final_only:
        write_planes[0, -1] = next(next_plane)
        write_planes[2, -1] = read_plane[2]
    else:
        for t in _some_tokens(rng, n_tokens, max_writes):
            write_planes[0, t] = next(next_plane)
        write_planes[1, -1] = next(next_plane)
        tokens = _some_tokens(rng, n_real, max(1, max_writes // 2))
        write_planes[2, tokens] = [next(next_plane) for _ in tokens]
        write_planes[2, tokens[-1]] = read_plane[2]
    n_planes = next(next_plane) + 2
    ssm_pool = rng.normal(scale=0.5, size=(n_planes, n_value_heads, dk, dv)).astype(np.float32)
    ssm_pool[0] = 0.0
    return Problem(q, k, v, g, beta, ssm_pool, read_plane, write_planes)


def _some_tokens(rng: np.random.Generator, n_tokens: int, count: int) -> list[int]:
    """Up to `count` sorted token indices below n_tokens, always including the last one."""
    if n_tokens <= count:
        return list(range(n_tokens))
    chosen = rng.choice(n_tokens - 1, size=count - 1, replace=False)
    return sorted(int(t) for t in chosen) + [n_tokens - 1]
