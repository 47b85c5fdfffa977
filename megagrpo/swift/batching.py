"""ms-swift's batch layout, loss normalisers and launch environment -> megagrpo keys (used by
`megagrpo from-swift`).

* Batches. ms-swift counts completions: an optimizer step trains ``global_batch_size`` of
  them (``swift rlhf``: ``per_device_train_batch_size x world x gradient_accumulation_steps``);
  a generation makes ``generation_batch_size`` (= the step's x ``steps_per_generation``, in
  optimizer steps for ``megatron rlhf`` and in micro-steps for ``swift rlhf``); each generated
  batch is trained ``num_iterations`` times. megagrpo: ``trainer.batch_groups`` problems per
  generated batch, ``trainer.mini_batches`` optimizer steps per pass over it,
  ``trainer.ppo_epochs`` passes; ``trainer.max_steps`` counts optimizer steps as ms-swift's
  ``max_steps`` / ``train_iters`` do (``swift/rlhf_trainers/grpo_trainer.py`` ``_prepare_inputs``,
  ``swift/megatron/trainers/grpo_trainer.py`` ``_build_rollout_buffer``).
* Normalisers (ms-swift 4.6.0 as installed; the loss code is run by
  tests/unit/test_from_swift_loss.py): ``megatron rlhf`` divides bnpo and dapo by the
  optimizer step's completion tokens over all ranks and pre-multiplies by
  ``num_microbatches`` (cancelled by Megatron's division): megagrpo's ``token_mean``.
  ``swift rlhf``'s bnpo is a token mean per micro-batch of ``per_device_train_batch_size``
  completions, averaged over micro-batches and ranks (= grpo's sequence mean at 1); its dapo
  divides by the completion tokens of the whole *generated* batch (the gradient-accumulation
  division undone): ``token_mean`` when a generation is one optimizer step, else scaled by
  (tokens of the step) / (tokens of the generation).
* Launch. ``NPROC_PER_NODE`` / ``NNODES`` (given before the command or ``export``-ed by the
  script) size ``swift rlhf``'s batch and become ``cluster.gpus_per_node`` /
  ``cluster.num_nodes``; ``--offload_model`` / ``--offload_optimizer`` become
  ``trainer.offload_during_rollout``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megagrpo.errors import ConfigError
from megagrpo.swift.flags import (
    DIFFERS,
    EXACT,
    MEGATRON_DEFAULTS,
    MISSING,
    SWIFT_DEFAULTS,
    Translation,
    _bool,
)
from megagrpo.swift.shell import Unexpanded


@dataclass(frozen=True)
class Layout:
    """ms-swift's batches of a command, in completions and optimizer steps."""

    per_step: int
    """Completions per optimizer step."""
    per_generation: int
    """Completions per generated batch."""
    mini_batches: int
    """Optimizer steps per generated batch (0: optimizer steps straddle generations)."""
    micro_steps: int
    """swift rlhf: gradient-accumulation micro-steps per optimizer step (megatron: 1)."""
    steps_per_generation: int
    """As ms-swift resolves it: micro-steps (swift rlhf) or optimizer steps (megatron)."""


def layout(t: Translation) -> Layout:
    """ms-swift's ``_init_generation_batch_params`` / ``resolve_generation_batch_size``."""
    spg, gen = t.get("steps_per_generation"), t.get("generation_batch_size")
    if t.flavor == "megatron" or "global_batch_size" in t.flags:
        per_step = int(t.get("global_batch_size", MEGATRON_DEFAULTS["global_batch_size"]))
        per_micro, micro = per_step, 1  # spg counts optimizer steps
    else:
        mb = int(t.get("per_device_train_batch_size", 1))
        gas = t.get("gradient_accumulation_steps")
        micro = int(gas) if gas is not None else max(1, math.ceil(16 / mb / t.world_size))
        per_micro, per_step = mb * t.world_size, mb * t.world_size * micro
    if spg is None and gen is None:
        spg = micro
    elif spg is None:
        if int(gen) % per_micro:
            raise ConfigError(
                f"--generation_batch_size {gen}: not a multiple of {per_micro} completions "
                "(ms-swift raises too)"
            )
        spg = int(gen) // per_micro
    elif gen is not None and int(gen) != per_micro * int(spg):
        raise ConfigError(
            f"--generation_batch_size {gen} != {per_micro} x --steps_per_generation {spg} "
            "(ms-swift raises too)"
        )
    spg = int(spg)
    if spg < 1:
        raise ConfigError(f"--steps_per_generation {spg}: must be > 0 (ms-swift raises too)")
    per_gen = per_micro * spg
    mini = spg // micro if spg % micro == 0 else 0
    return Layout(per_step, per_gen, mini, micro, spg)


