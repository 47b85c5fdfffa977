"""`megagrpo train CONFIG [key=value ...] [--resume | --overwrite]`: GRPO training.

Single process:            megagrpo train configs/demo_cpu.yaml trainer.max_steps=3
Several (gloo/NCCL):       torchrun --nproc-per-node 2 -m megagrpo.cli train CONFIG parallel.tp=2
Continue a stopped run:    megagrpo train CONFIG --resume
Start over in its dir:     megagrpo train CONFIG --overwrite   (the old run is moved aside)

Writes runs/<trainer.name>/: config.yaml (resolved), metrics.jsonl (one row per step, every
metric of the design), checkpoints/step_*/ (adapters, optimiser, sampler state, RNGs),
wandb/ (offline unless metrics.wandb_mode=online), adapter/ (PEFT adapter at the end).

SIGTERM, SIGINT (Ctrl-C) or SIGUSR1 finish the current step, write a checkpoint and exit with
status 0 (every rank stops after the same step); a second Ctrl-C stops at once (status 130).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megagrpo.trainer.context import TrainContext

DESCRIPTION = __doc__

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run config YAML (configs/demo_cpu.yaml, ...)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted config overrides, e.g. trainer.max_steps=3",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest verified checkpoint of the run",
    )
    mode.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh although the run directory holds a run: it is moved aside to "
        "<name>.old-<time> (never deleted)",
    )
    parser.add_argument(
        "--allow-base-change",
        action="store_true",
        help="with --resume: continue although the base weights under model.hf_path are not "
        "those the checkpoint was trained on (their fingerprint differs); refused otherwise",
    )


def _env_defaults() -> None:
    """CPU-friendly defaults that must be set before vllm/triton/wandb are imported."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("WANDB_SILENT", "true")
    # W&B's own telemetry posts to the W&B host at exit, even offline: 10 s per exit on a
    # cluster without network. Set WANDB_ERROR_REPORTING=true to send it anyway.
    os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def check_layout(cfg: Any) -> None:
    """``parallel.*`` against the launch's world size (torchrun's WORLD_SIZE, else 1) and,
    for a local model directory, its config.json: ConfigError naming the key before any
    engine or model starts (vLLM's start-up takes tens of seconds)."""
    from pathlib import Path

    from megagrpo.errors import ConfigError
    from megagrpo.model.arch import load_hf_config
    from megagrpo.parallel.state import validate_layout

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.rollout.placement == "separate":  # the last processes serve the engines
        world = max(world - cfg.rollout.engine_ranks, 1)
    path = Path(cfg.model.hf_path).expanduser()
    hf = load_hf_config(path) if (path / "config.json").is_file() else None
    if hf is not None and "num_attention_heads" in hf:
        validate_layout(cfg.parallel, hf, world)
        return
    p = cfg.parallel
    if world % (p.tp * p.pp) or world % (p.ep * p.etp * p.pp):
        raise ConfigError(
            f"config key 'parallel': world size {world} (WORLD_SIZE) is not divisible by "
            f"tp*pp={p.tp * p.pp} and ep*etp*pp={p.ep * p.etp * p.pp}"
        )


def run(args: argparse.Namespace) -> int:
    _env_defaults()
    from megagrpo.config import load_config
    from megagrpo.parallel.signals import StopSignals
    from megagrpo.parallel.strict import strict_from_env
    from megagrpo.trainer.config import RunConfig
    from megagrpo.trainer.loop import train
    from megagrpo.trainer.setup import build_context, finish, shutdown

    cfg = load_config(RunConfig, [args.config], args.overrides)
    check_layout(cfg)
    from megagrpo.placement.separate import trainer_link  # None without separate placement

    split = None
    if cfg.rollout.placement == "separate":  # trainer ranks + the engines' own ranks
        from megagrpo.parallel.split import split_world
        from megagrpo.placement.separate import serve_engine_rank

        ro = cfg.rollout
        split = split_world(cfg.parallel.timeout_minutes, ro.engine_ranks, ro.tensor_parallel_size)
        if split.is_engine:  # a stop signal is the trainers' to act on: the engine rank
            held = StopSignals().install()  # reports it, they checkpoint, close the link
            try:
                serve_engine_rank(ro, cfg.model.hf_path, cfg.trainer.seed, split, stop=held)
            finally:
                held.restore()
            return 0
    stop = StopSignals().install()  # a signal during start-up stops before step 1
    try:
        channel = trainer_link(split)
        ctx = build_context(
            cfg,
            resume=args.resume,
            overwrite=args.overwrite,
            channel=channel,
            allow_base_change=args.allow_base_change,
        )
        try:
            # MEGAGRPO_STRICT_DEVICES=1: every tensor handed to a collective or to the loss
            # must be on the declared compute device (emulated on CPU): megagrpo.parallel.strict
            with strict_from_env(ctx.pgs, host_modules=host_modules(ctx.rollouts.engine)):
                rows = train(ctx, stop)
                if ctx.stopped_by is None:
                    finish(ctx)
        finally:
            shutdown(ctx)
    except KeyboardInterrupt:
        print("megagrpo train: interrupted: no checkpoint written", file=sys.stderr)
        return 130
    finally:
        stop.restore()
    if ctx.comm.is_main:
        _report(ctx, rows)
    return 0


def _report(ctx: TrainContext, rows: list[dict]) -> None:
    """The run's last line: how it ended and where to continue."""
    skipped = sum(1 for r in rows if r.get("train/skipped_empty_batch"))
    nonfinite = sum(1 for r in rows if r.get("train/skipped_nonfinite"))
    note = f" ({skipped} trained nothing)" if skipped else ""
    note += f" ({nonfinite} skipped: non-finite)" if nonfinite else ""
    if ctx.stopped_by and ctx.saved_step is None:
        print(
            f"stopped by {ctx.stopped_by} before step 1: nothing trained, no checkpoint; "
            "start again with the same command"
        )
    elif ctx.stopped_by:
        print(
            f"stopped by {ctx.stopped_by} after step {ctx.step}: checkpoint "
            f"{ctx.ckpt_root / f'step_{ctx.step:06d}'}; continue with --resume"
        )
    elif rows:
        from megagrpo.metrics.report import last_generation_row

        last = last_generation_row(rows)  # other optimizer steps of a generation hold None
        print(
            f"done: {ctx.step} steps{note}, run dir {ctx.run_dir}, last reward/mean="
            f"{last.get('reward/mean')}, collapse/acr_raw={last.get('collapse/acr_raw')}"
        )
        print_learning(ctx.run_dir)


def print_learning(run_dir) -> None:
    """The run's learning line (raw reward first vs last fifth, held-out accuracy first vs
    last evaluation: :func:`megagrpo.metrics.report.learning_summary`), from the whole
    metrics.jsonl (a resumed run included)."""
    from megagrpo.metrics import read_metrics
    from megagrpo.metrics.report import format_learning, learning_summary

    path = run_dir / "metrics.jsonl"
    if path.is_file():
        line = format_learning(learning_summary(read_metrics(path)))
        if line:
            print(f"learning: {line}")


def host_modules(engine: object) -> tuple:
    """Modules strict device mode keeps on the host: an in-process HF engine's model (its
    ``generate`` cannot run on an emulated device)."""
    from megagrpo.rollout.hf_engine import HFEngine

    return (engine.model,) if isinstance(engine, HFEngine) else ()
