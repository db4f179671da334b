"""Drafter policy: per sequence and per step, which drafter proposes and how long a draft it makes.

The rule
--------
Each request names an ordered list of drafters and bounds the draft length to [n_min, n_max].

Acceptance. For every (sequence, drafter) the policy estimates alpha, the probability that a drafted token is
accepted given that the ones before it were. A verified draft of d tokens with a accepted contributes a successes
and, if a < d, one failure (the maximum-likelihood estimate of a geometric acceptance). Evidence ages by `decay` per
step of the sequence, so the estimate follows recent behaviour; it starts from `prior_acceptance` with the weight of
`prior_weight` token trials. Between observations the estimate stays where it was. A new sequence also starts from
what the drafter did for the sequences before it: every observation enters an engine-wide record per drafter, aged
by `pool_decay` per observation, and a sequence's own evidence starts as that record scaled to at most `pool_weight`
token trials (`pooled_start`). Without it a short request never drafts: at one host step per 8 tokens a 64-token
request plans 8 steps, too few to earn trust or reach a probe (measured on an H100, where MTP drafting at n_max 3
decodes 1.8x plain, the policy drafted 49 tokens in 512).

Cost, measured by the engine. A target step verifying n tokens costs target(n) = fixed + per_token * n, and a
proposal of d tokens costs proposal_i(d) = fixed_i + per_token_i * d; each line is fitted by discounted least
squares to what the engine reports (`record_target`, `record_proposal`). Until something is reported, a target step
costs 1, a verified token 1/16 of that (`target_token_prior`), and proposals nothing; while all measurements share one
n, a small ridge prior splits the target's cost in that ratio. The engine calibrates before serving (`calibrate`): warm
steps of one row at 1 and 1 + n_max tokens give the line until something is reported, and from then on their slope
in seconds is the prior that splits measurements of one n. They are not measurements themselves: each is a call of
its own, host overhead included, while the engine reports a call of several iterations per iteration, so mixing the
two would read the overhead as a cost per verified token (on an H100 a plain phase then priced every verified token
twenty times its calibrated cost, and the policy stopped drafting; docs/performance.md, "On a GPU"). It reports
decoding steps only (a prompt chunk's cost says little about a draft's), and the draft chain the MTP head runs
inside the target's step as that drafter's proposal cost, from the chain's calibrated cost per draft. Sequences
batched together share a step: with B of them each is charged fixed / B (for alike sequences, the per-sequence
optimum is then the batch's optimum). Steps of different batch sizes have lines of their own, one per `batch_class`
(the powers of 4 the runtime compiles), each calibrated from that batch's warm steps: on one line over the batch's
total tokens, one-row steps set the slope that 16-row steps were priced by, and MTP did not draft at 16 streams on
an H100, where a fixed draft paid (docs/performance.md, "On a GPU").

Calls of one iteration. The engine runs several iterations per device call while the host has nothing to decide,
so a call's fixed cost (dispatch, read-back) is spread over its iterations; a draft proposed on the host
(`host_drafters`: the draft model) needs the host between iterations, so its steps run one iteration per call.
Calls of one iteration are fitted on a line of their own (`Costs.single`), which prices host drafters; no drafting
and the drafters that draft on device (the MTP head's chain, the n-gram lookup) are priced per iteration of looping
calls: an iteration of a looping call costs a fraction of a call of one, so on one shared line the n-gram drafter
was undercharged and chosen where it lost, and MTP overcharged (docs/performance.md, "On a GPU").

Value. A draft of length d with per-token acceptance alpha yields E[accepted] = (1 - alpha^(d+1)) / (1 - alpha) - 1
drafts plus the target's own token, so the expected tokens per unit of cost are

    value_i(d) = (1 + E[accepted](alpha_i, d)) / (target(1 + d) + proposal_i(d)),

and not drafting is worth 1 / target(1). For each drafter the length is the d in [n_min, n_max] with the highest
value (value is unimodal in d: higher alpha or cheaper tokens lengthen the draft, lower alpha shortens it).

Choice. Drafters are compared by the value at a pessimistic acceptance, alpha lowered by `confidence` standard
errors of its estimate (sqrt(alpha (1 - alpha) / trials)), so a drafter must show enough evidence before it is
trusted; not drafting is compared as it is. The sequence's main choice is the option of highest such value; on equal
values the request's order wins, and not drafting comes last. To stay stable, the main choice changes only to an
option worth more than (1 + switch_margin) times the current one, and never within `min_dwell` steps of the last
change. Its draft length comes from the plain estimate. The plan lists the main choice first, then the other
drafters worth more than not drafting by their plain estimate, best first: fallbacks for when the drafters before
them have nothing to propose (an n-gram drafter without a match).

Exploration. A drafter that is not the main choice goes first for one step (a probe) when it has not been tried for
`probe_every` steps, or for `probe_soon` steps while its plain estimate is worth more than the main choice (it looks
promising but has not shown enough evidence yet). A probe drafts the length the drafter would get at
alpha = max(its estimate, prior_acceptance). Old evidence has aged by the time of a probe, so the probe's outcome
weighs heavily: a drafter that turned good looks promising, is probed again soon and soon chosen; one that is still
bad waits twice as long for its next probe, up to `probe_every_max` steps. Becoming the main choice resets the wait.

The policy is plain Python and deterministic given its inputs; `plan_step` and `observe_draft` are pure functions
over frozen state, and `DrafterPolicy` keeps that state per sequence for the engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from jaxmodel.requests import SeqId, SpeculativeConfig


@dataclass(frozen=True)
class PolicyParams:
    """The policy's constants (see the module docstring for their roles)."""

    prior_acceptance: float = 0.5
    prior_weight: float = 2.0
    decay: float = 0.95
    switch_margin: float = 0.2
    confidence: float = 1.0
    min_dwell: int = 8
    probe_every: int = 16
    probe_soon: int = 2
    probe_every_max: int = 128
    cost_decay: float = 0.98
    cost_ridge: float = 1.0
    target_token_prior: float = 1.0 / 16  # a verified token costs this fraction of a step's fixed cost, until measured
    # batch class -> (fixed, per_token) seconds of warm steps of that many rows
    target_calibrated: Mapping[int, tuple[float, float]] = field(default_factory=dict)
    pool_decay: float = 0.98  # per observation, of the engine-wide record a new sequence starts from
    pool_weight: float = 8.0  # token trials of that record a new sequence starts with, at most
    loops: bool = False  # the engine runs several iterations per call where the host has nothing to decide
    host_drafters: frozenset[str] = frozenset()  # drafters that propose on the host: one iteration per call


