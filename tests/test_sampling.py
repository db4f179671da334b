"""Sampling and verification: greedy cases, filters, reproducibility, and the target distribution kept exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmodel.sampling import SamplingParams, process_logits, sample, verify

V = 8
verify_jit = jax.jit(verify)
sample_jit = jax.jit(sample)


def target_distribution(logits, temperature, top_p=1.0, top_k=0):
    """numpy reference of the processed distribution q: temperature, top-k, then top-p."""
    z = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-z)
    keep = np.zeros(len(z), bool)
    keep[order[: top_k if top_k > 0 else len(z)]] = True
    probs = np.where(keep, np.exp(z - z.max()), 0.0)
    probs /= probs.sum()
    mass_before = 0.0
    for rank, token in enumerate(order):
        if not keep[token]:
            continue
        if rank > 0 and mass_before >= top_p:
            keep[token] = False
        mass_before += probs[token]
    q = np.where(keep, np.exp(z - z.max()), 0.0)
    return q / q.sum()


def chi_square_ok(samples, expected, n_bins=V):
    """Pearson's test at the 0.999 level (Wilson-Hilferty critical value); impossible tokens must never appear."""
    counts = np.bincount(np.asarray(samples), minlength=n_bins).astype(np.float64)
    support = expected > 0
    if counts[~support].sum() > 0:
        return False
    n = counts.sum()
    stat = np.sum((counts[support] - n * expected[support]) ** 2 / (n * expected[support]))
    df = support.sum() - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * np.sqrt(2 / (9 * df))) ** 3
    return stat < critical


# --- greedy -------------------------------------------------------------------------------------------------------

def greedy_logits(argmaxes):
    """[B, R] argmax tokens -> [B, R, V] logits with those argmaxes."""
    argmaxes = np.asarray(argmaxes)
    logits = np.random.default_rng(0).normal(size=argmaxes.shape + (V,)).astype(np.float32)
    np.put_along_axis(logits, argmaxes[..., None], 10.0, axis=-1)
    return jnp.asarray(logits)


def test_greedy_all_none_partial_and_padding():
    argmaxes = [[3, 1, 4, 1], [3, 1, 4, 1], [3, 1, 4, 1], [5, 2, 6, 7]]
    drafts = jnp.asarray([[3, 1, 4], [2, 1, 4], [3, 1, 5], [5, 2, 6]], jnp.int32)
    n_drafts = jnp.asarray([3, 3, 3, 2], jnp.int32)  # row 3's third draft (6) would match but is padding
    params = SamplingParams.of(0.0, batch=4)
    positions = jnp.zeros(4, jnp.int32)
    for probs in (None, jnp.full((4, 3, V), 1.0 / V, jnp.float32)):  # deterministic drafts, then soft ones
        n_accepted, tokens = verify_jit(greedy_logits(argmaxes), drafts, probs, n_drafts, params, positions)
        assert n_accepted.tolist() == [3, 0, 2, 2]
        assert tokens.tolist() == [[3, 1, 4, 1], [3, -1, -1, -1], [3, 1, 4, -1], [5, 2, 6, -1]]


def test_no_drafts_is_plain_sampling():
    logits = greedy_logits([[1, 2, 3, 4]] * 4)
    params = SamplingParams.of([0.0, 0.7, 1.0, 1.3], seed=[1, 2, 3, 4])
    positions = jnp.asarray([0, 5, 9, 100], jnp.int32)
    zeros = jnp.zeros((4, 3), jnp.int32)
    n_accepted, tokens = verify_jit(logits, zeros, None, jnp.zeros(4, jnp.int32), params, positions)
    assert n_accepted.tolist() == [0, 0, 0, 0]
    assert tokens[:, 0].tolist() == sample_jit(logits[:, 0], params, positions).tolist()
    assert (tokens[:, 1:] == -1).all()


# --- filters ------------------------------------------------------------------------------------------------------

def test_top_k_and_top_p_masks():
    logits = jnp.log(jnp.asarray([[0.05, 0.4, 0.1, 0.3, 0.15, 0.0 + 1e-9, 0.0 + 1e-9, 0.0 + 1e-9]] * 4))
    temperature = jnp.ones(4)
    top_p = jnp.asarray([1.0, 0.6, 0.75, 0.3])
    top_k = jnp.asarray([2, 0, 3, 0], jnp.int32)
    kept = np.isfinite(np.asarray(process_logits(logits, temperature, top_p, top_k)))
    assert kept[0].nonzero()[0].tolist() == [1, 3]  # top-2
    assert kept[1].nonzero()[0].tolist() == [1, 3]  # 0.4 < 0.6, then 0.7 >= 0.6 stops
    assert kept[2].nonzero()[0].tolist() == [1, 3]  # top-3 renormalised: 0.47, 0.35 -> 0.82 >= 0.75
    assert kept[3].nonzero()[0].tolist() == [1]  # the most probable token is always kept
    greedy = process_logits(logits, jnp.zeros(4), top_p, top_k)
    assert np.isfinite(np.asarray(greedy)).all()  # greedy rows are not filtered
    for row in range(4):
        expected = target_distribution(np.asarray(logits[row]), 1.0, float(top_p[row]), int(top_k[row]))
        got = np.asarray(jax.nn.softmax(process_logits(logits[row], temperature[row], top_p[row], top_k[row])))
        np.testing.assert_allclose(got, expected, atol=1e-6)


# --- reproducibility ----------------------------------------------------------------------------------------------

