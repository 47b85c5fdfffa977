"""`megagrpo export --out` and every other writer of a user-named directory: they write into a
new or empty directory apart from what they read, and never delete anything."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from lora_pieces import whole_lora_pieces

from megagrpo import fileio
from megagrpo.checkpoint import format as checkpoint
from megagrpo.cli import main
from megagrpo.errors import ConfigError
from megagrpo.model.config import LoraConfig
from megagrpo.testing import EMPTY_SAMPLER_STATE

LORA = LoraConfig(rank=4)


def _snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def run(tmp_path, tiny_dense_dir) -> tuple[Path, Path]:
    """A run directory with one layout-free checkpoint of the tiny dense model, its config and
    metrics, and a copy of the model: ``(run_dir, model_dir)``."""
    model = tmp_path / "model"
    shutil.copytree(tiny_dense_dir, model)
    run_dir = tmp_path / "runs" / "x"
    checkpoint.save(
        run_dir / "checkpoints",
        1,
        rank=0,
        world_size=1,
        rank_state={
            "pieces": whole_lora_pieces(model, LORA),
            "optimizer_groups": [],
            "scheduler": None,
        },
        trainer_state={"sampler": EMPTY_SAMPLER_STATE, "dynamic": {}},
        meta={},
        extra={
            "lora_layout": checkpoint.LAYOUT_FREE,
            "config": {"model": {"hf_path": str(model), "lora": {"rank": LORA.rank}}},
        },
    )
    (run_dir / "config.yaml").write_text("trainer: {name: x}\n")
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    return run_dir, model


@pytest.mark.parametrize("kind", ["--adapter", "--merged"])
def test_export_never_deletes_the_run_the_model_or_a_full_directory(run, tmp_path, kind, capsys):
    run_dir, model = run
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    before = _snapshot(tmp_path)
    for out, why in [
        (run_dir, "is the run directory"),
        (run_dir / "checkpoints", "is inside the run directory"),
        (run_dir.parent, "contains the run directory"),
        (model, "exists and is not empty"),  # checked before the model is resolved
        (model / "merged", "is inside the base model directory"),
        (notes, "exists and is not empty"),
    ]:
        assert main(["export", str(run_dir), kind, "--out", str(out)]) == 2, out
        assert why in capsys.readouterr().err, out
        assert _snapshot(tmp_path) == before, out
    assert not (model / "merged").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export", str(run_dir), kind, "--out", str(empty)]) == 0
    assert (empty / "config.json").is_file() or (empty / "adapter_config.json").is_file()
    run_files = {k[len("runs/x/") :]: v for k, v in before.items() if k.startswith("runs/x/")}
    assert _snapshot(run_dir) == run_files


def test_check_out_dir_names_the_flag_and_the_protected_directory(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    with pytest.raises(ConfigError, match=r"--hf-out .*src.* is the checkpoint"):
        fileio.check_out_dir(src, {"checkpoint": src}, "--hf-out")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        fileio.check_out_dir(tmp_path / "file", {})
    assert fileio.check_out_dir(tmp_path / "new", {"checkpoint": src}) == tmp_path / "new"


def test_replace_dir_replaces_a_symlink_never_its_target(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    link = tmp_path / "adapter"
    link.symlink_to(target, target_is_directory=True)
    with fileio.atomic_dir(link) as tmp:
        (tmp / "w.bin").write_bytes(b"1")
    assert not link.is_symlink() and (link / "w.bin").read_bytes() == b"1"
    assert (target / "keep.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "elsewhere"]


def test_merged_export_missing_an_adapted_weight_leaves_out_as_it_was(run, tmp_path, capsys):
    """Red team 3, M6: the check ran after the temporary directory was renamed into ``--out``,
    leaving a complete-looking model there; now ``--out`` stays empty (and a new one absent)."""
    from safetensors.torch import load_file, save_file

    run_dir, model = run
    (shard,) = sorted(model.glob("*.safetensors"))
    tensors = load_file(str(shard))
    adapted = next(n for n in sorted(tensors) if n.endswith("self_attn.q_proj.weight"))
    tensors["renamed." + adapted] = tensors.pop(adapted)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = model / "model.safetensors.index.json"
    if index.exists():
        body = json.loads(index.read_text())
        body["weight_map"]["renamed." + adapted] = body["weight_map"].pop(adapted)
        index.write_text(json.dumps(body))
    empty, new = tmp_path / "empty", tmp_path / "new"
    empty.mkdir()
    for out in (empty, new):
        assert main(["export", str(run_dir), "--merged", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "adapted weights not found" in err and adapted in err, err
    assert list(empty.iterdir()) == []
    assert not new.exists()
    assert not list(tmp_path.glob("*.tmp*")) and not list(tmp_path.glob(".*tmp*"))
