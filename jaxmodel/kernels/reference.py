"""The plain gated delta rule: the specification every other implementation is tested against.

A per-token loop in numpy float64, written to be read (docs/model.md §4.2 step 6). Nothing here is fast or
jitted; the model never calls it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ReferenceResult:
    """What `delta_rule_reference` returns (float64 numpy arrays)."""

    outputs: np.ndarray  # [B, T, Hv, Dv]
    final_state: np.ndarray  # [B, Hv, Dk, Dv]
    states: np.ndarray | None  # [B, T, Hv, Dk, Dv] state after each token, when asked for


def delta_rule_reference(q, k, v, g, beta, initial_state, *, keep_states: bool = False) -> ReferenceResult:
    """Run the gated delta rule token by token.

    q, k:           [B, T, Hk, Dk]  L2-normalised; value head h uses key head h % Hk
    v:              [B, T, Hv, Dv]
    g, beta:        [B, T, Hv]      log-decay (<= 0) and write strength
    initial_state:  [B, Hv, Dk, Dv]
    keep_states:    also return the state after every token
    Per head, for each token: S <- exp(g) S; delta = beta (v - S^T k); S <- S + k delta^T; o = S^T q / sqrt(Dk).
    """
    q, k, v, g, beta, state = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, initial_state))
    n_rows, n_tokens, n_key_heads, dk = q.shape
    n_value_heads, dv = v.shape[2], v.shape[3]
    state = state.copy()
    outputs = np.zeros((n_rows, n_tokens, n_value_heads, dv))
    states = np.zeros((n_rows, n_tokens, n_value_heads, dk, dv)) if keep_states else None
    for b in range(n_rows):
        for t in range(n_tokens):
            for h in range(n_value_heads):
                key_head = h % n_key_heads
                s = state[b, h] * np.exp(g[b, t, h])
                delta = beta[b, t, h] * (v[b, t, h] - s.T @ k[b, t, key_head])
                s = s + np.outer(k[b, t, key_head], delta)
                outputs[b, t, h] = s.T @ q[b, t, key_head] / np.sqrt(dk)
                state[b, h] = s
            if keep_states:
                states[b, t] = state[b]
    return ReferenceResult(outputs=outputs, final_state=state, states=states)


def reference_pool_update(q, k, v, g, beta, ssm_pool, read_plane, write_planes, *, final_only: bool = False):
    """The `gated_delta_rule` contract, spelled out on top of `delta_rule_reference`.

    Shapes as `jaxmodel.delta_rule.gated_delta_rule`; ssm_pool [N, Hv, Dk, Dv], read_plane [B],
    write_planes [B, T]. Every row reads its plane before anything is written. Without final_only the state
    after token t of row b goes to plane write_planes[b, t] (rows in order, tokens in order); with final_only
    the state after all T tokens goes to the one plane the row names.
    Returns (outputs [B, T, Hv, Dv], pool [N, Hv, Dk, Dv]) as float64 numpy arrays.
    """
    pool = np.asarray(ssm_pool, np.float64)
    read_plane, write_planes = np.asarray(read_plane), np.asarray(write_planes)
    result = delta_rule_reference(q, k, v, g, beta, pool[read_plane], keep_states=not final_only)
    pool = pool.copy()
    for b in range(write_planes.shape[0]):
        if final_only:
            targets = write_planes[b][write_planes[b] >= 0]
            assert len(targets) <= 1, "final_only rows write at most one plane"
            if len(targets):
                pool[targets[0]] = result.final_state[b]
        else:
            for t, plane in enumerate(write_planes[b]):
                if plane >= 0:
                    pool[plane] = result.states[b, t]
    return result.outputs, pool
