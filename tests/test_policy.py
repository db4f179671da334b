"""Drafter policy on recorded acceptance sequences: which drafter, how long, and staying stable."""

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from drafters.policy import Costs, DrafterPolicy, DrafterStats, LinearCost, PolicyParams, SequenceState, best_length, expected_accepted, planned_length
from jaxmodel.requests import SpeculativeConfig

TARGET = (0.010, 0.001)  # the simulated target step: 10 ms + 1 ms per verified token
PROPOSAL_PER_TOKEN = {"a": 0.0005, "b": 0.0005, "mtp": 0.0005, "ngram": 0.00001, "slow": 0.005}


def recorded(alpha, steps=1000, seed=0):
    """A recorded acceptance sequence: per step, how many leading draft tokens the target would accept.

    Each token is accepted with probability alpha (a constant or a function of the step) given the ones before it.
    """
    rng = random.Random(seed)
    rate = alpha if callable(alpha) else (lambda step: alpha)
    runs = []
    for step in range(steps):
        run = 0
        while run < 64 and rng.random() < rate(step):
            run += 1
        runs.append(run)
    return runs


def simulate(policy, config, streams, steps, batch_size=1, empty=lambda name, step: False):
    """Run the engine's side: plan, draft from recorded outcomes, verify, and report costs and acceptance.

    streams: drafter -> recorded acceptance runs; a draft of d tokens at step t gets min(d, run[t]) accepted.
    Returns one (drafter used or None, length, probe, main choice) per step.
    """
    log = []
    for step in range(steps):
        used = None
        for choice in policy.plan(0, config, batch_size):
            drafted = 0 if empty(choice.drafter, step) else choice.n_draft
            policy.record_proposal(choice.drafter, PROPOSAL_PER_TOKEN[choice.drafter] * drafted, drafted)
            if drafted:
                used = choice
                break
        drafted = used.n_draft if used else 0
        policy.record_target(TARGET[0] + TARGET[1] * (1 + drafted) * batch_size, (1 + drafted) * batch_size,
                             rows=batch_size)
        if used:
            policy.observe(0, used.drafter, drafted, min(drafted, streams[used.drafter][step]))
        log.append((used.drafter if used else None, drafted, bool(used and used.probe), policy.sequences[0].main))
    return log


def main_switches(log, start=0):
    mains = [entry[3] for entry in log[start:]]
    return sum(1 for before, after in zip(mains, mains[1:]) if before != after)


# --- the value model ----------------------------------------------------------------------------------------------

def test_expected_accepted():
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_accepted(0.0, 8) == 0.0
    assert expected_accepted(1.0, 8) == 8.0
    assert expected_accepted(0.999999, 8) == pytest.approx(8.0, rel=1e-4)


@given(
    alpha=st.floats(0.0, 0.99),
    n_min=st.integers(1, 4),
    span=st.integers(0, 40),
    per_token=st.floats(1e-5, 1e-2),
    proposal=st.floats(0.0, 1e-2),
)
def test_best_length_is_the_argmax_and_grows_with_acceptance(alpha, n_min, span, per_token, proposal):
    n_max = n_min + span
    target, line = (0.01, per_token), (0.0, proposal)
    d, value = best_length(alpha, n_min, n_max, target, line)

    def value_of(k):
        return (1 + expected_accepted(alpha, k)) / (target[0] + target[1] * (1 + k) + line[1] * k)

    assert n_min <= d <= n_max
    assert value == pytest.approx(max(value_of(k) for k in range(n_min, n_max + 1)))
    assert best_length(min(alpha + 0.05, 1.0), n_min, n_max, target, line)[0] >= d
    assert best_length(alpha, n_min, n_max, (0.01, per_token * 2), line)[0] <= d