@dataclass(frozen=True)
class Choice:
    """Draft with `drafter`, up to `n_draft` tokens; drafts shorter than the request's n_min are to be dropped."""

    drafter: str
    n_draft: int
    probe: bool = False


# --- acceptance and value -----------------------------------------------------------------------------------------

def expected_accepted(alpha: float, length: int) -> float:
    """Expected accepted drafts of a draft of `length` tokens, each accepted with prob alpha after the previous."""
    if alpha >= 1.0:
        return float(length)
    return (1.0 - alpha ** (length + 1)) / (1.0 - alpha) - 1.0


@dataclass(frozen=True)
class LinearCost:
    """seconds ~= fixed + per_token * n, fitted by discounted least squares with a small ridge on the slope.

    The sums are weighted by age: each observation multiplies the earlier ones' weight by the decay.
    """

    w: float = 0.0
    wn: float = 0.0
    wnn: float = 0.0
    ws: float = 0.0
    wns: float = 0.0

    def observed(self, n: float, seconds: float, decay: float) -> LinearCost:
        """The fit after one more measurement of `seconds` for `n` tokens."""
        return LinearCost(
            w=decay * self.w + 1.0,
            wn=decay * self.wn + n,
            wnn=decay * self.wnn + n * n,
            ws=decay * self.ws + seconds,
            wns=decay * self.wns + n * seconds,
        )

    def coefficients(self, ridge: float, slope_prior: float, default: tuple[float, float],
                     slope_seconds: float = 0.0) -> tuple[float, float]:
        """(fixed, per_token), both >= 0; `default` before any measurement.

        The ridge pulls per_token towards slope_prior * fixed + slope_seconds (a unit-free prior, or a measured
        slope in seconds), which decides the split when every measurement had the same n: minimises
        sum w (s - a - b n)^2 + ridge (b - slope_prior a - slope_seconds)^2.
        """
        if self.w <= 0.0:
            return default
        r, c = slope_prior, slope_seconds
        aa, ab, bb = self.w + ridge * r * r, self.wn - ridge * r, self.wnn + ridge
        det = aa * bb - ab * ab
        ys, yns = self.ws - ridge * r * c, self.wns + ridge * c
        fixed = (bb * ys - ab * yns) / det
        per_token = (aa * yns - ab * ys) / det
        if per_token < 0.0:
            return self.ws / self.w, 0.0
        if fixed < 0.0:
            return 0.0, self.wns / self.wnn if self.wnn > 0 else 0.0
        return fixed, per_token


