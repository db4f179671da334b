"""One speculative iteration as one device call: the target's forward over every row, verification, and the next
drafts of the target's own MTP head, chained on device. Also the draft model's chain as one call.

The host sends a padded batch plus small arrays (drafts, sampling parameters, how long an MTP chain each row wants)
and receives small arrays back (accepted counts, committed tokens, the next drafts); hidden states never leave the
device.

MTP inputs. The MTP block at position p reads (token x_p, the target's post-norm hidden h_{p-1}) and predicts
x_{p+1}. A row feeding tokens at positions s.. whose first n_kept tokens are committed after verification (its fed
tokens plus the accepted drafts) then commits one more token, the bonus, at m = s + n_kept. The MTP block catches
up on positions s..m-1 in the same call, writing their KV: x_s with h_{s-1}, which the hidden pool holds at the
row's read plane (the null plane's zeros at s = 0), x_p with this step's h_{p-1}. A row that drafts then feeds the
bonus with h_{m-1}, whose logits give the first draft for the next step; the chain continues on the MTP's own
hidden state. Chained positions get the MTP's own hidden rather than the target's; the next catch-up rewrites them
once they are committed, so the MTP's KV never keeps a wrong entry for a committed position.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .config import ModelConfig
from .kernels.cpu_argmax import greedy_tokens
from .model import Record, forward, mtp_forward, mtp_write_kv, rebuild
from .ngram_lookup import append_tokens, ngram_lookup
from .sampling import SamplingParams, verify
from .state import HeadBacklog, ModelState, StepBatch, read_planes
from .weights import Weights, pytree


@pytree
class VerifyInputs:
    """What verification needs besides the logits, all host arrays."""

    drafts: jax.Array  # [B, R-1] int32, padding beyond n_drafts
    n_drafts: jax.Array  # [B] int32
    positions: jax.Array  # [B] int32, position of the token that logit row 0 predicts
    commits: jax.Array  # [B] bool, rows that reach their newest token and commit (not intermediate prompt chunks)
    sampling: SamplingParams  # [B] each


@pytree
class ChainInputs:
    """Per row: how many drafts to chain for the next step and the probability below which chaining stops."""

    n_chain: jax.Array  # [B] int32: -1 no MTP at all, 0 catch-up only, n > 0 catch-up and up to n drafts
    p_min: jax.Array  # [B] float32


@pytree
class ReplayInputs:
    """Rows in replay rollback (docs/design.md "Rollback"); the replay slot of row b is slot b. A row writes one
    state into `plane` and records GDN inputs in its slot, in one of two ways:
    - forward (optimistic False): the state after `last`, recording the drafts; after verification the state is
      advanced there by the accepted drafts, so it is wrong when some draft is accepted;
    - optimistic: the state after its last draft, recording `last` and the drafts; wrong when some draft is
      rejected, then rebuilt from the row's read plane over `last` and the accepted drafts. Only for rows whose
      read plane holds the state before `last` (no replayed tokens before it).
    Only the rows whose plane is wrong are rebuilt (`model.rebuild`), in the same call."""

    plane: jax.Array  # [B] int32, the row's write plane; -1: not a replay row
    optimistic: jax.Array  # [B] bool


@pytree
class BacklogInputs:
    """Rows whose MTP head holds its catch-up in a slot of the backlog (`state.HeadBacklog`), all [B]. The host
    (`Runtime`) decides per row: flush where its head chains in this call or its slot could overflow; hold where its
    head only catches up. A holding row runs no head pass: each iteration's kept tokens, their positions and
    h_{p-1} go to its slot (a call in which every row holds runs the head not at all), and an iteration whose tokens
    no longer fit catches up as it goes instead. A row with neither catches up as `ChainInputs` says."""

    slot: jax.Array  # int32, the row's slot; -1: none
    held: jax.Array  # int32, tokens its slot holds before the call
    flush: jax.Array  # bool: the held tokens' KV is written before anything else, and the slot emptied
    hold: jax.Array  # bool: the row's catch-up goes to its slot while it has room (its n_chain must be 0)


@pytree
class SpeculativeOutput:
    """Small arrays for the host."""

    n_accepted: jax.Array  # [B] int32
    tokens: jax.Array  # [B, R] int32: tokens[b, :n_accepted[b] + 1] are committed
    drafts: jax.Array  # [B, N] int32: the next step's drafts (MTP), drafts[b, :n_drafted[b]] are valid
    n_drafted: jax.Array  # [B] int32
    held: jax.Array  # [B] int32: tokens the row's backlog slot holds after the call (0 without one)


def greedy_pick(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits [B, V] -> argmax token [B] int32 and its probability [B]."""
    token = greedy_tokens(logits)
    top = jnp.take_along_axis(logits, token[:, None], axis=-1)[:, 0]  # the max, without a second reduction
    prob = 1.0 / jnp.sum(jnp.exp(logits - top[:, None]), axis=-1)
    return token, prob


