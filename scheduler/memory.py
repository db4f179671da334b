"""The memory budget: free lists of KV pages and GDN planes, the replay pool, and the per-step rollback/draft
decision.

Pools. Page 0 (trash) and plane 0 (null) are never handed out, so a pool of n_pages pages has n_pages - 1
allocatable ones, likewise planes. Every running sequence holds two planes for its whole life (the live plane and
a spare to write into), and KV pages for the positions it has fed. A snapshot step borrows extra planes that the
scheduler returns when the step is committed. The replay pool (`PoolSizes.replay_tokens` draft tokens for each row
of a step) is set aside from the budget once (`pool_sizes`); a replay row uses its row's slot and nothing else.

The rule (`decide_drafts`), per step, over the sequences whose row may carry drafts, in scheduling priority order:

1. Draft length. Each sequence gets d = min(what it asks, the step's remaining token budget, what fits in its
   pages plus the free pages); budget and pages are consumed in priority order. What it asks is the drafter
   policy's plan, made before memory is granted: the policy's draft decision comes first.
2. Mode: the cheapest that fits. Snapshot needs d + 1 planes to write besides the one it reads, i.e. `d + 1 - spare`
   extra planes, and costs writing d more GDN states than the other modes do (`RollbackCosts.plane_write_seconds`,
   timed at calibration per batch bucket in planes the engine lends while idle; a state is tens of megabytes at
   real shapes). Replay and checkpoint need no plane beyond the two a sequence holds.
   Replay costs the rebuild of the rows whose written state turns out wrong: a row writes the state after `last`
   (wrong when a draft is accepted, chance alpha) or, optimistically, after its last draft (wrong when one is
   rejected, 1 - alpha^d), whichever is likelier right (`replays_optimistically`; only without replayed tokens).
   The device rebuilds the wrong rows in passes (one row per pass on CPU where a row's state is large, so that a
   pass costs what its row does; otherwise all of the step's rows in one), each pass timed at calibration
   (`RollbackCosts.rebuild_seconds`, `expected_rebuild`). Checkpoint
   costs the tokens it replays next step: with per-token acceptance alpha (the policy's estimate), d drafts and p
   replayed tokens before `last`, it replays p + 1 + k tokens when k < d drafts are accepted and nothing when all
   are (`expected_replay = sum_{k<d} alpha^k (1 - alpha) (p + 1 + k)` in expectation). Steps are padded to a few
   compiled lengths, so what those tokens cost is the longer step they cause when the next step's row (p + 2 + k + d
   tokens instead of 1 + d) crosses a compiled length: `RollbackCosts.checkpoint`, from measured step times (until
   measured: the expected replayed tokens at the target's per-token cost). Replayed tokens also pile up: a
   checkpoint row keeps its read plane until a step keeps all its drafts, so after a rejection it has p + 1 + k
   replayed tokens, and a row with more than its request's n_max of them may not draft. Checkpoint is charged those
   forbidden draft steps too, at the rate a row that always checkpoints meets them (a Markov chain over p:
   `forbidden_draft_rate`), each worth the accepted drafts it would have yielded at the measured step's time per
   token.
   - rollback="checkpoint": checkpoint.
   - rollback="snapshot": snapshot; when the free planes do not cover d, the draft is shortened until they do
     (d = 0 always fits). These go first: they were promised.
   - rollback="replay": replay, the draft cut to the replay pool's tokens.
   - rollback="auto": the sequences that may snapshot are ranked by the expected replayed tokens snapshot saves
     per extra plane, and taken in that order while planes remain. The rest replay when the rebuild passes they
     add (to those of the step's forced replay rows) cost less than what their checkpoints would together cost
     next step, and checkpoint otherwise (without a replay pool they checkpoint). Of the ranked sequences,
     snapshot goes to the leading ones for which its writes plus the rest's mode cost least (all of them when
     writes are free: snapshot is then the cheapest mode where it fits).
   `reserve_planes` is kept free for the admission of waiting requests, so borrowed planes never keep a new
   request queued.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from drafters.policy import expected_accepted
from jaxmodel.requests import Rollback

from .types import Mode, SeqId


@dataclass(frozen=True)
class PoolSizes:
    """Pool sizes, the trash page and the null plane included."""

    n_pages: int
    n_planes: int
    page_size: int  # tokens per KV page
    replay_tokens: int = 0  # the longest draft a replay row may verify (the replay pool's tokens per row; 0: none)

    def __post_init__(self):
        if self.page_size < 1 or self.n_pages < 2 or self.n_planes < 3 or self.replay_tokens < 0:
            raise ValueError(f"pools too small: {self} (need page_size >= 1, n_pages >= 2, n_planes >= 3)")


def pool_sizes(total_bytes: int, *, page_bytes: int, plane_bytes: int, page_size: int, max_running: int,
               planes_per_seq: int = 2, replay_tokens: int = 0, replay_token_bytes: int = 0,
               backlog_bytes: int = 0, extra_planes: int = 0) -> PoolSizes:
    """Spend `total_bytes` on the replay pool (max_running rows of replay_tokens tokens, replay_token_bytes each),
    the MTP head's backlog (backlog_bytes), 1 + max_running * planes_per_seq + extra_planes planes and the rest on
    KV pages.

    page_bytes / plane_bytes: bytes of one KV page (all attention layers, K and V) and one GDN plane (all GDN
    layers, conv and recurrent state); `jaxmodel.state` computes both from a model config, and a token's replay
    record (`replay_bytes_per_token`). planes_per_seq = 2 lets every sequence run in checkpoint or replay mode;
    2 + n_max lets every sequence snapshot a full draft at once.
    """
    if planes_per_seq < 2:
        raise ValueError(f"planes_per_seq must be >= 2, got {planes_per_seq}")
    n_planes = 1 + max_running * planes_per_seq + extra_planes
    replay_bytes = max_running * replay_tokens * replay_token_bytes
    n_pages = (total_bytes - replay_bytes - backlog_bytes - n_planes * plane_bytes) // page_bytes
    if n_pages < 2:
        raise ValueError(f"{total_bytes} bytes do not hold a replay pool of {replay_bytes} bytes, an MTP backlog "
                         f"of {backlog_bytes} bytes, {n_planes} planes of {plane_bytes} bytes and 2 pages of "
                         f"{page_bytes} bytes")
    return PoolSizes(n_pages=int(n_pages), n_planes=n_planes, page_size=page_size, replay_tokens=replay_tokens)


def pages_for(n_positions: int, page_size: int) -> int:
    """KV pages covering positions [0, n_positions)."""
    return -(-n_positions // page_size)


def expected_replay(alpha: float, n_drafts: int, n_pending: int) -> float:
    """Expected tokens a checkpoint step replays next step (and a snapshot step does not).

    alpha: per-token acceptance probability; k drafts are accepted with probability alpha^k (1 - alpha) for k < d.
    """
    return sum(alpha**k * (1.0 - alpha) * (n_pending + 1 + k) for k in range(n_drafts))


def replays_optimistically(alpha: float, n_drafts: int, n_pending: int) -> bool:
    """Whether a replay row writes the state after its last draft (optimistic) rather than after `last`
    (`jaxmodel.speculative.ReplayInputs`): its plane is then wrong, and rebuilt, when a draft is rejected
    (1 - alpha^d) instead of when one is accepted (alpha), so it is taken when that is the likelier to be right.
    Only rows without replayed tokens before `last` may (the rebuild starts from the read plane at `last`).

    >>> replays_optimistically(0.9, 4, 0), replays_optimistically(0.6, 4, 0), replays_optimistically(0.9, 4, 2)
    (True, False, False)
    """
    return n_pending == 0 and n_drafts > 0 and alpha**n_drafts >= 1.0 - alpha


def replay_plane_wrong(optimistic: bool, n_drafts: int, n_accepted: int) -> bool:
    """Whether a replay row's written plane was wrong after verification, and rebuilt: an optimistic row's when a
    draft was rejected, a forward row's when one was accepted."""
    return n_accepted < n_drafts if optimistic else n_accepted > 0


