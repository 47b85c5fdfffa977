"""Checkpoint content checked to the last field (red team 3: M3, L7) and the base weights'
fingerprint (M8), on the bigram fakes of test_trainer_reliability.py.

A ``trainer.json`` edited and re-hashed (so its checksum matches) with a sampler array cut
short, a generator state that is not one, a carried token id outside the vocabulary, carried
log-probs shorter than their tokens, or a walk position past its permutation crashed after
the model was built, or resumed silently. Now ``--resume`` skips it with a warning naming the
field and continues from the checkpoint before, before any model is built. Base weights
rebuilt under the same ``model.hf_path`` are refused naming both fingerprints, unless
``--allow-base-change``; a checkpoint written before fingerprints resumes with a warning.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
from test_trainer_reliability import _context, _train

from megagrpo.errors import CheckpointError
from megagrpo.metrics import read_metrics
from megagrpo.types import Group, Problem

VOCAB = 512


@pytest.fixture
def model_dir(bigram_dir, tmp_path) -> Path:
    """The bigram fakes with a ``vocab_size`` and one safetensors file of base weights."""
    out = tmp_path / "base"
    shutil.copytree(bigram_dir, out)
    (out / "config.json").write_text(json.dumps({"model_type": "bigram", "vocab_size": VOCAB}))
    _weights(out, seed=0)
    return out


def _weights(model: Path, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    save_file({"w": torch.randn(64, 64, generator=g)}, str(model / "model.safetensors"))


def _run(model: Path, tmp_path: Path, name: str = "r", **kw):
    """4 steps, checkpoints at steps 2 and 4."""
    return _train(_context(model, tmp_path, name, **kw))


def _tamper(ckpt: Path, edit) -> None:
    """Edit ``trainer.json`` and re-hash it in the manifest (its checksum matches)."""
    path = ckpt / "trainer.json"
    state = json.loads(path.read_text())
    edit(state)
    data = json.dumps(state).encode()
    path.write_bytes(data)
    manifest = json.loads((ckpt / "meta.json").read_text())
    digest = hashlib.sha256(data).hexdigest()
    manifest["files"]["trainer.json"] = {"bytes": len(data), "sha256": digest}
    (ckpt / "meta.json").write_text(json.dumps(manifest))


def _tamper_rank_file(ckpt: Path, edit) -> None:
    """Edit rank 0's file and re-hash it in the manifest (its checksum matches)."""
    import io

    import torch

    path = ckpt / "rank00000.pt"
    state = torch.load(path, weights_only=True)
    edit(state)
    buf = io.BytesIO()
    torch.save(state, buf)
    path.write_bytes(buf.getvalue())
    manifest = json.loads((ckpt / "meta.json").read_text())
    digest = hashlib.sha256(buf.getvalue()).hexdigest()
    manifest["files"]["rank00000.pt"] = {"bytes": len(buf.getvalue()), "sha256": digest}
    (ckpt / "meta.json").write_text(json.dumps(manifest))


def _carried(token_ids, logprobs) -> dict:
    problem = Problem(id="p", messages=[{"role": "user", "content": "q"}], answer=["a"])
    n = len(token_ids)
    group = Group(problem, ["x"] * n, token_ids, logprobs, rewards=[1.0] * n)
    return dataclasses.asdict(group)


def _set(path: str, value):
    """An edit of ``trainer.json`` setting the dotted ``path`` (list indices allowed)."""

    def edit(state):
        *parts, last = path.split(".")
        node = state
        for part in parts:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[int(last) if isinstance(node, list) else last] = value

    return edit


EDITS = {
    "sampler.succ cut to 3 (M3)": (
        lambda s: s["sampler"].update(succ=s["sampler"]["succ"][:3]),
        "sampler.succ",
    ),
    "sampler.rng.main = 'abc' (M3)": (_set("sampler.rng.main", "abc"), "sampler.rng.main"),
    "carried token id 1e9 (M3)": (
        _set("dynamic.carry", [_carried([[1, 2, 10**9]], [[-0.1, -0.2, -0.3]])]),
        "dynamic.carry[0].token_ids[0][2]",
    ),
    "carried logprobs 2 for 8 tokens (L7)": (
        _set("dynamic.carry", [_carried([[1] * 8], [[-0.1, -0.2]])]),
        "dynamic.carry[0].logprobs[0]",
    ),
    "walks.main = [[0, 99999]] (L7)": (
        _set("sampler.walks.main", [[0, 99999]]),
        "sampler.walks.main[0][1]",
    ),
}