def _single_token_batch(tokens, positions, live, page_table) -> StepBatch:
    """[B] tokens at [B] positions with their logits, rows with live False are padding."""
    B = tokens.shape[0]
    return StepBatch(
        tokens=tokens[:, None], positions=positions[:, None], n_tokens=live.astype(jnp.int32),
        page_table=page_table, read_plane=jnp.zeros((B,), jnp.int32), write_planes=jnp.full((B, 1), -1, jnp.int32),
        logit_rows=jnp.zeros((B, 1), jnp.int32),
    )  # fmt: skip


def _kv_only_batch(tokens, start, n_tokens, page_table) -> StepBatch:
    """tokens [B, T] at positions start [B] onwards, the first n_tokens [B] of each row live, without logits: what
    a KV-only catch-up of the MTP head feeds (`model.mtp_write_kv`)."""
    B, T = tokens.shape
    return StepBatch(
        tokens=tokens, positions=start[:, None] + jnp.arange(T)[None, :], n_tokens=n_tokens, page_table=page_table,
        read_plane=jnp.zeros((B,), jnp.int32), write_planes=jnp.full((B, T), -1, jnp.int32),
        logit_rows=jnp.zeros((B, 0), jnp.int32),
    )  # fmt: skip


def mtp_inputs_of(hidden_before: jax.Array, hidden: jax.Array) -> jax.Array:
    """The MTP block's h_{p-1} for each token a step fed and for the one after its last: hidden_before [B, E] (h_{s-1},
    from the row's read plane) then the step's post-norm hidden [B, T, E] -> [B, T+1, E]."""
    return jnp.concatenate([hidden_before[:, None], hidden], axis=1)


def later_width(T: int, n_max: int, lookup_width: int) -> int:
    """Tokens per row of a looping call's later iterations, for a first iteration of T: the MTP chain's drafts and
    `last` (a plain decoding call stays at one), or the lookup's width where the call looks up."""
    return max(min(T, 1 + n_max), lookup_width)


def mtp_catch_up_and_chain(
    weights: Weights, cfg: ModelConfig, batch: StepBatch, hidden: jax.Array, hidden_before: jax.Array,
    n_kept: jax.Array, bonus: jax.Array, has_bonus: jax.Array, chain: ChainInputs, state: ModelState, n_max: int,
    vocab: int | None = None,
) -> tuple[jax.Array, jax.Array, ModelState]:
    """The MTP catch-up over each row's committed tokens, then, where the row chains, a greedy chain of up to
    chain.n_chain drafts from its bonus token.

    batch: the target step's batch [B, T]; hidden [B, T, E] its post-norm hidden; hidden_before [B, E] = h_{s-1};
    n_kept [B]: leading fed tokens committed; bonus [B]: the token committed after them (valid where has_bonus).
    Returns drafts [B, n_max], n_drafted [B] and the state with the MTP block's KV written.

    Nothing a chain computes reads a committed position's MTP output, only its KV, so the catch-up writes the KV of
    the kept tokens alone (`model.mtp_write_kv`: no attention, FFN or head). The bonus is the chain's first link:
    one MTP step at the bonus (its KV, and its logits for draft 1), then one per draft, all of one shape. A row
    that does not chain leaves its bonus for the next step, which feeds it first and writes its KV then.
    """
    T = batch.tokens.shape[1]
    on = chain.n_chain >= 0
    chaining = on & has_bonus & (chain.n_chain >= 1)
    start = batch.positions[:, 0]
    hidden_in = mtp_inputs_of(hidden_before, hidden)  # [B, T+1, E]
    kept = _kv_only_batch(batch.tokens, start, jnp.where(on, n_kept, 0), batch.page_table)
    state = mtp_write_kv(weights, cfg, kept, hidden_in[:, :T], state)
    # The bonus at m = s + n_kept (over a rejected draft, if any) takes h_{m-1}, the target's hidden at index n_kept.
    bonus_hidden_in = jnp.take_along_axis(hidden_in, n_kept[:, None, None], axis=1)[:, 0]  # [B, E]
    return _chain(weights, cfg, batch.page_table, bonus, bonus_hidden_in, start + n_kept, chaining, chain, state,
                  n_max, vocab)  # fmt: skip


