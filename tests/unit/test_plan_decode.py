"""The shrinking-batch decode model (issue 21 item 5): expected decode time against a direct sum
over every outcome of small length distributions, the log-normal survival against its
closed form, the partial-rollout round length by hand."""

from __future__ import annotations

import itertools
import math
from statistics import NormalDist

import numpy as np
import pytest

from megagrpo.plan.decode import (
    budget_steps,
    expected_decode_s,
    lognormal_survival,
    partial_round,
    synchronous_round,
)

A, B = 0.05, 0.002  # an affine step cost: a + b n seconds


def _affine(n, context):
    return A + B * n


def _survival(pmf: dict[int, float], max_tokens: int) -> np.ndarray:
    return np.array([sum(p for L, p in pmf.items() if L > t) for t in range(max_tokens)])


@pytest.mark.parametrize(
    ("pmf", "n"),
    [({2: 0.5, 4: 0.5}, 2), ({1: 0.2, 3: 0.5, 5: 0.3}, 3), ({2: 0.25, 6: 0.75}, 4)],
)
def test_expected_decode_equals_the_direct_sum_over_outcomes(pmf, n):
    """Every joint outcome of n i.i.d. lengths: steps run while any completion runs, each
    costs c(running); the expectation is the model's sum over steps."""
    max_tokens = max(pmf)
    want = 0.0
    for lengths in itertools.product(pmf, repeat=n):
        prob = math.prod(pmf[L] for L in lengths)
        steps = sum(_affine(sum(L > t for L in lengths), t) for t in range(max(lengths)))
        want += prob * steps
    shape = synchronous_round(_survival(pmf, max_tokens), n)
    assert expected_decode_s(shape, n, _affine) == pytest.approx(want, rel=1e-12)
    # expected steps: E[longest completion]
    longest = sum(
        math.prod(pmf[L] for L in ls) * max(ls) for ls in itertools.product(pmf, repeat=n)
    )
    assert shape.expected_steps == pytest.approx(longest, rel=1e-12)


def test_every_completion_at_max_tokens_is_the_full_batch():
    s = lognormal_survival(8.0, 0.0, 8)  # sigma 0: every completion of the mean length
    assert s.tolist() == [1.0] * 8
    shape = synchronous_round(s, 10)
    assert expected_decode_s(shape, 10, _affine) == pytest.approx(8 * (A + B * 10))


def test_lognormal_survival_closed_form():
    mean, sigma, max_tokens = 1100.0, 0.6, 4096
    s = lognormal_survival(mean, sigma, max_tokens)
    mu = math.log(mean) - sigma**2 / 2
    dist = NormalDist(mu, sigma)
    for t in (16, 100, 900, 1100, 3000, 4095):
        assert s[t] == pytest.approx(1 - dist.cdf(math.log(t)), abs=1e-12)
    assert (s[:16] == 1).all() and len(s) == max_tokens  # clipped to [16, max_tokens]
    assert math.exp(mu) == pytest.approx(918.8, abs=0.1)  # median (bench_packing: ~900)
    # sum_t P(L > t) = E[ceil(L)]: the mean (+ ~0.5) when nothing is clipped
    wide = lognormal_survival(mean, sigma, 200_000)
    assert wide.sum() == pytest.approx(mean + 0.5, rel=2e-3)


def test_partial_round_length_and_cohorts_by_hand():
    """Lengths uniform on 1..8 (S[t] = (8 - t) / 8), staleness 1, chunk 1: the fraction
    finished (1 - S[2T]) / (S[0] + S[T]) is 0.133, 0.286, 0.46, 0.67 at T = 1..4."""
    s = np.array([(8 - t) / 8 for t in range(8)])
    assert budget_steps(s, 0.5, 1, 1) == 4
    assert budget_steps(s, 0.25, 1, 1) == 2
    assert budget_steps(s, 0.25, 1, 3) == 3  # whole chunks only
    r = partial_round(s, 10, 0.25, 1, 1)
    # head: new completions + the cohort carried with 2 tokens; tail: that cohort to its end
    assert r.running.tolist() == pytest.approx([14 / 8, 12 / 8, 4 / 8, 3 / 8, 2 / 8, 1 / 8])
    tail = np.array([4, 3, 2, 1]) / 8
    head = [1, 1 - (1 / 8) ** 10 * (3 / 8) ** 10]
    assert r.p_any.tolist() == pytest.approx([*head, *(1 - (1 - tail) ** 10)], rel=1e-12)
    assert r.in_flight == pytest.approx(1 + 6 / 8) and r.round_tokens == 2
    assert r.carried_context == pytest.approx(2 * 6 / 8)  # prefixes re-prefilled
    assert r.context[:2].tolist() == pytest.approx([1.5 / (14 / 8), 22 / 12])
    # staleness 0: every completion finishes in its round, the synchronous round
    sync = synchronous_round(s, 10)
    r0 = partial_round(s, 10, 0.5, 0, 1)
    assert r0.running.tolist() == pytest.approx(sync.running.tolist())
    assert expected_decode_s(r0, 10, _affine) == pytest.approx(
        expected_decode_s(sync, 10, _affine), rel=1e-12
    )
