"""`megagrpo plan-memory CONFIG [key=value ...] [--hf-config FILE] [--gpus N [--allow-lossy]]
[--ladder] [--levels TEXT] [--hw-file FILE] [--hw k=v] [--assume k=v] [--json]`: per-GPU memory
of every phase (train, generate, sync, startup) of the config's layout on its cluster, a
per-phase step-time estimate with its low / central / high bounds, and whether its weight sync
is exact or lossy (the predicted survival of the LoRA update), before renting GPUs. ``--gpus
N`` searches the layouts of N GPUs and prints the best exact and the best unverified one
(``--allow-lossy``: the best lossy one too); ``--ladder`` the step time with one throughput
lever added per rung (:mod:`megagrpo.plan.ladder`). ``--hw-file``: the figures
``tools/measure_cluster.py`` measured on the cluster (points, no longer ranges; ``--hw``
overrides them).

Dynamic sampling is billed from the collapse simulation of `megagrpo plan` (the run's levels
file, or ``--levels``; :mod:`megagrpo.plan.collapse`). Every layout goes through the
compatibility gate (``megagrpo.gate.compat``). Every key the plan reads is the run config's
own (overrides as for `megagrpo train`). What each line means: :mod:`megagrpo.plan.memory` and
:mod:`megagrpo.plan.time`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import TYPE_CHECKING, Any

from megagrpo.errors import ConfigError

if TYPE_CHECKING:  # the planner imports torch: only when the command runs (fast --help)
    from megagrpo.plan.gate import Gate
    from megagrpo.plan.prefix import PromptStats
    from megagrpo.plan.scenario import Assumptions, Scenario
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
    parser.add_argument(
        "--gpus",
        type=int,
        default=0,
        help="search the layouts of N GPUs: the best exact and the best unverified one",
    )
    parser.add_argument(
        "--allow-lossy",
        action="store_true",
        help="with --gpus: rank lossy layouts too (a merged sync that rounds the LoRA update "
        "away); the trainer runs them only with trainer.allow_lossy_sync=true",
    )
    parser.add_argument(
        "--ladder",
        action="store_true",
        help="step time per phase with streamed sync, partial rollouts, vLLM TP 8 per node, "
        "FP8 rollout and one-step off-policy added in turn",
    )
    parser.add_argument(
        "--levels",
        default=None,
        metavar="L1=..,L2=..",
        help="level histogram that dynamic sampling is billed from (default: "
        "curriculum.levels_file; the article's when that file is not here)",
    )
    parser.add_argument(
        "--hw-file",
        default=None,
        metavar="FILE",
        help="hardware figures measured on the cluster (tools/measure_cluster.py --out FILE)",
    )
    parser.add_argument("--hw", nargs="*", default=[], metavar="key=value", help="Hardware")
    parser.add_argument("--assume", nargs="*", default=[], metavar="key=value", help="Assumptions")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _replaced(obj: Any, dotted: list[str], value: Any) -> Any:
    """``obj`` (a config dataclass) with the field at path ``dotted`` set to ``value``."""
    head, rest = dotted[0], dotted[1:]
    if not rest:
        return dataclasses.replace(obj, **{head: value})
    return dataclasses.replace(obj, **{head: _replaced(getattr(obj, head), rest, value)})


def config_of(cfg: RunConfig, sc: Scenario) -> RunConfig:
    """``cfg`` with every key a planned layout sets (:func:`megagrpo.plan.gate.settings_of`)."""
    from megagrpo.plan.gate import settings_of

    for key, value in settings_of(sc):
        cfg = _replaced(cfg, key.split("."), value)
    return cfg


def make_gate(cfg: RunConfig, hf: dict) -> Gate:
    """The compatibility gate (``megagrpo.gate.compat.check_run``) on ``cfg`` with a
    layout's keys, for the layout's GPUs; FP8 weights marked unverified on GPU."""
    from megagrpo.gate import compat
    from megagrpo.plan.exactness import lossy_notes
    from megagrpo.plan.gate import Verdict, planner_unverified

    def gate(sc: Scenario) -> Verdict:
        layout = config_of(cfg, sc)
        found = compat.check_run(layout, hf, world=sc.num_gpus)
        refused = tuple(f"{v.rule.name} ({v.reason})" for v in found)
        cautions = tuple(  # the gate's unverified rules (read from upstream, no GPU run yet)
            f"{c.rule.name}: follows vLLM 0.33's source, not yet run on a GPU"
            for c in compat.cautions(layout, hf, world=sc.num_gpus)
        )
        return Verdict(refused, planner_unverified(sc) + cautions, lossy_notes(sc))

    return gate


def loads(config: str, overrides: list[str], sc: Scenario) -> str:
    """'' when the config with a layout's overrides loads as `megagrpo train` loads it (the
    trainer's own rules and the gate), else the loader's error."""
    from megagrpo.config import load_config
    from megagrpo.plan.gate import overrides_of
    from megagrpo.trainer.config import RunConfig

    try:
        load_config(RunConfig, [config], [*overrides, *overrides_of(sc)])
    except ConfigError as exc:
        return str(exc).splitlines()[0]
    return ""


def plan_run(cfg: RunConfig, hf: dict, **kw) -> dict:
    """The full plan (memory per phase + step time, dynamic sampling billed: ``collapse``) of
    a run config; ``levels``: a ``--levels`` histogram text."""
    from megagrpo.plan.collapse import billed, collapse_bill
    from megagrpo.plan.scenario import Assumptions, Hardware, scenario_from_config
    from megagrpo.plan.search import full_plan

    a = kw.get("assumptions") or Assumptions()
    hw = kw.get("hardware") or Hardware(host_memory_gib_per_node=cfg.cluster.host_memory_gib)
    bill = collapse_bill(cfg, kw.get("levels"))
    plan = full_plan(billed(scenario_from_config(cfg, hf), bill), a, hw)
    plan["collapse"] = bill.as_dict()
    return plan


def _dump(obj: Any) -> str:
    from megagrpo.plan.scenario import Scenario

    def default(o: Any) -> Any:
        if isinstance(o, Scenario):
            return None  # the overrides say it; the HF config would be repeated
        return str(o)

    return json.dumps(obj, default=default)


def prompts_line(cfg: RunConfig, stats: PromptStats, sc: Scenario) -> str:
    """What the plan assumed of the prompts and whether training shares them."""
    spec = "local" if cfg.model.spec == "local" else "te"
    on, why = cfg.shared_prefix_decision(spec)
    shared = (
        f"each group's prompt once ({sc.prompts_per_group:.2f} renderings per group)"
        if on
        else f"off ({why})"
    )
    return (
        f"prompts: {stats.mean_tokens:.0f} tokens on average, {stats.source}; "
        f"shared prefix: {shared}"
    )


def _prompts(cfg: RunConfig, args: argparse.Namespace, a: Assumptions) -> PromptStats:
    """The prompt lengths the plan bills: ``--assume mean_prompt_tokens=``, else measured on
    ``data.train`` when readable here, else the assumption (:mod:`megagrpo.plan.prefix`)."""
    from megagrpo.plan.prefix import PromptStats, prompt_stats

    if any(item.startswith("mean_prompt_tokens=") for item in args.assume):
        return PromptStats(a.mean_prompt_tokens, 1.0, "--assume", False)
    return prompt_stats(cfg, a.mean_prompt_tokens)


def run(args: argparse.Namespace) -> int:
    from megagrpo.config import load_config
    from megagrpo.gate import compat
    from megagrpo.plan.collapse import billed, collapse_bill
    from megagrpo.plan.hwfile import hardware_from_file, measured_line
    from megagrpo.plan.ladder import ladder_report
    from megagrpo.plan.memory import hf_config_for
    from megagrpo.plan.report import format_ladder, format_plan, format_search
    from megagrpo.plan.scenario import (
        Assumptions,
        Hardware,
        parse_assignments,
        scenario_from_config,
    )
    from megagrpo.plan.search import full_plan, search
    from megagrpo.trainer.config import RunConfig

    # a lossy config is planned (and labelled lossy), not refused as `megagrpo train` refuses it
    cfg = load_config(RunConfig, [args.config], [*args.overrides, "trainer.allow_lossy_sync=true"])
    hf = hf_config_for(cfg.model.hf_path, args.hf_config)
    if not args.gpus:  # the pinned upstream rules for this model (the loader had no model)
        compat.enforce(cfg, hf)
    a = parse_assignments(args.assume, Assumptions(), "--assume")
    node = Hardware(host_memory_gib_per_node=cfg.cluster.host_memory_gib)
    measured = hardware_from_file(args.hw_file, node) if args.hw_file else node
    hw = parse_assignments(args.hw, measured, "--hw")  # --hw overrides the file
    if args.hw_file and not args.json:
        print(measured_line(args.hw_file))
    stats = _prompts(cfg, args, a)
    a = dataclasses.replace(a, mean_prompt_tokens=stats.mean_tokens)  # a point when measured
    bill = collapse_bill(cfg, args.levels)
    sc = billed(scenario_from_config(cfg, hf), bill).with_(
        prompts_per_group=stats.prompts_per_group
    )
    prompts = {**dataclasses.asdict(stats), "line": prompts_line(cfg, stats, sc)}
    gate = make_gate(cfg, hf)
    if args.gpus:

        def loader(cand: Scenario) -> str:
            return loads(args.config, args.overrides, cand)

        res = search(sc, a, hw, args.gpus, gate=gate, loads=loader, allow_lossy=args.allow_lossy)
        for key in ("best_exact", "best_unverified", "best_lossy"):
            if res[key] is not None:
                res[key]["collapse"] = bill.as_dict()
        res["prompts"] = prompts
        if args.json:
            print(_dump(res))
            return 0
        if not res["top"]:
            print(f"no layout fits {args.gpus} GPUs of {sc.gpu_memory_gib} GiB")
            return 1
        print(format_search(res, args.gpus, sc.gpu_memory_gib) + "\n" + prompts["line"])
        return 0
    if args.ladder:
        report = ladder_report(sc, a, hw, gate=gate)
        report["collapse"] = bill.as_dict()
        report["prompts"] = prompts
        print(_dump(report) if args.json else format_ladder(report) + "\n" + prompts["line"])
        return 0
    result = full_plan(sc, a, hw)
    result["collapse"] = bill.as_dict()
    result["prompts"] = prompts
    print(_dump(result) if args.json else format_plan(result) + "\n" + prompts["line"])
    return 0
