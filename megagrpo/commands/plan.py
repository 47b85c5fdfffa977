"""`megagrpo plan`: simulate curriculum + dynamic sampling before renting a GPU."""

from __future__ import annotations

import argparse
import json

from megagrpo.curriculum.config import POLICIES, CurriculumConfig, DynamicSamplingConfig
from megagrpo.curriculum.dynamic import preflight_check
from megagrpo.curriculum.levels import (
    histogram,
    level_alternatives,
    parse_histogram,
    parse_level_set,
    predict_acr,
    read_levels_file,
)
from megagrpo.curriculum.simulate import population_from_records, run_plan
from megagrpo.errors import ConfigError

DESCRIPTION = """\
Runs the real CurriculumSampler and DynamicSampler against a simulated rollout engine whose
rewards are Bernoulli draws from each problem's p (drawn from the beta-binomial posterior of
its level). No model needed.

example (the article's specialist exam, all levels, ms-swift behaviour):
  megagrpo plan --levels L1=2164,L2=294,L3=223,L4=180,L5=216,L6=636 --keep-levels L1-L6 \\
      --policy original --retire-streak 0

rollout budgets against uniform G (effective ratio at trained group size G):
  megagrpo plan --keep-levels L1-L6 --retire-streak 0 --budget knapsack
refit the planner's prior from a run's measured per-level raw ACR:
  megagrpo plan --calibrate runs/my_run
"""

