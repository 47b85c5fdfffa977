"""Checkpoint format and integrity (issue 14.1, 14.7): nothing is unpickled, every file is
verified against the manifest written last, a damaged newest checkpoint falls back to the
one before it, files and directories are fsynced before the rename, disk full names the
file, stale temporary directories are removed."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from megagrpo import fileio
from megagrpo.checkpoint import format as checkpoint
from megagrpo.checkpoint import plain as plain_state
from megagrpo.curriculum.config import DynamicSamplingConfig
from megagrpo.curriculum.dynamic import DynamicSampler
from megagrpo.errors import CheckpointError
from megagrpo.types import Group, Problem

REPO = Path(__file__).resolve().parents[2]


class Payload:
    """A pickle that runs code when loaded: it creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _save(root: Path, step: int, keep: int = 3) -> Path:
    return checkpoint.save(
        root,
        step,
        rank=0,
        world_size=1,
        rank_state={"lora": {"w": torch.full((4,), float(step))}, "optimizer": {"state": {}}},
        trainer_state={"counters": {"s": step, "x": np.float64(0.5)}},
        meta={"tp": 1},
        keep=keep,
    )


def _load(path: Path):
    return checkpoint.load(path, rank=0, world_size=1, meta={"tp": 1})


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _rehash(ckpt: Path, name: str) -> None:
    """Make the manifest agree with ``name`` again (an attacker controls the directory)."""
    manifest = json.loads((ckpt / "meta.json").read_text())
    data = (ckpt / name).read_bytes()
    entry = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest.setdefault("files", {})[name] = entry
    (ckpt / "meta.json").write_text(json.dumps(manifest))


def test_planted_pickle_in_a_rank_file_is_refused_and_never_runs(tmp_path):
    ckpt = _save(tmp_path / "ck", 1)
    marker = tmp_path / "pwned"
    torch.save({"lora": {}, "x": Payload(marker)}, ckpt / "rank00000.pt")
    _rehash(ckpt, "rank00000.pt")
    with pytest.raises(CheckpointError, match=r"rank00000\.pt: refused"):
        _load(ckpt)
    assert not marker.exists()


def test_planted_pickle_in_an_old_format_trainer_pt_is_refused(tmp_path):
    ckpt = _save(tmp_path / "ck", 1)
    manifest = json.loads((ckpt / "meta.json").read_text())
    manifest.pop("format", None)  # the previous format: meta.json without checksums,
    manifest.pop("files", None)  # trainer.pt
    (ckpt / "meta.json").write_text(json.dumps(manifest))
    (ckpt / "trainer.json").unlink(missing_ok=True)
    marker = tmp_path / "pwned"
    torch.save({"step": 1, "sampler": Payload(marker)}, ckpt / "trainer.pt")
    with pytest.raises(CheckpointError, match=r"trainer\.pt: refused"):
        _load(ckpt)
    assert not marker.exists()


def test_previous_format_checkpoint_still_loads_with_weights_only(tmp_path):
    """meta.json without checksums, trainer.pt, numpy's RNG state as an ndarray tuple (what
    main wrote before this format): read with weights_only=True, the one numpy array
    type allowed, and the RNG restores."""
    ckpt = tmp_path / "step_000002"
    ckpt.mkdir()
    np.random.seed(7)
    legacy_rng = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    expected = np.random.rand(3)
    torch.save({"lora": {"w": torch.ones(2)}, "rng": legacy_rng}, ckpt / "rank00000.pt")
    torch.save({"step": 2, "sampler": {"r": np.float64(0.25)}}, ckpt / "trainer.pt")
    (ckpt / "meta.json").write_text(json.dumps({"step": 2, "world_size": 1, "tp": 1}))
    point = checkpoint.find_resume_checkpoint(tmp_path)
    rank_state, trainer_state = _load(point.path)
    assert trainer_state == {"step": 2, "sampler": {"r": 0.25}}
    np.random.rand(5)
    plain_state.set_rng_state(rank_state["rng"])
    np.testing.assert_array_equal(np.random.rand(3), expected)


