"""The batch gate: whether the drafts the policy chose per sequence pay for the step's batch as a whole (a row that
drafts lengthens the step for every row in it), and when a closed gate lets one step draft anyway to learn
acceptance (docs/design.md "The drafter policy")."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from drafters.base import Drafter
from drafters.policy import Choice, DrafterPolicy, drafting_pays, expected_accepted
from jaxmodel.executor import Runtime

from .step_times import StepTimes
from .types import SeqId

# A closed gate's probes: a step drafts after this many declined steps, then twice as many, up to the most.
GATE_PROBE_MIN, GATE_PROBE_MAX = 16, 128


@dataclass
class BatchGate:
    """The probe schedule of a gate that stays closed: one step drafts after GATE_PROBE_MIN declined steps, then
    twice as many, up to GATE_PROBE_MAX (a batch probe: acceptance is learnt only from drafts, and every row drafts
    in it, so that they share its padding); a step whose drafts pay resets the wait."""

    wait: int = 0  # declined steps until the next probe
    interval: int = GATE_PROBE_MIN

    def closed(self, declines: bool) -> bool:
        """Whether a step whose batch `declines` drafting drafts nothing (False for a probe)."""
        if not declines:
            self.wait, self.interval = 0, GATE_PROBE_MIN
            return False
        if self.wait > 0:
            self.wait -= 1
            return True
        self.wait, self.interval = self.interval, min(2 * self.interval, GATE_PROBE_MAX)
        return False


def batch_declines(planned: Mapping[SeqId, Sequence[Choice]], n_rows: int, *, runtime: Runtime,
                   step_times: StepTimes, policy: DrafterPolicy, drafters: Mapping[str, Drafter]) -> bool:
    """Whether the drafts the policy chose per sequence would cost the step's batch of n_rows rows more than they
    return. Where the engine has measured both at this batch size: whether its calls drafting with the drafter most
    rows chose committed fewer tokens per second than its calls in which no row drafted (all of it measured: the
    padding, rows without a draft, the chain, the rebuild). Until then an estimate (`policy.drafting_pays`): the
    step at the longest draft's padded length against the plain step (`step_times`: measured under load where both
    are, in calls of one iteration where a drafter drafts on the host; else calibrated, then with the MTP chain's
    calibrated cost added), for every row's expected accepted drafts at its acceptance estimate. No price yet: no
    decline."""
    firsts = [(seq_id, options[0]) for seq_id, options in planned.items() if options]
    if not firsts or runtime.shapes is None:
        return False
    B = runtime.shapes.batch(n_rows)
    drafter = Counter(choice.drafter for _, choice in firsts).most_common(1)[0][0]
    rates = step_times.plain_and_drafting_rates(B, drafter)
    if rates is not None:
        return rates[1] <= rates[0]
    longest = max(choice.n_draft for _, choice in firsts)
    T = runtime.shapes.tokens(1 + longest)
    host = any(c.drafter in policy.params.host_drafters for _, c in firsts)
    prices = step_times.plain_and_drafting(B, T, host)
    if prices is None:
        return False
    plain, drafting, measured = prices
    if not measured and any(drafters[c.drafter].device_chain(seq_id, 1) > 0 for seq_id, c in firsts):
        drafting += runtime.costs.chain_cost(n_rows) * longest
    gain = sum(expected_accepted(policy.acceptance(seq_id, c.drafter), c.n_draft) for seq_id, c in firsts)
    return not drafting_pays(n_rows, gain, plain, drafting)
