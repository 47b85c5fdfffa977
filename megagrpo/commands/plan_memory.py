"""`megagrpo plan-memory CONFIG [key=value ...] [--hf-config FILE] [--gpus N] [--ladder]
[--hw k=v] [--assume k=v] [--json]`: per-GPU memory of every phase (train, generate, sync,
startup) of the config's layout on its cluster, and a per-phase step-time estimate, before
renting GPUs. ``--gpus N`` prints the fastest layouts that fit N GPUs instead; ``--ladder`` the
step time with one throughput lever added per rung (:mod:`megagrpo.plan.ladder`).

Every key the plan reads is the run config's own (overrides as for `megagrpo train`). What
each line means: :mod:`megagrpo.plan.memory` and :mod:`megagrpo.plan.time`.
"""

from __future__ import annotations

import argparse
import json

from megagrpo.config import load_config
from megagrpo.plan.ladder import (
    TARGET_STEP_S,
    config_row,
    format_ladder,
    ladder,
    runnable_ladder,
)
from megagrpo.plan.memory import hf_config_for
from megagrpo.plan.scenario import (
    Assumptions,
    Hardware,
    parse_assignments,
    scenario_from_config,
)
from megagrpo.plan.search import format_plan, full_plan, search
from megagrpo.trainer import compat
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
    parser.add_argument("--gpus", type=int, default=0, help="search layouts for N GPUs")
    parser.add_argument(
        "--ladder",
        action="store_true",
        help="step time per phase with FP8 rollout, streamed sync, partial rollouts and "
        "one-step off-policy added in turn",
    )
    parser.add_argument("--hw", nargs="*", default=[], metavar="key=value", help="Hardware")
    parser.add_argument("--assume", nargs="*", default=[], metavar="key=value", help="Assumptions")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def plan_run(cfg: RunConfig, hf: dict, **kw) -> dict:
    """The full plan (memory per phase + step time) of a run config."""
    a = kw.get("assumptions") or Assumptions()
    hw = kw.get("hardware") or Hardware()
    return full_plan(scenario_from_config(cfg, hf), a, hw)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(RunConfig, [args.config], args.overrides)
    hf = hf_config_for(cfg.model.hf_path, args.hf_config)
    if not args.gpus:  # the pinned upstream rules for this model (the loader had no model)
        compat.enforce(cfg, hf)
    a = parse_assignments(args.assume, Assumptions(), "--assume")
    hw = parse_assignments(args.hw, Hardware(), "--hw")
    sc = scenario_from_config(cfg, hf)
    if args.gpus:
        best = search(sc, a, hw, args.gpus)
        if args.json:
            print(json.dumps(best, default=str))
            return 0
        if not best:
            print(f"no layout fits {args.gpus} GPUs of {sc.gpu_memory_gib} GiB")
            return 1
        for i, p in enumerate(best):
            print(f"#{i + 1}: " + " ".join(p["overrides"]))
            print(format_plan(p) + "\n")
        return 0
    if args.ladder:
        rows, config = ladder(sc, a, hw), config_row(sc, a, hw)
        runnable = runnable_ladder(sc, a, hw)
        if args.json:
            out = {"target_s": TARGET_STEP_S, "config": config, "rungs": rows}
            print(json.dumps({**out, "runnable": runnable}, default=str))
        else:
            print(format_ladder(rows, sc.num_gpus, config, runnable))
        return 0
    result = full_plan(sc, a, hw)
    print(json.dumps(result, default=str) if args.json else format_plan(result))
    return 0