def rebuild_chance(alpha: float, n_drafts: int, n_pending: int) -> float:
    """The chance that a replay row's plane is wrong after verification and is rebuilt (see
    `replays_optimistically`)."""
    if replays_optimistically(alpha, n_drafts, n_pending):
        return 1.0 - alpha**n_drafts
    return alpha if n_drafts > 0 else 0.0


@dataclass(frozen=True)
class RollbackCosts:
    """What the non-snapshot modes cost, in seconds (the engine measures them; any unit works if shared).

    rebuild_seconds: one pass of the replay rebuild, which covers rebuild_rows rows (0: every row of the step): a
        step runs as many passes as its wrong planes need (`expected_rebuild`).
    step_seconds: ((tokens per row, seconds), ...) ascending: a step of this many rows at each compiled length
        (steps are padded to these lengths, so a step costs the smallest one that holds its longest row). What a
        checkpoint's replayed tokens cost is the longer next step they cause. Empty: not measured.
    token_seconds: a token fed to the target, for replayed tokens where step_seconds does not tell.
    plane_write_seconds: a GDN state written into a plane; a snapshot row writes d more of them than a row in the
        other modes (0: not measured, or free).
    """

    token_seconds: float = 1.0
    rebuild_seconds: float = 1.0
    step_seconds: tuple[tuple[int, float], ...] = ()
    plane_write_seconds: float = 0.0
    rebuild_rows: int = 0

    def expected_rebuild(self, chances: Sequence[float]) -> float:
        """Expected seconds of the rebuild passes for replay rows each wrong with its chance: rebuild_seconds
        times the expected passes, ceil(wrong rows / rebuild_rows), one at most when a pass covers every row.

        >>> RollbackCosts(rebuild_seconds=2.0, rebuild_rows=1).expected_rebuild([0.5, 0.5])  # 2 x 0.5 passes
        2.0
        >>> RollbackCosts(rebuild_seconds=2.0).expected_rebuild([0.5, 0.5])  # one pass unless neither is wrong
        1.5
        """
        rest = RestCost(self, replay_tokens=0)
        for p in chances:
            rest.add_chance(p)
        return rest.rebuild_seconds()

    def rest(self, rows: Sequence[tuple[float, int, int, int | None]], replay_tokens: int,
             replaying: Sequence[float] = ()) -> tuple[Mode | None, float]:
        """The mode rows of (alpha, d, p, pending_max) that do not snapshot take together, and its expected
        seconds: replay when the rebuild passes they add to those of the step's forced replay rows (`replaying`:
        their `rebuild_chance`s) cost less than their checkpoints would, else checkpoint; replay needs a replay
        pool (replay_tokens > 0). `RestCost` computes it one row at a time."""
        rest = RestCost(self, replay_tokens, replaying)
        for r in rows:
            rest.add(r)
        return rest.cost()

    def step(self, n_tokens: int) -> float | None:
        """Seconds of a step whose longest row feeds n_tokens tokens (None: no measured length holds it)."""
        return next((seconds for length, seconds in self.step_seconds if length >= n_tokens), None)

    def checkpoint(self, rows: Sequence[tuple[float, int, int, int | None]]) -> float:
        """Expected seconds checkpoint rollback costs the next step, for rows of (alpha, d, p, pending_max).

        A checkpoint row that keeps k < d drafts replays p + 1 + k tokens at the front of its next step, which
        then feeds up to p + 2d + 1 tokens instead of the 1 + d of a row that rolled back by a plane: the step
        is padded to a longer compiled length when that crosses one, once for all rows. So: the chance that some
        row replays, times the largest such lengthening. Without measured lengths: the expected replayed tokens
        at token_seconds each. Plus, per row, the draft steps its replayed tokens forbid once they exceed
        pending_max (None: no limit; see `lost_draft_seconds`)."""
        rest = RestCost(self, replay_tokens=0)
        for r in rows:
            rest.add(r)
        return rest.checkpoint_seconds()

    def lost_draft_seconds(self, alpha: float, d: int, pending_max: int | None) -> float:
        """Expected seconds per step that checkpoint rollback loses to draft steps its replayed tokens forbid.

        A checkpoint row keeps its read plane until a step keeps all d drafts; keeping k < d of them leaves
        p + 1 + k replayed tokens, and more than pending_max of them forbid a draft: that step yields 1 token
        instead of 1 + sum_{i=1..d} alpha^i, in about a verify step's time (the measured 1 + d token step; until
        measured, 1 + d tokens at token_seconds each), and resets p to 0. The charge is per drafting step, at the
        rate a row that always checkpoints loses such steps (`forbidden_draft_rate`), since one step's choice
        leads to the next's replayed tokens. None: no limit."""
        if pending_max is None or d == 0:
            return 0.0
        accepted = expected_accepted(alpha, d)
        step = self.step(1 + d)
        step = (1 + d) * self.token_seconds if step is None else step
        return forbidden_draft_rate(round(alpha, 3), d, pending_max) * step * accepted / (1.0 + accepted)