def test_cost_line_fit():
    line = LinearCost()
    assert line.coefficients(1.0, 0.0, default=(1.0, 0.0)) == (1.0, 0.0)
    for n in [1, 5, 2, 9, 17, 3, 33, 1, 8]:
        line = line.observed(n, 0.02 + 0.003 * n, decay=0.98)
    fixed, per_token = line.coefficients(1.0, 0.0, default=(1.0, 0.0))
    assert fixed == pytest.approx(0.02, rel=0.02) and per_token == pytest.approx(0.003, rel=0.02)
    same_n = LinearCost()
    for _ in range(20):
        same_n = same_n.observed(9, 0.05, decay=0.98)
    fixed, per_token = same_n.coefficients(1.0, 1.0 / 16, default=(1.0, 0.0))
    assert fixed + 9 * per_token == pytest.approx(0.05, rel=1e-3)  # the data is fitted; the prior only splits it
    assert per_token == pytest.approx(fixed / 16, rel=1e-3)


def test_calibration_splits_the_target_cost_and_decides_drafting():
    """Warm steps timed before serving set the fixed/per-token split that later measurements, all of one length
    while a sequence keeps drafting the same, cannot: where a verify step of up to 4 tokens costs 3.4x a decoding
    step, a drafter accepted 70% of the time does not pay; where it costs 1.5x, it does."""
    config = SpeculativeConfig(("mtp",), n_max=3)
    runs = recorded(0.7, steps=400)
    for verify_cost, pays in ((3.4e-3, False), (1.5e-3, True)):
        policy = DrafterPolicy()
        policy.calibrate({(1, 1): 1.0e-3, (1, 4): verify_cost})
        per_token = (verify_cost - 1.0e-3) / 3
        assert policy.params.target_token_prior == pytest.approx(per_token / (1.0e-3 - per_token))
        drafting = []
        for step in range(400):
            choices = policy.plan(0, config)
            d = choices[0].n_draft if choices else 0
            policy.record_target(verify_cost if d else 1.0e-3, 1 + d)
            if d:
                policy.record_proposal("mtp", 1.0e-4 * d, d)
                policy.observe(0, "mtp", d, min(d, runs[step]))
            drafting.append(d > 0)
        assert (sum(drafting[200:]) > 150) is pays
        fixed, slope = policy.costs.target[1].coefficients(policy.params.cost_ridge, policy.params.target_token_prior,
                                                           default=(1.0, 0.0))  # fmt: skip
        assert fixed + slope == pytest.approx(1.0e-3, rel=0.15)  # a decoding step, seen only in the calibration


def test_cheaper_live_steps_do_not_read_as_a_cost_per_token():
    """The engine reports a call of several iterations per iteration, so a plain phase reports steps far cheaper
    than the calibration's single calls (host overhead included). On a GPU, where a verify step of 4 tokens costs
    what a decoding step does, those reports must not turn into a cost per verified token: MTP, accepted 70% of the
    time, is still drafted after 60 plain reports (measured on an H100: calibrated 2.49 / 2.39 ms, live 0.3 ms)."""
    policy = DrafterPolicy()
    policy.calibrate({(1, 1): 2.49e-3, (1, 4): 2.39e-3})
    for _ in range(60):
        policy.record_target(0.3e-3, 1)
    config = SpeculativeConfig(("mtp",), n_max=3)
    runs = recorded(0.7, steps=200)
    drafted = 0
    for step in range(200):
        choices = policy.plan(1, config)
        d = choices[0].n_draft if choices else 0
        policy.record_target(0.3e-3 + 0.01e-3 * d, 1 + d)
        if d:
            policy.record_proposal("mtp", 0.05e-3 * d, d)
            policy.observe(1, "mtp", d, min(d, runs[step]))
        drafted += d > 0
    assert drafted > 150


def test_sharing_the_step_shortens_drafts():
    alone = best_length(0.8, 1, 64, (0.01, 0.001), (0.0, 0.0005))[0]
    shared = best_length(0.8, 1, 64, (0.01 / 64, 0.001), (0.0, 0.0005))[0]
    assert shared < alone