def test_same_seed_same_tokens_and_drafts_do_not_change_them():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(4, 4, V)).astype(np.float32))
    params = SamplingParams.of(1.0, seed=[7, 7, 8, 9])
    positions = jnp.asarray([3, 3, 3, 3], jnp.int32)
    drafts = jnp.asarray(rng.integers(0, V, size=(4, 3)), jnp.int32)
    n_drafts = jnp.full(4, 3, jnp.int32)
    first = verify_jit(logits, drafts, None, n_drafts, params, positions)
    again = verify_jit(logits, drafts, None, n_drafts, params, positions)
    assert all((a == b).all() for a, b in zip(first, again))
    # deterministic drafts: every committed token is the one plain sampling draws at that position
    n_accepted, tokens = first
    for r in range(4):
        plain = sample_jit(logits[:, r], params, positions + r)
        for b in range(4):
            if r <= n_accepted[b]:
                assert tokens[b, r] == plain[b]


def test_one_hot_rows_in_a_soft_batch_match_deterministic_drafts():
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(4, 4, V)).astype(np.float32))
    positions = jnp.asarray([0, 1, 2, 3], jnp.int32)
    n_drafts = jnp.asarray([3, 3, 2, 1], jnp.int32)
    for seed in range(0, 40, 4):
        params = SamplingParams.of(0.9, seed=[seed, seed + 1, seed + 2, seed + 3])
        drafts = jnp.asarray(rng.integers(0, V, size=(4, 3)), jnp.int32)
        deterministic = verify_jit(logits, drafts, None, n_drafts, params, positions)
        one_hot = verify_jit(logits, drafts, jax.nn.one_hot(drafts, V), n_drafts, params, positions)
        assert all((a == b).all() for a, b in zip(deterministic, one_hot))


def test_seed_and_position_change_the_draws():
    logits = jnp.zeros((4, V))
    base = sample_jit(logits, SamplingParams.of(1.0, seed=[1, 2, 3, 4]), jnp.zeros(4, jnp.int32))
    again = sample_jit(logits, SamplingParams.of(1.0, seed=[1, 2, 3, 4]), jnp.zeros(4, jnp.int32))
    assert (base == again).all()
    many = [sample_jit(logits, SamplingParams.of(1.0, seed=[1, 2, 3, 4]), jnp.full(4, p, jnp.int32)) for p in range(8)]
    assert len({tuple(np.asarray(m).tolist()) for m in many}) > 1
    other = [sample_jit(logits, SamplingParams.of(1.0, seed=[s, 2, 3, 4]), jnp.zeros(4, jnp.int32)) for s in range(8)]
    assert len({int(o[0]) for o in other}) > 1


# --- the target distribution is kept ------------------------------------------------------------------------------

N = 4096
ROW_LOGITS = np.log(
    np.asarray(
        [
            [0.30, 0.05, 0.25, 0.02, 0.08, 0.10, 0.15, 0.05],
            [0.05, 0.10, 0.05, 0.40, 0.10, 0.20, 0.05, 0.05],
            [0.11, 0.12, 0.13, 0.14, 0.10, 0.15, 0.09, 0.16],
        ]
    )
)
DRAFT_PROBS = np.asarray(
    [
        [0.10, 0.20, 0.10, 0.10, 0.10, 0.30, 0.05, 0.05],
        [0.05, 0.05, 0.10, 0.20, 0.30, 0.20, 0.05, 0.05],
    ]
)


@pytest.mark.parametrize("temperature, top_p, top_k", [(1.0, 1.0, 0), (0.8, 0.9, 6)])
@pytest.mark.parametrize("soft", [False, True])
def test_emitted_tokens_follow_the_target(soft, temperature, top_p, top_k):
    rng = np.random.default_rng(42)
    logits = jnp.asarray(np.broadcast_to(ROW_LOGITS, (N, 3, V)).astype(np.float32))
    if soft:
        drafts = np.stack([rng.choice(V, size=N, p=p) for p in DRAFT_PROBS], axis=1)
        probs = jnp.asarray(np.broadcast_to(DRAFT_PROBS, (N, 2, V)).astype(np.float32))
    else:
        drafts = np.broadcast_to(np.asarray([0, 3]), (N, 2))
        probs = None
    params = SamplingParams.of(temperature, top_p, top_k, seed=np.arange(N) + 1000 * soft)
    n_accepted, tokens = verify_jit(
        logits, jnp.asarray(drafts, jnp.int32), probs, jnp.full(N, 2, jnp.int32), params, jnp.full(N, 17, jnp.int32)
    )
    n_accepted, tokens = np.asarray(n_accepted), np.asarray(tokens)
    q = [target_distribution(ROW_LOGITS[r], temperature, top_p, top_k) for r in range(3)]

    assert chi_square_ok(tokens[:, 0], q[0])
    assert chi_square_ok(tokens[n_accepted >= 1, 1], q[1])  # the second token, given the first draft was accepted
    assert chi_square_ok(tokens[n_accepted >= 2, 2], q[2])
    # the acceptance rate of the first draft is sum_x min(p(x), q(x)); for a one-hot p that is q(draft)
    p0 = DRAFT_PROBS[0] if soft else np.eye(V)[0]
    expected_rate = np.minimum(p0, q[0]).sum()
    assert abs((n_accepted >= 1).mean() - expected_rate) < 4 * np.sqrt(expected_rate * (1 - expected_rate) / N)
    # the test has the power to see a wrong distribution
    if soft:
        assert not chi_square_ok(drafts[:, 0], q[0])
    else:
        assert not chi_square_ok(tokens[:, 0], np.full(V, 1.0 / V))
