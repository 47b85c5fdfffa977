"""Offload during generation (``trainer.offload_during_rollout``, issue 15.1): where every
frozen weight, LoRA parameter and optimiser moment lives in each phase of real train steps.

Real tiny Qwen3-MoE policy (Megatron, LoRA on every linear), real HF engine, 1 process, under
strict device mode: the compute device is emulated as ``cuda:0`` (megagrpo.parallel.strict),
so host and device are different places on a CPU and the offload's copies are real. A
recording engine stores ``Offload.placement()`` whenever it generates or takes weights, and
the policy stores it whenever it trains and when the optimiser steps:

- offload on: generate and push see the base weights and moments on the host and the LoRA
  parameters on the device; forward/backward and the optimiser step see everything on the
  device. Start-up order: the trainer's probe, then the weights to the host, then the engine.
- offload off (the control: the recorder sees "device" when nothing moves).
- The rows of both runs are identical (offloading moves values, never changes them), and
  ``perf/offload_gb`` of step 2 is exactly 2 x (base weights + moments) bytes.

Before the offload existed the "on" run had no ``trainer.offload_during_rollout`` key (a
config error) and the placement assertions fail on the control's "device" everywhere.
"""

from __future__ import annotations

import pytest
import torch

from megagrpo.config import load_config
from megagrpo.parallel.strict import strict_devices
from megagrpo.testing import tiny_run_config, write_run_config
from megagrpo.trainer.config import RunConfig


class Recorder:
    """Placement snapshots per phase, plus the order of start-up events."""

    def __init__(self) -> None:
        self.ctx = None
        self.policy = None
        self.records: list[tuple[str, dict[str, str]]] = []
        self.events: list[str] = []

    def snap(self, phase: str) -> None:
        if self.ctx is not None:
            self.records.append((phase, self.ctx.offload.placement()))

    def phases(self, phase: str) -> list[dict[str, str]]:
        return [p for name, p in self.records if name == phase]


def _factories(rec: Recorder):
    from megagrpo.model import build_policy
    from megagrpo.rollout.hf_engine import HFEngine

    class RecordingEngine(HFEngine):
        def __init__(self, *args, **kwargs):
            rec.events.append("engine_start")
            super().__init__(*args, **kwargs)

        def generate(self, problems, n, sampling=None):
            rec.snap("generate")
            return super().generate(problems, n, sampling)

        def update_weights(self, named_tensors, *args, **kwargs):
            rec.snap("push")
            return super().update_weights(named_tensors, *args, **kwargs)

        def wake_up(self):
            rec.snap("wake_up")
            return super().wake_up()

    def policy_factory(model_cfg, pgs):
        policy = build_policy(model_cfg, pgs)
        rec.policy = policy
        inner = policy.forward_backward

        def forward_backward(batches, loss_fn, *, forward_only=False, broadcast=True, **kw):
            rec.events.append("probe" if forward_only else "train")
            if not forward_only:
                rec.snap("train")
            return inner(batches, loss_fn, forward_only=forward_only, broadcast=broadcast, **kw)

        policy.forward_backward = forward_backward  # type: ignore[method-assign]
        return policy

    return policy_factory, RecordingEngine


def _run(tmp_path, model_dir, name: str, offload: bool, monkeypatch, max_steps: int = 2):
    from megagrpo.commands.train import host_modules
    from megagrpo.placement import offload as offload_mod
    from megagrpo.trainer.loop import train
    from megagrpo.trainer.setup import build_context, shutdown

    rec = Recorder()
    real_move = offload_mod.Offload._move

    def move(self, weights, moments, target):
        rec.events.append(f"offload_{target}")
        return real_move(self, weights, moments, target)

    monkeypatch.setattr(offload_mod.Offload, "_move", move)
    cfg = tiny_run_config(
        model_dir,
        tmp_path,
        name,
        dynamic={"enabled": False},
        rollout={"max_tokens": 4},
        trainer={
            "max_steps": max_steps,
            "batch_groups": 2,
            "export_adapter": False,
            "offload_during_rollout": offload,
        },
    )
    run = load_config(RunConfig, [write_run_config(tmp_path / f"{name}.yaml", cfg)])
    policy_factory, engine = _factories(rec)
    ctx = build_context(run, policy_factory=policy_factory, engine_factory=engine)
    rec.ctx = ctx
    step = ctx.optimizer.step

    def recorded_step(*args, **kwargs):
        rec.snap("optimizer_step")
        out = step(*args, **kwargs)
        rec.snap("after_step")
        return out

    ctx.optimizer.step = recorded_step  # type: ignore[method-assign]
    try:
        with strict_devices(ctx.pgs, host_modules=host_modules(ctx.rollouts.engine)):
            rows = train(ctx)
    finally:
        shutdown(ctx)
    return rows, rec, ctx


def _kinds(placement: dict[str, str], prefix: str) -> set[str]:
    return {where for name, where in placement.items() if name.startswith(prefix)}


