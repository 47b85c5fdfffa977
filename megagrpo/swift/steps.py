"""How many optimizer steps an ms-swift run trains, per launcher (used by `megagrpo from-swift`
for ``trainer.max_steps``).

* ``--train_iters`` / ``--max_steps``: that many.
* ``swift rlhf --num_train_epochs N`` (default 3): transformers plans N x rows / problems per
  generated batch x optimizer steps per generated batch (TRL's ``RepeatSampler`` floors the
  rows to whole generated batches); ``--max_epochs M`` < N stops it after M epochs
  (``swift/trainers/patcher.py``) on the schedule planned for N.
* ``megatron rlhf --num_train_epochs N`` (3.x: ``--max_epochs``): ms-swift's ``init_iters``
  (``swift/megatron/arguments/megatron_args.py``): rows floored to a multiple of
  micro_batch_size x DP, x num_generations x N // global_batch_size, with DP = world / (TP x
  PP x CP). That plans the LR schedule; the run itself can stop earlier: each generation pulls
  its prompts up front (``_build_rollout_buffer``), and when the last epoch's data runs out
  ``cyclic_iter`` sets ``train_iters`` to the current iteration + 1
  (``swift/megatron/trainers/base.py``). megagrpo trains ``init_iters`` steps on that schedule
  and says when ms-swift stops sooner (:func:`megatron_steps`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from megagrpo.swift.batching import Layout
from megagrpo.swift.flags import DIFFERS, EXACT, MISSING, Translation


def megatron_steps(
    rows: int, mbs: int, dp: int, g: int, epochs: float, gbs: int, per_generation: int
) -> tuple[int, int]:
    """``(train_iters, steps run)`` of ``megatron rlhf``: ms-swift's ``init_iters`` and the
    step after which its ``cyclic_iter`` ends the run (the last epoch's data ran out while a
    generation pulled its prompts), whichever comes first."""
    step_batch = mbs * dp
    iters = int(rows // step_batch * step_batch * g * epochs // gbs)
    per_epoch = rows // step_batch  # micro-iterations of one rank per epoch
    pulls = per_generation // (dp * g * mbs)  # get_num_iters_per_step
    spg = per_generation // gbs
    if per_epoch < 1 or pulls < 1:
        return iters, iters
    last_epoch = max(0, math.ceil(epochs - 1))  # cyclic_iter: epoch >= num_train_epochs - 1
    available = per_epoch * (last_epoch + 1)
    generation = available // pulls  # the first generation that asks for more
    return iters, min(iters, generation * spg + 1)


def translate_steps(t: Translation, lay: Layout) -> None:
    """``trainer.max_steps`` (optimizer steps, as ms-swift counts them)."""
    for flag in ("train_iters", "max_steps"):
        if flag in t.flags:
            t.add(
                flag,
                EXACT,
                {"trainer.max_steps": int(t.get(flag))},
                "optimizer steps (megagrpo's trainer.max_steps counts them too)",
            )
            for other in ("num_train_epochs", "max_epochs"):
                if other in t.flags:
                    t.add(other, EXACT, {}, f"--{flag} takes precedence")
            t.done.update({"num_train_epochs", "max_epochs"})
            return
    epochs = t.get("num_train_epochs", 3 if t.flavor == "swift" else None)
    rows = dataset_rows(t)
    if epochs is None or rows is None:
        _unknown_steps(t, epochs, rows)
        return
    if t.flavor == "megatron":
        _megatron(t, lay, float(epochs), rows)
    else:
        _swift(t, lay, float(epochs), rows)


def _swift(t: Translation, lay: Layout, epochs: float, rows: int) -> None:
    g = int(t.get("num_generations", 8))
    problems = max(1, lay.per_generation // g if lay.mini_batches else lay.per_step // g)
    updates = max(lay.mini_batches, 1) * int(t.get("num_iterations", 1))

    def steps(n: float) -> int:
        return max(1, int(n * rows) // problems * updates)

    planned = steps(epochs)
    given = "num_train_epochs" in t.flags
    why = (
        f"{epochs:g} epochs x {rows} rows / {problems} problems per generated batch x "
        f"{updates} optimizer steps each = {planned} optimizer steps"
        + ("" if given else " (ms-swift's default)")
    )
    cap = t.get("max_epochs")
    if cap is not None and float(cap) < epochs:
        run = steps(float(cap))
        constant = str(t.overrides.get("trainer.lr_schedule", "cosine")) == "constant"
        t.add(
            "max_epochs",
            EXACT if constant else DIFFERS,
            {"trainer.max_steps": run},
            f"ms-swift stops after {cap} epochs = {run} optimizer steps (patcher.py)"
            + (
                ""
                if constant
                else f", on the LR schedule it planned for {planned} ({why}); megagrpo's "
                f"schedule ends at step {run}"
            ),
        )
        t.add(
            "num_train_epochs",
            EXACT if given else DIFFERS,
            {},
            why,
            value=t.get("num_train_epochs", 3),
        )
        return
    if cap is not None:
        t.add("max_epochs", EXACT, {}, f"no effect: not below num_train_epochs {epochs:g}")
    t.add(
        "num_train_epochs",
        EXACT if given else DIFFERS,
        {"trainer.max_steps": planned},
        why,
        value=t.get("num_train_epochs", 3),
    )


def data_parallel(t: Translation) -> tuple[int, str]:
    """``megatron rlhf``'s DP = world / (TP x PP x CP) and a note when it is not known here."""
    model = 1
    for flag in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        model *= int(t.get(flag, 1))
    model *= int(t.get("context_parallel_size", 1))
    if not t.world_known:
        return 1, (
            "the world size is not in the command (NPROC_PER_NODE x NNODES; pass --world-size): "
            "counted with DP 1"
        )
    if t.world_size % model:
        return 1, (
            f"world {t.world_size} is not a multiple of TP x PP x CP = {model}: counted with DP 1"
        )
    return t.world_size // model, ""


