"""`megagrpo profile CONFIG [key=value ...]`: AlphaMed difficulty levels of the training set."""

from __future__ import annotations

import argparse
import logging

from megagrpo.curriculum.profile import format_level_table, run_profile

log = logging.getLogger(__name__)

DESCRIPTION = """\
Sample k answers per training problem from the model (before training) through the
configured rollout engine, score them with the first (correctness) reward of the config,
and write a levels file (JSONL: id, k, correct, level, mean_length) plus a level table.
L1 = k/k correct ... L{k+1} = 0/k. Resumable: rerun the same command after an interruption.

example:
  megagrpo profile configs/qwen3_235b_a22b.yaml --out runs/levels.jsonl --k 5
  then train with curriculum.levels_file=runs/levels.jsonl curriculum.keep_levels=[2,3,4,5]
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run config YAML")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    parser.add_argument(
        "--out",
        default=None,
        help="levels JSONL to write/resume (default: curriculum.levels_file, else levels.jsonl)",
    )
    parser.add_argument("--k", type=int, default=5, help="answers per problem (AlphaMed: 5)")
    parser.add_argument("--batch-size", type=int, default=64, help="problems per generate call")
    parser.add_argument("--limit", type=int, default=0, help="profile only the first N problems")


def run(args: argparse.Namespace) -> int:
    from megagrpo.config import load_config  # noqa: PLC0415 (lazy: heavy imports)
    from megagrpo.data import load_problems
    from megagrpo.errors import ConfigError
    from megagrpo.model.pretrained import resolve_model_path
    from megagrpo.rewards import get as get_reward
    from megagrpo.rollout import build_engine
    from megagrpo.trainer.config import RunConfig

    cfg = load_config(RunConfig, [args.config], args.overrides)
    if not cfg.data.train:
        raise ConfigError("data.train: no training files to profile")
    problems = load_problems(
        cfg.data.train, exclude_images=cfg.data.exclude_images, prompt=cfg.data.prompt
    )
    if args.limit:
        problems = problems[: args.limit]
    spec = cfg.rewards.functions[0]
    reward_fn = get_reward(spec.name, **spec.kwargs)
    out = args.out or cfg.curriculum.levels_file or "levels.jsonl"
    engine = build_engine(cfg.rollout, str(resolve_model_path(cfg.model.hf_path)), cfg.rollout.seed)
    try:
        records = run_profile(problems, engine, reward_fn, args.k, out, args.batch_size)
    finally:
        close = getattr(engine, "close", None)
        if callable(close):
            close()
    print(format_level_table(records, args.k, cfg.rollout.group_size, cfg.curriculum.keep_levels))
    print(f"levels written to {out}")
    return 0
