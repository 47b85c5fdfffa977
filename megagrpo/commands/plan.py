"""`megagrpo plan [CONFIG] [key=value ...]`: simulate curriculum + dynamic sampling before
renting a GPU."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from megagrpo.commands.plan_budget import add_budget_arguments, run_budget, run_calibrate
from megagrpo.config import load_config
from megagrpo.curriculum.config import SamplingPolicy
from megagrpo.curriculum.dynamic import preflight_check
from megagrpo.curriculum.levels import (
    level_alternatives,
    parse_level_set,
    predict_acr,
)
from megagrpo.errors import ConfigError
from megagrpo.plan.inputs import ARTICLE_LEVELS, PlanInputs, plan_inputs
from megagrpo.plan.simulate import PlanSetup, run_plan

if TYPE_CHECKING:  # imports torch: loaded when the command runs (fast --help)
    from megagrpo.trainer.config import RunConfig

DESCRIPTION = """\
Runs the real CurriculumSampler and DynamicSampler against a simulated rollout engine whose
rewards are Bernoulli draws from each problem's p (drawn from the beta-binomial posterior of
its level). No model needed.

The run config (CONFIG, then key=value overrides) gives G (rollout.group_size), B
(trainer.batch_groups), R (dynamic.max_resample), the shortfall policy and the curriculum
(keep_levels, level_weights, retire_streak, revisit_prob, seed, levels_file); the flags below
are shorthands for those keys. The level histogram comes from --levels, --levels-file or
curriculum.levels_file.