def _megatron(t: Translation, lay: Layout, epochs: float, rows: int) -> None:
    g = int(t.get("num_generations", 8))
    mbs = int(t.get("micro_batch_size", 1))
    dp, dp_note = data_parallel(t)
    iters, run = megatron_steps(rows, mbs, dp, g, epochs, lay.per_step, lay.per_generation)
    iters = max(1, iters)
    why = (
        f"ms-swift's init_iters: {rows} rows // (micro_batch_size {mbs} x DP {dp}) x "
        f"{mbs * dp} x {g} generations x {epochs:g} epochs // global_batch_size "
        f"{lay.per_step} = {iters} optimizer steps, its LR schedule's length"
    )
    notes = [why]
    status = EXACT
    if run < iters:
        status = DIFFERS
        notes.append(
            f"ms-swift's run itself stops sooner: its data-parallel ranks with the fewest rows "
            f"stop after {run} (a generation pulls {lay.per_generation // g} prompts up front, "
            "their last epoch's rows run out first and cyclic_iter ends them one step later: "
            f"megatron/trainers/base.py); set trainer.max_steps={run} to stop there "
            f"(megagrpo's schedule then ends at {run})"
        )
    if dp_note:
        status = DIFFERS
        notes.append(dp_note)
    shown = t.get("num_train_epochs", epochs)
    t.add("num_train_epochs", status, {"trainer.max_steps": iters}, "; ".join(notes), value=shown)


def _unknown_steps(t: Translation, epochs: Any, rows: int | None) -> None:
    if "dataset" not in t.flags:
        why = "no --dataset"
    elif rows is None:
        why = "the dataset is not a local file here"
    else:
        why = "no --num_train_epochs"
    t.add(
        "num_train_epochs",
        MISSING,
        {},
        f"the number of optimizer steps is not known here ({why}): set trainer.max_steps "
        "(megagrpo's default is 10)",
        value=epochs,
    )


def dataset_rows(t: Translation) -> int | None:
    """Rows of the local JSONL datasets (``path#N``: N rows), None when one is not local."""
    total = 0
    for d in _as_list(t.get("dataset", [])):
        path, _, sample = str(d).partition("#")
        p = Path(path).expanduser()
        if not p.is_file():
            return None
        with p.open(encoding="utf-8") as f:
            n = sum(1 for line in f if line.strip())
        total += int(sample) if sample.isdigit() else n
    return total or None


def _as_list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else [v]
