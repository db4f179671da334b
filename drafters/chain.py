"""Greedy draft chains shared by the model-based drafters (MTP, draft model)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def greedy_chain(
    first_logits: np.ndarray,  # [N, V]
    n_max: Sequence[int],
    p_min: Sequence[float],
    advance: Callable[[list[int], list[int], int], np.ndarray],
) -> list[list[int]]:
    """Draft greedily for N sequences at once.

    Each sequence takes the argmax of its logits while that token's probability is at least p_min and its draft is
    shorter than n_max. `advance(indices, tokens, step)` feeds the newest draft token of each continuing sequence
    (step = 1, 2, ...: how many drafts precede it) and returns their next logits [len(indices), V].

    >>> logits = np.log(np.array([[0.7, 0.2, 0.1], [0.4, 0.35, 0.25]]))
    >>> greedy_chain(logits, n_max=[2, 3], p_min=[0.5, 0.5], advance=lambda idx, tok, step: logits[idx])
    [[0, 0], []]
    """
    drafts: list[list[int]] = [[] for _ in range(len(first_logits))]
    going, logits = list(range(len(first_logits))), first_logits
    step = 0
    while going:
        still, tokens = [], []
        for i, row in zip(going, logits):
            z = np.exp(row - row.max())
            token = int(np.argmax(z))
            if z[token] / z.sum() < p_min[i]:
                continue
            drafts[i].append(token)
            if len(drafts[i]) < n_max[i]:
                still.append(i)
                tokens.append(token)
        if not still:
            break
        step += 1
        logits = advance(still, tokens, step)
        going = still
    return drafts
