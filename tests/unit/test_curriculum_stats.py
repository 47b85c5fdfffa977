"""Collapse statistics, levels and the beta-binomial prediction against closed forms and the
article's tables (../shared/seed/article-ja.txt sections 2.3, 3.2, 5.2)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from megagrpo.curriculum.levels import (
    BetaPrior,
    beta_collapse_prob,
    fill_success_prob,
    histogram,
    level_from_counts,
    parse_histogram,
    parse_level_set,
    predict_acr,
    read_levels_file,
)
from megagrpo.curriculum.stats import collapse_metrics, collapse_prob, collapse_stats, ds_can_fill
from megagrpo.errors import DataError

SPECIALIST = {1: 2164, 2: 294, 3: 223, 4: 180, 5: 216, 6: 636}
IGAKUQA_2001_2022 = {1: 7061, 2: 325, 3: 154, 4: 119, 5: 150, 6: 286}


@pytest.mark.parametrize(
    "p,expected", [(0.05, 0.66), (0.1, 0.43), (0.2, 0.17), (0.3, 0.06), (0.5, 0.008)]
)
def test_closed_form_matches_article_table(p, expected):
    # Article section 2.3, G=8; the table is symmetric in p <-> 1-p.
    assert round(collapse_prob(p, 8), 2 if expected >= 0.01 else 3) == expected
    assert collapse_prob(1 - p, 8) == pytest.approx(collapse_prob(p, 8))


def test_collapse_prob_matches_monte_carlo():
    rng = np.random.default_rng(0)
    draws = rng.random((200_000, 8)) < 0.2
    mc = float((draws.all(1) | (~draws).all(1)).mean())
    assert mc == pytest.approx(collapse_prob(0.2, 8), abs=3e-3)


def test_collapse_stats_constructed_batch():
    rewards = [
        [1, 1, 1, 1],  # all correct
        [0, 0, 0, 0],  # all wrong
        [1, 0, 1, 0],  # split
        [1, 0.8, 1, 1],  # all correct, one length-penalised: split on the total
        [0.5, 0.5, 0.5, 0.5 + 5e-7],
    ]  # std ~2e-7: < tau=1e-6 but > ms-swift's 1e-8
    correct = [[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    s = collapse_stats(rewards, correct, levels=[1, 6, 3, 1, None])
    assert s["num_groups"] == 5
    assert s["acr"] == pytest.approx(3 / 5)
    assert s["frac_reward_zero_std"] == pytest.approx(2 / 5)
    assert s["acr_correctness"] == pytest.approx(4 / 5)
    assert s["solve_all"] == pytest.approx(2 / 5)
    assert s["solve_none"] == pytest.approx(2 / 5)
    assert s["acr_by_level/L1"] == pytest.approx(0.5)
    assert s["acr_by_level/L6"] == 1.0 and s["acr_by_level/L3"] == 0.0
    # ms-swift's definition is torch's unbiased std <= 1e-8
    std1 = np.asarray(rewards, dtype=float).std(axis=1, ddof=1)
    assert s["frac_reward_zero_std"] == pytest.approx(float((std1 <= 1e-8).mean()))


def test_collapse_stats_empty_and_bad_shapes():
    assert collapse_stats([])["acr"] == 0.0
    with pytest.raises(ValueError):
        collapse_stats([[1, 0]], [[1, 0, 1]])
    with pytest.raises(ValueError):
        collapse_stats([[1, 0]], levels=[1, 2])


def test_metric_names_follow_design():
    raw = collapse_stats([[1, 1], [0, 1]], [[1, 1], [0, 1]], levels=[1, 3])
    post = collapse_stats([[0, 1]])
    m = collapse_metrics(raw, post, acr_predicted=0.7)
    for name in (
        "collapse/acr_raw",
        "collapse/solve_all_raw",
        "collapse/solve_none_raw",
        "collapse/frac_reward_zero_std",
        "collapse/acr_predicted",
        "collapse/acr_by_level/L1",
        "collapse/acr_by_level/L3",
    ):
        assert name in m, name
    assert m["collapse/acr_raw"] == 0.5 and m["collapse/frac_reward_zero_std"] == 0.0


def test_levels_alphamed_and_general_k():
    assert [level_from_counts(c, 5) for c in (5, 4, 3, 2, 1, 0)] == [1, 2, 3, 4, 5, 6]
    assert level_from_counts(0, 8) == 9 and level_from_counts(8, 8) == 1
    with pytest.raises(ValueError):
        level_from_counts(6, 5)
    assert parse_histogram("L1=2164,L2=294,L6=636") == {1: 2164, 2: 294, 6: 636}
    assert parse_level_set("L2-L5") == [2, 3, 4, 5]
    assert parse_level_set("L1,3-4") == [1, 3, 4]
    assert histogram([1, 1, 3], 6) == {1: 2, 2: 0, 3: 1, 4: 0, 5: 0, 6: 0}


def _beta_moment_numeric(a, b, g):
    """E[p^g] + E[(1-p)^g] for Beta(a, b) by quadrature (independent of the product form)."""
    x = np.linspace(0, 1, 400_001)[1:-1]
    logpdf = (
        (a - 1) * np.log(x)
        + (b - 1) * np.log1p(-x)
        - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))
    )
    pdf = np.exp(logpdf)
    dx = x[1] - x[0]
    return float(((x**g + (1 - x) ** g) * pdf).sum() * dx / (pdf.sum() * dx))


def test_beta_collapse_moment_matches_quadrature():
    for a, b in ((2.3, 1.7), (5.3, 1.1), (3.0, 4.0)):
        assert beta_collapse_prob(a, b, 8) == pytest.approx(_beta_moment_numeric(a, b, 8), rel=2e-3)


def test_beta_binomial_fit_reproduces_histogram_and_is_a_maximum():
    prior = BetaPrior.fit_histogram(SPECIALIST, 5)
    total = sum(SPECIALIST.values())
    a, b = prior.a, prior.b
    for level, n in SPECIALIST.items():
        c = 5 - level + 1
        pmf = math.comb(5, c) * math.exp(
            math.lgamma(a + c)
            + math.lgamma(b + 5 - c)
            - math.lgamma(a + b + 5)
            - math.lgamma(a)
            - math.lgamma(b)
            + math.lgamma(a + b)
        )
        assert pmf * total == pytest.approx(n, rel=0.1)  # fitted marginal ~ observed

    def ll(a, b):
        return sum(
            n
            * (
                math.lgamma(a + 6 - lv)
                + math.lgamma(b + lv - 1)
                - math.lgamma(a + b + 5)
                - math.lgamma(a)
                - math.lgamma(b)
                + math.lgamma(a + b)
            )
            for lv, n in SPECIALIST.items()
        )

    best = ll(a, b)
    for da, db in ((1.01, 1), (0.99, 1), (1, 1.01), (1, 0.99)):
        assert ll(a * da, b * db) <= best + 1e-9


def test_predicted_acr_reproduces_article():
    # Section 5.1: training on all levels gave frac_reward_zero_std 0.72-0.75; 75% of the
    # problems sat at L1/L6. The beta-binomial prediction lands just below the observed band.
    pred_all = predict_acr(SPECIALIST, 5, 8)
    share_extremes = (SPECIALIST[1] + SPECIALIST[6]) / sum(SPECIALIST.values())
    assert share_extremes == pytest.approx(0.75, abs=0.005)
    assert 0.69 <= pred_all.acr <= 0.76
    assert pred_all.by_level[1] > 0.85 and pred_all.by_level[6] > 0.7
    assert all(pred_all.by_level[lv] < 0.35 for lv in (2, 3, 4, 5))
    # Above ms-swift's ceiling 1 - 1/R = 0.67 at R=3 (section 5.2) ...
    assert not ds_can_fill(pred_all.acr, 3)
    # ... while L2-L5 falls well below it (section 5.3).
    pred_mid = predict_acr(SPECIALIST, 5, 8, keep_levels=[2, 3, 4, 5])
    assert pred_mid.acr < 0.3 and ds_can_fill(pred_mid.acr, 3)
    # IgakuQA 2001-2022 (87% L1) collapses even more when trained whole.
    assert predict_acr(IGAKUQA_2001_2022, 5, 8).acr > pred_all.acr


def test_article_fill_ceiling_numbers():
    # Section 5.2: ACR 0.73 -> ~26 valid of 96 per batch, ~78 over 3 checked batches < 96.
    assert not ds_can_fill(0.73, 3) and ds_can_fill(0.5, 3) and ds_can_fill(1 - 1 / 3, 3)
    assert fill_success_prob(0.73, 96, 3) < 0.02
    assert fill_success_prob(0.5, 96, 3) > 0.999


def test_fill_success_prob_matches_binomial_sum():
    n, q, b = 3 * 10, 0.3, 10
    ref = sum(math.comb(n, x) * q**x * (1 - q) ** (n - x) for x in range(b, n + 1))
    assert fill_success_prob(0.7, 10, 3) == pytest.approx(ref, rel=1e-9)


def test_read_levels_file_checks(tmp_path):
    path = tmp_path / "levels.jsonl"
    path.write_text(
        '{"id": "a", "k": 5, "correct": 5}\n{"id": "b", "k": 5, "correct": 0}\n'
        '{"id": "c", "k": 5, "co'
    )
    recs = read_levels_file(path)
    assert [r["level"] for r in recs] == [1, 6]
    path.write_text('{"id": "a", "k": 5, "correct": 7}\n')
    with pytest.raises(DataError, match="levels.jsonl:1"):
        read_levels_file(path)


def test_levels_file_skips_a_truncated_last_line_but_names_a_bad_middle_one(tmp_path, caplog):
    from megagrpo.curriculum.levels import read_levels_file
    from megagrpo.errors import DataError

    good = '{"id": 1, "k": 5, "correct": 5}\n{"id": "b", "k": 5, "correct": 2}\n'
    path = tmp_path / "levels.jsonl"
    path.write_text(good + '{"id": "c", "k": 5, "corr', encoding="utf-8")
    with caplog.at_level("WARNING"):
        records = read_levels_file(path)
    assert [(r["id"], r["level"]) for r in records] == [("1", 1), ("b", 4)]
    assert "levels.jsonl:3: truncated last line ignored" in caplog.text
    path.write_text('{"id": 1, "k": 5, "corr\n' + good, encoding="utf-8")
    with pytest.raises(DataError, match=r"levels\.jsonl:1: malformed JSON"):
        read_levels_file(path)
