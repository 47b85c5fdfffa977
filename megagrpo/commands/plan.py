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


def run(args: argparse.Namespace) -> int:
    hist, k, population = _inputs(args)
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
