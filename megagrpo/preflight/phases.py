"""The phases of ``megagrpo preflight``: the run's own start-up and step code, one phase at a
time, on a model truncated to a few layers with dummy weights (:mod:`megagrpo.commands.preflight`
builds that config). Every phase runs on every rank (collective, like ``megagrpo train``); each
records its wall time and the peak memory of the process (max over ranks):

start (``build_context``: policy, engines from dummy weights, first verified sync), generate
(one scored round), sleep, wake (the loop's no-update wake), train (one optimiser step),
sync (verified), skipped (a non-finite update is skipped and the engines still generate),
checkpoint, resume (restored into the same context, LoRA equal, verified sync), export (PEFT
adapter).

The first phase that fails stops the run; its error is reported with the phase's name.
``MEGAGRPO_PREFLIGHT_FAIL=PHASE`` raises inside that phase on purpose (to test the report).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megagrpo.model import ModelConfig, Policy
from megagrpo.parallel import ParallelGroups
from megagrpo.trainer.config import RunConfig
from megagrpo.trainer.context import TrainContext

log = logging.getLogger(__name__)

PHASES = (
    "start",
    "generate",
    "sleep",
    "wake",
    "train",
    "sync",
    "skipped",
    "checkpoint",
    "resume",
    "export",
)
"""The phases in the order they run."""

PLAN_PHASE = {"start": "startup", "generate": "generate", "train": "train", "sync": "sync"}
"""Which phase of ``plan-memory`` predicts a preflight phase's peak."""

FAIL_ENV = "MEGAGRPO_PREFLIGHT_FAIL"


class PreflightError(RuntimeError):
    """A phase's check failed (the phase ran, but did not do what it must)."""


@dataclass
class PhaseResult:
    """One phase: ``ok``, wall seconds, peak memory in GiB (max over ranks), error text."""

    name: str
    ok: bool
    seconds: float
    peak_gib: float
    error: str = ""


@dataclass
class PreflightRun:
    """What the phases hand each other."""

    cfg: RunConfig
    ctx: TrainContext | None = None
    groups: list = field(default_factory=list)
    saved: dict[str, torch.Tensor] = field(default_factory=dict)
    checkpoint: Path | None = None


