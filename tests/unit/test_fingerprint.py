"""The base-weights fingerprint sees an in-place change of any tensor (red team 4, N4).

Version 1 sampled 16 tensors from the start of the sorted list: rewriting layer 1's attention
in place (what saving a base with an attention LoRA merged into it looks like) kept the
fingerprint, and ``--resume`` went on silently. Each test rewrites bytes of one tensor's data
in place (the safetensors header byte-identical, the file the same size) and compares.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import pytest

from megagrpo.model.fingerprint import base_fingerprint


def family(name: str) -> str:
    return re.sub(r"\.\d+(?=\.)", ".*", name)


def _spans(model: Path) -> list[tuple[Path, str, int, int]]:
    """``(file, tensor, start, end)`` of every tensor's data bytes."""
    out = []
    for shard in sorted(model.glob("*.safetensors")):
        with open(shard, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, spec in header.items():
            if name != "__metadata__":
                lo, hi = spec["data_offsets"]
                out.append((shard, name, 8 + n + lo, 8 + n + hi))
    return out


def _flip(shard: Path, start: int, end: int) -> bytes:
    """Every byte of ``[start, end)`` inverted in place; returns the old bytes."""
    with open(shard, "r+b") as fh:
        fh.seek(start)
        old = fh.read(end - start)
        fh.seek(start)
        fh.write(bytes(b ^ 0xFF for b in old))
    return old


def _put(shard: Path, start: int, data: bytes) -> None:
    with open(shard, "r+b") as fh:
        fh.seek(start)
        fh.write(data)


@pytest.fixture
def moe(tmp_path, tiny_moe_dir) -> Path:
    return Path(shutil.copytree(tiny_moe_dir, tmp_path / "moe"))


def test_an_in_place_rewrite_of_any_tensor_changes_the_fingerprint(moe):
    """Each tensor of the tiny Qwen3-MoE (attention, norms, router, every expert, the
    embeddings, the head), rewritten whole in place: a new fingerprint every time."""
    before = base_fingerprint(moe)
    spans = _spans(moe)
    assert {family(n) for _, n, _, _ in spans} >= {
        "model.layers.*.self_attn.q_proj.weight",
        "model.layers.*.input_layernorm.weight",
        "model.layers.*.mlp.gate.weight",
        "model.layers.*.mlp.experts.*.down_proj.weight",
        "model.embed_tokens.weight",
    }
    missed = []
    for shard, name, start, end in spans:
        old = _flip(shard, start, end)
        if base_fingerprint(moe)["sha256"] == before["sha256"]:
            missed.append(name)
        _put(shard, start, old)
    assert base_fingerprint(moe) == before  # restored: the same again
    assert missed == [], f"{len(missed)} of {len(spans)} tensors unseen: {missed[:5]}"


def test_layer_one_attention_merged_in_place_is_seen(tmp_path, tiny_dense_dir):
    """The review's reproduction: every ``model.layers.1.self_attn.*_proj.weight`` of the
    tiny dense model rewritten in place (same header and size)."""
    model = Path(shutil.copytree(tiny_dense_dir, tmp_path / "dense"))
    before = base_fingerprint(model)
    for shard, name, start, end in _spans(model):
        if name.startswith("model.layers.1.self_attn.") and name.endswith("_proj.weight"):
            _flip(shard, start, end)
    after = base_fingerprint(model)
    assert after["sha256"] != before["sha256"]
    from megagrpo.model.fingerprint import changed

    diff = changed(before, model)
    assert diff is not None and "then:" in diff


def test_a_version_1_fingerprint_of_an_older_checkpoint_still_matches(moe):
    """A checkpoint written before version 2 recorded version 1 (no ``version`` key): the
    same directory matches it (recomputed as version 1), a changed one does not."""
    from megagrpo.model.fingerprint import VERSION, changed

    old = base_fingerprint(moe, version=1)
    assert "version" not in old and old["sampled"] == 16
    now = base_fingerprint(moe)
    assert now["version"] == VERSION and now["sha256"] != old["sha256"]
    assert changed(old, moe, now) is None and changed(now, moe, now) is None
    shard, _, start, end = _spans(moe)[0]
    _flip(shard, start, end)
    assert changed(old, moe) is not None
    assert (
        changed({"version": 99, "sha256": "x"}, moe)
        == "its fingerprint is of an unknown version 99"
    )
