"""Resume rules for layout-free checkpoints (issue 15.7): a changed parallel layout or world
size is adapted (resharded) instead of refused, and such a checkpoint is verified file by
file even when another number of processes resumes it (each rank checks its share)."""

from __future__ import annotations

import pytest
import torch

from megagrpo.checkpoint import format as checkpoint
from megagrpo.errors import CheckpointError
from megagrpo.parallel.comm import Comm
from megagrpo.testing import EMPTY_SAMPLER_STATE
from megagrpo.trainer.resume_check import ADAPT, REFUSE, check_resume_config, compare_configs


def test_layout_changes_are_adapted_only_for_layout_free_checkpoints():
    saved = {"parallel": {"tp": 2, "ep": 2}, "model": {"lora": {"rank": 4}}}
    new = {"parallel": {"tp": 1, "ep": 1}, "model": {"lora": {"rank": 8}}}
    kinds = {c.key: c.kind for c in compare_configs(saved, new, 4, 1)}
    assert kinds == {
        "world size": REFUSE,
        "parallel.tp": REFUSE,
        "parallel.ep": REFUSE,
        "model.lora.rank": REFUSE,
    }
    kinds = {c.key: c.kind for c in compare_configs(saved, new, 4, 1, reshardable=True)}
    assert kinds == {
        "world size": ADAPT,
        "parallel.tp": ADAPT,
        "parallel.ep": ADAPT,
        "model.lora.rank": REFUSE,  # the pieces have the saved LoRA shape
    }
    manifest = {"config": saved, "world_size": 4, "step": 3, "lora_layout": "hf-pieces"}
    with pytest.raises(CheckpointError, match="model.lora.rank") as err:
        check_resume_config(manifest, new, 1)
    assert "parallel" not in str(err.value) and "world size" not in str(err.value)
    changes = check_resume_config(manifest, dict(new, model=saved["model"]), 1)
    assert {c.key for c in changes} == {"world size", "parallel.tp", "parallel.ep"}


def _layout_free_checkpoint(root, step: int, world: int):
    return checkpoint.save(
        root,
        step,
        rank=0,
        world_size=world,
        rank_state={"pieces": [], "optimizer_groups": [], "scheduler": None},
        trainer_state={"sampler": EMPTY_SAMPLER_STATE},
        meta={},
        extra={"lora_layout": checkpoint.LAYOUT_FREE},
    )


def test_another_world_size_still_verifies_every_file(tmp_path):
    older = _layout_free_checkpoint(tmp_path, 1, world=2)
    newer = _layout_free_checkpoint(tmp_path, 2, world=2)
    point = checkpoint.find_resume_checkpoint(tmp_path, Comm())
    assert point.step == 2 and checkpoint.reshardable(point.manifest)
    data = (newer / "rank00000.pt").read_bytes()
    (newer / "rank00000.pt").write_bytes(data[:-10] + b"0123456789")  # same size, other bytes
    point = checkpoint.find_resume_checkpoint(tmp_path, Comm())  # falls back, naming the file
    assert point.path == older
    assert torch.load(older / "rank00000.pt", weights_only=True)["pieces"] == []


def test_export_refuses_a_damaged_checkpoint_naming_the_file(tmp_path):
    """`megagrpo export` reads every rank file of another layout: each is checked against the
    manifest first (a flipped byte names the file), and a rank file without pieces is named."""
    from megagrpo.commands.export import read_checkpoint

    ckpt = _layout_free_checkpoint(tmp_path, 1, world=1)
    manifest, pieces = read_checkpoint(ckpt)
    assert pieces == [] and checkpoint.reshardable(manifest)
    data = bytearray((ckpt / "rank00000.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (ckpt / "rank00000.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="damaged checkpoint.*rank00000.pt"):
        read_checkpoint(ckpt)