@functools.lru_cache(maxsize=4096)
def forbidden_draft_rate(alpha: float, d: int, pending_max: int) -> float:
    """Forbidden draft steps per drafting step of a row that always checkpoints, in the long run.

    A Markov chain over p, the replayed tokens before `last` at a drafting step (0..pending_max): all d drafts kept
    (alpha^d): p -> 0; k < d kept (alpha^k (1 - alpha)): p -> p + 1 + k, or, past pending_max, a step without
    drafts and then p -> 0. Returns the stationary chance of the latter per drafting step.

    With alpha = 0.5, d = 2 and pending_max = 2: from p = 0 a step leaves p = 0, 1 or 2 (1/4, 1/2, 1/4); from
    p = 1 keeping a draft overflows (1/4); from p = 2 any rejection does (3/4). The chain spends 1/2, 1/4 and 1/4 of
    its steps at p = 0, 1, 2, so 1/4 * 1/4 + 1/4 * 3/4 = 1/4 of drafting steps are followed by a forbidden one
    (per episode from p = 0: visits 1, 1/2, 1/2, overflows 1/2):

    >>> round(forbidden_draft_rate(0.5, 2, 2), 6)
    0.25
    """
    # Each episode starts at p = 0 and ends at a full acceptance or an overflow; p only grows within it, so one
    # pass in order of p gives each state's expected visits per episode.
    keep = [alpha**k * (1.0 - alpha) for k in range(d)]
    visits = [1.0] + [0.0] * pending_max
    overflows = 0.0
    for p in range(pending_max + 1):
        for k, q in enumerate(keep):
            if p + 1 + k <= pending_max:
                visits[p + 1 + k] += visits[p] * q
            else:
                overflows += visits[p] * q
    return overflows / sum(visits)



