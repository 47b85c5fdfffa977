"""A checkpoint whose files match their checksums but whose content is wrong (written wrong,
or edited and re-hashed) is named and skipped like a damaged one on resume, and refused by
export: layout-free pieces (shape, bounds, coverage, finiteness) and trainer.json (step,
sampler, dynamic)."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
from lora_pieces import whole_lora_pieces

from megagrpo.checkpoint import format as checkpoint
from megagrpo.checkpoint.checks import TRAINER_KEYS
from megagrpo.commands.export import export_adapter
from megagrpo.errors import CheckpointError
from megagrpo.model.config import LoraConfig
from megagrpo.parallel.comm import Comm
from megagrpo.testing import EMPTY_SAMPLER_STATE

LORA = LoraConfig(rank=4)
TRAINER = {"sampler": EMPTY_SAMPLER_STATE, "dynamic": {}, "loop": {"nonfinite_streak": 0}}


def _save(tmp: Path, step: int, model: Path, pieces: list[dict], trainer: dict) -> Path:
    return checkpoint.save(
        tmp / "run" / "checkpoints",
        step,
        rank=0,
        world_size=1,
        rank_state={"pieces": pieces, "optimizer_groups": [], "scheduler": None},
        trainer_state=trainer,
        meta={},
        extra={
            "lora_layout": checkpoint.LAYOUT_FREE,
            "config": {"model": {"hf_path": str(model), "lora": {"rank": LORA.rank}}},
        },
    )


def _b_piece(pieces: list[dict]) -> dict:
    return next(p for p in pieces if p["factor"] == "B")


def _wrong_shape(pieces):
    _b_piece(pieces)["param"] = torch.zeros(3, 3)


def _same_half_twice(pieces):
    b = _b_piece(pieces)
    rows, r = b["param"].shape
    half = {**b, "bounds": [[0, rows // 2], [0, r]], "param": b["param"][: rows // 2].clone()}
    pieces[pieces.index(b)] = half
    pieces.append({**half, "param": torch.full_like(half["param"], 7.0)})


def _nan(pieces):
    _b_piece(pieces)["param"][0, 0] = float("nan")


def _nan_moment(pieces):
    b = _b_piece(pieces)
    b["state"] = {"exp_avg": torch.full_like(b["param"], float("inf"))}


PIECES = {
    "wrong shape": (_wrong_shape, "param shape"),
    "same half twice": (_same_half_twice, "overlap"),
    "NaN param": (_nan, "NaN or inf"),
    "inf moment": (_nan_moment, "state 'exp_avg' holds NaN or inf"),
}
TRAINER_JSON = {
    "step abc": ({"step": "abc"}, "'step' must be an integer"),
    "step 1e6": ({"step": 1000000}, "'step' is 1000000"),
    "no sampler": ({"sampler": None}, "'sampler' must be an object"),
    "no dynamic": ({"dynamic": 3}, "'dynamic' must be an object"),
}


@pytest.mark.parametrize("case", [*PIECES, *TRAINER_JSON])
def test_wrong_content_falls_back_to_the_previous_checkpoint(
    tiny_dense_dir, tmp_path, case, caplog
):
    good = whole_lora_pieces(tiny_dense_dir, LORA)
    older = _save(tmp_path, 1, tiny_dense_dir, good, {**TRAINER})
    pieces, trainer = copy.deepcopy(good), {**TRAINER}
    if case in PIECES:
        PIECES[case][0](pieces)
        why = PIECES[case][1]
    else:
        trainer.update(TRAINER_JSON[case][0])
        why = TRAINER_JSON[case][1]
    newer = _save(tmp_path, 2, tiny_dense_dir, pieces, trainer)
    with caplog.at_level(logging.WARNING, logger="megagrpo.checkpoint.format"):
        point = checkpoint.find_resume_checkpoint(
            tmp_path / "run" / "checkpoints", Comm(), TRAINER_KEYS
        )
    assert point.path == older and point.step == 1
    assert f"{newer} is unusable" in caplog.text and why in caplog.text
    with pytest.raises(CheckpointError, match=why.replace("(", r"\(").replace(")", r"\)")):
        export_adapter(newer, tmp_path / "out", model=str(tiny_dense_dir))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit", ["outside", "half"])
def test_pieces_that_do_not_fit_the_model_are_refused_by_name(tiny_dense_dir, tmp_path, edit):
    """Bounds beyond the unit, or one half of it missing: what only the model's shapes show
    (a CheckpointError, not torch's RuntimeError)."""
    pieces = whole_lora_pieces(tiny_dense_dir, LORA)
    b = _b_piece(pieces)
    rows, r = b["param"].shape
    if edit == "outside":
        b["bounds"] = [[0, rows + 8], [0, r]]
        b["param"] = torch.zeros(rows + 8, r)
        match = "outside"
    else:
        b["bounds"] = [[0, rows // 2], [0, r]]
        b["param"] = b["param"][: rows // 2].clone()
        match = "pieces missing"
    ckpt = _save(tmp_path, 1, tiny_dense_dir, pieces, {**TRAINER})
    with pytest.raises(CheckpointError, match=match):
        export_adapter(ckpt, tmp_path / "out", model=str(tiny_dense_dir))


def test_a_good_checkpoint_passes_every_check(tiny_dense_dir, tmp_path):
    pieces = whole_lora_pieces(tiny_dense_dir, LORA, value=0.5)
    ckpt = _save(tmp_path, 3, tiny_dense_dir, pieces, {**TRAINER})
    assert (
        checkpoint.find_resume_checkpoint(
            tmp_path / "run" / "checkpoints", Comm(), TRAINER_KEYS
        ).path
        == ckpt
    )
    out = export_adapter(ckpt, tmp_path / "out", model=str(tiny_dense_dir))
    assert (out / "adapter_model.safetensors").is_file()
