"""One speculative iteration as one device call: the target's forward over every row, verification, and the next
drafts of the target's own MTP head, chained on device. Also the draft model's chain as one call.

The host sends a padded batch plus small arrays (drafts, sampling parameters, how long an MTP chain each row wants)
and receives small arrays back (accepted counts, committed tokens, the next drafts); hidden states never leave the
device.

MTP inputs. The MTP block at position p reads (token x_p, the target's post-norm hidden h_{p-1}) and predicts
x_{p+1}. A row feeding tokens at positions s.. whose first n_kept tokens are committed after verification (its fed
tokens plus the accepted drafts) then commits one more token, the bonus, at m = s + n_kept. The MTP block catches
up on positions s..m in the same call: x_s with h_{s-1}, which the hidden pool holds at the row's read plane (the
null plane's zeros at s = 0), x_p with this step's h_{p-1} up to the bonus. Its logits at m are the first draft for
the next step; the chain continues on the MTP's own hidden state. Chained positions get the MTP's own hidden rather
than the target's; the next catch-up rewrites them once they are committed, so the MTP's KV never keeps a wrong
entry for a committed position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .config import ModelConfig
from .model import forward, mtp_forward
from .sampling import SamplingParams, verify
from .state import ModelState, StepBatch, read_planes
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
class SpeculativeOutput:
    """Small arrays for the host."""

    n_accepted: jax.Array  # [B] int32
    tokens: jax.Array  # [B, R] int32: tokens[b, :n_accepted[b] + 1] are committed
    drafts: jax.Array  # [B, N] int32: the next step's drafts (MTP), drafts[b, :n_drafted[b]] are valid
    n_drafted: jax.Array  # [B] int32


def greedy_pick(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits [B, V] -> argmax token [B] int32 and its probability [B]."""
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    top = jnp.max(logits, axis=-1)
    prob = 1.0 / jnp.sum(jnp.exp(logits - top[:, None]), axis=-1)
    return token, prob


def _single_token_batch(tokens, positions, live, page_table) -> StepBatch:
    """[B] tokens at [B] positions, rows with live False are padding."""
    B = tokens.shape[0]
    return StepBatch(
        tokens=tokens[:, None], positions=positions[:, None], n_tokens=live.astype(jnp.int32),
        page_table=page_table, read_plane=jnp.zeros((B,), jnp.int32), write_planes=jnp.full((B, 1), -1, jnp.int32),
        logit_rows=jnp.zeros((B, 1), jnp.int32),
    )  # fmt: skip