class RestCost:
    """`RollbackCosts.rest` of a set of rows built one row at a time, each addition O(1) (O(rows) when a rebuild
    pass covers more than one row and not all), so that `decide_drafts` weighs every split of its auto rows
    between snapshot and the rest in O(rows^2) rather than O(rows^3).

    >>> rest = RestCost(RollbackCosts(rebuild_seconds=1.0, step_seconds=((4, 1.0), (8, 3.0))), replay_tokens=3)
    >>> rest.cost()  # no rows
    (None, 0.0)
    >>> rest.add((0.5, 3, 0, None)); rest.cost()  # rebuilt with chance 0.5 against a longer step with 1 - 1/8
    ('replay', 0.5)
    """

    def __init__(self, costs: RollbackCosts, replay_tokens: int, replaying: Sequence[float] = ()):
        self.costs, self.replay_tokens = costs, replay_tokens
        self.n_rows = 0
        # checkpoint's terms: forbidden draft steps, the longest lengthening of the next step and the chance that
        # no row replays, or (some length unmeasured) the expected replayed tokens
        self.lost = 0.0
        self.unmeasured = False
        self.longest_jump = 0.0
        self.none_replays = 1.0
        self.replayed_tokens = 0.0
        # replay's terms: the rebuild's chances, the forced replay rows' first (`base_passes`: their passes alone)
        self.n_chances = 0
        self.sum_chances = 0.0
        self.none_wrong = 1.0
        self.wrong = [1.0]  # wrong[n]: the chance that n rows are wrong (kept only for passes of several rows)
        for p in replaying:
            self.add_chance(p)
        self.base_passes = self.rebuild_seconds()

    def add_chance(self, p: float) -> None:
        """A replay row wrong with chance p."""
        self.n_chances += 1
        self.sum_chances += p
        self.none_wrong *= 1.0 - p
        if self.costs.rebuild_rows > 1:
            w = self.wrong
            self.wrong = [w[0] * (1.0 - p)] + [w[n] * (1.0 - p) + w[n - 1] * p for n in range(1, len(w))] + [w[-1] * p]

    def add(self, row: tuple[float, int, int, int | None]) -> None:
        """One more row of (alpha, d, p, pending_max) in the rest."""
        alpha, d, p, pending_max = row
        costs = self.costs
        self.n_rows += 1
        self.lost += costs.lost_draft_seconds(alpha, d, pending_max)
        longer, shorter = costs.step(p + 2 * d + 1), costs.step(1 + d)
        if longer is None or shorter is None:
            self.unmeasured = True
        else:
            self.longest_jump = max(self.longest_jump, longer - shorter)
        self.none_replays *= alpha**d
        self.replayed_tokens += expected_replay(alpha, d, p)
        self.add_chance(rebuild_chance(alpha, min(d, self.replay_tokens), p))

    def rebuild_seconds(self) -> float:
        """Expected seconds of the rebuild passes of every chance added (`RollbackCosts.expected_rebuild`)."""
        costs = self.costs
        if costs.rebuild_rows == 1:
            passes = self.sum_chances
        elif costs.rebuild_rows <= 0:  # one pass covers every row
            passes = 1.0 - self.none_wrong
        else:
            passes = sum(q * -(-n // costs.rebuild_rows) for n, q in enumerate(self.wrong))
        return costs.rebuild_seconds * passes

    def checkpoint_seconds(self) -> float:
        """`RollbackCosts.checkpoint` of the rows added."""
        if self.n_rows == 0 or self.unmeasured:
            return self.lost + self.replayed_tokens * self.costs.token_seconds
        return self.lost + (1.0 - self.none_replays) * self.longest_jump

    def cost(self) -> tuple[Mode | None, float]:
        """The rows' mode and expected seconds (`RollbackCosts.rest`)."""
        if self.n_rows == 0:
            return None, 0.0
        checkpoint = self.checkpoint_seconds()
        replay = max(self.rebuild_seconds() - self.base_passes, 0.0)
        if self.replay_tokens > 0 and replay < checkpoint:
            return "replay", replay
        return "checkpoint", checkpoint


@dataclass(frozen=True)
class DraftCandidate:
    """A row that may carry drafts this step."""

    seq_id: SeqId
    want: int  # the longest draft the sequence can use (n_max, capped by max_tokens and the context length)
    preference: Rollback
    kv_end: int  # positions covered by the row without drafts (start + fed tokens)
    pages_owned: int
    spare_planes: int  # planes the sequence holds besides the one the row reads
    n_pending: int  # replayed tokens before `last` in the row
    alpha: float  # the sequence's per-token acceptance estimate
    pending_max: int | None = None  # the most replayed tokens with which the row may still draft (its n_max)


@dataclass(frozen=True)
class DraftDecision:
    """mode is None when no draft fits (n_drafts = 0). optimistic: a replay row writes the state after its last
    draft (`replays_optimistically`)."""

    seq_id: SeqId
    mode: Mode | None
    n_drafts: int
    new_pages: int
    new_planes: int
    optimistic: bool = False


def decide_drafts(candidates: Sequence[DraftCandidate], *, token_budget: int, free_pages: int, free_planes: int,
                  page_size: int, replay_tokens: int = 0,
                  costs: RollbackCosts = RollbackCosts()) -> tuple[DraftDecision, ...]:
    """The rule in the module docstring; candidates in priority order, decisions in the same order.

    replay_tokens: the longest draft a replay row may verify (0: no replay pool)."""

    def new_pages(c: DraftCandidate, d: int) -> int:
        return max(0, pages_for(c.kv_end + d, page_size) - c.pages_owned)

    def extra_planes(c: DraftCandidate, d: int) -> int:
        return max(0, d + 1 - c.spare_planes)

    lengths: dict[int, int] = {}
    for i, c in enumerate(candidates):
        room = (c.pages_owned + free_pages) * page_size - c.kv_end
        d = max(0, min(c.want, token_budget, room))
        lengths[i] = d
        token_budget -= d
        free_pages -= new_pages(c, d)

    modes: dict[int, Mode | None] = {i: None for i in lengths}
    for i, c in enumerate(candidates):
        if c.preference == "snapshot" and lengths[i] > 0:
            d = min(lengths[i], max(0, c.spare_planes + free_planes - 1))
            free_pages += new_pages(c, lengths[i]) - new_pages(c, d)
            lengths[i] = d
            if d > 0:
                modes[i] = "snapshot"
                free_planes -= extra_planes(c, d)
        elif c.preference == "checkpoint" and lengths[i] > 0:
            modes[i] = "checkpoint"
        elif c.preference == "replay" and lengths[i] > 0:
            d = min(lengths[i], replay_tokens)
            free_pages += new_pages(c, lengths[i]) - new_pages(c, d)
            lengths[i] = d
            if d > 0:
                modes[i] = "replay"

    def saving_per_plane(i: int) -> float:
        c, d = candidates[i], lengths[i]
        extra = extra_planes(c, d)
        return float("inf") if extra == 0 else expected_replay(c.alpha, d, c.n_pending) / extra

    def row(i: int) -> tuple[float, int, int, int | None]:
        return candidates[i].alpha, lengths[i], candidates[i].n_pending, candidates[i].pending_max

    auto = [i for i, c in enumerate(candidates) if c.preference == "auto" and lengths[i] > 0]
    fits = []  # the auto rows that may snapshot, best saving first, while planes remain
    for i in sorted(auto, key=lambda i: (-saving_per_plane(i), i)):
        extra = extra_planes(candidates[i], lengths[i])
        if extra <= free_planes:
            fits.append(i)
            free_planes -= extra
    # The rest replay or checkpoint together: the longer step checkpoints cause is paid once, and so may a rebuild
    # pass be. So snapshot goes to the prefix of `fits` for which its writes plus the rest's mode cost least (the
    # longest on ties).
    replaying = [rebuild_chance(c.alpha, lengths[i], c.n_pending) for i, c in enumerate(candidates)
                 if modes[i] == "replay"]  # fmt: skip
    rest_cost = RestCost(costs, replay_tokens, replaying)
    fitted = set(fits)
    for i in auto:
        if i not in fitted:
            rest_cost.add(row(i))
    writes = [0.0]  # writes[n]: the states the first n of `fits` write
    for i in fits:
        writes.append(writes[-1] + lengths[i] * costs.plane_write_seconds)
    mode, seconds = rest_cost.cost()
    n_snapshot, least = len(fits), writes[-1] + seconds
    if costs.plane_write_seconds > 0:  # otherwise snapshot is the cheapest mode wherever it fits
        for n in range(len(fits) - 1, -1, -1):
            rest_cost.add(row(fits[n]))
            rest_mode, seconds = rest_cost.cost()
            if writes[n] + seconds < least:
                n_snapshot, least, mode = n, writes[n] + seconds, rest_mode
    for i in fits[:n_snapshot]:
        modes[i] = "snapshot"
    snapshots = set(fits[:n_snapshot])
    rest = [i for i in auto if i not in snapshots]
    for i in rest:
        if mode == "replay":
            d = min(lengths[i], replay_tokens)
            free_pages += new_pages(candidates[i], lengths[i]) - new_pages(candidates[i], d)
            lengths[i] = d
        modes[i] = mode

    out = []
    for i, c in enumerate(candidates):
        d = lengths[i] if modes[i] else 0
        extra = extra_planes(c, d) if modes[i] == "snapshot" else 0
        optimistic = modes[i] == "replay" and replays_optimistically(c.alpha, d, c.n_pending)
        out.append(DraftDecision(c.seq_id, modes[i], d, new_pages(c, d), extra, optimistic))
    return tuple(out)


class MemoryManager:
    """Owns the free lists of pages and planes; grants and takes them back, refusing double frees.

    A page may be shared (`share_pages`): it holds the KV of positions every holder has computed alike (the prefix
    cache's blocks), and returns to the free list when its last holder gives it back. Planes are never shared.
    """

    def __init__(self, sizes: PoolSizes):
        self.sizes = sizes
        # Lowest ids are handed out first (pop from the end), which keeps traces readable.
        self._free_pages = list(range(sizes.n_pages - 1, 0, -1))
        self._free_planes = list(range(sizes.n_planes - 1, 0, -1))
        self._page_holders: dict[int, int] = {}  # page -> how many hold it
        self._planes_out: set[int] = set()

    @property
    def page_size(self) -> int:
        """Tokens per KV page."""
        return self.sizes.page_size

    @property
    def free_pages(self) -> int:
        """Pages not held by any sequence."""
        return len(self._free_pages)

    @property
    def free_planes(self) -> int:
        """Planes not held by any sequence."""
        return len(self._free_planes)

    @property
    def usable_pages(self) -> int:
        """All allocatable pages (the trash page excluded)."""
        return self.sizes.n_pages - 1

    @property
    def usable_planes(self) -> int:
        """All allocatable planes (the null plane excluded)."""
        return self.sizes.n_planes - 1

    def take_pages(self, n: int) -> list[int]:
        """n free pages, each with one holder; ValueError when fewer are free."""
        if n > len(self._free_pages):
            raise ValueError(f"{n} pages wanted, {len(self._free_pages)} free")
        taken = [self._free_pages.pop() for _ in range(n)]
        self._page_holders.update(dict.fromkeys(taken, 1))
        return taken

    def share_pages(self, pages: Iterable[int]) -> list[int]:
        """One more holder for each of `pages` (held already); returns them."""
        pages = list(pages)
        for page in pages:
            if page not in self._page_holders:
                raise ValueError(f"page {page} shared but not handed out")
        for page in pages:
            self._page_holders[page] += 1
        return pages

    def holders(self, page: int) -> int:
        """How many hold `page` (0: free)."""
        return self._page_holders.get(page, 0)

    def take_planes(self, n: int) -> list[int]:
        """n free planes; ValueError when fewer are free."""
        if n > len(self._free_planes):
            raise ValueError(f"{n} planes wanted, {len(self._free_planes)} free")
        taken = [self._free_planes.pop() for _ in range(n)]
        self._planes_out.update(taken)
        return taken

    def give_pages(self, pages: Iterable[int]) -> None:
        """One holder fewer for each of `pages`; a page nobody holds returns to the pool."""
        for page in pages:
            held = self._page_holders.get(page)
            if held is None:
                raise ValueError(f"page {page} returned but not handed out")
            if held > 1:
                self._page_holders[page] = held - 1
            else:
                del self._page_holders[page]
                self._free_pages.append(page)

    def give_planes(self, planes: Iterable[int]) -> None:
        """Return planes to the pool."""
        for plane in planes:
            if plane not in self._planes_out:
                raise ValueError(f"plane {plane} returned but not handed out")
            self._planes_out.remove(plane)
            self._free_planes.append(plane)

    def decide_drafts(self, candidates: Sequence[DraftCandidate], token_budget: int, reserve_planes: int = 0,
                      costs: RollbackCosts = RollbackCosts()) -> tuple[DraftDecision, ...]:
        """`decide_drafts` over the current free counts, keeping `reserve_planes` planes out of reach."""
        return decide_drafts(candidates, token_budget=token_budget, free_pages=self.free_pages,
                             free_planes=max(0, self.free_planes - reserve_planes), page_size=self.page_size,
                             replay_tokens=self.sizes.replay_tokens, costs=costs)
