"""The scheduler's vocabulary: requests in, step plans out, committed tokens back, events out.

Everything here is a frozen dataclass or a Protocol; the mutable bookkeeping lives in `scheduler.core`.

A plan row (`PlannedRow`) becomes the device's row (`jaxmodel.state.Row`) by `PlannedRow.device_row`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

from jaxmodel.requests import Rollback, Sampling, SeqId, SpeculativeConfig
from jaxmodel.state import Row

Mode = Literal["snapshot", "checkpoint", "replay"]  # the rollback mode a step runs in; a request may also ask for "auto"
FinishReason = Literal["stop", "length", "cancelled", "error"]

UNNAMED_DRAFTER = "unnamed"


class Detokenizer(Protocol):
    """Incremental detokenizer of one sequence's output (the real one wraps `tokenizers`)."""

    def add(self, token_id: int) -> str:
        """Feed one token; return the newly complete text (never half a UTF-8 character)."""
        ...

    def flush(self) -> str:
        """At the end of the sequence: whatever text is still held back (incomplete bytes rendered as-is)."""
        ...


@dataclass(frozen=True)
class GenerationRequest:
    """What `Engine.generate` takes: a prompt in token ids and how to continue it (checked as a `Request`).

    speculative: None for plain decoding.
    """

    prompt_ids: tuple[int, ...]
    max_tokens: int = 128
    sampling: Sampling = Sampling()
    stop: tuple[str, ...] = ()
    speculative: SpeculativeConfig | None = None


@dataclass(frozen=True)
class Request:
    """One generation request as the core sees it: a `GenerationRequest` with its sequence id and the engine's
    end-of-generation ids.

    prompt: token ids, at least one.
    stop_token_ids: end-of-generation ids (EOS and the like); such a token ends the sequence and is not emitted.
    stop_strings: the output text is cut before the first occurrence of any of them.
    sampling: passed through to the device step.
    speculative: drafters, draft bounds and rollback mode; None for plain decoding.
    """

    seq_id: SeqId
    prompt: tuple[int, ...]
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    sampling: Sampling = Sampling()
    speculative: SpeculativeConfig | None = None

    def __post_init__(self):
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
        object.__setattr__(self, "stop_token_ids", frozenset(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        if not self.prompt:
            raise ValueError(f"request {self.seq_id!r}: empty prompt")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.seq_id!r}: max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop_strings):
            raise ValueError(f"request {self.seq_id!r}: empty stop string")

    @property
    def n_max(self) -> int:
        """The longest draft this request may verify per step (0: plain decoding)."""
        return self.speculative.n_max if self.speculative else 0

    @property
    def rollback(self) -> Rollback:
        """The rollback mode the memory rule may use ("auto" lets it choose per step)."""
        return self.speculative.rollback if self.speculative else "auto"


@dataclass(frozen=True)
class PlannedRow:
    """One sequence's share of a step.

    The fed tokens are `tokens = fed + drafts` at positions start, start+1, ...; `fed` are committed tokens not yet
    computed (a prompt chunk, or replayed tokens followed by `last`, the newest committed token).
    read_plane: the GDN plane the row starts from (0 = the null plane of a fresh sequence).
    write_planes: per token, the plane that receives the state after it, or -1.
    pages: the sequence's KV pages in position order, covering every position this row may feed.
    logit_rows: token indices whose logits are wanted: from `last` to the end when the row reaches the newest
        committed token, none for an intermediate chunk.
    draft_max: the most drafts `StepPlan.with_drafts` accepts for this row (0: none).
    mode: the rollback mode of this step when it may carry drafts, else None.
    write_pool: planes the sequence may write this step (snapshot: draft_max + 1 of them; otherwise one).
    optimistic: in replay mode, the row writes the state after its last draft rather than after `last`
        (`scheduler.memory.replays_optimistically`; only rows with `last` as their only fed token).
    speculative: the request's speculative decoding (None: plain), carried with the row to the speculator.
    """

    seq_id: SeqId
    fed: tuple[int, ...]
    start: int
    read_plane: int
    pages: tuple[int, ...]
    needs_logits: bool
    draft_max: int
    mode: Mode | None
    write_pool: tuple[int, ...]
    drafts: tuple[int, ...] = ()
    drafter: str | None = None
    optimistic: bool = False
    speculative: SpeculativeConfig | None = None

    @property
    def tokens(self) -> tuple[int, ...]:
        """[n] the tokens fed: fed + drafts."""
        return self.fed + self.drafts

    @property
    def positions(self) -> tuple[int, ...]:
        """[n] consecutive positions of `tokens`."""
        return tuple(range(self.start, self.start + len(self.fed) + len(self.drafts)))

    @property
    def write_planes(self) -> tuple[int, ...]:
        """[n] the plane receiving the state after each token, -1 for none.

        Snapshot: the state after `last` and after every draft (len(drafts) + 1 planes). Replay: the state after
        `last`, which the device advances by the accepted drafts after verification. Otherwise (checkpoint,
        optimistic replay, a plain step, a prompt chunk): only the state after the final token; optimistic replay
        rebuilds it on device when a draft is rejected.
        """
        n = len(self.fed) + len(self.drafts)
        if self.mode == "snapshot":
            keep = len(self.drafts) + 1
            return (-1,) * (n - keep) + self.write_pool[:keep]
        if self.mode == "replay" and not self.optimistic:
            return (-1,) * (len(self.fed) - 1) + self.write_pool[:1] + (-1,) * len(self.drafts)
        return (-1,) * (n - 1) + self.write_pool[:1]

    @property
    def logit_rows(self) -> tuple[int, ...]:
        """Indices into `tokens` whose logits verification needs."""
        if not self.needs_logits:
            return ()
        return tuple(range(len(self.fed) - 1, len(self.fed) + len(self.drafts)))

    def device_row(self) -> Row:
        """The row as the device takes it: its tokens, positions, pages and planes."""
        return Row(self.tokens, self.start, self.pages, self.read_plane, self.write_planes, self.logit_rows)