def _assumed_world(t: Translation, g: int) -> Layout:
    """The world size only the shell knows: the smallest that makes an optimizer step a
    whole number of groups (reported as not supported: pass --world-size)."""
    one = t.world_size
    t.world_size = next(w for w in range(1, 4 * g + 1) if layout_at(t, w).per_step % g == 0)
    t.add(
        "[world size]",
        MISSING,
        {},
        f"computed by the shell: {one} process(es) make optimizer steps of "
        f"{layout_at(t, one).per_step} completions, not a multiple of num_generations={g}; "
        f"written for {t.world_size} processes: pass --world-size",
        given=False,
        value=t.world_size,
    )
    return layout(t)


def layout_at(t: Translation, world: int) -> Layout:
    """:func:`layout` with another world size."""
    saved, t.world_size = t.world_size, world
    try:
        return layout(t)
    finally:
        t.world_size = saved


def _world_hint(t: Translation) -> str:
    if t.flavor == "megatron":
        return ""
    return (
        f" (swift rlhf: per_device_train_batch_size x world size {t.world_size} x "
        "gradient_accumulation_steps; the world size is NPROC_PER_NODE x NNODES from the "
        "command or the script's exports: pass --world-size N when it differs)"
    )


def translate_batches(t: Translation) -> Layout:
    """``trainer.batch_groups``, ``trainer.mini_batches``, ``trainer.ppo_epochs``."""
    g = int(t.get("num_generations", SWIFT_DEFAULTS["num_generations"]))
    lay = layout(t)
    if lay.per_step % g and t.world_from_shell and t.flavor == "swift":
        lay = _assumed_world(t, g)
    if lay.per_step % g:
        raise ConfigError(
            f"{lay.per_step} completions per optimizer step is not a multiple of "
            f"num_generations={g}{_world_hint(t)}"
        )
    flag = (
        "global_batch_size"
        if t.flavor == "megatron" or "global_batch_size" in t.flags
        else "gradient_accumulation_steps"
    )
    mini = max(lay.mini_batches, 1)
    groups = lay.per_step * mini // g if lay.mini_batches else lay.per_step // g
    t.add(
        flag,
        DIFFERS,
        {"trainer.batch_groups": groups, "trainer.mini_batches": mini},
        f"ms-swift counts completions ({lay.per_step} per optimizer step); "
        f"trainer.batch_groups counts problems per generated batch: {lay.per_step} x {mini} / "
        f"{g} generations = {groups}"
        + ("" if t.flavor == "megatron" else f" (world size {t.world_size})"),
        value=t.get(flag, lay.per_step),
    )
    _generation_entries(t, lay, g)
    _iterations(t)
    return lay


def _generation_entries(t: Translation, lay: Layout, g: int) -> None:
    """steps_per_generation / generation_batch_size: ``trainer.mini_batches``."""
    given = [f for f in ("steps_per_generation", "generation_batch_size") if f in t.flags]
    if not given:
        return
    if lay.mini_batches >= 1:
        note = (
            f"{lay.per_generation} completions ({lay.per_generation // g} problems) per "
            f"generation = trainer.mini_batches {lay.mini_batches} optimizer steps of "
            f"{lay.per_step} completions; old log-probs from before the first, as ms-swift"
        )
        status = EXACT
    elif lay.micro_steps % lay.steps_per_generation == 0:
        note = (
            f"{lay.micro_steps // lay.steps_per_generation} generations of "
            f"{lay.per_generation} completions with the same weights make up one optimizer "
            f"step: megagrpo generates the step's {lay.per_step} at once"
        )
        status = EXACT
    else:
        note = (
            f"not supported: optimizer steps of {lay.micro_steps} micro-steps straddle "
            f"generations of {lay.steps_per_generation}"
        )
        status = MISSING
    for flag in given:
        t.add(flag, status, {}, note)