def _chain(weights, cfg, page_table, bonus, bonus_hidden_in, bonus_position, chaining, chain: ChainInputs, state,
           n_max, vocab):
    """The greedy chain from each row's bonus token [B] at bonus_position [B], whose MTP input is the target's
    hidden bonus_hidden_in [B, E]: link k feeds the bonus (k = 0) or draft k, at bonus_position + k, and drafts
    token k + 1 from its logits; later links take the MTP's own hidden. Rows stop at chain.n_chain drafts or at a
    draft below chain.p_min. Returns drafts [B, n_max], n_drafted [B] and the state."""
    B = bonus.shape[0]

    def feeding(carry):  # [B]: rows whose link k runs
        k, going = carry[0], carry[1]
        return going & (k < chain.n_chain)

    def more(carry):
        return (carry[0] < n_max) & jnp.any(feeding(carry))

    def link(carry):
        k, going, drafts, n_drafted, token, hidden_in, state = carry
        fed = feeding(carry)
        step = _single_token_batch(token, bonus_position + k, fed, page_table)
        out, state = mtp_forward(weights, cfg, step, hidden_in[:, None], state, vocab)
        token, prob = greedy_pick(out.logits[:, 0])
        going = fed & (prob >= chain.p_min)
        drafts = jax.lax.dynamic_update_slice_in_dim(drafts, jnp.where(going, token, 0)[:, None], k, axis=1)
        return k + 1, going, drafts, n_drafted + going, token, out.hidden[:, 0], state

    carry = (jnp.int32(0), chaining, jnp.zeros((B, n_max), jnp.int32), jnp.zeros((B,), jnp.int32), bonus,
             bonus_hidden_in, state)  # fmt: skip
    _, _, drafts, n_drafted, _, _, state = jax.lax.while_loop(more, link, carry)
    return drafts, n_drafted, state


def iteration(
    weights: Weights, cfg: ModelConfig, batch: StepBatch, state: ModelState, verify_in: VerifyInputs,
    chain: ChainInputs, replay: ReplayInputs | None = None, backlog: BacklogInputs | None = None, *,
    final_only: bool = False, n_max: int = 0, draft_vocab: int | None = None, rebuild_rows: int = 0,
) -> tuple[SpeculativeOutput, ModelState]:
    """Target forward, verification and (n_max > 0, the model has MTP) the next MTP drafts.

    draft_vocab: the MTP head drafts among token ids below it only. Draft tokens cost a pass over the head, which
    at a large vocabulary weighs more than the MTP block; BPE ids are in merge order, roughly by frequency, so a
    prefix of the vocabulary holds most tokens (FR-Spec's frequency-ranked drafting). Drafts outside it are
    never proposed; verification is unchanged, so output is too.

    batch as `forward`; rows verify their drafts `verify_in.drafts` (the last n_drafts of their tokens). Rows
    without logit rows (intermediate prompt chunks) commit nothing: their n_accepted is 0 and their tokens are
    to be ignored. replay: rows in replay rollback, whose state after the accepted drafts is rebuilt after
    verification where their written plane is wrong (needs the state's replay pool), rebuild_rows rows per pass
    (`replay_rebuild`). backlog: rows whose head holds its catch-up (`BacklogInputs`; its flush is not read here,
    `speculative_step` flushes). Returns the small outputs and the new state.
    """
    B = batch.tokens.shape[0]
    hidden_before = read_planes(state.hidden, batch.read_plane)  # [B, E] before the step overwrites planes
    replaying = replay is not None and bool(state.replay)
    record = None
    if replaying:  # records from the first draft, or from `last` when optimistic
        slot = jnp.where(replay.plane >= 0, jnp.arange(B, dtype=jnp.int32), -1)
        record = Record(slot, batch.n_tokens - verify_in.n_drafts - replay.optimistic.astype(jnp.int32))
    out, state = forward(weights, cfg, batch, state, final_only=final_only, record=record)
    n_accepted, tokens = verify(out.logits, verify_in.drafts, None, verify_in.n_drafts, verify_in.sampling,
                                verify_in.positions)  # fmt: skip
    n_kept = batch.n_tokens - verify_in.n_drafts + n_accepted  # leading fed tokens committed
    if replaying:
        kept_hidden = jnp.take_along_axis(out.hidden, jnp.maximum(n_kept - 1, 0)[:, None, None], axis=1)[:, 0]
        state = replay_rebuild(weights, cfg, state, replay, batch.read_plane, verify_in.n_drafts, n_accepted,
                               kept_hidden, rebuild_rows)  # fmt: skip
    none = jnp.zeros((B,), jnp.int32)
    if n_max == 0 or weights.mtp is None:
        return SpeculativeOutput(n_accepted, tokens, jnp.zeros((B, 1), jnp.int32), none, none), state
    held = none
    if backlog is not None and state.backlog is not None:
        T = batch.tokens.shape[1]
        hidden_in = mtp_inputs_of(hidden_before, out.hidden)[:, :T]  # h_{p-1} per fed token
        # A row whose slot cannot take this iteration's tokens catches up as it goes; what it holds stays held.
        holds = backlog.hold & (chain.n_chain >= 0) & (backlog.held + n_kept <= state.backlog.capacity)
        pool, held = _hold(state.backlog, backlog.slot, backlog.held, batch.tokens, batch.positions, hidden_in,
                           jnp.where(holds, n_kept, 0))  # fmt: skip
        state = dataclasses.replace(state, backlog=pool)
        chain = ChainInputs(jnp.where(holds, -1, chain.n_chain), chain.p_min)
    has_bonus = verify_in.commits
    bonus = jnp.take_along_axis(tokens, n_accepted[:, None], axis=1)[:, 0]

    # Only the MTP block's KV pages pass through the branch (`_when`), the one part of the state it writes.
    def with_mtp(mtp_kv):
        drafts, n_drafted, mtp_kv = mtp_catch_up_and_chain(weights, cfg, batch, out.hidden, hidden_before, n_kept,
                                                           bonus, has_bonus, chain, mtp_kv, n_max, draft_vocab)
        return (drafts, n_drafted), mtp_kv

    no_drafts = (jnp.zeros((B, n_max), jnp.int32), jnp.zeros((B,), jnp.int32))
    (drafts, n_drafted), mtp_kv = _when(jnp.any(chain.n_chain >= 0), with_mtp, no_drafts, _mtp_kv(state))
    return SpeculativeOutput(n_accepted, tokens, drafts, n_drafted, held), _with_mtp_kv(state, mtp_kv)