def test_a_bad_value_falls_back_to_the_previous_checkpoint_before_the_model(
    model_dir, tmp_path, caplog
):
    """Each edit on its own copy of one run's last checkpoint (one run for all the cases)."""
    from megagrpo.trainer.setup import shutdown

    _run(model_dir, tmp_path)
    ckpt = tmp_path / "r" / "checkpoints" / "step_000004"
    pristine = tmp_path / "pristine"
    shutil.copytree(ckpt, pristine)
    for i, case in enumerate(sorted(EDITS)):
        edit, field = EDITS[case]
        shutil.rmtree(ckpt)
        shutil.copytree(pristine, ckpt)
        _tamper(ckpt, edit)
        calls: list[str] = []
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            ctx = _context(model_dir, tmp_path, "r", resume=True, calls=calls)
        assert ctx.step == 2, case
        assert calls == ["r"], case  # one model, built after the fall-back
        warning = next(r.getMessage() for r in caplog.records if "unusable" in r.getMessage())
        assert "step_000004" in warning and field in warning, (case, warning)
        if i < len(EDITS) - 1:
            shutdown(ctx)
            continue
        _train(ctx)  # and it continues from step 2
    assert [r["step"] for r in read_metrics(tmp_path / "r" / "metrics.jsonl")] == [1, 2, 3, 4]


def test_the_only_checkpoint_bad_is_a_named_error(model_dir, tmp_path):
    _run(model_dir, tmp_path, trainer={"max_steps": 2})
    _tamper(tmp_path / "r" / "checkpoints" / "step_000002", EDITS["sampler.succ cut to 3 (M3)"][0])
    calls: list[str] = []
    with pytest.raises(CheckpointError, match=r"sampler\.succ"):
        _context(model_dir, tmp_path, "r", resume=True, calls=calls, trainer={"max_steps": 2})
    assert calls == []


def test_changed_base_weights_are_refused_naming_both(model_dir, tmp_path, caplog):
    """M8: the base rebuilt with another seed under the same path."""
    _run(model_dir, tmp_path, trainer={"max_steps": 2})
    manifest = json.loads((tmp_path / "r/checkpoints/step_000002/meta.json").read_text())
    assert manifest["base"]["sha256"] and manifest["base"]["files"] == 1
    _weights(model_dir, seed=7)
    calls: list[str] = []
    with pytest.raises(CheckpointError, match="base weights under model.hf_path") as err:
        _context(model_dir, tmp_path, "r", resume=True, calls=calls, trainer={"max_steps": 4})
    assert calls == [] and manifest["base"]["sha256"][:12] in str(err.value)
    assert "--allow-base-change" in str(err.value)
    with caplog.at_level(logging.WARNING):
        ctx = _context(
            model_dir, tmp_path, "r", resume=True, trainer={"max_steps": 4}, allow_base_change=True
        )
    assert ctx.step == 2 and "--allow-base-change" in caplog.text
    _train(ctx)


def test_a_checkpoint_without_a_fingerprint_resumes_with_a_warning(model_dir, tmp_path, caplog):
    _run(model_dir, tmp_path, trainer={"max_steps": 2})
    path = tmp_path / "r/checkpoints/step_000002/meta.json"
    manifest = json.loads(path.read_text())
    del manifest["base"]  # as written before this round
    path.write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING):
        ctx = _context(model_dir, tmp_path, "r", resume=True, trainer={"max_steps": 3})
    assert ctx.step == 2 and "without a fingerprint of the base weights" in caplog.text
    _train(ctx)


def test_train_has_the_allow_base_change_flag():
    import argparse

    from megagrpo.commands import train

    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    assert parser.parse_args(["c.yaml", "--resume", "--allow-base-change"]).allow_base_change


GENERATED = {"mini_batches": 2, "ppo_epochs": 3}
"""6 optimiser steps per generated batch: the checkpoints of steps 2 and 4 both hold the
batch of step 1 (``generated.done`` 2 and 4)."""