# --- choosing drafters --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("order", [("a", "b"), ("b", "a")])
def test_equal_statistics_follow_request_order(order):
    policy = DrafterPolicy()
    choices = policy.plan(0, SpeculativeConfig(order, n_max=8))
    assert [c.drafter for c in choices] == list(order)
    assert not any(c.probe for c in choices)


def test_switches_to_the_drafter_that_pays_and_stays():
    log = simulate(
        DrafterPolicy(), SpeculativeConfig(("a", "b"), n_max=16), {"a": recorded(0.3), "b": recorded(0.8, seed=1)}, 400
    )
    assert log[0][0] == "a"  # the request's order first
    assert any(entry[0] == "b" and entry[2] for entry in log[:8])  # "b" looked promising: probed early
    assert all(entry[3] == "b" for entry in log[10:])
    assert main_switches(log) == 1
    probes = [step for step, entry in enumerate(log) if entry[2] and step >= 10]
    assert 2 <= len(probes) <= 6 and all(log[step][0] == "a" for step in probes)  # "a" is still tried, rarely


@pytest.mark.parametrize("seed", range(4))
def test_close_drafters_do_not_flap(seed):
    params = PolicyParams()
    streams = {"a": recorded(0.62, seed=seed), "b": recorded(0.68, seed=seed + 100)}
    log = simulate(DrafterPolicy(params), SpeculativeConfig(("a", "b"), n_max=16), streams, 600)
    mains = [entry[3] for entry in log]
    switches = [step for step in range(1, 600) if mains[step] != mains[step - 1]]
    assert len(switches) <= 3
    assert all(later - earlier >= params.min_dwell for earlier, later in zip(switches, switches[1:]))


def test_cost_decides_between_equally_accepted_drafters():
    streams = {"slow": recorded(0.7), "mtp": recorded(0.7)}  # equally accepted; "slow" costs 10x per token
    log = simulate(DrafterPolicy(), SpeculativeConfig(("slow", "mtp"), n_max=16), streams, 200)
    assert log[0][0] == "slow"
    assert all(entry[3] == "mtp" for entry in log[40:])


def test_bad_drafter_recovers():
    params = PolicyParams()
    turn = 300
    log = simulate(
        DrafterPolicy(params),
        SpeculativeConfig(("a", "b"), n_max=16),
        {"a": recorded(lambda step: 0.1 if step < turn else 0.95), "b": recorded(0.6, seed=1)},
        turn + 2 * params.probe_every_max,
    )
    assert all(entry[3] == "b" for entry in log[20:turn])
    assert log[-1][3] == "a" and all(entry[3] == "a" for entry in log[-params.probe_every_max :])


def test_no_drafting_when_nothing_pays():
    params = PolicyParams()
    log = simulate(DrafterPolicy(params), SpeculativeConfig(("slow",), n_max=16), {"slow": recorded(0.0)}, 300)
    drafting = [step for step, entry in enumerate(log) if entry[0] is not None]
    assert drafting[: params.min_dwell] == list(range(params.min_dwell))  # the first choice, held a while
    probes = drafting[params.min_dwell :]
    assert all(log[step][2] for step in probes) and 3 <= len(probes) <= 5  # probes, ever less often
    assert all(later - earlier >= 16 for earlier, later in zip(probes, probes[1:]))