@pytest.fixture(scope="module")
def runs(tiny_moe_dir, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    try:
        out = {}
        for name, on in (("on", True), ("off", False)):
            out[name] = _run(tmp_path_factory.mktemp(name), tiny_moe_dir, name, on, mp)
        return out
    finally:
        mp.undo()


@pytest.mark.slow
def test_every_tensor_is_where_its_phase_needs_it(runs):
    rows, rec, _ = runs["on"]
    assert [r["train/skipped_empty_batch"] for r in rows] == [0.0, 0.0]
    gens, pushes, trains = rec.phases("generate"), rec.phases("push"), rec.phases("train")
    assert len(gens) >= 2 and len(pushes) == 2 and len(trains) >= 2
    for placement in gens + pushes:  # the engines hold the memory
        assert _kinds(placement, "weights.") == {"host"}
        assert _kinds(placement, "lora.") == {"device"}  # the adapter sync reads them
        assert _kinds(placement, "optimizer.") <= {"host"}
    assert _kinds(pushes[-1], "optimizer.") == {"host"}  # moments exist after step 1
    for placement in trains + rec.phases("optimizer_step") + rec.phases("after_step"):
        assert set(placement.values()) == {"device"}
    assert _kinds(rec.phases("after_step")[0], "optimizer.") == {"device"}
    n_weights = sum(1 for k in gens[0] if k.startswith("weights."))
    assert n_weights > 10  # embeddings, attention, experts, norms: every frozen tensor


@pytest.mark.slow
def test_startup_probes_first_then_offloads_then_starts_the_engine(runs):
    _, rec, _ = runs["on"]
    first = rec.events.index("engine_start")
    assert "probe" in rec.events[:first]
    assert rec.events.index("offload_host") < first
    assert max(i for i, e in enumerate(rec.events[:first]) if e == "probe") < rec.events.index(
        "offload_host"
    )


@pytest.mark.slow
def test_without_offload_nothing_moves(runs):
    rows, rec, _ = runs["off"]
    for placement in rec.phases("generate") + rec.phases("push") + rec.phases("train"):
        assert set(placement.values()) == {"device"}
    assert "perf/offload_gb" not in rows[-1]


@pytest.mark.slow
def test_offload_changes_no_value_and_moves_the_planned_bytes(runs):
    on, _, ctx = runs["on"]
    off, _, _ = runs["off"]
    for a, b in zip(off, on, strict=True):
        for key in ("reward/mean", "loss/policy", "loss/entropy", "train/grad_norm"):
            assert b[key] == a[key], key
        assert b["sync/probe_max_diff"] < 1e-3
    weights = sum(p.numel() * p.element_size() for _, p in ctx.offload.frozen())
    moments = sum(t.numel() * t.element_size() for *_, t in ctx.offload.moments())
    assert moments > 0
    # step 2: back to the device for training, to the host for the sync (generation: none)
    assert on[1]["perf/offload_gb"] == pytest.approx(2 * (weights + moments) / 1e9, rel=1e-12)
    assert torch.cuda.is_available() or on[1]["perf/offload_s"] >= 0.0


@pytest.mark.slow
def test_a_skipped_update_wakes_the_engines_into_offloaded_memory(
    tiny_moe_dir, tmp_path, monkeypatch
):
    """A non-finite update is skipped (no sync): the engines wake up as they were, after the
    trainer's weights and moments left the device again (they used to wake while training
    had everything on the device)."""
    from megagrpo.trainer import loop

    real = loop.compute_advantages

    def nan_at_step_2(ctx, groups):
        adv = real(ctx, groups)
        return [torch.full_like(a, float("nan")) for a in adv] if ctx.step + 1 == 2 else adv

    monkeypatch.setattr(loop, "compute_advantages", nan_at_step_2)
    rows, rec, _ = _run(tmp_path, tiny_moe_dir, "skip", True, monkeypatch)
    assert [r["train/skipped_nonfinite"] for r in rows] == [0.0, 1.0]
    wakes = rec.phases("wake_up")
    assert wakes, "the skipped update did not wake the engines"
    for placement in wakes:
        assert _kinds(placement, "weights.") == {"host"}
        assert _kinds(placement, "optimizer.") <= {"host"}


def test_strict_mode_sees_a_parameter_move_with_its_data():
    """``p.data = t`` is how offloading moves a parameter (CUDA allows it); the emulated
    device follows it. Before strict.py handled it, the assignment raised DeviceError (a
    device parameter "mixed" with a host tensor)."""
    with strict_devices(device="cpu") as dev:
        p = torch.nn.Parameter(torch.ones(3, device=dev), requires_grad=False)
        assert p.device == dev
        p.data = torch.zeros(3, device="cpu")
        assert p.device.type == "cpu" and not p.is_cuda
        p.data = p.data.to(dev)
        assert p.device == dev and float(p.sum()) == 0.0