# ------------------------------------------------------------------ memory
def reset_peak() -> None:
    """Start a new peak: the device allocator's, or the process's RSS high-water mark
    (Linux: ``/proc/self/clear_refs`` 5 resets VmHWM)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_bytes() -> float:
    """Peak since :func:`reset_peak`: ``torch.cuda.max_memory_allocated`` on GPU; the RSS
    high-water mark (VmHWM) on CPU (``ru_maxrss`` where /proc is missing)."""
    if torch.cuda.is_available():
        return float(torch.cuda.max_memory_allocated())
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


# ------------------------------------------------------------------ dummy policy
def dummy_init(policy: Any, seed: int = 0) -> None:
    """Deterministic stand-in weights for a policy built without reading any: norms 1, every
    other base tensor N(0, 0.02) from a generator seeded by its name (so replicated tensors
    agree on every rank). LoRA parameters keep their own initialisation."""
    with torch.no_grad():
        for name, p in policy.params().items():
            if "lora" in name.lower() or "adapter" in name.lower():
                continue
            if p.dim() == 1 and "norm" in name:
                p.fill_(1.0)
                continue
            gen = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(0.02))


def dummy_policy_factory(model_cfg: ModelConfig, pgs: ParallelGroups) -> Policy:
    """``build_policy`` without reading weights, then :func:`dummy_init`."""
    from megagrpo.model.policy import build_policy

    policy = build_policy(model_cfg, pgs, load_weights=False)
    dummy_init(policy)
    return policy


# ------------------------------------------------------------------ phases
def _ctx(run: PreflightRun) -> TrainContext:
    if run.ctx is None:
        raise PreflightError("no training context (the start phase failed)")
    return run.ctx


def _start(run: PreflightRun) -> None:
    from megagrpo.trainer.setup import build_context

    run.ctx = build_context(run.cfg, policy_factory=dummy_policy_factory)
    if run.ctx.rollouts.last_probe is None:
        raise PreflightError("the engines started without a verified first sync")


def _round(ctx: TrainContext, seed: int) -> list:
    problems = ctx.sampler.next_problems(ctx.cfg.trainer.batch_groups)
    groups = ctx.rollouts.generate_round(problems, ctx.cfg.rollout.group_size, seed)
    if not groups or not any(sum(g.lengths) for g in groups):
        raise PreflightError(f"{len(groups)} groups and no generated token")
    return groups


def _generate(run: PreflightRun) -> None:
    run.groups = _round(_ctx(run), seed=1)


def _sleep(run: PreflightRun) -> None:
    ctx = _ctx(run)
    ctx.rollouts.sleep()
    ctx.offload.for_training()


def _wake(run: PreflightRun) -> None:
    from megagrpo.trainer import loop

    ctx = _ctx(run)
    loop._no_sync(ctx, slept=True)  # noqa: SLF001 - the loop's own wake, as a step runs it
    ctx.offload.for_generation()
    _round(ctx, seed=2)


def _advantages(groups: list) -> list[torch.Tensor]:
    """Synthetic non-zero advantages (the dummy model's rewards are all alike): +1 / -1
    alternating within each group, so every phase trains on a real gradient."""
    return [
        torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(g.size)], dtype=torch.float32)
        for g in groups
    ]


def _train(run: PreflightRun) -> None:
    from megagrpo.trainer.optimize import train_on_batch

    ctx = _ctx(run)
    ctx.rollouts.sleep()
    ctx.offload.for_training()
    metrics = train_on_batch(ctx, run.groups, _advantages(run.groups))
    if metrics.get("train/optimizer_steps", 0.0) <= 0:
        raise PreflightError(f"no optimiser step (train metrics {metrics})")
    ctx.step += 1


def _sync(run: PreflightRun) -> None:
    from megagrpo.trainer.sync import sync_weights

    metrics = sync_weights(_ctx(run))
    if "sync/probe_max_diff" in metrics and not metrics["sync/probe_max_diff"] < float("inf"):
        raise PreflightError(f"sync not verified: {metrics}")


def _skipped(run: PreflightRun) -> None:
    from megagrpo.trainer import loop
    from megagrpo.trainer.optimize import train_on_batch

    ctx = _ctx(run)
    ctx.rollouts.sleep()
    ctx.offload.for_training()
    bad = [torch.full_like(a, float("nan")) for a in _advantages(run.groups)]
    metrics = train_on_batch(ctx, run.groups, bad)
    if metrics.get("train/skipped_nonfinite") != 1.0:
        raise PreflightError(f"a non-finite update was not skipped: {metrics}")
    loop._no_sync(ctx, slept=True)  # noqa: SLF001 - what the loop does after a skip
    ctx.offload.for_generation()
    _round(ctx, seed=3)


def _checkpoint(run: PreflightRun) -> None:
    from megagrpo.trainer.train_state import save_checkpoint

    ctx = _ctx(run)
    run.saved = {k: v.detach().clone() for k, v in ctx.policy.lora_state_dict().items()}
    run.checkpoint = save_checkpoint(ctx, ctx.step)


def _resume(run: PreflightRun) -> None:
    from megagrpo.checkpoint.format import find_resume_checkpoint
    from megagrpo.trainer.sync import push_weights, sync_mode, trainer_probe
    from megagrpo.trainer.train_state import restore_checkpoint

    ctx = _ctx(run)
    with torch.no_grad():  # disturb the adapters: the restore must bring them back
        for p in ctx.policy.lora_parameters():
            p.add_(1.0)
    point = find_resume_checkpoint(ctx.ckpt_root, ctx.comm)
    problem = ""
    try:  # rank-local: every rank must reach the agreement below
        restore_checkpoint(ctx, point)
        now = ctx.policy.lora_state_dict()
        wrong = [k for k, v in run.saved.items() if not torch.equal(now[k].cpu(), v.cpu())]
        if wrong:
            problem = f"{len(wrong)} LoRA tensors differ after the restore: {wrong[:3]}"
    except Exception as exc:  # noqa: BLE001 - agreed on, then raised on every rank
        problem = f"{type(exc).__name__}: {exc}"
    problems = [p for p in ctx.comm.all_gather_object(problem) if p]
    if problems:
        raise PreflightError("; ".join(problems))
    expected = trainer_probe(ctx, ctx.rollouts.probe_token_ids)
    push_weights(ctx, sync_mode(ctx), expected)


def _export(run: PreflightRun) -> None:
    ctx = _ctx(run)
    out = ctx.policy.export_peft_adapter(ctx.run_dir / "adapter")
    if ctx.comm.is_main and (out is None or not any(Path(out).glob("adapter_model*"))):
        raise PreflightError(f"no adapter written under {ctx.run_dir / 'adapter'}")


RUNNERS: dict[str, Callable[[PreflightRun], None]] = {
    "start": _start,
    "generate": _generate,
    "sleep": _sleep,
    "wake": _wake,
    "train": _train,
    "sync": _sync,
    "skipped": _skipped,
    "checkpoint": _checkpoint,
    "resume": _resume,
    "export": _export,
}


def _agree(run: PreflightRun, error: str) -> str:
    """Collective when the context exists: every rank's error joined (one decision)."""
    if run.ctx is None:
        return error
    errors = run.ctx.comm.all_gather_object(error)
    return "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)


def _max(run: PreflightRun, value: float) -> float:
    return value if run.ctx is None else run.ctx.comm.max_over(value)


def run_phase(run: PreflightRun, name: str) -> PhaseResult:
    """Run phase ``name`` (collective); the error of any rank fails it on every rank."""
    log.info("preflight phase %s", name)
    reset_peak()
    t0 = time.perf_counter()
    error = ""
    try:
        if os.environ.get(FAIL_ENV) == name:
            raise PreflightError(f"failed on purpose ({FAIL_ENV}={name})")
        RUNNERS[name](run)
    except Exception as exc:  # noqa: BLE001 - reported per phase, the run stops
        log.warning("preflight phase %s failed", name, exc_info=True)
        error = f"{type(exc).__name__}: {exc}"
    seconds = time.perf_counter() - t0
    error = _agree(run, error)
    peak = _max(run, peak_bytes()) / 2**30
    return PhaseResult(name, not error, seconds, peak, error)


def run_phases(cfg: RunConfig, before_phase: Callable[[], None] | None = None) -> list[PhaseResult]:
    """Every phase in order until one fails; the context is released at the end.
    ``before_phase`` runs before each (the command re-asserts its signal handlers)."""
    from megagrpo.trainer.setup import shutdown

    run = PreflightRun(cfg)
    results: list[PhaseResult] = []
    try:
        for name in PHASES:
            if before_phase is not None:
                before_phase()
            results.append(run_phase(run, name))
            if not results[-1].ok:
                break
    finally:
        if run.ctx is not None:
            run.ctx.logger.close()
            shutdown(run.ctx)
    return results


def as_dict(result: PhaseResult) -> dict[str, Any]:
    """JSON form of one phase."""
    return dataclasses.asdict(result)