def mtp_catch_up_and_chain(
    weights: Weights, cfg: ModelConfig, batch: StepBatch, hidden: jax.Array, hidden_before: jax.Array,
    n_kept: jax.Array, bonus: jax.Array, has_bonus: jax.Array, chain: ChainInputs, state: ModelState, n_max: int,
) -> tuple[jax.Array, jax.Array, ModelState]:
    """The MTP catch-up over each row's committed tokens, then a greedy chain of up to chain.n_chain drafts.

    batch: the target step's batch [B, T]; hidden [B, T, E] its post-norm hidden; hidden_before [B, E] = h_{s-1};
    n_kept [B]: leading fed tokens committed; bonus [B]: the token committed after them (valid where has_bonus).
    Returns drafts [B, n_max], n_drafted [B] and the state with the MTP block's KV written.
    """
    B, T = batch.tokens.shape
    index = jnp.arange(T + 1)[None, :]  # [1, T+1]
    tokens = jnp.concatenate([batch.tokens, jnp.zeros((B, 1), jnp.int32)], axis=1)
    tokens = jnp.where(index < n_kept[:, None], tokens, bonus[:, None])  # [B, T+1]
    hidden_in = jnp.concatenate([hidden_before[:, None], hidden], axis=1)  # [B, T+1, E]
    on = chain.n_chain >= 0
    n_tokens = jnp.where(on, n_kept + has_bonus.astype(jnp.int32), 0)
    start = batch.positions[:, :1]
    catch_up = StepBatch(
        tokens=tokens, positions=start + index, n_tokens=n_tokens, page_table=batch.page_table,
        read_plane=jnp.zeros((B,), jnp.int32), write_planes=jnp.full((B, T + 1), -1, jnp.int32),
        logit_rows=n_kept[:, None],
    )  # fmt: skip
    out, state = mtp_forward(weights, cfg, catch_up, hidden_in, state)
    first, prob = greedy_pick(out.logits[:, 0])
    going = on & has_bonus & (chain.n_chain >= 1) & (prob >= chain.p_min)
    drafts = jnp.zeros((B, n_max), jnp.int32).at[:, 0].set(first)
    own_hidden = jnp.take_along_axis(out.hidden, n_kept[:, None, None], axis=1)[:, 0]  # [B, E] at the bonus
    bonus_position = start[:, 0] + n_kept

    def link(k, carry):
        drafts, going, n_drafted, own_hidden, state = carry
        feeding = going & (k < chain.n_chain)
        step = _single_token_batch(drafts[:, k - 1], bonus_position + k, feeding, batch.page_table)
        out, state = mtp_forward(weights, cfg, step, own_hidden[:, None], state)
        token, prob = greedy_pick(out.logits[:, 0])
        going = feeding & (prob >= chain.p_min)
        drafts = drafts.at[:, k].set(jnp.where(going, token, 0))
        return drafts, going, n_drafted + going, out.hidden[:, 0], state

    n_links = jnp.clip(jnp.max(jnp.where(going, chain.n_chain, 0)), 0, n_max)
    drafts, _, n_drafted, _, state = jax.lax.fori_loop(
        1, n_links, link, (drafts, going, going.astype(jnp.int32), own_hidden, state)
    )
    return drafts, n_drafted, state


def speculative_step(
    weights: Weights, cfg: ModelConfig, batch: StepBatch, state: ModelState, verify_in: VerifyInputs,
    chain: ChainInputs, *, final_only: bool = False, n_max: int = 0,
) -> tuple[SpeculativeOutput, ModelState]:
    """Target forward, verification and (n_max > 0, the model has MTP) the next MTP drafts, in one call.

    batch as `forward`; rows verify their drafts `verify_in.drafts` (the last n_drafts of their tokens). Rows
    without logit rows (intermediate prompt chunks) commit nothing: their n_accepted is 0 and their tokens are
    to be ignored. Returns the small outputs and the new state.
    """
    hidden_before = read_planes(state.hidden, batch.read_plane)  # [B, E] before the step overwrites planes
    out, state = forward(weights, cfg, batch, state, final_only=final_only)
    n_accepted, tokens = verify(out.logits, verify_in.drafts, None, verify_in.n_drafts, verify_in.sampling,
                                verify_in.positions)  # fmt: skip
    B = tokens.shape[0]
    if n_max == 0 or weights.mtp is None:
        empty = jnp.zeros((B, 1), jnp.int32)
        return SpeculativeOutput(n_accepted, tokens, empty, jnp.zeros((B,), jnp.int32)), state
    has_bonus = verify_in.commits
    n_kept = batch.n_tokens - verify_in.n_drafts + n_accepted
    bonus = jnp.take_along_axis(tokens, n_accepted[:, None], axis=1)[:, 0]

    def with_mtp(state):
        return mtp_catch_up_and_chain(weights, cfg, batch, out.hidden, hidden_before, n_kept, bonus, has_bonus,
                                      chain, state, n_max)  # fmt: skip

    def without(state):
        return jnp.zeros((B, n_max), jnp.int32), jnp.zeros((B,), jnp.int32), state

    drafts, n_drafted, state = jax.lax.cond(jnp.any(chain.n_chain >= 0), with_mtp, without, state)
    return SpeculativeOutput(n_accepted, tokens, drafts, n_drafted), state


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