@dataclass(frozen=True)
class Costs:
    """The measured cost lines: the target's step and each drafter's proposal."""

    # batch class -> the line per iteration of calls that ran several (of all calls, where none loop)
    target: Mapping[int, LinearCost] = field(default_factory=dict)
    proposals: Mapping[str, LinearCost] = field(default_factory=dict)
    single: Mapping[int, LinearCost] = field(default_factory=dict)  # batch class -> the line of one-iteration calls


def best_length(
    alpha: float, n_min: int, n_max: int, target: tuple[float, float], proposal: tuple[float, float]
) -> tuple[int, float]:
    """(d, value) maximising value(d) = (1 + expected_accepted(alpha, d)) / (target(1 + d) + proposal(d)).

    target and proposal are (fixed, per_token) cost lines. value is unimodal in d, so the walk up from n_min stops
    at the first d that does not improve.
    """

    def value(d: int) -> float:
        cost = target[0] + target[1] * (1 + d) + proposal[0] + proposal[1] * d
        return (1.0 + expected_accepted(alpha, d)) / cost

    d, best = n_min, value(n_min)
    while d < n_max:
        better = value(d + 1)
        if better <= best:
            break
        d, best = d + 1, better
    return d, best


def drafting_pays(n_rows: int, expected_accepted: float, plain_seconds: float, drafting_seconds: float) -> bool:
    """Whether a step of n_rows rows commits more tokens per second with its drafts than without: n_rows plus the
    drafts' expected accepted tokens in drafting_seconds (the step at its longest row's length: every row is padded
    to it) against n_rows in plain_seconds. The batch gate: where it fails, no row of the step drafts.

    >>> drafting_pays(16, 2.0, plain_seconds=0.1, drafting_seconds=0.2)  # one of 16 rows drafts 3 at alpha 0.8
    False
    >>> drafting_pays(16, 32.0, plain_seconds=0.1, drafting_seconds=0.2)  # all 16 do
    True
    """
    return (n_rows + expected_accepted) * plain_seconds > n_rows * drafting_seconds


# --- per-sequence state -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DrafterStats:
    """One drafter's record for one sequence; counts are token trials, aged to step `observed_at`."""

    successes: float = 0.0
    trials: float = 0.0
    observed_at: int = 0
    tried_at: int = 0
    probe_every: int = 0  # 0: not yet set, use the params' probe_every


_UNSET = "<unset>"  # main choice before the first step; None means "no drafting"


@dataclass(frozen=True)
class SequenceState:
    """The policy's memory of one sequence."""

    step: int = 0
    main: str | None = _UNSET
    main_since: int = 0
    stats: Mapping[str, DrafterStats] = field(default_factory=dict)


def acceptance(stats: DrafterStats, params: PolicyParams) -> float:
    """The estimated per-token acceptance alpha."""
    return (stats.successes + params.prior_acceptance * params.prior_weight) / (stats.trials + params.prior_weight)


def pessimistic_acceptance(stats: DrafterStats, params: PolicyParams) -> float:
    """alpha lowered by `confidence` standard errors of its estimate: little evidence, little trust."""
    alpha = acceptance(stats, params)
    return max(alpha - params.confidence * math.sqrt(alpha * (1.0 - alpha) / (stats.trials + params.prior_weight)), 0.0)