ARTICLE_LEVELS = "L1=2164,L2=294,L3=223,L4=180,L5=216,L6=636"
SUMMARY_KEYS = (
    "acr_predicted",
    "acr_raw_mean",
    "acr_raw_first_10pct",
    "acr_raw_last_10pct",
    "frac_reward_zero_std_mean",
    "ds_success_prob_predicted",
    "ds_success_rate",
    "gen_batches_per_step",
    "valid_groups_per_step",
    "collapsed_groups_trained_per_step",
    "valid_groups_discarded_per_step",
    "valid_groups_carried_per_step",
    "valid_groups_per_gen_batch",
    "retired_final",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group()
    src.add_argument(
        "--levels", default=None, help=f"level histogram, e.g. {ARTICLE_LEVELS} (the default)"
    )
    src.add_argument("--levels-file", default=None, help="levels JSONL from `megagrpo profile`")
    parser.add_argument("--k", type=int, default=5, help="profile samples per problem (--levels)")
    parser.add_argument("--keep-levels", default="L2-L5", help="e.g. L2-L5, L1-L6, L2,L3")
    parser.add_argument(
        "--level-weights", default="", help="comma-separated mixing weights, one per kept level"
    )
    parser.add_argument("--group-size", type=int, default=8, help="G")
    parser.add_argument("--batch-groups", type=int, default=96, help="groups per batch (B)")
    parser.add_argument("--max-resample", type=int, default=3, help="R")
    parser.add_argument(
        "--policy",
        default="carry",
        choices=[*POLICIES, "all"],
        help="shortfall policy; 'all' compares the three",
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--retire-streak",
        type=int,
        default=CurriculumConfig.retire_streak,
        help="online retirement (0: off, the article's setting)",
    )
    parser.add_argument("--revisit-prob", type=float, default=CurriculumConfig.revisit_prob)
    parser.add_argument(
        "--drift",
        type=float,
        default=0.0,
        help="p += drift * (1 - p) per trained group (simulated learning)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_budget_arguments(parser)


def _inputs(args: argparse.Namespace):
    if args.levels_file:
        records = read_levels_file(args.levels_file)
        ks = {int(r["k"]) for r in records}
        if len(ks) != 1:
            raise ConfigError(f"{args.levels_file}: mixed k values {sorted(ks)}")
        k = ks.pop()
        hist = histogram((int(r["level"]) for r in records), k + 1)
        return hist, k, population_from_records(records, k, args.seed)
    try:
        hist = parse_histogram(args.levels or ARTICLE_LEVELS)
    except ValueError as exc:
        raise ConfigError(f"--levels: {exc}") from exc
    if max(hist) > args.k + 1:
        raise ConfigError(f"--levels has L{max(hist)} but --k {args.k} allows L1..L{args.k + 1}")
    return hist, args.k, None


def _curriculum(args: argparse.Namespace, hist, k: int) -> tuple[CurriculumConfig, list[int]]:
    try:
        keep = parse_level_set(args.keep_levels) or sorted(hist)
        weights = [float(x) for x in args.level_weights.split(",") if x.strip()]
    except ValueError as exc:
        raise ConfigError(f"--keep-levels/--level-weights: {exc}") from exc
    cur = CurriculumConfig(
        keep_levels=keep,
        level_weights=weights,
        seed=args.seed,
        level_k=k,
        retire_streak=args.retire_streak,
        revisit_prob=args.revisit_prob,
    )
    cur.validate("curriculum")
    return cur, keep


def run(args: argparse.Namespace) -> int:
    if args.calibrate:
        return run_calibrate(args)
    if args.budget:
        return run_budget(args)
    hist, k, population = _inputs(args)
    return _plan_policies(args, hist, k, population)


def _plan_policies(args: argparse.Namespace, hist, k: int, population) -> int:
    cur, keep = _curriculum(args, hist, k)
    policies = list(POLICIES) if args.policy == "all" else [args.policy]
    results = {}
    for policy in policies:
        dyn = DynamicSamplingConfig(max_resample=args.max_resample, policy=policy, preflight="off")
        dyn.validate("dynamic")
        results[policy] = run_plan(
            hist,
            k,
            args.group_size,
            args.batch_groups,
            args.steps,
            cur,
            dyn,
            drift=args.drift,
            seed=args.seed,
            population=population,
        ).to_dict()
    if args.json:
        print(json.dumps(results[policies[0]] if len(policies) == 1 else results, indent=1))
        return 0
    _print_report(hist, k, keep, args, results)
    return 0


def _print_report(hist, k, keep, args, results) -> None:
    pred = predict_acr(hist, k, args.group_size, keep)
    print(
        f"problems {sum(hist.values())}, kept {', '.join(f'L{x}' for x in keep)}: "
        f"{sum(hist.get(x, 0) for x in keep)}; G={args.group_size}, B={args.batch_groups}, "
        f"R={args.max_resample}, {args.steps} steps"
    )
    print(
        f"prior Beta(a={pred.prior.a:.3f}, b={pred.prior.b:.3f}); predicted P(collapse): "
        + ", ".join(f"L{lv} {p:.3f}" for lv, p in pred.by_level.items())
    )
    alternatives = level_alternatives(hist, k, args.group_size)
    for policy in results:
        dyn = DynamicSamplingConfig(max_resample=args.max_resample, policy=policy, preflight="off")
        print(
            f"pre-flight [{policy}]: "
            + preflight_check(dyn, pred.acr, args.batch_groups, alternatives).message
        )
    width = max(len(x) for x in SUMMARY_KEYS)
    print(f"\n{'':<{width}}" + "".join(f"{p:>12}" for p in results))
    for key in SUMMARY_KEYS:
        print(f"{key:<{width}}" + "".join(f"{results[p][key]:>12.3f}" for p in results))


# ----------------------------------------------------------------------------- budgets

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
        "--budget-price", type=float, default=d.budget_price, help="-1 auto, 0 Knapsack RL"
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


def _budget_configs(args: argparse.Namespace) -> dict:
    from megagrpo.curriculum.config import BudgetConfig

    names = ["knapsack", "sequential"] if args.budget == "all" else [args.budget]
    out = {}
    for name in names:
        cfg = BudgetConfig(
            budget=name,
            min_samples=args.min_samples,
            max_samples=args.max_samples,
            round_samples=args.round_samples,
            trained_size=args.trained_size,
            budget_price=args.budget_price,
        )
        cfg.validate("budget")
        cfg.resolved(args.group_size, "budget")
        out[name] = cfg
    return out


def run_budget(args: argparse.Namespace, population=None) -> int:
    """``megagrpo plan --budget``: uniform G under original/partial/carry against the budget
    policies under partial/carry, one population, same round budget B * G and cap 1 + R."""
    from megagrpo.curriculum.simulate_budget import compare_budgets

    hist, k, records_population = _inputs(args)
    cur, keep = _curriculum(args, hist, k)
    results = compare_budgets(
        hist,
        k,
        args.group_size,
        args.batch_groups,
        args.steps,
        cur,
        args.max_resample,
        _budget_configs(args),
        seed=args.seed,
        population=population or records_population,
        drift=args.drift,
        budget_policies=("partial", "carry"),
    )
    base = results["uniform/carry"]["effective_ratio"]
    for row in results.values():
        row["effective_vs_uniform_carry"] = row["effective_ratio"] / base if base else 0.0
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print(
        f"problems {sum(hist.values())}, kept {', '.join(f'L{x}' for x in keep)}; "
        f"G={args.group_size}, B={args.batch_groups}, R={args.max_resample}, {args.steps} steps; "
        f"every round may spend B*G = {args.batch_groups * args.group_size} completions; "
        "trained groups hold exactly the trained size"
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


# ----------------------------------------------------------------------------- calibration


def _run_config(run_dir) -> dict:
    """``{k, group_size, levels_file}`` from RUN_DIR/config.yaml (empty when absent)."""
    from pathlib import Path

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return {}
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: not a mapping")
    cur, roll = cfg.get("curriculum") or {}, cfg.get("rollout") or {}
    out = {"k": cur.get("level_k"), "group_size": roll.get("group_size")}
    out["levels_file"] = cur.get("levels_file")
    return {key: v for key, v in out.items() if v is not None}


def run_calibrate(args: argparse.Namespace) -> int:
    """``megagrpo plan --calibrate RUN_DIR``: measured vs predicted raw ACR per level, the
    refitted prior, then the plan drawn from it."""
    from pathlib import Path

    from megagrpo.curriculum.calibrate import refit_prior
    from megagrpo.curriculum.levels import BetaPrior
    from megagrpo.curriculum.simulate import synthetic_population
    from megagrpo.metrics.logger import read_metrics

    metrics = Path(args.calibrate) / "metrics.jsonl"
    if not metrics.is_file():
        raise ConfigError(f"--calibrate: {metrics} not found (is it a run directory?)")
    run = _run_config(args.calibrate)
    if not args.levels and not args.levels_file and Path(run.get("levels_file", "")).is_file():
        args.levels_file = run["levels_file"]
    args.k = int(run.get("k", args.k))
    args.group_size = int(run.get("group_size", args.group_size))
    hist, k, _ = _inputs(args)
    try:
        cal = refit_prior(
            read_metrics(metrics),
            k,
            args.group_size,
            BetaPrior.fit_histogram(hist, k),
            first_steps=args.calibrate_steps,
        )
    except ValueError as exc:
        raise ConfigError(f"--calibrate {metrics}: {exc}") from exc
    if args.levels_file:
        records = read_levels_file(args.levels_file)
        population = population_from_records(records, k, args.seed, cal.prior_after)
    else:
        population = synthetic_population(hist, k, args.seed, cal.prior_after)
    if args.json:
        print(json.dumps(cal.to_dict(), indent=1))
        return 0
    print(f"{metrics}: {cal.steps} steps, G={args.group_size}, k={k}")
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
    if args.budget:
        return run_budget(args, population=population)
    return _plan_policies(args, hist, k, population)
