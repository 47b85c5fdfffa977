"""`megagrpo plan-memory CONFIG [key=value ...] [--hf-config FILE] [--gpus N] [--hw k=v]
[--assume k=v] [--json]`: per-GPU memory of every phase (train, generate, sync, startup) of
the config's layout on its cluster, and a per-phase step-time estimate, before renting GPUs.
``--gpus N`` prints the fastest layouts that fit N GPUs instead.

Keys the planner models before the trainer has them (``trainer.offload_during_rollout``,
``rollout.replicas``, ...: :data:`megagrpo.model.plan_scenario.PLANNED_KEYS`) are accepted in
the YAML and as overrides. What each line means: :mod:`megagrpo.model.plan_memory` and
:mod:`megagrpo.model.plan_time`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import yaml

from megagrpo.config import compat, load_config
from megagrpo.errors import ConfigError
from megagrpo.model.plan_memory import hf_config_for
from megagrpo.model.plan_scenario import (
    PLANNED_KEYS,
    Assumptions,
    Hardware,
    parse_assignments,
    scenario_from_config,
    split_planned,
)
from megagrpo.model.plan_search import format_plan, full_plan, search
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
    parser.add_argument("--hw", nargs="*", default=[], metavar="key=value", help="Hardware")
    parser.add_argument("--assume", nargs="*", default=[], metavar="key=value", help="Assumptions")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _schema_has(section: str, key: str) -> bool:
    sub = getattr(RunConfig(), section, None)
    if sub is None or not dataclasses.is_dataclass(sub):
        return False
    return key in {f.name for f in dataclasses.fields(sub)}


def load_with_planned(path: str, overrides: list[str]) -> tuple[RunConfig, dict]:
    """The run config of ``path`` + ``overrides`` and the planned keys taken out of both."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read YAML: {exc}") from exc
    planned = split_planned(data, _schema_has) if isinstance(data, dict) else {}
    rest = []
    for item in overrides:
        key, _, value = item.partition("=")
        if key in PLANNED_KEYS and not _schema_has(*key.split(".")):
            planned[key] = yaml.safe_load(value)
        else:
            rest.append(item)
    with tempfile.TemporaryDirectory(prefix="megagrpo-plan-") as tmp:
        clean = Path(tmp) / Path(path).name
        clean.write_text(yaml.safe_dump(data), encoding="utf-8")
        return load_config(RunConfig, [clean], rest), planned


def plan_run(cfg: RunConfig, hf: dict, planned: dict | None = None, **kw) -> dict:
    """The full plan (memory per phase + step time) of a run config."""
    a = kw.get("assumptions") or Assumptions()
    hw = kw.get("hardware") or Hardware()
    return full_plan(scenario_from_config(cfg, hf, planned), a, hw)


def run(args: argparse.Namespace) -> int:
    cfg, planned = load_with_planned(args.config, args.overrides)
    hf = hf_config_for(cfg.model.hf_path, args.hf_config)
    if not args.gpus:  # the pinned upstream rules for this model (the loader had no model)
        compat.enforce(cfg, hf)
    a = parse_assignments(args.assume, Assumptions(), "--assume")
    hw = parse_assignments(args.hw, Hardware(), "--hw")
    sc = scenario_from_config(cfg, hf, planned)
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
    result = full_plan(sc, a, hw)
    print(json.dumps(result, default=str) if args.json else format_plan(result))
    return 0