def observe_draft(
    state: SequenceState, drafter: str, drafted: int, accepted: int, params: PolicyParams
) -> SequenceState:
    """The state after `accepted` of `drafted` tokens from `drafter` were accepted (drafted 0: nothing learnt)."""
    if drafted <= 0:
        return state
    if not 0 <= accepted <= drafted:
        raise ValueError(f"accepted {accepted} of {drafted} drafted")
    old = state.stats.get(drafter, DrafterStats())
    age = params.decay ** max(state.step - old.observed_at, 0)
    new = replace(_counted(old, age, drafted, accepted), observed_at=state.step, tried_at=state.step)
    return replace(state, stats={**state.stats, drafter: new})


def _counted(stats: DrafterStats, age: float, drafted: int, accepted: int) -> DrafterStats:
    """stats, its evidence weighed by `age`, with one more draft counted: each accepted token is a success in a
    trial, and a rejection, which ends the draft, one more trial."""
    return replace(stats, successes=age * stats.successes + accepted,
                   trials=age * stats.trials + accepted + (1 if accepted < drafted else 0))


def pool_observation(pooled: DrafterStats, drafted: int, accepted: int, params: PolicyParams) -> DrafterStats:
    """The engine-wide record of a drafter after one more verified draft (drafted 0: unchanged)."""
    if drafted <= 0:
        return pooled
    return _counted(pooled, params.pool_decay, drafted, accepted)


def pooled_start(pooled: Mapping[str, DrafterStats], params: PolicyParams) -> dict[str, DrafterStats]:
    """A new sequence's evidence: each drafter's engine-wide record, scaled to at most `pool_weight` token trials.

    >>> params = PolicyParams(pool_weight=8.0)
    >>> pooled_start({"mtp": DrafterStats(successes=60.0, trials=100.0)}, params)["mtp"]
    DrafterStats(successes=4.8, trials=8.0, observed_at=0, tried_at=0, probe_every=0)
    """
    start = {}
    for name, stats in pooled.items():
        scale = min(1.0, params.pool_weight / stats.trials) if stats.trials > 0 else 0.0
        start[name] = DrafterStats(successes=stats.successes * scale, trials=stats.trials * scale)
    return start


def batch_class(n_rows: int) -> int:
    """The batch sizes that share a cost line: 1, 4, 16, ... rows (the runtime compiles steps of these)."""
    size = 1
    while size < n_rows:
        size *= 4
    return size


def _target_line(costs: Costs, params: PolicyParams, batch_size: int, drafter: str | None = None
                 ) -> tuple[float, float]:
    """The (fixed, per_token) cost line of a target step of batch_size sequences drafted by `drafter` (None: not
    drafting), the fixed part shared by them: their batch class's one-iteration line for host drafters (or where no
    call loops), else its per-iteration line of looping calls; while the one has no measurement, the other."""
    rows = batch_class(batch_size)
    looped, single = costs.target.get(rows, LinearCost()), costs.single.get(rows, LinearCost())
    line = single if drafter in params.host_drafters or not params.loops else looped
    if line.w <= 0.0:  # one kind of call not measured yet: the other's line, never a unit-free default beside it
        line = looped if line is single else single
    calibrated = params.target_calibrated.get(rows)
    if calibrated is not None:
        step_fixed, per_token = line.coefficients(params.cost_ridge, 0.0, default=calibrated,
                                                  slope_seconds=calibrated[1])  # fmt: skip
    else:
        step_fixed, per_token = line.coefficients(
            params.cost_ridge, params.target_token_prior, default=(1.0, params.target_token_prior)
        )
    return step_fixed / max(batch_size, 1), per_token


def _best_option(name: str, alpha: float, config: SpeculativeConfig, costs: Costs, params: PolicyParams,
                 target: tuple[float, float]) -> tuple[int, float]:
    line = costs.proposals.get(name, LinearCost())
    proposal = line.coefficients(params.cost_ridge, slope_prior=0.0, default=(0.0, 0.0))
    return best_length(alpha, config.n_min, config.n_max, target, proposal)