def _iterations(t: Translation) -> None:
    if "num_iterations" not in t.flags:
        return
    n = int(t.get("num_iterations"))
    note = "each generated batch is trained num_iterations times; max_steps counts optimizer steps"
    status = EXACT
    if t.flavor == "megatron" and n > 1:
        status = DIFFERS
        note = (
            "ms-swift's megatron rlhf refuses num_iterations > 1 (megatron_args.py); megagrpo "
            "trains it as swift rlhf does: " + note
        )
    t.add("num_iterations", status, {"trainer.ppo_epochs": n}, note)


def loss_normaliser(t: Translation, loss: str, lay: Layout) -> tuple[str, str, str]:
    """``(status, loss_agg, note)`` of ms-swift's ``loss_type`` under this launcher."""
    if loss in ("grpo", "sapo"):
        return EXACT, "seq_mean_token_mean", "per-completion token mean, then the batch mean"
    if loss == "dr_grpo":
        return EXACT, "seq_mean_token_sum_norm", "token sum / (completions x max_completion_length)"
    if t.flavor == "megatron":
        return (
            EXACT,
            "token_mean",
            f"ms-swift 4.6.0's megatron {loss}: the step's completion tokens over all ranks "
            "(its x num_microbatches cancels Megatron's / num_microbatches)",
        )
    if loss == "bnpo":
        mb = int(t.get("per_device_train_batch_size", 1))
        if mb == 1:
            return (
                EXACT,
                "seq_mean_token_mean",
                "swift rlhf's bnpo is a token mean per micro-batch, averaged over "
                "micro-batches and ranks: with per_device_train_batch_size 1 that is each "
                "completion's token mean, averaged (grpo's sequence mean)",
            )
        return (
            DIFFERS,
            "token_mean",
            f"swift rlhf's bnpo is a token mean per micro-batch of {mb} completions, "
            "averaged over micro-batches and ranks: between a token mean (mapped) and a "
            "sequence mean; megagrpo's token mean is over the whole step",
        )
    factor = lay.per_step / lay.per_generation
    if factor == 1:
        return EXACT, "token_mean", "the completion tokens of the step (one generation)"
    return (
        DIFFERS,
        "token_mean",
        f"swift rlhf's dapo divides by the completion tokens of the whole generated batch "
        f"({lay.per_generation} completions) and a step trains {lay.per_step}: its loss and "
        f"gradient are about {factor:g} x megagrpo's token mean (exactly: step tokens / "
        "generation tokens); grad clipping then acts on a different scale",
    )


def translate_launch(t: Translation, env: dict[str, str]) -> None:
    """NPROC_PER_NODE / NNODES -> ``cluster``; offload flags -> offload_during_rollout."""
    keys: dict[str, Any] = {}
    for name, key in (("NPROC_PER_NODE", "cluster.gpus_per_node"), ("NNODES", "cluster.num_nodes")):
        value = env.get(name)
        if value is None or isinstance(value, Unexpanded):
            continue
        try:
            keys[key] = int(value)
        except ValueError as exc:
            raise ConfigError(f"{name}={value!r}: not a number of processes") from exc
    if keys:
        shown = " ".join(f"{k}={env[k]}" for k in ("NPROC_PER_NODE", "NNODES") if k in env)
        t.add(
            f"[env {shown}]",
            EXACT,
            keys,
            "the launch's nodes x processes (plan-memory and the Slurm launcher read cluster:)",
            given=False,
            value="-",
        )
    offload = [f for f in ("offload_model", "offload_optimizer") if f in t.flags]
    on = any(_bool(t.get(f)) for f in offload)
    for flag in offload:
        t.add(
            flag,
            DIFFERS,
            {"trainer.offload_during_rollout": on},
            "trainer.offload_during_rollout: the frozen weights and the optimizer's moments "
            "go to host memory while the engines generate (weights and moments together; "
            "where memory lives, not what is trained)",
        )