GENERATED_EDITS = {  # case: (dotted path edited, value, the field the warning names)
    "done = -100 (red team 4, N6: retrained the batch silently)": ("generated.done", -100, None),
    "done = 'x' (N6: raw ValueError after the model)": ("generated.done", "x", None),
    "done = 6: every step of the batch": ("generated.done", 6, None),
    "done = 3: not the checkpoint's step": ("generated.done", 3, None),
    "done = true": ("generated.done", True, None),
    "step = 0": ("generated.step", 0, None),
    "step = 5: after the checkpoint": ("generated.step", 5, None),
    "step = '1'": ("generated.step", "1", None),
    "prepared = 'yes'": ("generated.prepared", "yes", None),
    "layout = []": ("generated.layout", [], None),
    "layout.world_size = 0": ("generated.layout.world_size", 0, None),
    "layout.tp = {}": ("generated.layout.tp", {}, None),
    "version = 2": ("generated.version", 2, None),
    "sync verifier count -1 (N11's state)": (
        "sync.verifiers.0.syncs",
        -1,
        "sync.verifiers[0].syncs",
    ),
    "sync verifier probe cut short": (
        "sync.verifiers.0.ref_engine",
        [-0.5],
        "sync.verifiers[0].ref_engine",
    ),
    "sync verifier probe NaN": (
        "sync.verifiers.0.last_probe",
        [float("nan")] * 7,
        "sync.verifiers[0].last_probe[0]",
    ),
}


E2E_EDITS = [("generated.done", "x"), ("generated.step", 0)]
"""Also resumed (the red team's ``done = -100`` runs to the end below)."""


def test_a_bad_generated_batch_falls_back_before_the_model(model_dir, tmp_path, caplog):
    """N6: every field of a generated batch saved between two mini-batches is checked by
    value with the rest of trainer.json (and N11's sync-verification state): the resume
    skips the checkpoint with a warning naming the field, before any model is built, and
    continues exactly from the one before (itself between two mini-batches of the same
    batch)."""
    import torch

    from megagrpo.checkpoint.checks import TRAINER_KEYS, check_trainer_state
    from megagrpo.trainer.setup import shutdown

    _run(model_dir, tmp_path, trainer=GENERATED)
    ckpt = tmp_path / "r" / "checkpoints" / "step_000004"
    state = json.loads((ckpt / "trainer.json").read_text())
    assert (state["generated"]["step"], state["generated"]["done"]) == (1, 4)
    full = read_metrics(tmp_path / "r" / "metrics.jsonl")
    pristine = tmp_path / "pristine"
    shutil.copytree(ckpt, pristine)
    assert len(state["sync"]["verifiers"][0]["last_probe"]) == 7  # probe_len 8
    for case, (path, value, field) in GENERATED_EDITS.items():  # the check itself, each field
        edited = json.loads(json.dumps(state))
        _set(path, value)(edited)
        why = check_trainer_state(edited, 4, "trainer.json", TRAINER_KEYS, None, VOCAB)
        assert why is not None and (field or path) in why, (case, why)
    assert check_trainer_state(state, 4, "trainer.json", TRAINER_KEYS, None, VOCAB) is None
    for path, value in E2E_EDITS:  # the resume: falls back before the model, naming it
        shutil.rmtree(ckpt)
        shutil.copytree(pristine, ckpt)
        _tamper(ckpt, _set(path, value))
        calls: list[str] = []
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            ctx = _context(model_dir, tmp_path, "r", resume=True, calls=calls, trainer=GENERATED)
        warning = next((r.getMessage() for r in caplog.records if "unusable" in r.getMessage()), "")
        try:
            assert ctx.step == 2 and calls == ["r"], path
            assert "step_000004" in warning and path in warning, (path, warning)
            assert ctx.generated is not None and ctx.generated.done == 2, path
        finally:
            shutdown(ctx)
    shutil.rmtree(ckpt)
    shutil.copytree(pristine, ckpt)
    _tamper_rank_file(ckpt, lambda rank: rank["generated"].pop("old"))
    with pytest.raises(CheckpointError, match="holds no 'old' entry per mini-batch"):
        _context(model_dir, tmp_path, "r", resume=True, trainer=GENERATED)  # was a KeyError
    shutil.rmtree(ckpt)
    shutil.copytree(pristine, ckpt)
    _tamper(ckpt, _set("generated.done", -100))  # the red team's case, to the end
    _train(_context(model_dir, tmp_path, "r", resume=True, trainer=GENERATED))
    rows = read_metrics(tmp_path / "r" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for a, b in zip(full, rows, strict=True):  # steps 3 and 4 again, to the same numbers
        for key in ("loss/policy", "loss/ratio_max", "train/epoch", "train/mini_batch"):
            assert torch.tensor(a[key]).equal(torch.tensor(b[key])), (a["step"], key)