def planned_length(state: SequenceState, drafter: str, config: SpeculativeConfig, costs: Costs,
                   params: PolicyParams, batch_size: int = 1) -> int:
    """The draft length `plan_step` would give `drafter` at the sequence's next step (from its plain acceptance
    estimate, or the longer probe length when its estimate is below the prior): what a drafter computing its draft
    a step early should make ready. 0 while the drafter is neither the main choice nor close to a probe (at most
    `probe_soon` steps away)."""
    stats = state.stats.get(drafter, DrafterStats())
    interval = stats.probe_every or params.probe_every
    if state.main not in (drafter, _UNSET) and state.step + 1 + params.probe_soon - stats.tried_at < interval:
        return 0
    alpha = max(acceptance(stats, params), params.prior_acceptance)
    return _best_option(drafter, alpha, config, costs, params, _target_line(costs, params, batch_size, drafter))[0]


def plan_step(
    state: SequenceState, config: SpeculativeConfig, costs: Costs, params: PolicyParams, batch_size: int = 1
) -> tuple[list[Choice], SequenceState]:
    """The drafters to try this step, in order, and the state after planning it. An empty list: do not draft.

    batch_size: how many sequences share the target step; each is charged its share of the step's fixed cost.
    """
    step = state.step + 1
    stats = {name: state.stats.get(name, DrafterStats()) for name in config.drafters}
    target = _target_line(costs, params, batch_size)
    no_draft_value = 1.0 / (target[0] + target[1])

    def options(name: str, alpha: float) -> tuple[int, float]:
        return _best_option(name, alpha, config, costs, params, _target_line(costs, params, batch_size, name))

    planned = {name: options(name, acceptance(stats[name], params)) for name in config.drafters}  # (length, value)
    judged: dict[str | None, float] = {
        name: options(name, pessimistic_acceptance(stats[name], params))[1] for name in config.drafters
    }
    judged[None] = no_draft_value
    ranked = sorted(judged, key=lambda name: -judged[name])  # stable: request order, then no drafting, on ties

    main = ranked[0]
    if state.main != _UNSET and state.main in judged:
        settling = step - state.main_since < params.min_dwell
        if settling or judged[main] <= (1.0 + params.switch_margin) * judged[state.main]:
            main = state.main
    main_value = planned[main][1] if main is not None else no_draft_value

    def wait(name: str) -> int:
        return params.probe_soon if planned[name][1] > main_value else stats[name].probe_every or params.probe_every

    due = [name for name in config.drafters if name != main and step - stats[name].tried_at >= wait(name)]
    probe = min(due, key=lambda name: stats[name].tried_at, default=None)  # the longest idle; request order on ties

    choices = []
    if probe is not None:
        alpha = max(acceptance(stats[probe], params), params.prior_acceptance)
        choices.append(Choice(probe, options(probe, alpha)[0], probe=True))
        interval = stats[probe].probe_every or params.probe_every
        if planned[probe][1] <= main_value:
            interval = min(2 * interval, params.probe_every_max)
        stats[probe] = replace(stats[probe], tried_at=step, probe_every=interval)
    fallbacks = sorted(  # only used when the choices before have nothing to propose: judged by the estimate
        (name for name in config.drafters if name not in (main, probe) and planned[name][1] > no_draft_value),
        key=lambda name: -planned[name][1],
    )
    for name in ([main] if main is not None and main != probe else []) + fallbacks:
        choices.append(Choice(name, planned[name][0]))
    if main is not None:
        stats[main] = replace(stats[main], tried_at=step, probe_every=params.probe_every)
    main_since = state.main_since if main == state.main else step
    return choices, SequenceState(step=step, main=main, main_since=main_since, stats={**state.stats, **stats})


# --- the engine's handle ------------------------------------------------------------------------------------------

