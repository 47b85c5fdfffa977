"""Planner for rollout budgets and its calibration (megagrpo plan --budget / --calibrate)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from megagrpo.curriculum.calibrate import predicted_acr_metrics, refit_prior
from megagrpo.curriculum.config import BudgetConfig, CurriculumConfig, DynamicSamplingConfig
from megagrpo.curriculum.levels import BetaPrior, beta_collapse_prob
from megagrpo.curriculum.sampler import CurriculumSampler
from megagrpo.plan.simulate import (
    CORRECTNESS_KEY,
    BernoulliEngine,
    PlanSetup,
    run_plan,
    synthetic_population,
)
from megagrpo.plan.simulate_budget import compare_budgets, generate_mixed

SPECIALIST = {1: 2164, 2: 294, 3: 223, 4: 180, 5: 216, 6: 636}
ALL = [1, 2, 3, 4, 5, 6]


def test_knapsack_reaches_1_4x_the_effective_ratio_of_uniform_carry():
    """The issue's target: the article's histogram, all levels, levels measured once."""
    cur = CurriculumConfig(keep_levels=ALL, retire_streak=0)
    res = compare_budgets(
        PlanSetup(SPECIALIST, 5, 8, 96, 60, cur),
        3,
        {"knapsack": BudgetConfig(mode="knapsack")},
        uniform_policies=("carry",),
    )
    uni, knap = res["uniform/carry"], res["knapsack/carry"]
    # README: carry trains 96 valid groups from ~3.3 generated batches of 96 x 8
    assert uni["effective_ratio"] == pytest.approx(96 / (3.29 * 96), abs=0.03)
    assert knap["valid_groups_per_step"] == 96 and knap["trained_group_size_mean"] == 8
    assert knap["effective_ratio"] >= 1.4 * uni["effective_ratio"]
    assert knap["generated_completions_per_step"] < 0.7 * uni["generated_completions_per_step"]


def test_plan_cli_budget_table_and_json(capsys):
    from megagrpo.cli import main

    args = ["plan", "--keep-levels", "L1-L6", "--retire-streak", "0", "--steps", "6"]
    assert main([*args, "--budget", "all", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {
        "uniform/original",
        "uniform/partial",
        "uniform/carry",
        "knapsack/partial",
        "knapsack/carry",
        "sequential/partial",
        "sequential/carry",
    }
    for row in out.values():
        for key in (
            "generated_completions_per_step",
            "acr_raw_mean",
            "valid_groups_per_step",
            "effective_ratio",
        ):
            assert isinstance(row[key], float) and math.isfinite(row[key])
    assert out["uniform/carry"]["effective_vs_uniform_carry"] == pytest.approx(1.0)
    assert main([*args, "--budget", "knapsack"]) == 0
    table = capsys.readouterr().out
    assert "effective ratio" in table and "knapsack/carry" in table and "uniform/original" in table


def test_predicted_acr_by_level_is_the_posterior_collapse_and_is_calibrated():
    """Before each first round: predicted collapse per level from the sampler's posterior;
    over many steps it matches the measured raw collapse of those groups."""
    problems, levels, ps = synthetic_population(SPECIALIST, 5, seed=4)
    cur = CurriculumConfig(keep_levels=ALL, retire_streak=0, seed=4)
    sampler = CurriculumSampler(problems, cur, levels, CORRECTNESS_KEY, level_k=5)
    engine = BernoulliEngine(ps, seed=4)
    first = sampler.next_problems(96)
    sizes = np.where(np.arange(96) % 2 == 0, 8, 3)
    pred = predicted_acr_metrics(sampler, first, sizes.tolist())
    a, b = sampler.posterior_of(first)
    direct = [beta_collapse_prob(x, y, int(n)) for x, y, n in zip(a, b, sizes)]
    lv = np.array([levels[p.id] for p in first])
    for level in range(1, 7):
        key = f"collapse/acr_predicted_by_level/L{level}"
        if (lv == level).any():
            assert pred[key] == pytest.approx(np.mean(np.array(direct)[lv == level]), rel=1e-9)
        else:
            assert math.isnan(pred[key])
    assert pred["collapse/acr_predicted_step"] == pytest.approx(np.mean(direct), rel=1e-9)
    predicted, measured = [], []
    for _ in range(80):
        batch = sampler.next_problems(96)
        predicted.append(predicted_acr_metrics(sampler, batch, 8)["collapse/acr_predicted_step"])
        from megagrpo.curriculum.budget_rounds import Request

        groups = generate_mixed(engine, [Request(p, 8) for p in batch])
        measured.append(np.mean([float(np.std(g.rewards)) < 1e-6 for g in groups]))
        sampler.observe(groups)
    se = np.std(measured) / math.sqrt(len(measured))
    assert np.mean(predicted) == pytest.approx(np.mean(measured), abs=max(4 * se, 0.01))


def _run_rows(true_prior, steps=60, seed=0):
    """metrics rows of a simulated run whose problems follow ``true_prior``."""
    pop = synthetic_population(SPECIALIST, 5, seed=seed, prior=true_prior)
    cur = CurriculumConfig(keep_levels=ALL, retire_streak=0, seed=seed)
    dyn = DynamicSamplingConfig(policy="carry")
    plan = run_plan(PlanSetup(SPECIALIST, 5, 8, 96, steps, cur, seed=seed, population=pop), dyn)
    return [{"step": i + 1, **row} for i, row in enumerate(plan.steps)]


def test_refit_prior_explains_a_run_the_histogram_prior_mispredicts():
    planner_prior = BetaPrior.fit_histogram(SPECIALIST, 5)
    true_prior = BetaPrior(1.2, 0.5)  # a model that is less sure than the profile suggests
    rows = _run_rows(true_prior)
    cal = refit_prior(rows, 5, 8, planner_prior)
    before, after = cal.mean_abs_error(after=False), cal.mean_abs_error(after=True)
    assert before > 0.05  # the histogram prior is wrong for this run ...
    # ... the refit explains it, down to the noise of 60 steps x 96 groups of a finite
    # population (levels of ~200 problems: ~0.02)
    assert after < 0.035 and after < before / 4
    assert cal.prior_after.a == pytest.approx(1.2, rel=0.3)
    assert cal.prior_after.b == pytest.approx(0.5, rel=0.3)
    for level in range(1, 7):  # and predicts what the true prior predicts
        truth = true_prior.level_collapse_prob(level, 5, 8)
        assert cal.predicted_after[level] == pytest.approx(truth, abs=0.04), level
    assert cal.loglik_after >= cal.loglik_before
    with pytest.raises(ValueError, match="levels file"):
        refit_prior([{"step": 1, "collapse/acr_raw": 0.5}], 5, 8, planner_prior)


def test_refit_prior_uses_logged_counts_as_weights():
    rows = [
        {"collapse/acr_by_level/L1": 1.0, "collapse/groups_by_level/L1": 1},
        {"collapse/acr_by_level/L1": 0.5, "collapse/groups_by_level/L1": 3},
        {"collapse/acr_by_level/L1": None, "collapse/groups_by_level/L1": 0},
    ]
    cal = refit_prior(rows, 5, 8, BetaPrior(0.3, 0.1))
    assert cal.measured == {1: pytest.approx(2.5 / 4)} and cal.weight == {1: 4.0}
    assert cal.notes  # one level: (a, b) not identified


def test_plan_cli_calibrate(tmp_path, capsys):
    from megagrpo.cli import main

    rows = _run_rows(BetaPrior(1.2, 0.5), steps=20, seed=1)
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "metrics.jsonl", "w") as fh:
        for row in rows:
            fh.write(json.dumps({k: (None if v != v else v) for k, v in row.items()}) + "\n")
    (run / "config.yaml").write_text("curriculum:\n  level_k: 5\nrollout:\n  group_size: 8\n")
    assert main(["plan", "--calibrate", str(run), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == 20
    assert out["mean_abs_error_after"] < out["mean_abs_error_before"]
    args = ["plan", "--calibrate", str(run), "--keep-levels", "L1-L6", "--steps", "3"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "refitted" in text and "plan with the refitted prior" in text
    assert main(["plan", "--calibrate", str(tmp_path / "nothing")]) == 2
    assert "metrics.jsonl not found" in capsys.readouterr().err


def test_plan_cli_calibrate_refuses_what_is_not_the_run(tmp_path, capsys):
    """Without config.yaml the plan used the defaults (G=8, the article's histogram) with rc
    0; a row that is not an object, or a NaN / negative group count, gave raw errors or was
    dropped silently."""
    from megagrpo.cli import main

    rows = _run_rows(BetaPrior(1.2, 0.5), steps=4, seed=1)
    run = tmp_path / "run"
    run.mkdir()

    def write(extra: str = "") -> None:
        with open(run / "metrics.jsonl", "w") as fh:
            for row in rows:
                fh.write(json.dumps({k: (None if v != v else v) for k, v in row.items()}) + "\n")
            fh.write(extra)

    write()
    assert main(["plan", "--calibrate", str(run), "--json"]) == 2
    assert "config.yaml not found: pass the run's config" in capsys.readouterr().err
    (run / "config.yaml").write_text("curriculum:\n  level_k: 5\nrollout:\n  group_size: 8\n")
    key = "collapse/groups_by_level/L1"
    for extra, match in [
        ("[1, 2]\n", "metrics.jsonl:5: a metrics row must be a JSON object"),
        (json.dumps({"step": 5, "collapse/acr_by_level/L1": 0.5, key: -3}) + "\n", "not a count"),
        ('{"step": 5, "collapse/acr_by_level/L1": 0.5, "' + key + '": NaN}\n', "not a count"),
        (json.dumps({"step": 5, "collapse/acr_by_level/L1": 1.5}) + "\n", "outside"),
    ]:
        write(extra)
        assert main(["plan", "--calibrate", str(run), "--json"]) == 2, extra
        err = capsys.readouterr().err
        assert match in err and "metrics.jsonl" in err, err
