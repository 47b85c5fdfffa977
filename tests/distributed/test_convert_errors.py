"""tools/convert_ckpt.py on broken inputs: every failure exits 2 with a message naming the
file, key or tensor (issue 14.9; red-team rows 68, 71, 73, 74, 75, 38).

Before the fix: a 2-rank export with a missing shard printed rank 0's secondary
"Connection closed by peer" and exited 1; corrupt safetensors and a corrupt
megagrpo_ckpt.json raised bare SafetensorError / JSONDecodeError tracebacks (exit 1).
"""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def convert(repo_root):
    spec = importlib.util.spec_from_file_location(
        "convert_ckpt", repo_root / "tools" / "convert_ckpt.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def ckpt_tp2(convert, tiny_dense_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("convert_errors") / "ckpt_tp2"
    assert (
        convert.main(["import", "--hf", str(tiny_dense_dir), "--out", str(out), "--tp", "2"]) == 0
    )
    return out


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_shard_on_rank1_is_reported_with_exit_2(convert, ckpt_tp2, tmp_path, capsys):
    ckpt = _copy(ckpt_tp2, tmp_path / "ckpt")
    (ckpt / "dense_tp1_pp0.safetensors").unlink()
    assert convert.main(["export", "--ckpt", str(ckpt), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "rank 1: " in err and "shard file 'dense_tp1_pp0.safetensors' missing" in err
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.tmp*"))


def test_layout_edited_in_meta_is_reported_with_exit_2(convert, tiny_dense_dir, tmp_path, capsys):
    # Red-team row 73: tp1 shards whose meta claims tp2; the CheckpointError used to arrive
    # wrapped in "RuntimeError: rank 0 failed" with exit status 1.
    ckpt = tmp_path / "ckpt_tp1"
    assert convert.main(["import", "--hf", str(tiny_dense_dir), "--out", str(ckpt)]) == 0
    meta = json.loads((ckpt / "megagrpo_ckpt.json").read_text())
    meta["layout"].update(tp=2, sequence_parallel=True)
    meta["world_size"] = 2
    (ckpt / "megagrpo_ckpt.json").write_text(json.dumps(meta))
    capsys.readouterr()
    assert convert.main(["export", "--ckpt", str(ckpt), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "CheckpointError" not in err.split("\n")[0]  # the message itself, no traceback
    assert "model has" in err or "missing" in err


def test_truncated_shard_names_the_file(convert, ckpt_tp2, tmp_path, capsys):
    ckpt = _copy(ckpt_tp2, tmp_path / "ckpt")
    shard = ckpt / "dense_tp0_pp0.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    assert convert.main(["export", "--ckpt", str(ckpt), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"{shard}: unreadable safetensors file" in err and "rank 0: " in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"format": "megagrpo-megatron-v1", layout: }', "megagrpo_ckpt.json: not valid JSON"),
        ("[1, 2]", "megagrpo_ckpt.json: expected a JSON object, got list"),
        ('{"format": "megagrpo-megatron-v1"}', "megagrpo_ckpt.json: key 'layout' missing"),
    ],
)
def test_corrupt_meta_names_the_file_and_key(convert, ckpt_tp2, tmp_path, capsys, text, message):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "megagrpo_ckpt.json").write_text(text)
    assert convert.main(["export", "--ckpt", str(ckpt), "--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err


def test_meta_with_a_wrong_type_names_the_key(convert, ckpt_tp2, tmp_path, capsys):
    ckpt = _copy(ckpt_tp2, tmp_path / "ckpt")
    meta = json.loads((ckpt / "megagrpo_ckpt.json").read_text())
    meta["world_size"] = "2"
    (ckpt / "megagrpo_ckpt.json").write_text(json.dumps(meta))
    assert convert.main(["export", "--ckpt", str(ckpt), "--out", str(tmp_path / "o")]) == 2
    assert "key 'world_size' has a wrong type: '2'" in capsys.readouterr().err


@pytest.mark.parametrize("keep", [0, 1000])  # empty file (header too small), truncated data
def test_corrupt_hf_safetensors_on_import_names_the_file(
    convert, tiny_dense_dir, tmp_path, capsys, keep
):
    hf = _copy(tiny_dense_dir, tmp_path / "hf")
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:keep])
    assert convert.main(["import", "--hf", str(hf), "--out", str(tmp_path / "o")]) == 2
    assert f"{weights}: unreadable safetensors file" in capsys.readouterr().err


def test_corrupt_hf_safetensors_when_building_the_policy_names_the_file(tiny_dense_dir, tmp_path):
    # The training path (build_policy -> load_hf_weights), not the convert tool's header check.
    from megagrpo.errors import CheckpointError
    from megagrpo.model import ModelConfig, build_policy
    from megagrpo.parallel import ParallelConfig, destroy_parallel, init_parallel

    hf = _copy(tiny_dense_dir, tmp_path / "hf")
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    groups = init_parallel(ParallelConfig())
    try:
        with pytest.raises(CheckpointError, match="model.safetensors: unreadable safetensors"):
            build_policy(ModelConfig(hf_path=str(hf)), groups)
    finally:
        destroy_parallel()
