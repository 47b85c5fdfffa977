"""`megagrpo plan --budget` (rollout budgets against uniform G) and `--calibrate RUN_DIR`
(refit the planner's prior from a run): the parts of :mod:`megagrpo.commands.plan` beyond the
dynamic-sampling policies."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

from megagrpo.errors import ConfigError
from megagrpo.plan.inputs import PlanInputs
from megagrpo.plan.simulate import PlanSetup, population_from_records

if TYPE_CHECKING:  # imports torch: annotations only (fast --help)
    from megagrpo.trainer.config import RunConfig

BUDGET_ROWS = (
    ("generated_completions_per_step", "generated completions / step", "{:.0f}"),
    ("acr_raw_mean", "raw ACR (first round)", "{:.3f}"),
    ("valid_groups_per_step", "valid groups / step", "{:.1f}"),
    ("effective_ratio", "effective ratio", "{:.3f}"),
    ("effective_vs_uniform_carry", "  x uniform/carry", "{:.2f}"),
    ("rounds_per_step", "generation rounds / step", "{:.2f}"),
    ("trained_group_size_mean", "trained group size", "{:.1f}"),
    ("first_request_mean_n", "first request n / problem", "{:.2f}"),
    ("ds_success_rate", "batch filled", "{:.2f}"),
    ("price_mean", "price (knapsack: best ratio)", "{:.3f}"),
)


def add_budget_arguments(parser: argparse.ArgumentParser) -> None:
    """``--budget`` (compare rollout budgets with uniform G) and ``--calibrate``."""
    from megagrpo.curriculum.config import BudgetConfig

    d = BudgetConfig()
    parser.add_argument(
        "--budget",
        choices=["knapsack", "sequential", "all"],
        default=None,
        help="compare this rollout budget (both, with 'all') with uniform G under every "
        "dynamic-sampling policy: completions, raw ACR, valid groups, effective ratio",
    )
    parser.add_argument("--min-samples", type=int, default=d.min_samples)
    parser.add_argument("--max-samples", type=int, default=d.max_samples)
    parser.add_argument(
        "--round-samples", type=int, default=d.round_samples, help="sequential (0: G)"
    )
    parser.add_argument(
        "--trained-size", type=int, default=d.trained_size, help="trained group size (0: G)"
    )
    parser.add_argument(
        "--budget-price", type=float, default=d.price, help="-1 auto, 0 Knapsack RL"
    )
    parser.add_argument(
        "--calibrate",
        metavar="RUN_DIR",
        default=None,
        help="refit the prior from RUN_DIR/metrics.jsonl (measured raw ACR per level), "
        "then plan with it",
    )
    parser.add_argument(
        "--calibrate-steps", type=int, default=0, help="use the first N steps only (0: all)"
    )


def _budget_configs(args: argparse.Namespace, group_size: int) -> dict:
    from megagrpo.curriculum.config import BudgetConfig, BudgetMode

    names: list[BudgetMode] = ["knapsack", "sequential"] if args.budget == "all" else [args.budget]
    sizes = ("min_samples", "max_samples", "round_samples", "trained_size")
    flags = {key: getattr(args, key) for key in sizes}
    out = {}
    for name in names:
        cfg = BudgetConfig(mode=name, price=args.budget_price, **flags)
        cfg.validate("budget")
        cfg.resolved(group_size, "budget")
        out[name] = cfg
    return out


def run_budget(
    args: argparse.Namespace, cfg: RunConfig, inputs: PlanInputs, population=None
) -> int:
    """``megagrpo plan --budget``: uniform G under original/partial/carry against the budget
    policies under partial/carry, one population, same round budget B * G and cap 1 + R."""
    from megagrpo.plan.simulate_budget import compare_budgets

    g, b, r = cfg.rollout.group_size, cfg.trainer.batch_groups, cfg.dynamic.max_resample
    setup = PlanSetup(
        inputs.hist,
        inputs.k,
        g,
        b,
        args.steps,
        inputs.curriculum,
        drift=args.drift,
        seed=inputs.curriculum.seed,
        population=population or inputs.population,
    )
    results = compare_budgets(
        setup, r, _budget_configs(args, g), budget_policies=("partial", "carry")
    )
    base = results["uniform/carry"]["effective_ratio"]
    for row in results.values():
        row["effective_vs_uniform_carry"] = row["effective_ratio"] / base if base else 0.0
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    keep = inputs.curriculum.keep_levels
    print(
        f"problems {sum(inputs.hist.values())}, kept {', '.join(f'L{x}' for x in keep)}; "
        f"G={g}, B={b}, R={r}, {args.steps} steps; every round may spend B*G = {b * g} "
        "completions; trained groups hold exactly the trained size"
    )
    print(format_budget_table(results))
    return 0


def format_budget_table(results: dict) -> str:
    """The side-by-side table of :func:`run_budget` (one column per budget/policy)."""
    labels = list(results)
    width = max(len(r[1]) for r in BUDGET_ROWS)
    col = max(14, *(len(x) + 2 for x in labels))
    lines = [" " * width + "".join(f"{x:>{col}}" for x in labels)]
    for key, name, fmt in BUDGET_ROWS:
        cells = "".join(f"{fmt.format(results[x].get(key, float('nan'))):>{col}}" for x in labels)
        lines.append(f"{name:<{width}}{cells}")
    return "\n".join(lines)


def run_calibrate(
    args: argparse.Namespace, cfg: RunConfig, inputs: PlanInputs
) -> PlanInputs | None:
    """``megagrpo plan --calibrate RUN_DIR``: measured vs predicted raw ACR per level and the
    refitted prior (``cfg`` is the run's saved config); returns the inputs the plan is then
    drawn from (None with ``--json``: the calibration is the whole answer)."""
    from megagrpo.curriculum.calibrate import refit_prior
    from megagrpo.curriculum.levels import BetaPrior
    from megagrpo.metrics.logger import read_metrics
    from megagrpo.plan.simulate import synthetic_population

    metrics = Path(args.calibrate) / "metrics.jsonl"
    g, k, seed = cfg.rollout.group_size, inputs.k, inputs.curriculum.seed
    try:
        cal = refit_prior(
            read_metrics(metrics),
            k,
            g,
            BetaPrior.fit_histogram(inputs.hist, k),
            first_steps=args.calibrate_steps,
        )
    except ValueError as exc:
        raise ConfigError(f"--calibrate {metrics}: {exc}") from exc
    if inputs.records:
        population = population_from_records(inputs.records, k, seed, cal.prior_after)
    else:
        population = synthetic_population(inputs.hist, k, seed, cal.prior_after)
    if args.json:
        print(json.dumps(cal.to_dict(), indent=1))
        return None
    print(f"{metrics}: {cal.steps} steps, G={g}, k={k}")
    print(f"{'level':<8}{'measured':>10}{'obs':>8}{'predicted':>11}{'refitted':>10}")
    for lv in sorted(cal.measured):
        print(
            f"L{lv:<7}{cal.measured[lv]:>10.3f}{cal.weight[lv]:>8.0f}"
            f"{cal.predicted_before[lv]:>11.3f}{cal.predicted_after[lv]:>10.3f}"
        )
    print(
        f"prior Beta({cal.prior_before.a:.3f}, {cal.prior_before.b:.3f}) -> "
        f"Beta({cal.prior_after.a:.3f}, {cal.prior_after.b:.3f}); mean |error| "
        f"{cal.mean_abs_error(after=False):.3f} -> {cal.mean_abs_error(after=True):.3f}"
    )
    for note in cal.notes:
        print("note:", note)
    print("\nplan with the refitted prior:")
    return dataclasses.replace(inputs, population=population)
