"""A small separate model of the same vocabulary as a drafter.

The draft model is hybrid too, so it keeps its own KV pages and GDN planes and rolls back the same way the target
does in snapshot mode: while drafting it writes the state after each fed token into a plane of its own, and after
verification the plane holding the state after the last accepted token becomes live. Committed tokens it has not
fed yet (the bonus token, and everything committed while another drafter was chosen) are fed at the start of its
next proposal, in the same call that yields draft 1.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from jaxmodel.gguf_io import open_gguf
from jaxmodel.model import Model
from jaxmodel.requests import SeqId
from jaxmodel.executor import Runtime, Shapes
from jaxmodel.state import Row

from .base import Draft, Drafter, DraftRequest

CATCH_UP_CHUNK = 128


def check_same_vocab(target_path: str, draft_path: str) -> None:
    """Raise ValueError naming both files unless their token lists are identical."""
    t_tokens = open_gguf(target_path).fields["tokenizer.ggml.tokens"]
    d_tokens = open_gguf(draft_path).fields["tokenizer.ggml.tokens"]
    t_list = [bytes(t_tokens.parts[i]) for i in t_tokens.data]
    d_list = [bytes(d_tokens.parts[i]) for i in d_tokens.data]
    if t_list != d_list:
        first = next((i for i, (a, b) in enumerate(zip(t_list, d_list)) if a != b), min(len(t_list), len(d_list)))
        raise ValueError(
            f"draft model {draft_path} has a different vocabulary from {target_path} "
            f"({len(d_list)} vs {len(t_list)} tokens, first difference at id {first})"
        )


class _Slot:
    def __init__(self, pages: list[int], planes: list[int]):
        self.pages = pages
        self.planes = planes
        self.live = 0  # plane holding the state after `fed` tokens (0: the null plane, nothing fed)
        self.fed = 0
        self.chain: list[int] = []  # planes written during the last proposal, one per fed token from `last` on
        self.proposed: list[int] = []
        self.last_position = 0  # position of `last` at the last proposal


class DraftModelDrafter(Drafter):
    name = "draft_model"

    def __init__(self, model: Model, *, max_seqs: int, max_context: int, n_max: int, page_size: int = 16):
        self.model = model
        self.n_max = n_max
        self.page_size = page_size
        pages_per_seq = -(-(max_context + n_max + 1) // page_size)
        planes_per_seq = n_max + 2
        shapes = Shapes(max_rows=max_seqs, max_tokens=CATCH_UP_CHUNK + 1, max_logit_rows=1, pages_per_row=pages_per_seq)
        self.runtime = Runtime(model, n_pages=1 + max_seqs * pages_per_seq, n_planes=1 + max_seqs * planes_per_seq,
                               page_size=page_size, shapes=shapes, n_chain_max=n_max)  # fmt: skip
        self.free_slots = [
            _Slot(
                list(range(1 + s * pages_per_seq, 1 + (s + 1) * pages_per_seq)),
                list(range(1 + s * planes_per_seq, 1 + (s + 1) * planes_per_seq)),
            )
            for s in range(max_seqs)
        ]
        self.slots: dict[SeqId, _Slot] = {}

    def warmup(self) -> Iterator[tuple[int, int]]:
        """Compile the draft model's chain and catch-up shapes, one per item."""
        return self.runtime.warmup_chain()

    def _spare(self, slot: _Slot) -> list[int]:
        return [p for p in slot.planes if p != slot.live]

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        live = []
        for r in requests:
            if r.n_max <= 0:
                continue
            slot = self.slots.get(r.seq_id)
            if slot is None and self.free_slots:
                slot = self.slots[r.seq_id] = self.free_slots.pop()
            if slot is not None:
                live.append((r, slot))
        while True:  # catch up long backlogs first, a chunk per call
            behind = [(r, s) for r, s in live if len(r.tokens) - 1 - s.fed > CATCH_UP_CHUNK]
            if not behind:
                break
            rows = []
            for r, s in behind:
                target = self._spare(s)[0]
                chunk = list(r.tokens[s.fed : s.fed + CATCH_UP_CHUNK])
                rows.append(Row(chunk, s.fed, s.pages, s.live, [-1] * (len(chunk) - 1) + [target]))
                s.live, s.fed = target, s.fed + len(chunk)
            self.runtime.forward(rows, prefill_only=True)
        if not live:
            return [Draft(tokens=[]) for _ in requests]
        rows = []
        for r, s in live:
            s.chain = self._spare(s)
            backlog = list(r.tokens[s.fed :])
            writes = [-1] * (len(backlog) - 1) + [s.chain[0]]
            rows.append(Row(backlog, s.fed, s.pages, s.live, writes, [len(backlog) - 1]))
            s.last_position = len(r.tokens) - 1
        chains = self.runtime.chain(rows, [s.chain for _, s in live], [min(r.n_max, self.n_max) for r, _ in live],
                                    [r.p_min for r, _ in live])  # fmt: skip
        drafts = {}
        for (r, s), chain in zip(live, chains):
            s.proposed = drafts[r.seq_id] = chain
        return [Draft(tokens=drafts.get(r.seq_id, [])) for r in requests]

    def observe(self, seq_id: SeqId, accepted: int, committed_tokens: Sequence[int]) -> None:
        """`accepted` of the last proposal were accepted: the state after `last` + those drafts becomes live
        (draft k itself was never fed, so at most k-1 of them are in a plane)."""
        slot = self.slots.get(seq_id)
        if slot is None or not slot.chain:
            return
        kept = min(accepted, max(len(slot.proposed) - 1, 0))
        slot.live = slot.chain[kept]
        slot.fed = slot.last_position + 1 + kept
        slot.chain, slot.proposed = [], []

    def release(self, seq_id: SeqId) -> None:
        slot = self.slots.pop(seq_id, None)
        if slot is not None:
            slot.live, slot.fed, slot.chain, slot.proposed = 0, 0, [], []
            self.free_slots.append(slot)