example (the article's specialist exam, all levels, ms-swift behaviour):
  megagrpo plan configs/qwen3_235b_a22b.yaml --levels L1=2164,L2=294,L3=223,L4=180,L5=216,L6=636 \\
      --keep-levels L1-L6 --policy original --retire-streak 0

rollout budgets against uniform G (effective ratio at trained group size G):
  megagrpo plan configs/qwen3_235b_a22b.yaml --keep-levels L1-L6 --retire-streak 0 --budget all
refit the planner's prior from a run's measured per-level raw ACR (its config.yaml is the config):
  megagrpo plan --calibrate runs/my_run
"""

SUMMARY_KEYS = (
    "acr_predicted",
    "acr_raw_mean",
    "acr_raw_first_10pct",
    "acr_raw_last_10pct",
    "frac_reward_zero_std_mean",
    "ds_success_prob_predicted",
    "ds_success_rate",
    "gen_batches_per_step",
    "generated_groups_per_step",
    "first_round_groups_per_step",
    "valid_groups_per_step",
    "collapsed_groups_trained_per_step",
    "valid_groups_discarded_per_step",
    "valid_groups_carried_per_step",
    "valid_groups_per_gen_batch",
    "retired_final",
)
# flag -> config key it overrides
SHORTHANDS = {
    "group_size": "rollout.group_size",
    "batch_groups": "trainer.batch_groups",
    "max_resample": "dynamic.max_resample",
    "retire_streak": "curriculum.retire_streak",
    "revisit_prob": "curriculum.revisit_prob",
    "seed": "curriculum.seed",
    "k": "curriculum.level_k",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default=None, help="run config YAML (optional)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    src = parser.add_mutually_exclusive_group()
    src.add_argument(
        "--levels", default=None, help=f"level histogram, e.g. {ARTICLE_LEVELS} (the default)"
    )
    src.add_argument(
        "--levels-file",
        default=None,
        help="levels JSONL from `megagrpo profile` (default: curriculum.levels_file)",
    )
    parser.add_argument("--k", type=int, help="profile samples per problem (curriculum.level_k)")
    parser.add_argument("--keep-levels", help="curriculum.keep_levels, e.g. L2-L5, L1-L6, L2,L3")
    parser.add_argument("--level-weights", help="curriculum.level_weights, e.g. 1,1,2,2")
    parser.add_argument("--group-size", type=int, help="G (rollout.group_size)")
    parser.add_argument("--batch-groups", type=int, help="B (trainer.batch_groups)")
    parser.add_argument("--max-resample", type=int, help="R (dynamic.max_resample)")
    parser.add_argument(
        "--policy",
        choices=[*get_args(SamplingPolicy), "all"],
        help="dynamic.policy; 'all' compares the three",
    )
    parser.add_argument("--steps", type=int, default=200, help="simulated training steps")
    parser.add_argument("--seed", type=int, help="curriculum.seed (also the simulation's)")
    parser.add_argument("--retire-streak", type=int, help="curriculum.retire_streak (0: off)")
    parser.add_argument("--revisit-prob", type=float, help="curriculum.revisit_prob")
    parser.add_argument(
        "--drift",
        type=float,
        default=0.0,
        help="p += drift * (1 - p) per trained group (simulated learning)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_budget_arguments(parser)


def plan_config(args: argparse.Namespace) -> RunConfig:
    """The run config with the flags applied as overrides (each flag is one config key)."""
    from megagrpo.trainer.config import RunConfig

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).exists():
        config, overrides = None, [config, *overrides]  # no CONFIG: only overrides
    if args.calibrate:
        metrics = Path(args.calibrate) / "metrics.jsonl"
        if not metrics.is_file():
            raise ConfigError(f"--calibrate: {metrics} not found (is it a run directory?)")
        saved = Path(args.calibrate) / "config.yaml"
        if config is None and not saved.is_file():
            raise ConfigError(
                f"--calibrate: {saved} not found: pass the run's config (megagrpo plan CONFIG "
                "--calibrate RUN_DIR); its defaults (G, levels) would not be the run's"
            )
        if config is None:
            config = str(saved)  # plan with the run's own config
    for flag, key in SHORTHANDS.items():
        if getattr(args, flag) is not None:
            overrides.append(f"{key}={getattr(args, flag)}")
    try:
        if args.keep_levels:
            overrides.append(f"curriculum.keep_levels={parse_level_set(args.keep_levels)}")
        if args.level_weights:
            weights = [float(x) for x in args.level_weights.split(",") if x.strip()]
            overrides.append(f"curriculum.level_weights={weights}")
    except ValueError as exc:
        raise ConfigError(f"--keep-levels/--level-weights: {exc}") from exc
    if args.policy and args.policy != "all":
        overrides.append(f"dynamic.policy={args.policy}")
    if args.levels_file:
        overrides.append(f"curriculum.levels_file={args.levels_file}")
    return load_config(RunConfig, [config] if config else [], overrides)


def _inputs(args: argparse.Namespace, cfg: RunConfig) -> PlanInputs:
    """The histogram from --levels, --levels-file / curriculum.levels_file (or the article's);
    a bare histogram (no keep_levels, levels file or config) is planned on all its levels."""
    bare = not args.keep_levels and not (cfg.curriculum.levels_file or args.config)
    return plan_inputs(cfg.curriculum, args.levels, all_levels=bare)


SIMULATION_LOGGERS = ("megagrpo.curriculum.dynamic", "megagrpo.curriculum.rounds")
"""Loggers that speak once per simulated step (a short dynamic-sampling batch): the table
summarises them (``ds_success_rate``); ``megagrpo -v plan`` shows them."""


@contextlib.contextmanager
def quiet_simulation() -> Iterator[None]:
    """The per-step INFO lines of :data:`SIMULATION_LOGGERS` held back (warnings pass)
    unless debug logging is on: the plan's table is the output, not 200 log lines."""
    loggers = [logging.getLogger(name) for name in SIMULATION_LOGGERS]
    if logging.getLogger().isEnabledFor(logging.DEBUG):
        yield
        return
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def run(args: argparse.Namespace) -> int:
    cfg = plan_config(args)
    inputs = _inputs(args, cfg)
    with quiet_simulation():
        if args.calibrate:
            refitted = run_calibrate(args, cfg, inputs)
            if refitted is None:
                return 0
            inputs = refitted
        if args.budget:
            return run_budget(args, cfg, inputs)
        return plan_policies(args, cfg, inputs)


def plan_policies(args: argparse.Namespace, cfg: RunConfig, inputs: PlanInputs) -> int:
    """The dynamic-sampling policies (--policy, or the config's) on the inputs."""
    policies = list(get_args(SamplingPolicy)) if args.policy == "all" else [cfg.dynamic.policy]
    setup = PlanSetup(
        inputs.hist,
        inputs.k,
        cfg.rollout.group_size,
        cfg.trainer.batch_groups,
        args.steps,
        inputs.curriculum,
        drift=args.drift,
        seed=inputs.curriculum.seed,
        population=inputs.population,
    )
    results = {}
    print(
        f"plan: simulating {args.steps} steps x {len(policies)} dynamic-sampling "
        f"polic{'ies' if len(policies) > 1 else 'y'} ({', '.join(policies)}; G="
        f"{cfg.rollout.group_size}, B={cfg.trainer.batch_groups}, "
        f"{sum(inputs.hist.values())} problems) ...",
        file=sys.stderr,
        flush=True,
    )
    with _progress(args.steps * len(policies)) as bar:
        for policy in policies:
            dyn = dataclasses.replace(cfg.dynamic, policy=policy, preflight="off")
            results[policy] = run_plan(setup, dyn, on_step=bar.update).to_dict()
    if args.json:
        print(json.dumps(results[policies[0]] if len(policies) == 1 else results, indent=1))
        return 0
    _print_report(inputs, cfg, args.steps, results)
    return 0


def _progress(total: int) -> Any:
    """A progress bar over the simulated steps on stderr (shown on a terminal only)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="plan", unit="step", disable=None, file=sys.stderr)


def _print_report(inputs: PlanInputs, cfg: RunConfig, steps: int, results) -> None:
    hist, k, keep = inputs.hist, inputs.k, inputs.curriculum.keep_levels
    g, b = cfg.rollout.group_size, cfg.trainer.batch_groups
    pred = predict_acr(hist, k, g, keep)
    print(
        f"problems {sum(hist.values())}, kept {', '.join(f'L{x}' for x in keep)}: "
        f"{sum(hist.get(x, 0) for x in keep)}; G={g}, B={b}, "
        f"R={cfg.dynamic.max_resample}, {steps} steps"
    )
    print(
        f"prior Beta(a={pred.prior.a:.3f}, b={pred.prior.b:.3f}); predicted P(collapse): "
        + ", ".join(f"L{lv} {p:.3f}" for lv, p in pred.by_level.items())
    )
    alternatives = level_alternatives(hist, k, g)
    for policy in results:
        dyn = dataclasses.replace(cfg.dynamic, policy=policy, preflight="off")
        print(f"pre-flight [{policy}]: " + preflight_check(dyn, pred.acr, b, alternatives).message)
    width = max(len(x) for x in SUMMARY_KEYS)
    print(f"\n{'':<{width}}" + "".join(f"{p:>12}" for p in results))
    for key in SUMMARY_KEYS:
        print(f"{key:<{width}}" + "".join(f"{results[p][key]:>12.3f}" for p in results))