def _mtp_kv(state: ModelState) -> ModelState:
    """The MTP block's KV pages alone, as a state (what the MTP branches carry)."""
    return ModelState(k_pages=state.k_pages[-1:], v_pages=state.v_pages[-1:], conv=(), ssm=(),
                      hidden=jnp.zeros((0,), jnp.float32), replay=())


def _with_mtp_kv(state: ModelState, mtp_kv: ModelState) -> ModelState:
    """state with the MTP block's KV pages from mtp_kv (`_mtp_kv`)."""
    return dataclasses.replace(state, k_pages=state.k_pages[:-1] + mtp_kv.k_pages,
                               v_pages=state.v_pages[:-1] + mtp_kv.v_pages)


def rebuild_pass_rows(rows_per_pass: int, B: int) -> int:
    """Rows one pass of the replay rebuild covers in a step of B (padded) rows; rows_per_pass 0: all of them."""
    return min(rows_per_pass, B) if rows_per_pass > 0 else B


def replay_rebuild(
    weights: Weights, cfg: ModelConfig, state: ModelState, replay: ReplayInputs, read_plane: jax.Array,
    n_drafts: jax.Array, n_accepted: jax.Array, hidden: jax.Array, rows_per_pass: int = 0,
) -> ModelState:
    """Rebuild the replay rows whose written plane is wrong after verification (see `ReplayInputs`): a forward
    row that accepted a draft, advanced in place by them; an optimistic row that rejected one, rebuilt from
    read_plane [B] over `last` and the accepted drafts. n_drafts, n_accepted [B]; hidden [B, E] the target's
    post-norm hidden of each row's last kept token.

    Those rows go first and are rebuilt rebuild_pass_rows(rows_per_pass, B) at a time, as many passes as they need,
    none when no plane is wrong. Where a pass's cost follows its rows (large states on CPU: moving them through
    memory) one row per pass rebuilds only what is wrong; where it is mostly a fixed cost (small states, a GPU)
    one pass of all rows is cheaper (`jaxmodel.executor.runtime.PER_ROW_REBUILD_MIN_BYTES`)."""
    B = replay.plane.shape[0]
    optimistic = replay.optimistic
    source = jnp.where(optimistic, read_plane, replay.plane)
    n_keep = jnp.where(optimistic, 1 + n_accepted, n_accepted)
    wrong = (replay.plane >= 0) & jnp.where(optimistic, n_accepted < n_drafts, n_accepted > 0)
    per_pass = rebuild_pass_rows(rows_per_pass, B)
    order = jnp.argsort((~wrong).astype(jnp.int32), stable=True).astype(jnp.int32)  # the wrong rows first
    order = jnp.concatenate([order, jnp.zeros((per_pass,), jnp.int32)])
    n_wrong = jnp.sum(wrong.astype(jnp.int32))

    def one_pass(i, gdn):
        rows = jax.lax.dynamic_slice_in_dim(order, i * per_pass, per_pass)
        target = jnp.where(i * per_pass + jnp.arange(per_pass) < n_wrong, replay.plane[rows], -1)
        return rebuild(weights, cfg, gdn, source[rows], target, rows, n_keep[rows], hidden[rows])

    # The KV pages stay out of the loop: it changes only the GDN and hidden pools (in place; none is copied).
    gdn = dataclasses.replace(state, k_pages=(), v_pages=())
    gdn = jax.lax.fori_loop(0, (n_wrong + per_pass - 1) // per_pass, one_pass, gdn)
    return dataclasses.replace(gdn, k_pages=state.k_pages, v_pages=state.v_pages)


@pytree
class LoopInputs:
    """Rows that may run further iterations in the same call, without the host in between (all [B] unless noted).

    A looping row feeds its bonus token and up to n_draft drafts per iteration: the MTP head's, or where
    lookup_min > 0 the n-gram lookup's over its history (`jaxmodel.ngram_lookup`), which grows by each iteration's
    committed tokens (its MTP head, if its request has one, then only catches up). In snapshot mode it reads its
    live plane and writes the state after each fed token into `planes` minus the live one, in order; after a
    accepted drafts the a-th of those becomes live. A `replay` row owns two planes: it writes the state after the
    bonus (after its last draft when `optimistic`) into the other one, records GDN inputs in its replay slot, and
    that plane, rebuilt after verification where wrong (`ReplayInputs`), becomes live. The host's scheduler replays
    the same rules.
    """

    loops: jax.Array  # [B] bool
    replay: jax.Array  # [B] bool, rows in replay rollback (n_draft at most the replay pool's tokens)
    optimistic: jax.Array  # [B] bool, replay rows that write the state after their last draft
    n_draft: jax.Array  # [B] int32, drafts per later iteration (0: plain decoding)
    planes: jax.Array  # [B, n_max + 2] int32, the planes the row owns (its read plane first), -1 padding
    budget: jax.Array  # [B] int32, tokens the row may still commit (max_tokens, context length)
    capacity: jax.Array  # [B] int32, positions its KV pages cover
    stop_ids: jax.Array  # [S] int32, end-of-generation ids (-1 padding)
    n_iterations: jax.Array  # [] int32, iterations in all, the step's own included (at most the static maximum)
    lookup_min: jax.Array  # [B] int32, shortest n-gram of a row drafting by lookup; 0: it drafts with the MTP head
    lookup_max: jax.Array  # [B] int32, longest n-gram (at most ngram_lookup.LOOKUP_MAX_N)
    history: jax.Array  # [B, H] int32, the row's last tokens up to `last`, oldest first (H = 1 without lookup)
    history_len: jax.Array  # [B] int32


@pytree
class LoopOutput:
    """What the later iterations did, per iteration j = 1.. (row j - 1 here)."""

    ran: jax.Array  # [K-1, B] bool
    n_accepted: jax.Array  # [K-1, B] int32
    tokens: jax.Array  # [K-1, B, W] int32: tokens[j, b, :n_accepted + 1] committed (W = min(T, 1 + n_max))
    n_drafts: jax.Array  # [K-1, B] int32, drafts fed


@pytree
class LoopCarry:
    """The state of a call's later iterations, carried from one to the next (B rows; W tokens a later iteration
    feeds at most; D = the MTP chain's width)."""

    j: jax.Array  # [] int32: the iteration to run next (the first, run before the loop, is 0)
    active: jax.Array  # [B] bool: rows still iterating
    live: jax.Array  # [B] int32: each row's live plane, the state after its last committed token
    start: jax.Array  # [B] int32: the position of each row's bonus token
    bonus: jax.Array  # [B] int32: the target's token after the last accepted one, fed next
    drafts: jax.Array  # [B, D] int32: the MTP head's latest drafts (what goes back to the host)
    n_drafted: jax.Array  # [B] int32
    offered: jax.Array  # [B, max(W - 1, 1)] int32: the drafts the next iteration may feed (the head's or the lookup's)
    n_offered: jax.Array  # [B] int32
    n_committed: jax.Array  # [B] int32: tokens committed in this call so far
    history: jax.Array  # [B, H] int32: the lookup's history (a placeholder without a lookup)
    history_len: jax.Array  # [B] int32
    record: LoopOutput  # what each later iteration did, for the host
    held: jax.Array  # [B] int32: tokens held in each row's backlog slot (0 without one)
    state: ModelState


def _next_write_planes(planes: jax.Array, live: jax.Array) -> jax.Array:
    """planes [B, P] without the live plane [B], in order: [B, P - 1]."""
    order = jnp.argsort(planes == live[:, None], axis=1, stable=True)
    return jnp.take_along_axis(planes, order, axis=1)[:, :-1]


def _live_after(write_pool: jax.Array, n_accepted: jax.Array, replay: jax.Array) -> jax.Array:
    """The plane live after an iteration [B]: the one written after the a-th accepted draft of the row's write
    pool [B, P] (snapshot), or its first, which the rebuild advanced (replay [B])."""
    index = jnp.where(replay, 0, n_accepted)
    return jnp.take_along_axis(write_pool, index[:, None], axis=1)[:, 0]


def _stops(tokens: jax.Array, n_committed: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """Whether a row's committed tokens [B, R] (the first n_committed [B]) hold an end-of-generation id."""
    committed = jnp.arange(tokens.shape[1])[None, :] < n_committed[:, None]
    return jnp.any(committed & jnp.any(tokens[..., None] == stop_ids, axis=-1), axis=1)


def _when(pred: jax.Array, fn, otherwise, state: ModelState):
    """`lax.cond(pred, fn, lambda s: (otherwise, s), state)` for fn returning (small outputs, state), as one loop of
    at most one trip: XLA's CPU runtime copies the buffers a conditional carries (the whole pools, tens of
    milliseconds a step at a server's sizes), while a loop updates its carry in place."""
    def body(carry):
        _, _, state = carry
        return (jnp.bool_(True),) + fn(state)

    return jax.lax.while_loop(lambda carry: pred & ~carry[0], body, (jnp.bool_(False), otherwise, state))[1:]


def _hold(pool: HeadBacklog, slot: jax.Array, held: jax.Array, tokens: jax.Array, positions: jax.Array,
          hidden_in: jax.Array, n: jax.Array) -> tuple[HeadBacklog, jax.Array]:
    """Append each row's first n [B] tokens and positions [B, T] with their h_{p-1} hidden_in [B, T, E] to its slot
    slot [B] (-1: none), after the held [B] it holds. Returns the backlog and the rows' new counts [B]."""
    T = tokens.shape[1]
    index = held[:, None] + jnp.arange(T)[None, :]
    kept = (jnp.arange(T)[None, :] < n[:, None]) & (slot[:, None] >= 0)
    slots = jnp.where(kept, slot[:, None], pool.tokens.shape[0])  # out of bounds: dropped, no copy of the pool
    held_pool = HeadBacklog(tokens=pool.tokens.at[slots, index].set(tokens, mode="drop"),
                            positions=pool.positions.at[slots, index].set(positions, mode="drop"),
                            hidden=pool.hidden.at[slots, index].set(hidden_in.astype(pool.hidden.dtype), mode="drop"))
    return held_pool, held + jnp.where(slot >= 0, n, 0)


def _flush_backlog(weights: Weights, cfg: ModelConfig, page_table: jax.Array, backlog: BacklogInputs,
                   state: ModelState) -> tuple[jax.Array, ModelState]:
    """The MTP KV of the held tokens of each flushing row (`model.mtp_write_kv`), one row per pass: a pass costs
    what its held tokens do (the products skip padding), and none runs where no row flushes. page_table [B, P].
    Returns the rows' held counts after it [B] (0 where flushed) and the state."""
    pool = state.backlog
    D = pool.capacity
    order = jnp.argsort(~backlog.flush, stable=True).astype(jnp.int32)  # the flushing rows first

    def one_row(i, carry):
        mtp_kv, held = carry
        b = order[i]
        s = backlog.slot[b]
        batch = StepBatch(tokens=pool.tokens[s][None], positions=pool.positions[s][None], n_tokens=held[b][None],
                          page_table=page_table[b][None], read_plane=jnp.zeros((1,), jnp.int32),
                          write_planes=jnp.full((1, D), -1, jnp.int32), logit_rows=jnp.zeros((1, 0), jnp.int32))
        return mtp_write_kv(weights, cfg, batch, pool.hidden[s][None], mtp_kv), held.at[b].set(0)

    # The counts come out of the loop so that the call's later writes to the backlog (indexed by them) follow its
    # reads: unordered, XLA copied the whole pool every call to keep them apart.
    mtp_kv, held = jax.lax.fori_loop(0, jnp.sum(backlog.flush, dtype=jnp.int32), one_row,
                                     (_mtp_kv(state), backlog.held))
    return held, _with_mtp_kv(state, mtp_kv)


def speculative_step(
    weights: Weights, cfg: ModelConfig, batch: StepBatch, state: ModelState, verify_in: VerifyInputs,
    chain: ChainInputs, loop: LoopInputs | None = None, replay: ReplayInputs | None = None,
    backlog: BacklogInputs | None = None, *, final_only: bool = False, n_max: int = 0, max_iterations: int = 1,
    draft_vocab: int | None = None, rebuild_rows: int = 0, lookup_width: int = 0,
) -> tuple[tuple[SpeculativeOutput, LoopOutput | None], ModelState]:
    """One engine step in one call: `iteration` over the batch, then, for the rows `loop` lets continue, up to
    loop.n_iterations - 1 more iterations (each feeding the bonus token and the drafts of the MTP head or the n-gram
    lookup), stopping a row at an end-of-generation id, its token budget or the end of its pages.

    backlog: rows whose MTP head holds its catch-up across calls (`BacklogInputs`): the flushing rows' held tokens
    are caught up first, then the holding rows' every iteration adds its kept tokens to their slots. (A row that
    only catches up without a slot does so in each iteration.)

    lookup_width: 0, or the tokens of a later iteration when some row drafts by lookup (its drafts then come from
    its history, and a row may start drafting after a plain first iteration). Such a call runs each later iteration
    at lookup_width tokens where some row feeds drafts and at one token where none does (a row without a match
    costs what plain decoding does).

    replay: rows in replay rollback in the first iteration (None: no row of this step shape can replay, and no
    later iteration replays either); rebuild_rows: rows per pass of their rebuild (`replay_rebuild`).

    Returns the first iteration's output (its drafts are the ones after the row's last iteration), the later
    iterations' record (None without `loop`) and the state.
    """
    holding = backlog is not None and state.backlog is not None and n_max > 0 and weights.mtp is not None
    if holding:
        held, state = _flush_backlog(weights, cfg, batch.page_table, backlog, state)
        backlog = dataclasses.replace(backlog, held=held)
    first, state = iteration(weights, cfg, batch, state, verify_in, chain, replay, backlog if holding else None,
                             final_only=final_only, n_max=n_max, draft_vocab=draft_vocab,
                             rebuild_rows=rebuild_rows)  # fmt: skip
    if loop is None or max_iterations <= 1:
        return (first, None), state
    B, T = batch.tokens.shape
    W = later_width(T, n_max, lookup_width)
    K = max_iterations - 1
    n_committed = first.n_accepted + 1
    start = batch.positions[:, 0] + batch.n_tokens - verify_in.n_drafts + first.n_accepted  # the bonus's position
    live = _live_after(_next_write_planes(loop.planes, batch.read_plane), first.n_accepted, loop.replay)
    active = (loop.loops & verify_in.commits & ~_stops(first.tokens, n_committed, loop.stop_ids)
              & (n_committed < loop.budget) & (start + loop.n_draft < loop.capacity))  # fmt: skip
    bonus = jnp.take_along_axis(first.tokens, first.n_accepted[:, None], axis=1)[:, 0]
    record = LoopOutput(ran=jnp.zeros((K, B), bool), n_accepted=jnp.zeros((K, B), jnp.int32),
                        tokens=jnp.zeros((K, B, W), jnp.int32), n_drafts=jnp.zeros((K, B), jnp.int32))
    # The carried drafts keep the chain's full width: a later iteration feeds W - 1 of them, and the last
    # iteration's all go back to the host, so that a plain decoding loop (W = 1) still hands the next call drafts.
    history, history_len = loop.history, loop.history_len
    if lookup_width:
        history, history_len = append_tokens(history, history_len, first.tokens,
                                             jnp.where(verify_in.commits, n_committed, 0))

    def offers(drafts, n_drafted, history, history_len):
        """The drafts the next iteration may feed [B, max(W - 1, 1)] (a loop carries no empty array) and how many
        [B]: the MTP head's, or the lookup's."""
        width = max(W - 1, 1)
        mtp = jnp.pad(drafts[:, :width], ((0, 0), (0, width - min(drafts.shape[1], width))))
        if not lookup_width:
            return mtp, n_drafted
        found, n_found = ngram_lookup(history, history_len, loop.lookup_min, loop.lookup_max, W - 1)
        looking = loop.lookup_min > 0
        return jnp.where(looking[:, None], found, mtp), jnp.where(looking, n_found, n_drafted)

    offered, n_offered = offers(first.drafts, first.n_drafted, history, history_len)
    carry = LoopCarry(jnp.int32(1), active, live, start, bonus, first.drafts, first.n_drafted, offered, n_offered,
                      n_committed, history, history_len, record, first.held, state)  # fmt: skip

    def n_fed_of(carry: LoopCarry) -> jax.Array:  # drafts each row feeds in the next iteration
        return jnp.where(carry.active, jnp.minimum(jnp.minimum(loop.n_draft, carry.n_offered), W - 1), 0)

    def more(carry: LoopCarry) -> jax.Array:
        return (carry.j < jnp.minimum(loop.n_iterations, max_iterations)) & jnp.any(carry.active)

    def iterate(width: int):
        """One later iteration over `width` tokens per row (1: no row feeds a draft), its record padded to W."""
        index = jnp.arange(width)[None, :]

        def body(carry: LoopCarry) -> LoopCarry:
            j, active, live, start, bonus = carry.j, carry.active, carry.live, carry.start, carry.bonus
            drafts, n_drafted, offered, n_committed = carry.drafts, carry.n_drafted, carry.offered, carry.n_committed
            history, history_len, record, held, state = (carry.history, carry.history_len, carry.record, carry.held,
                                                         carry.state)  # fmt: skip
            n_fed = n_fed_of(carry)
            tokens = jnp.concatenate([bonus[:, None], offered[:, : width - 1]], axis=1)
            tokens = jnp.where(index <= n_fed[:, None], tokens, 0)  # [B, width]
            write_pool = _next_write_planes(loop.planes, live)[:, :W]
            writes = jnp.where(active[:, None] & (index <= n_fed[:, None]), write_pool[:, :width], -1)
            after_last_draft = jnp.where(index == n_fed[:, None], write_pool[:, :1], -1)
            writes = jnp.where((active & loop.replay & loop.optimistic)[:, None], after_last_draft, writes)
            step = StepBatch(
                tokens=tokens, positions=start[:, None] + index, n_tokens=jnp.where(active, 1 + n_fed, 0),
                page_table=batch.page_table, read_plane=live, write_planes=writes,
                logit_rows=jnp.broadcast_to(index, (B, width)),
            )  # fmt: skip
            verify_j = VerifyInputs(tokens[:, 1:], n_fed, start + 1, active, verify_in.sampling)
            # A row drafting by lookup has its MTP head (where its request has one) only catch up: a chain's drafts
            # would be discarded for the lookup's. A holding row's catch-up goes to its backlog slot.
            n_chain_j = jnp.where(loop.lookup_min > 0, 0, loop.n_draft)
            chain_j = ChainInputs(jnp.where(active & (chain.n_chain >= 0), n_chain_j, -1), chain.p_min)
            backlog_j = None
            if holding:
                backlog_j = BacklogInputs(backlog.slot, held, backlog.flush, backlog.hold & active)
            replaying = active & loop.replay & (n_fed > 0)
            replay_j = None if replay is None else ReplayInputs(
                jnp.where(replaying, write_pool[:, 0], -1), replaying & loop.optimistic)  # fmt: skip
            out, state = iteration(weights, cfg, step, state, verify_j, chain_j, replay_j, backlog_j, n_max=n_max,
                                   draft_vocab=draft_vocab, rebuild_rows=rebuild_rows)  # fmt: skip
            held = out.held if holding else held
            a = out.n_accepted
            tokens_out = jnp.pad(out.tokens, ((0, 0), (0, W - width)), constant_values=-1)  # [B, W]
            record = LoopOutput(ran=record.ran.at[j - 1].set(active), n_accepted=record.n_accepted.at[j - 1].set(a),
                                tokens=record.tokens.at[j - 1].set(tokens_out),
                                n_drafts=record.n_drafts.at[j - 1].set(n_fed))  # fmt: skip
            live = jnp.where(active, _live_after(write_pool, a, loop.replay), live)
            start = jnp.where(active, start + 1 + a, start)
            bonus = jnp.where(active, jnp.take_along_axis(out.tokens, a[:, None], axis=1)[:, 0], bonus)
            drafts = jnp.where(active[:, None], out.drafts, drafts)
            n_drafted = jnp.where(active, out.n_drafted, n_drafted)
            n_committed = n_committed + jnp.where(active, a + 1, 0)
            if lookup_width:
                history, history_len = append_tokens(history, history_len, out.tokens, jnp.where(active, a + 1, 0))
            active = (active & ~_stops(out.tokens, a + 1, loop.stop_ids) & (n_committed < loop.budget)
                      & (start + loop.n_draft < loop.capacity))  # fmt: skip
            offered, n_offered = offers(drafts, n_drafted, history, history_len)
            return LoopCarry(j + 1, active, live, start, bonus, drafts, n_drafted, offered, n_offered, n_committed,
                             history, history_len, record, held, state)  # fmt: skip

        return body

    if lookup_width:
        # Runs of iterations in which no row feeds a draft, at one token, alternate with runs in which some row does,
        # at W: each run is a loop of its own, so choosing the width costs nothing per iteration. (Choosing it
        # within each iteration, by two loops of at most one trip, cost 10 % of a plain iteration.)
        feeding = lambda carry: jnp.any(n_fed_of(carry) > 0)

        def runs(carry):
            carry = jax.lax.while_loop(lambda c: more(c) & ~feeding(c), iterate(1), carry)
            return jax.lax.while_loop(lambda c: more(c) & feeding(c), iterate(W), carry)

        carry = jax.lax.while_loop(more, runs, carry)
    else:
        carry = jax.lax.while_loop(more, iterate(W), carry)
    first = SpeculativeOutput(first.n_accepted, first.tokens, carry.drafts, carry.n_drafted, carry.held)
    return (first, carry.record), carry.state


def draft_chain(
    weights: Weights, cfg: ModelConfig, batch: StepBatch, state: ModelState, chain_planes: jax.Array,
    n_chain: jax.Array, p_min: jax.Array, *, n_max: int,
) -> tuple[jax.Array, jax.Array, ModelState]:
    """A draft model's greedy chain in one call.

    batch: each row's backlog ending with `last`, one logit row at `last`, writing the state after `last` to
    chain_planes[:, 0]. Draft k (k >= 1) is fed at the next position reading chain_planes[:, k-1] and writing
    chain_planes[:, k]. chain_planes [B, n_max]; n_chain [B] drafts wanted (0: none); p_min [B].
    Returns drafts [B, n_max], n_drafted [B] and the state.
    """
    out, state = forward(weights, cfg, batch, state, final_only=True)
    first, prob = greedy_pick(out.logits[:, 0])
    going = (n_chain >= 1) & (prob >= p_min)
    B = first.shape[0]
    drafts = jnp.zeros((B, n_max), jnp.int32).at[:, 0].set(first)
    last_position = jnp.take_along_axis(batch.positions, batch.logit_rows[:, :1], axis=1)[:, 0]

    def link(k, carry):
        drafts, going, n_drafted, state = carry
        feeding = going & (k < n_chain)
        step = StepBatch(
            tokens=drafts[:, k - 1][:, None], positions=(last_position + k)[:, None], n_tokens=feeding.astype(jnp.int32),
            page_table=batch.page_table, read_plane=chain_planes[:, k - 1],
            write_planes=jnp.where(feeding, chain_planes[:, k], -1)[:, None], logit_rows=jnp.zeros((B, 1), jnp.int32),
        )  # fmt: skip
        out, state = forward(weights, cfg, step, state)
        token, prob = greedy_pick(out.logits[:, 0])
        going = feeding & (prob >= p_min)
        drafts = drafts.at[:, k].set(jnp.where(going, token, 0))
        return drafts, going, n_drafted + going, state

    n_links = jnp.clip(jnp.max(jnp.where(going, n_chain, 0)), 0, n_max)
    drafts, _, n_drafted, state = jax.lax.fori_loop(1, n_links, link, (drafts, going, going.astype(jnp.int32), state))
    return drafts, n_drafted, state
