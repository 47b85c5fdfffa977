"""`megagrpo verify-model --hf DIR --json` end to end (one rank, in-process)."""

from __future__ import annotations

import json
import os

import pytest
from forkrun import run_cli  # tests/forkrun.py: forked from the preloaded server


def test_verify_model_cli_json(tiny_moe_dir):
    cmd = [
        "verify-model",
        "--hf",
        str(tiny_moe_dir),
        "--json",
    ]
    out = run_cli(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rep = json.loads(out.stdout[out.stdout.index("{") :])
    assert rep["world_size"] == 1 and rep["ok"] is True
    assert rep["max_abs_logit_diff"] < 1e-4
    assert rep["lora_zero_init_max_diff"] == 0.0 and rep["roundtrip_bitwise"] is True


def test_verify_model_cli_bad_layout(tiny_moe_dir):
    cmd = [
        "verify-model",
        "--hf",
        str(tiny_moe_dir),
        "--ep",
        "3",
    ]
    out = run_cli(cmd, timeout=600)
    assert out.returncode == 2 and "num_experts=4 is not divisible by ep=3" in out.stderr


@pytest.mark.slow
@pytest.mark.distributed
def test_verify_model_uneven_pipeline_against_transformers(tiny_tokenizer_dir, tmp_path):
    """A 3-layer MoE (hidden size and experts of the tiny test model) on two pipeline stages:
    megatron-core's uneven split (2 + 1 layers) verifies against transformers' own model
    (before: "num_hidden_layers=3 is not divisible by pp=2")."""
    from megagrpo.testing import build_tiny_model

    model = build_tiny_model(
        tmp_path / "moe3", "moe", tokenizer_dir=tiny_tokenizer_dir, num_hidden_layers=3
    )
    cmd = ["verify-model", "--hf", str(model)]
    out = run_cli([*cmd, "--pp", "2", "--json"], env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    rep = json.loads(out.stdout[out.stdout.index("{") :])
    assert rep["world_size"] == 2 and rep["ok"] is True
    assert rep["max_abs_logit_diff"] < 1e-4 and rep["roundtrip_bitwise"] is True