def test_rng_state_survives_weights_only_and_restores_every_generator(tmp_path):
    random.seed(1)
    np.random.seed(2)
    np.random.randn()  # a cached gaussian is part of numpy's state
    torch.manual_seed(3)
    torch.save(plain_state.rng_state(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.randn(4).tolist(), torch.rand(4))
    random.random(), np.random.randn(9), torch.rand(9)
    plain_state.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert random.random() == expected[0]
    assert np.random.randn(4).tolist() == expected[1]
    assert torch.equal(torch.rand(4), expected[2])


def test_carry_buffer_with_numpy_scalars_round_trips_through_json(tmp_path):
    group = Group(
        problem=Problem("p1", [{"role": "user", "content": "q"}], ["a"], {"points": np.int64(3)}),
        completions=["x", "y"],
        token_ids=[[1, 2], [3]],
        logprobs=[[-0.5, -0.25], [-1.0]],
        rewards=[np.float64(1.0), np.float64(0.1 + 0.2)],
        reward_parts={"acc": [np.float32(1.0), 0.0]},
        meta={"step": np.int64(4)},
    )
    dyn = DynamicSampler(DynamicSamplingConfig())
    dyn.carry = [group]
    root = tmp_path / "ck"
    checkpoint.save(
        root,
        4,
        rank=0,
        world_size=1,
        rank_state={},
        trainer_state={"dynamic": dyn.state_dict()},
        meta={},
    )
    _, state = checkpoint.load(root / "step_000004", rank=0, world_size=1, meta={})
    back = DynamicSampler(DynamicSamplingConfig())
    back.load_state_dict(state["dynamic"])
    assert back.carry == [group]  # equal values, exactly (0.1 + 0.2 too)
    assert type(back.carry[0].rewards[1]) is float


def test_to_plain_names_what_cannot_be_checkpointed():
    with pytest.raises(TypeError, match=r"state\.dynamic\.carry\[0\]: object"):
        plain_state.to_plain({"dynamic": {"carry": [object()]}})
    with pytest.raises(TypeError, match="key 3"):
        plain_state.to_plain({3: 1})


def test_nothing_in_the_package_unpickles_a_file():
    """Every torch.load in megagrpo/ says weights_only=True; nothing in megagrpo/ or tools/
    passes weights_only=False or unpickles with pickle / dill / numpy (tools/ may rely on
    torch's own default, weights_only=True since torch 2.6). A line that unpickles a message
    from the job's own peer rank (never a file) says so: ``# unpickle: peer rank, not a file``
    (the separate placement's bridge, as torch.distributed's object collectives)."""
    offenders = []
    for path in [*REPO.joinpath("megagrpo").rglob("*.py"), *REPO.joinpath("tools").rglob("*.py")]:
        package = "tools" not in path.relative_to(REPO).parts[:1]
        for num, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            if line.endswith("# unpickle: peer rank, not a file") and path.name == "bridge.py":
                continue
            if package and "torch.load(" in code and "weights_only=True" not in code:
                offenders.append(f"{path}:{num}")
            if re.search(r"\bpickle\.loads?\(|\bdill\.|allow_pickle=True|weights_only=False", code):
                offenders.append(f"{path}:{num}")
    assert offenders == []


# ----------------------------------------------------------------------------- verification


def _truncate(ckpt: Path) -> str:
    data = (ckpt / "rank00000.pt").read_bytes()
    (ckpt / "rank00000.pt").write_bytes(data[: len(data) // 2])
    return "rank00000.pt"


def _flip_byte(ckpt: Path) -> str:
    data = bytearray((ckpt / "rank00000.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (ckpt / "rank00000.pt").write_bytes(bytes(data))
    return "rank00000.pt: SHA-256"


def _delete(ckpt: Path) -> str:
    (ckpt / "rank00000.pt").unlink()
    return "rank00000.pt is missing"


def _bad_manifest(ckpt: Path) -> str:
    (ckpt / "meta.json").write_text('{"step": 3, "world_si')
    return "meta.json: unreadable"


def _empty_trainer(ckpt: Path) -> str:
    (ckpt / "trainer.json").write_bytes(b"")
    return "trainer.json: 0 bytes"


@pytest.mark.parametrize(
    "damage",
    [_truncate, _flip_byte, _delete, _bad_manifest, _empty_trainer],
    ids=lambda f: f.__name__,
)
def test_damaged_newest_checkpoint_falls_back_to_the_older_one(tmp_path, caplog, damage):
    for step in (1, 2, 3):
        _save(tmp_path, step)
    why = damage(tmp_path / "step_000003")
    with caplog.at_level(logging.WARNING):
        point = checkpoint.find_resume_checkpoint(tmp_path)
    assert point.step == 2 and point.path.name == "step_000002"
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert "step_000003" in warning and why in warning, warning
    rank_state, trainer_state = _load(point.path)
    assert rank_state["lora"]["w"].tolist() == [2.0] * 4 and trainer_state["step"] == 2


def test_no_usable_checkpoint_lists_every_rejected_one(tmp_path):
    for step in (1, 2):
        _save(tmp_path, step)
    _truncate(tmp_path / "step_000001")
    _delete(tmp_path / "step_000002")
    with pytest.raises(CheckpointError, match="no usable checkpoint") as err:
        checkpoint.find_resume_checkpoint(tmp_path)
    assert "step_000002: rank00000.pt is missing" in str(err.value)
    assert "step_000001: rank00000.pt: " in str(err.value)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        checkpoint.find_resume_checkpoint(tmp_path / "nothing")


def test_stale_tmp_dirs_are_removed_and_complete_checkpoints_kept(tmp_path):
    _save(tmp_path, 3)
    for name in (".step_000004.tmp", ".step_000005.tmp"):  # saves killed half-way
        (tmp_path / name).mkdir()
        (tmp_path / name / "rank00000.pt").write_bytes(b"x" * 1000)
    _save(tmp_path, 6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003", "step_000006"]


def test_files_manifest_and_directory_are_fsynced_before_the_rename(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", f"{src} -> {dst}"))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    final = _save(tmp_path, 1)
    tmp = str(fileio.tmp_sibling(final))
    rename = events.index(("replace", f"{tmp} -> {final}"))
    before = [path for kind, path in events[:rename] if kind == "fsync"]
    for name in ("rank00000.pt", "trainer.json", "meta.json"):
        assert f"{tmp}/{name}" in before, name
    assert before.index(f"{tmp}/meta.json") > before.index(f"{tmp}/rank00000.pt")
    assert before.index(f"{tmp}/meta.json") > before.index(f"{tmp}/trainer.json")
    assert tmp in before  # the directory's entries
    assert ("fsync", str(tmp_path)) in events[rename:]  # the rename itself


def test_disk_full_names_the_file_and_errno_and_keeps_the_older_checkpoint(tmp_path, monkeypatch):
    _save(tmp_path, 1)
    before = _sha256(tmp_path / "step_000001" / "rank00000.pt")
    real_init = fileio.HashingWriter.__init__

    class FullDisk:  # the file system accepts 200 bytes, then fails as a full disk does
        def __init__(self, fh):
            self.fh, self.left = fh, 200

        def write(self, data):
            if len(data) > self.left:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.left -= len(data)
            return self.fh.write(data)

        def flush(self):
            self.fh.flush()

    def init(self, fh):
        real_init(self, FullDisk(fh))

    monkeypatch.setattr(fileio.HashingWriter, "__init__", init)
    with pytest.raises(CheckpointError) as err:
        _save(tmp_path, 2)
    msg = str(err.value)
    assert "rank00000.pt" in msg and "No space left on device" in msg
    assert "errno 28, ENOSPC" in msg and "MB free on" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]
    assert _sha256(tmp_path / "step_000001" / "rank00000.pt") == before
    assert checkpoint.find_resume_checkpoint(tmp_path).step == 1
