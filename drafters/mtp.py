"""The target's own MTP block as a drafter (SPEC-qwen35 §6.2).

The MTP block at position p reads (token x_p, the target's post-norm hidden h_{p-1}) and predicts x_{p+1}; it has
its own KV layer in the target's state, indexed by the target's page table. Two things happen in one batched call
per step:

* catch-up: every committed position not yet seen by the MTP is fed with the target's hidden state, so its KV holds
  what the target would have given it (the engine hands over hidden rows with `record` after each target step);
* drafting: the newest token `last` at position n is fed with h_{n-1}; its logits give draft 1. Drafts 2.. chain
  on the MTP's own hidden state, one token per call, stopping at n_max or below p_min.

Chained positions get the MTP's own hidden rather than the target's; the next catch-up rewrites them once they are
committed, so the MTP's KV never keeps a wrong entry for a committed position.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from jaxmodel.state import Row

from .base import Draft, DraftRequest, SeqId
from .chain import greedy_chain

CATCH_UP_CHUNK = 128


class _MtpSequence:
    def __init__(self):
        self.seen = 0  # positions < seen hold MTP KV computed from target hiddens
        self.hidden: dict[int, np.ndarray] = {}  # position -> target post-norm hidden [E]


class MtpDrafter:
    name = "mtp"

    def __init__(self, runner, pages_of: Callable[[SeqId], Sequence[int]]):
        """runner: the target's `scheduler.runner.Runner`; pages_of: the KV pages a sequence owns now."""
        if not runner.model.has_mtp:
            raise ValueError(f"{runner.model.path or 'the target model'} has no MTP block")
        self.runner = runner
        self.pages_of = pages_of
        self.n_embd = runner.model.cfg.n_embd
        # Catch-up rows, plus `last`, must fit the runner's longest row.
        self.chunk = runner.shapes.max_tokens - 1 if runner.shapes is not None else CATCH_UP_CHUNK
        self.seqs: dict[SeqId, _MtpSequence] = {}

    def record(self, seq_id: SeqId, start: int, hidden: np.ndarray) -> None:
        """The target computed positions start.. of this sequence (committed tokens only): hidden [n, E]."""
        seq = self.seqs.setdefault(seq_id, _MtpSequence())
        for i, row in enumerate(hidden):
            seq.hidden[start + i] = row
        for p in [p for p in seq.hidden if p < seq.seen - 1]:
            del seq.hidden[p]

    def _hidden_before(self, seq: _MtpSequence, p: int) -> np.ndarray:
        return np.zeros(self.n_embd, np.float32) if p == 0 else seq.hidden[p - 1]

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        live = [r for r in requests if r.n_max > 0 and self._ready(r)]
        # Catch up long backlogs in chunks, leaving at most one chunk for the drafting call.
        while True:
            behind = [r for r in live if len(r.tokens) - 1 - self.seqs[r.seq_id].seen > self.chunk]
            if not behind:
                break
            rows, hidden = [], []
            for r in behind:
                seq = self.seqs[r.seq_id]
                span = range(seq.seen, seq.seen + self.chunk)
                rows.append(Row([r.tokens[p] for p in span], seq.seen, self.pages_of(r.seq_id), 0, [-1] * len(span)))
                hidden.append(np.stack([self._hidden_before(seq, p) for p in span]))
                seq.seen += self.chunk
            self.runner.forward_mtp(rows, hidden)
        if not live:
            return [Draft(tokens=[]) for _ in requests]

        # Catch-up of the rest, plus `last` with h_{n-1}: its logits are draft 1.
        rows, hidden = [], []
        for r in live:
            seq, n = self.seqs[r.seq_id], len(r.tokens) - 1
            seq.seen = min(seq.seen, n)  # `last` is always fed: its logits are draft 1
            span = range(seq.seen, n + 1)
            rows.append(Row([r.tokens[p] for p in span], seq.seen, self.pages_of(r.seq_id), 0, [-1] * len(span),
                            [len(span) - 1]))  # fmt: skip
            hidden.append(np.stack([self._hidden_before(seq, p) for p in span]))
            seq.seen = n + 1
        out = self.runner.forward_mtp(rows, hidden)
        own_hidden = {i: np.asarray(out.hidden[i, len(row.tokens) - 1]) for i, row in enumerate(rows)}

        def advance(indices: list[int], tokens: list[int], step: int) -> np.ndarray:
            chain_rows = [Row([t], len(live[i].tokens) - 1 + step, self.pages_of(live[i].seq_id), 0, [-1], [0])
                          for i, t in zip(indices, tokens)]  # fmt: skip
            out = self.runner.forward_mtp(chain_rows, [own_hidden[i][None] for i in indices])
            for j, i in enumerate(indices):
                own_hidden[i] = np.asarray(out.hidden[j, 0])
            return np.asarray(out.logits[: len(indices), 0])

        chains = greedy_chain(
            np.asarray(out.logits[: len(live), 0]), [r.n_max for r in live], [r.p_min for r in live], advance
        )
        drafts = {r.seq_id: chain for r, chain in zip(live, chains)}
        return [Draft(tokens=drafts.get(r.seq_id, [])) for r in requests]

    def _ready(self, r: DraftRequest) -> bool:
        """Drafting needs the target's hidden at every position the MTP has not seen, up to n-1."""
        seq = self.seqs.setdefault(r.seq_id, _MtpSequence())
        n = len(r.tokens) - 1
        return all(p in seq.hidden for p in range(max(seq.seen - 1, 0), n))

    def observe(self, seq_id: SeqId, accepted: int, committed_tokens: Sequence[int]) -> None:
        """Nothing to roll back: the MTP rewrites chained positions when it catches up."""

    def release(self, seq_id: SeqId) -> None:
        self.seqs.pop(seq_id, None)
