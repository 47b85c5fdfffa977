"""`megagrpo plan-memory CONFIG [key=value ...] [--hf-config FILE] [--json]`: per-GPU memory
of the config's parallel layout on its cluster (``cluster.*``), before renting the GPUs.

The estimate and what it counts: :mod:`megagrpo.model.plan_memory`.
"""

from __future__ import annotations

import argparse
import json

from megagrpo.config import load_config
from megagrpo.model.plan_memory import format_plan, hf_config_for, plan
from megagrpo.trainer.config import RunConfig

DESCRIPTION = __doc__


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run config YAML")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    parser.add_argument(
        "--hf-config",
        default=None,
        help="HF config.json of the model (default: model.hf_path/config.json)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def plan_run(cfg: RunConfig, hf: dict) -> dict:
    """The memory plan of a whole run config (see :func:`megagrpo.model.plan_memory.plan`)."""
    return plan(
        hf,
        model=cfg.model,
        parallel=cfg.parallel,
        rollout=cfg.rollout,
        cluster=cfg.cluster,
        micro_batch_size=cfg.trainer.micro_batch_size,
        batch_groups=cfg.trainer.batch_groups,
    )


def run(args: argparse.Namespace) -> int:
    cfg = load_config(RunConfig, [args.config], args.overrides)
    result = plan_run(cfg, hf_config_for(cfg.model.hf_path, args.hf_config))
    print(json.dumps(result) if args.json else format_plan(result))
    return 0