@dataclass(frozen=True)
class StepPlan:
    """What one model step computes. Returned by `Scheduler.schedule`; drafts are attached with `with_drafts`."""

    step: int
    rows: tuple[PlannedRow, ...]
    # State the step's device call copies before its rows run, (source, target) pairs, every source read before any
    # target is written: cached prefixes into the planes and pages of the sequences starting from them, and states
    # kept for the prefix cache (`scheduler.prefix_cache`).
    plane_copies: tuple[tuple[int, int], ...] = ()
    page_copies: tuple[tuple[int, int], ...] = ()

    def row(self, seq_id: SeqId) -> PlannedRow:
        """The row of `seq_id` (KeyError when the sequence is not in this step)."""
        for r in self.rows:
            if r.seq_id == seq_id:
                return r
        raise KeyError(seq_id)

    @property
    def n_tokens(self) -> int:
        """Tokens fed in this step, drafts included."""
        return sum(len(r.fed) + len(r.drafts) for r in self.rows)

    def with_drafts(self, drafts: Mapping[SeqId, Sequence[int]],
                    drafters: Mapping[SeqId, str] | None = None) -> StepPlan:
        """A copy of the plan with each row's actual drafts (at most its draft_max, possibly empty) attached.

        drafters optionally names the drafter of each draft, for the per-drafter statistics of the done event.
        """
        by_id = {r.seq_id: r for r in self.rows}
        unknown = [s for s in drafts if s not in by_id]
        if unknown:
            raise ValueError(f"drafts for sequences not in step {self.step}: {unknown!r}")
        rows = []
        for r in self.rows:
            tokens = tuple(int(t) for t in drafts.get(r.seq_id, ()))
            if len(tokens) > r.draft_max:
                raise ValueError(f"sequence {r.seq_id!r}: {len(tokens)} drafts, at most {r.draft_max} allowed")
            name = (drafters or {}).get(r.seq_id, UNNAMED_DRAFTER) if tokens else None
            rows.append(replace(r, drafts=tokens, drafter=name))
        return replace(self, rows=tuple(rows))


@dataclass(frozen=True)
class DraftPlan:
    """What the drafter policy plans for a sequence's next step, before memory is granted for it: a draft of up to
    n_draft tokens, each accepted with probability alpha after the ones before (the policy's estimate for the
    drafter it chose). The scheduler grants pages and planes for it and may shorten it, never lengthen it."""

    n_draft: int
    alpha: float


@dataclass(frozen=True)
class Committed:
    """A verified row: `tokens` = the accepted drafts then one token sampled from the target."""

    tokens: tuple[int, ...]
    n_accepted: int

    def __post_init__(self):
        object.__setattr__(self, "tokens", tuple(map(int, self.tokens)))
        if not 0 <= self.n_accepted == len(self.tokens) - 1:
            raise ValueError(f"{len(self.tokens)} committed tokens for {self.n_accepted} accepted drafts")


@dataclass(frozen=True)
class Continued:
    """A later iteration the device ran for a row within the same step (`Scheduler.update`): it fed the previous
    iteration's last committed token and `drafts`, in snapshot mode over the row's planes, and committed
    `committed`. drafter: the drafter that made `drafts` (the one chaining on device)."""

    drafts: tuple[int, ...]
    committed: Committed
    drafter: str | None = None


@dataclass(frozen=True)
class TokensEvent:
    """New output: token ids as committed and the text now safe to show (text may lag ids near stop strings)."""

    seq_id: SeqId
    token_ids: tuple[int, ...]
    text: str
    n_from_drafts: int


@dataclass(frozen=True)
class DraftStats:
    """Draft tokens verified and accepted, for one drafter over one request; drafts: the verify steps that fed its
    drafts, accepted_per_position: how many of them had their draft token at each position (0, 1, ...) accepted."""

    drafted: int
    accepted: int
    drafts: int = 0
    accepted_per_position: tuple[int, ...] = ()


@dataclass(frozen=True)
class DoneEvent:
    """The last event of a sequence.

    completion_tokens counts every generated token, a final stop token included (which is not emitted).
    rollback_steps counts verify steps (steps that fed at least one draft) per rollback mode.
    error: with finish_reason "error", what failed (for the client and the log).
    """

    seq_id: SeqId
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    drafters: Mapping[str, DraftStats] = field(default_factory=dict)
    rollback_steps: Mapping[str, int] = field(default_factory=dict)
    preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens taken over from the prefix cache (`scheduler.prefix_cache`)
    error: str | None = None


Event = TokensEvent | DoneEvent
