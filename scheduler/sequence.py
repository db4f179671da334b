"""One request's bookkeeping inside the scheduler (`SequenceState`): its committed tokens, what is computed, its
pages and planes; how a verified step moves it on (`advance`), how committed tokens are appended up to a stop
(`append`), and the row it feeds next (`planned_row`). Private to `scheduler.core`, which owns the queues and the
memory."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .prefix_cache import chain_hashes
from .stops import scan_stop_strings
from .types import (UNNAMED_DRAFTER, Committed, Continued, Detokenizer, DoneEvent, DraftStats, FinishReason, Mode,
                    PlannedRow, Request)


@dataclass(eq=False)
class Burst:
    """What one row's step committed, gathered over its iterations into one tokens event (`SequenceState.append`)."""

    ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    n_from_drafts: int = 0
    reason: FinishReason | None = None


@dataclass(eq=False)
class SequenceState:
    """Mutable bookkeeping of one request (compared by identity)."""

    request: Request
    detokenizer: Detokenizer
    tokens: list[int] = field(default_factory=list)  # committed: prompt + output
    n_computed: int = 0  # tokens whose KV and GDN state are in pages / the live plane
    live_plane: int = 0  # 0 = the null plane (nothing computed)
    planes: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    admitted: int = -1  # admission order, -1 while waiting
    last_served: int = -1  # step of the last row
    n_generated: int = 0
    held_text: str = ""
    abort_requested: bool = False
    preemptions: int = 0
    draft_stats: dict[str, list[int]] = field(default_factory=dict)  # drafter -> [drafted, accepted, drafts]
    accepted_at: dict[str, list[int]] = field(default_factory=dict)  # drafter -> accepted drafts per position
    rollback_steps: dict[str, int] = field(default_factory=lambda: {"snapshot": 0, "checkpoint": 0, "replay": 0})
    cached_tokens: int = 0  # prompt tokens its last admission took from the prefix cache
    save_points: list[int] = field(default_factory=list)  # positions whose state goes to the prefix cache, ascending
    block_hashes: list[int] = field(default_factory=list)  # `prefix_cache.chain_hashes` of its tokens, as far as known

    @property
    def running(self) -> bool:
        return self.admitted >= 0

    @property
    def to_compute(self) -> int:
        return len(self.tokens) - self.n_computed

    def hashes(self, page_size: int) -> list[int]:
        """The chain hash after each full block of its tokens (`prefix_cache.chain_hashes`)."""
        if len(self.block_hashes) < len(self.tokens) // page_size:
            self.block_hashes = chain_hashes(self.tokens, page_size, self.block_hashes)
        return self.block_hashes

    def planned_row(self, n_feed: int, draft_max: int, mode: Mode | None, optimistic: bool) -> PlannedRow:
        """The row feeding the next n_feed tokens, with room for draft_max drafts in `mode`."""
        spare = [p for p in self.planes if p != self.live_plane]
        n_write = draft_max + 1 if mode == "snapshot" else 1
        return PlannedRow(seq_id=self.request.seq_id, fed=tuple(self.tokens[self.n_computed:self.n_computed + n_feed]),
                          start=self.n_computed, read_plane=self.live_plane, pages=tuple(self.pages),
                          needs_logits=n_feed == self.to_compute, draft_max=draft_max, mode=mode,
                          write_pool=tuple(spare[:n_write]), optimistic=optimistic,
                          speculative=self.request.speculative)

    def advance(self, mode: Mode, start: int, n_fed: int, write_pool: tuple[int, ...], n_drafts: int,
                n_accepted: int, drafter: str | None) -> None:
        """Move the live plane and n_computed after a verified step of n_fed tokens from `start` and n_drafts
        drafts, of which n_accepted were accepted (also each later iteration of a looping call, which feeds one
        token and builds no `PlannedRow`). The planes are `PlannedRow.write_planes`: snapshot wrote the state after
        `last` and each draft to write_pool in turn; replay rebuilt its plane on device; otherwise the one plane
        holds the state after every token fed, valid only when every draft was accepted. Tokens are appended by
        `append`."""
        if mode == "snapshot":
            self.live_plane = write_pool[n_accepted]
            self.n_computed = start + n_fed + n_accepted
        elif mode == "replay":
            self.live_plane = write_pool[0]
            self.n_computed = start + n_fed + n_accepted
        elif n_accepted == n_drafts:
            self.live_plane = write_pool[0]
            self.n_computed = start + n_fed + n_drafts
        if n_drafts:
            stats = self.draft_stats.setdefault(drafter, [0, 0, 0])
            stats[0] += n_drafts
            stats[1] += n_accepted
            stats[2] += 1
            positions = self.accepted_at.setdefault(drafter, [])
            positions += [0] * (n_drafts - len(positions))
            for i in range(n_accepted):
                positions[i] += 1
            self.rollback_steps[mode] += 1

    def follow(self, row: PlannedRow, later: Sequence[Continued], burst: Burst, max_model_len: int) -> bool:
        """Advance and append a row's later iterations (of the same device call) into `burst`; True when one
        finished the sequence (the iterations after it are not the sequence's). Each iteration read the live plane
        and wrote into the row's planes (its read plane, then its write pool) minus the live one, in that order."""
        planes = (row.read_plane,) + row.write_pool
        mode = "snapshot" if len(row.write_pool) > 1 else row.mode
        for iteration in later:
            n_drafts = len(iteration.drafts)
            pool = tuple(p for p in planes if p != self.live_plane)[: len(row.write_pool)]
            self.advance(mode, start=len(self.tokens) - 1, n_fed=1, write_pool=pool, n_drafts=n_drafts,
                         n_accepted=iteration.committed.n_accepted,
                         drafter=(iteration.drafter or row.drafter or UNNAMED_DRAFTER) if n_drafts else None)
            if self.append(iteration.committed, burst, max_model_len):
                return True
        return False

    def done(self, reason: FinishReason, error: str | None = None) -> DoneEvent:
        """The event that ends the sequence."""
        return DoneEvent(
            seq_id=self.request.seq_id, finish_reason=reason, prompt_tokens=len(self.request.prompt),
            completion_tokens=self.n_generated,
            drafters={name: DraftStats(d, a, n, tuple(self.accepted_at[name]))
                      for name, (d, a, n) in self.draft_stats.items()},
            rollback_steps=dict(self.rollback_steps), preemptions=self.preemptions, error=error,
            cached_tokens=self.cached_tokens)

    def append(self, result: Committed, burst: Burst, max_model_len: int) -> bool:
        """Append one verified row's tokens to the sequence and to `burst`, up to a stop; True when that finished
        the sequence (`burst.reason` says why)."""
        req = self.request
        n_ids = len(burst.ids)
        reason: FinishReason | None = None
        cut_by_stop_string = False
        for token in result.tokens:
            self.n_generated += 1
            self.tokens.append(token)
            if token in req.stop_token_ids:
                reason = "stop"
                break
            burst.ids.append(token)
            if req.stop_strings:
                scan = scan_stop_strings(self.held_text + self.detokenizer.add(token), req.stop_strings)
                burst.text.append(scan.emit)
                self.held_text = scan.held
                if scan.stopped:
                    reason, cut_by_stop_string = "stop", True
                    break
            else:
                burst.text.append(self.detokenizer.add(token))
            if self.n_generated == req.max_tokens or len(self.tokens) == max_model_len:
                reason = "length"
                break
        burst.n_from_drafts += min(result.n_accepted, len(burst.ids) - n_ids)
        if reason is not None and not cut_by_stop_string:
            # The end of the output: held-back text is no stop string after all, unless the flush completes one.
            scan = scan_stop_strings(self.held_text + self.detokenizer.flush(), req.stop_strings)
            burst.text.append(scan.emit if scan.stopped else scan.emit + scan.held)
            reason = "stop" if scan.stopped else reason
        burst.reason = reason
        return reason is not None


@dataclass(eq=False)
class RowSpec:
    """A sequence's row while a step is planned: the tokens it feeds, then the drafts and mode memory grants it."""

    seq: SequenceState
    n_feed: int
    draft_max: int = 0
    mode: Mode | None = None
    optimistic: bool = False

    def planned_row(self) -> PlannedRow:
        return self.seq.planned_row(self.n_feed, self.draft_max, self.mode, self.optimistic)