def test_fallback_when_the_first_drafter_has_nothing():
    # n-gram first: it pays when it has a match, and the model drafter covers the steps where it has none
    log = simulate(
        DrafterPolicy(),
        SpeculativeConfig(("ngram", "mtp"), n_max=16),
        {"ngram": recorded(0.9), "mtp": recorded(0.6, seed=1)},
        300,
        empty=lambda name, step: name == "ngram" and (step // 20) % 2 == 1,
    )
    used = [entry[0] for entry in log[20:]]
    assert used.count("ngram") > 100 and used.count("mtp") > 100 and used.count(None) == 0
    assert main_switches(log, start=20) <= 2


# --- draft length -------------------------------------------------------------------------------------------------

def test_draft_length_follows_acceptance():
    config = SpeculativeConfig(("mtp",), n_max=32, n_min=1)
    log = simulate(DrafterPolicy(), config, {"mtp": recorded(lambda step: 0.9 if step < 200 else 0.3)}, 400)
    lengths = [entry[1] for entry in log]
    high, low = lengths[150:200], lengths[-50:]
    assert sum(high) / 50 >= 6 and max(high) <= 16
    assert sum(low) / 50 <= 2
    assert min(lengths) >= 1 and max(lengths) <= 32


def test_respects_n_min_and_n_max():
    for n_min, n_max in [(1, 2), (4, 8), (6, 6)]:
        config = SpeculativeConfig(("a", "b"), n_max=n_max, n_min=n_min)
        log = simulate(DrafterPolicy(), config, {"a": recorded(0.97), "b": recorded(0.2, seed=1)}, 150)
        assert all(n_min <= entry[1] <= n_max for entry in log if entry[0] is not None)
    with pytest.raises(ValueError):
        SpeculativeConfig(("a",), n_max=2, n_min=3)


def test_deterministic_and_released():
    runs = []
    for _ in range(2):
        policy = DrafterPolicy()
        runs.append(simulate(policy, SpeculativeConfig(("a", "b")), {"a": recorded(0.5), "b": recorded(0.7)}, 100))
    assert runs[0] == runs[1]
    assert policy.acceptance(0, "b") > policy.acceptance(0, "a")
    policy.release(0)
    assert 0 not in policy.sequences
    # a new sequence starts from the record the released one left, not from its own last estimate
    assert policy.acceptance(0, "b") > policy.acceptance(0, "a")
    assert DrafterPolicy().acceptance(0, "b") == PolicyParams().prior_acceptance


@pytest.mark.parametrize("earlier_accepted", [3, 0])
def test_new_sequences_start_from_what_earlier_sequences_showed(earlier_accepted):
    """Short requests plan too few steps to earn trust on their own: the first step of a new sequence drafts when
    earlier sequences' drafts were accepted and does not when they were rejected, where the prior alone decides
    the other way."""
    config = SpeculativeConfig(("mtp",), n_max=3)
    per_token = 0.012 if earlier_accepted else 0.0  # at the prior, drafting pays only when verified tokens are free
    policy = DrafterPolicy()
    for n in (1, 4) * 20:
        policy.record_target(0.010 + per_token * n, n)
    policy.record_proposal("mtp", 0.0 if earlier_accepted else 0.006, 3)
    assert bool(policy.plan("fresh", config)) != bool(earlier_accepted)  # the prior alone
    for _ in range(12):
        policy.observe("earlier", "mtp", 3, earlier_accepted)
    policy.release("earlier")
    assert bool(policy.plan("new", config)) == bool(earlier_accepted)


def test_planned_length_readies_drafts_only_for_the_main_choice_or_a_coming_probe():
    """A drafter that drafts a step early (the MTP head, inside the target's step) is asked for a chain only when
    the next plan may use it."""
    params = PolicyParams()
    config = SpeculativeConfig(("mtp",), n_max=4)
    costs = Costs()
    fresh = SequenceState()
    assert planned_length(fresh, "mtp", config, costs, params) >= 1  # nothing decided yet
    main = SequenceState(step=10, main="mtp", main_since=1, stats={"mtp": DrafterStats(8.0, 9.0, 10, 10)})
    assert planned_length(main, "mtp", config, costs, params) >= 1
    idle = SequenceState(step=10, main=None, main_since=1, stats={"mtp": DrafterStats(0.0, 4.0, 9, 9)})
    assert planned_length(idle, "mtp", config, costs, params) == 0
    probe_due = SequenceState(step=9 + params.probe_every - params.probe_soon, main=None, main_since=1,
                              stats={"mtp": DrafterStats(0.0, 4.0, 9, 9)})
    assert planned_length(probe_due, "mtp", config, costs, params) >= 1


def test_host_drafters_pay_for_the_calls_they_keep_from_looping():
    """Costs as measured on an H100: 0.6 ms per iteration of a call that loops, 2.8 ms for a call of one. The n-gram
    drafter proposes on the host, so its steps run one iteration per call: not worth it even at 90% acceptance,
    while MTP (chained on device, so its steps loop) at 63% is."""
    policy = DrafterPolicy(PolicyParams(loops=True, host_drafters=frozenset({"ngram"})))
    policy.calibrate({(1, 1): 2.8e-3, (1, 4): 2.75e-3})
    for _ in range(20):
        policy.record_target(0.60e-3, 1, iterations=8)
        policy.record_target(0.65e-3, 4, iterations=8)
        policy.record_target(2.80e-3, 4, iterations=1)
    for _ in range(12):
        policy.observe("earlier", "ngram", 3, 3)
        policy.observe("earlier", "mtp", 3, 2)
    assert [c.drafter for c in policy.plan("both", SpeculativeConfig(("ngram", "mtp"), n_max=3))] == ["mtp"]
    assert policy.plan("n-gram only", SpeculativeConfig(("ngram",), n_max=3)) == []


def test_each_batch_size_has_its_own_cost_line():
    """Costs as measured on an H100: at one row a plain iteration 0.6 ms and an MTP iteration (4 tokens and the
    chain) 1 ms, at 16 rows a plain iteration 1.5 ms; warm steps of 16 rows 2.40 ms at 1 token per row and 2.52 ms
    at 4. A fixed draft of 3 decoded 1.45x plain at 16 streams there: MTP drafts at 16 rows. Priced by the one-row
    slope (0.13 ms per token, extrapolated to 64 tokens), it would not."""
    policy = DrafterPolicy(PolicyParams(loops=True))
    policy.calibrate({(1, 1): 2.8e-3, (1, 4): 2.75e-3, (16, 1): 2.40e-3, (16, 4): 2.52e-3})
    assert policy.params.target_calibrated[16][1] == pytest.approx(0.12e-3 / 48)
    for _ in range(20):
        policy.record_target(0.6e-3, 1, iterations=8, rows=1)
        policy.record_target(1.0e-3, 4, iterations=8, rows=1)
        policy.record_target(1.5e-3, 16, iterations=8, rows=16)
    for _ in range(12):
        policy.observe("earlier", "mtp", 3, 2)
    config = SpeculativeConfig(("mtp",), n_max=3)
    assert [c.drafter for c in policy.plan("one of 16", config, batch_size=16)] == ["mtp"]
    assert policy.token_seconds(16) < policy.token_seconds(1) / 10


def test_a_kind_of_call_not_yet_measured_is_priced_by_the_other():
    """An engine without warm-up whose first steps ran one iteration each has measured only its one-iteration line.
    Not drafting (priced by the looping line) must then take that line's seconds, not the unit-free default of
    one per step, beside which every draft would look nearly free: here verified tokens cost 2 ms each, and at
    the prior's acceptance drafting does not pay."""
    policy = DrafterPolicy(PolicyParams(loops=True, host_drafters=frozenset({"ngram"})))
    for _ in range(20):
        policy.record_target(2.0e-3, 1, iterations=1)
        policy.record_target(8.0e-3, 4, iterations=1)
    policy.record_proposal("ngram", 0.0, 3)
    assert policy.plan("s", SpeculativeConfig(("ngram",), n_max=3)) == []


def test_the_worked_examples_of_the_batch_gate_hold():
    """`drafting_pays` and the step prices it reads (`scheduler.step_times`): measured under load where both are,
    calibrated otherwise, never one of each."""
    import doctest

    import drafters.policy
    import scheduler.step_times

    assert doctest.testmod(drafters.policy).failed == 0
    assert doctest.testmod(scheduler.step_times).failed == 0
