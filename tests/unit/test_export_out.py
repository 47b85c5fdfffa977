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
    """A link where a new directory goes is refused (it is not what was checked: absent or
    empty); a directory the caller owns (``expected=True``) replaces the link itself."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    link = tmp_path / "adapter"
    link.symlink_to(target, target_is_directory=True)
    with pytest.raises(fileio.OutputChanged, match="symbolic link"), fileio.atomic_dir(link) as tmp:
        (tmp / "w.bin").write_bytes(b"1")
    assert link.is_symlink() and (tmp / "w.bin").read_bytes() == b"1"  # kept, named
    shutil.rmtree(tmp)
    with fileio.atomic_dir(link, expected=True) as tmp:
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


def _rewrite(model: Path, change) -> None:
    """Rewrite every safetensors file of ``model`` in place with ``change(name, tensor)``:
    same names, dtypes and shapes (the headers stay byte-identical), other values."""
    from safetensors.torch import load_file, save_file

    for shard in sorted(model.glob("*.safetensors")):
        tensors = load_file(str(shard))
        save_file({k: change(k, t) for k, t in tensors.items()}, str(shard), {"format": "pt"})


@pytest.fixture
def fp_run(run):
    """``run`` whose checkpoint records the base fingerprint, as training writes it."""
    from megagrpo.model.fingerprint import base_fingerprint

    run_dir, model = run
    manifest = run_dir / "checkpoints" / "step_000001" / checkpoint.MANIFEST
    body = json.loads(manifest.read_text())
    body["base"] = base_fingerprint(model)
    manifest.write_text(json.dumps(body))
    return run_dir, model


@pytest.mark.parametrize("kind", ["--adapter", "--merged"])
def test_export_refuses_another_base_under_the_same_path(fp_run, tmp_path, kind, capsys):
    """Red team 4, N3: after the base was rebuilt under model.hf_path (same sizes, other
    values), export merged the run's LoRA into it silently (rc 0)."""
    run_dir, model = fp_run
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    _rewrite(model, lambda name, t: t + 0.01)
    out = tmp_path / "out"
    assert main(["export", str(run_dir), kind, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "are not those step_000001's LoRA was trained on" in err and "then:" in err, err
    assert not out.exists()
    # the weights it was trained on (another copy) export; so does --allow-base-change
    assert main(["export", str(run_dir), kind, "--model", str(copy), "--out", str(out)]) == 0
    forced = tmp_path / "forced"
    args = ["export", str(run_dir), kind, "--allow-base-change", "--out", str(forced)]
    assert main(args) == 0 and any(forced.iterdir())


@pytest.mark.parametrize("kind", ["--adapter", "--merged"])
def test_what_appears_in_out_during_the_export_is_never_deleted(
    run, tmp_path, kind, monkeypatch, capsys
):
    """Red team 4, N2: ``--out`` was checked once, then ``rmtree``-d at the rename: a file
    another writer put there meanwhile was deleted. Now the rename is refused, the file stays
    and the finished export is kept in the temporary directory the error names."""
    run_dir, _ = run
    out = tmp_path / "out"
    real = fileio.write_text

    def write_text(path, text, *a, **kw):  # a second writer, while this export writes
        if not (out / "precious.txt").exists():
            out.mkdir(exist_ok=True)
            (out / "precious.txt").write_text("mine")
        return real(path, text, *a, **kw)

    monkeypatch.setattr(fileio, "write_text", write_text)
    assert main(["export", str(run_dir), kind, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "changed while this command wrote it" in err and "precious.txt" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["precious.txt"]
    assert (out / "precious.txt").read_text() == "mine"
    (kept,) = [p for p in tmp_path.iterdir() if fileio.is_tmp(p)]
    assert str(kept) in err and any(kept.iterdir())


def test_merged_export_never_copies_the_bases_other_weight_files(run, capsys):
    """Red team 4, N20: ``pytorch_model.bin`` (and its index, ``.pt``, ``.gguf``) of the base
    were copied beside the merged safetensors: a second, unmerged model in the output."""
    run_dir, model = run
    for name in ("pytorch_model.bin", "model.pt", "model-q8.gguf", "consolidated.pth"):
        (model / name).write_bytes(b"\0" * 1000)
    (model / "pytorch_model.bin.index.json").write_text('{"weight_map": {}}')
    out = model.parent / "merged"
    assert main(["export", str(run_dir), "--merged", "--out", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert "config.json" in names and "model.safetensors.index.json" in names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth", ".gguf", ".bin.index.json"))]


@pytest.fixture
def file_size_limit():
    """``ulimit -f``: writes past ``n`` bytes fail with EFBIG (Python ignores SIGXFSZ)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)

    def limit(n: int) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (n, hard))

    yield limit
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_disk_full_in_a_merged_export_is_named(run, tmp_path, file_size_limit, capsys):
    """Red team 4, N16: a full disk in ``export --merged`` was a raw SafetensorError."""
    run_dir, _ = run
    out = tmp_path / "out"
    file_size_limit(100_000)  # the config and tokenizer files fit, a weight shard does not
    rc = main(["export", str(run_dir), "--merged", "--out", str(out)])
    file_size_limit(-1)
    err = capsys.readouterr().err
    assert rc == 2 and "File too large (errno 27, EFBIG)" in err and ".safetensors" in err, err
    assert "nothing was written to" in err and not out.exists()
    assert not [p for p in tmp_path.iterdir() if fileio.is_tmp(p)]
