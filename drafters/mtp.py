"""The target's own MTP head as a drafter (docs: the MTP block reads token x_p and the target's hidden h_{p-1}).

Its drafts are computed inside the target's step (`jaxmodel.speculative`): after verification the head catches up
on the committed tokens with the target's hidden states, which never leave the device, and chains the next step's
drafts on its own hidden state. This drafter only asks for that chain (`device_chain`), keeps what the step
returned (`after_step`), and hands it out at the next `propose` if the sequence has not moved since.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxmodel.requests import SeqId
from jaxmodel.executor import RowResult

from .base import Draft, Drafter, DraftRequest


class MtpDrafter(Drafter):
    name = "mtp"

    def __init__(self, model):
        """model: the target `jaxmodel.model.Model`; it must have an MTP block."""
        if not model.has_mtp:
            raise ValueError(f"{model.path or 'the target model'} has no MTP block")
        self.ready: dict[SeqId, tuple[int, list[int]]] = {}  # seq -> (its length when drafted, drafts)

    def device_chain(self, seq_id: SeqId, n_next: int) -> int:
        return max(n_next, 0)

    def after_step(self, seq_id: SeqId, n_tokens: int, result: RowResult) -> None:
        if result.committed:
            self.ready[seq_id] = (n_tokens, list(result.next_drafts))

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        drafts = []
        for r in requests:
            n_tokens, tokens = self.ready.get(r.seq_id, (-1, []))
            drafts.append(Draft(tokens=tokens[: r.n_max] if n_tokens == len(r.tokens) else []))
        return drafts

    def observe(self, seq_id: SeqId, accepted: int, committed_tokens: Sequence[int]) -> None:
        """Nothing to roll back: the head rewrites chained positions when it catches up."""

    def release(self, seq_id: SeqId) -> None:
        self.ready.pop(seq_id, None)