class DrafterPolicy:
    """Per-sequence planning state plus the cost lines shared by all sequences; the engine feeds it measurements."""

    def __init__(self, params: PolicyParams = PolicyParams()):
        self.params = params
        self.costs = Costs()
        self.sequences: dict[SeqId, SequenceState] = {}
        self.pooled: dict[str, DrafterStats] = {}  # every sequence's evidence, per drafter (`pool_observation`)

    def _state(self, seq_id: SeqId) -> SequenceState:
        state = self.sequences.get(seq_id)
        return state if state is not None else SequenceState(stats=pooled_start(self.pooled, self.params))

    def record_target(self, seconds: float, n_tokens: float, iterations: int = 1, rows: int = 1) -> None:
        """A device call of `iterations` target steps over `rows` sequences took `seconds` per step, verifying
        `n_tokens` tokens per step on average (each sequence's 1 + drafts, plus prompt chunks). It goes on its batch
        class's lines: calls of one iteration on the one-iteration line (`Costs.single`), and on the per-iteration
        line too where no call loops."""
        decay, cls = self.params.cost_decay, batch_class(rows)

        def observed(lines: Mapping[int, LinearCost]) -> dict[int, LinearCost]:
            return {**lines, cls: lines.get(cls, LinearCost()).observed(n_tokens, seconds, decay)}

        if iterations > 1 or not self.params.loops:
            self.costs = replace(self.costs, target=observed(self.costs.target))
        if iterations == 1:
            self.costs = replace(self.costs, single=observed(self.costs.single))

    def token_seconds(self, n_rows: int) -> float:
        """What a verified token adds to a (looping) target step of n_rows sequences."""
        return _target_line(self.costs, self.params, n_rows)[1]

    def calibrate(self, steps: Mapping[tuple[int, int], float]) -> None:
        """Start from warm steps timed before serving, {(rows, tokens per row): seconds}. Each batch class's
        steps give its cost line until the engine reports a step of that class (`target_calibrated`), and then
        the slope, in seconds per verified token, that splits measurements sharing one n (as they do when every
        sequence keeps drafting the same length); `target_token_prior`, for classes not calibrated, is the one-row
        slope over the fixed cost. They are not recorded as measurements (see the module docstring)."""
        calibrated = dict(self.params.target_calibrated)
        for rows in sorted({B for B, _ in steps}):
            timed = sorted((T, seconds) for (B, T), seconds in steps.items() if B == rows)
            if len(timed) < 2:
                continue
            (t0, s0), (t1, s1) = timed[0], timed[-1]
            per_token = max(s1 - s0, 0.0) / (rows * (t1 - t0))
            fixed = s0 - per_token * rows * t0
            if fixed > 0.0:
                calibrated[batch_class(rows)] = (fixed, per_token)
                if rows == 1:
                    self.params = replace(self.params, target_token_prior=per_token / fixed)
        self.params = replace(self.params, target_calibrated=calibrated)

    def record_proposal(self, drafter: str, seconds: float, n_tokens: int) -> None:
        """`drafter` proposed `n_tokens` tokens for one sequence; `seconds` is that sequence's share of the call."""
        line = self.costs.proposals.get(drafter, LinearCost()).observed(n_tokens, seconds, self.params.cost_decay)
        self.costs = replace(self.costs, proposals={**self.costs.proposals, drafter: line})

    def plan(self, seq_id: SeqId, config: SpeculativeConfig, batch_size: int = 1) -> list[Choice]:
        """This step's drafters to try in order (the first non-empty draft is used); empty: do not draft.

        batch_size: the number of sequences in the target step, which share its fixed cost.
        """
        choices, self.sequences[seq_id] = plan_step(
            self._state(seq_id), config, self.costs, self.params, batch_size
        )
        return choices

    def length(self, seq_id: SeqId, drafter: str, config: SpeculativeConfig, batch_size: int = 1) -> int:
        """The draft length the sequence's next plan would give `drafter` (see `planned_length`)."""
        state = self._state(seq_id)
        return planned_length(state, drafter, config, self.costs, self.params, batch_size)

    def observe(self, seq_id: SeqId, drafter: str, drafted: int, accepted: int) -> None:
        """After verification: `accepted` of the `drafted` tokens that `drafter` proposed were accepted."""
        self.sequences[seq_id] = observe_draft(self._state(seq_id), drafter, drafted, accepted, self.params)
        self.pooled[drafter] = pool_observation(self.pooled.get(drafter, DrafterStats()), drafted, accepted,
                                                self.params)  # fmt: skip

    def acceptance(self, seq_id: SeqId, drafter: str) -> float:
        """The current per-token acceptance estimate of `drafter` for the sequence."""
        stats = self._state(seq_id).stats.get(drafter, DrafterStats())
        return acceptance(stats, self.params)

    def release(self, seq_id: SeqId) -> None:
        """Forget a finished sequence."""
        self.sequences.pop(seq_id, None)
